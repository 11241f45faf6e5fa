"""The data API, `GET|POST /q/<name>`: `DataResource.serve` is the request path, top to bottom, one line per stage:
authenticate → plan → bind → execute → govern → render → record.

Each stage is a function of the call (`Call`) and stamps its end on it; the times go to histograms and to a
`Server-Timing` header. Between bind and execute, a saved query's cache_ttl answers from the host's response
cache in the shared segment (`from_cache`; shm/LAYOUT.md [Response cache]), and `?stream=true` hands the call to
`stream`, which executes, governs, renders and
records as the rows go out. Paging is the plan's (`plan.paged_sql`), or a slice of the result here for a
statement the plan cannot page.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import falcon

from qag import connectors, entries, formats
from qag import params as P
from qag.errors import ApiError, DomainError
from qag.http import errors as http_errors
from qag.http.common import client_addr, read_json
from qag.http.options import call_options, given_once
from qag.render import FORMATS, RENDERERS, STREAMERS
from shm import responses as R

ROUTE = "/q/{name}"
SERVER_TIMING = ("auth;dur=%.3f, plan;dur=%.3f, bind;dur=%.3f, execute;dur=%.3f, govern;dur=%.3f, "
                 "render;dur=%.3f")
NOT_CURRENT = 1 << 62   # generations this high are qag/server/changes.py's "watcher behind" values: never cached
FILL_POLL_S = (0.001, 0.002, 0.005, 0.01)  # a waiter's polls of the response cache while another call fills (R13)

_log = logging.getLogger("qag.calls")


class DataResource:
    """`GET|POST /q/<name>`."""

    ROUTE = ROUTE
    POST_FIELDS = frozenset(("params", "format", "page", "page_size", "version", "timeout", "stream",
                             "connection_name"))

    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp, name):
        given = dict(req.params)
        self.serve(req, resp, name, given, None)

    def on_post(self, req, resp, name):
        body = read_json(req, self.app.cfg, allow_empty=True, nul_ok=True)
        unknown = [k for k in body if k not in self.POST_FIELDS]
        if unknown:
            raise ApiError(400, "unknown_field", f"Unknown field(s) {', '.join(sorted(unknown))}; allowed: "
                           f"{', '.join(sorted(self.POST_FIELDS))}.")
        params = body.get("params", {})
        if not isinstance(params, dict):
            raise ApiError(400, "invalid_body", "params must be a JSON object of parameter values.")
        given = dict(req.params)
        for k, v in body.items():
            if k != "params" and v is not None:
                if k in given:  # in the query string and in the body: which one was meant cannot be known
                    raise given_once(k)
                given[k] = v
        # Parameters may come in the query string as well as in the body's params, each name once.
        loose = {k: v for k, v in given.items() if k not in P.RESERVED}
        if loose:
            params = dict(params)
            for k, v in loose.items():
                params[k] = [params[k], v] if k in params else v  # twice: refused by bind ("must be given once")
        self.serve(req, resp, name, given, params)

    def serve(self, req, resp, name: str, given: dict, body_params: dict | None) -> None:
        c = Call(self, req, resp, name)
        try:
            authenticate(c, given)   # the caller, its rate limits, quotas and own limits, the call's options
            plan(c)                  # the governed plan of (caller, query, version, connection), cached
            bind(c, body_params)     # the values checked against the parameters' specs: the driver's arguments
            if c.opts.stream:        # the whole result in bounded memory: execute → govern → render → record
                return stream(c)     # as the rows go out
            if not from_cache(c):    # a saved query's cache_ttl: a fresh answer is served without the database
                execute(c)           # the statement on the connection's pool, within the call's time limit
                govern(c)            # the plan's masking over the result
                render(c)            # the page in the asked format, its headers, Server-Timing
            record(c)                # the run to the recorder and the metrics, the rows to the key's quota
        except (ApiError, DomainError) as exc:
            err = refused(c, exc)
            if err is None:
                raise
            raise err from None
        finally:
            if c.held is not None:   # its place in the caller's max_concurrent (a stream gives it back itself)
                c.app.caller_calls.release(c.held)
            if c.fill:               # the claim to fill this answer (R13): stored, or failed; others go on
                c.app.responses.release(c.cache_hash, c.fill)


class Call:
    """One `/q` call on its way through the stages: what each stage made, and when it ended."""

    __slots__ = ("app", "rt", "req", "resp", "name", "t0", "run", "principal", "limits", "opts", "t_auth",
                 "plan", "crow", "tier_key", "connector", "plan_hit", "t_plan", "args", "t_bind", "cache_key",
                 "cache_hash", "fill", "cols", "rows", "count", "t_exec", "query_seconds", "t_gov", "body", "nrows",
                 "t_render", "status", "held", "row_limit", "has_more")

    def __init__(self, resource: DataResource, req, resp, name: str):
        self.app = resource.app
        self.rt = resource.app.runtime
        self.req, self.resp, self.name = req, resp, name
        self.t0 = time.perf_counter()
        self.run: dict[str, Any] = {"at_us": time.time_ns() // 1000, "query": name, "version": None,
                                    "key_name": None, "connection": None, "rows": 0, "bytes": 0, "transport": "http",
                                    "error": None}
        self.principal = self.limits = self.plan_hit = self.cache_key = self.query_seconds = None
        self.held = self.row_limit = self.fill = self.tier_key = None
        self.has_more = False


# -- the stages, in order --------------------------------------------------------------------------------------
def authenticate(c: Call, given: dict) -> None:
    """The caller (401/403 before anything else is looked at), its queue and rate limits (429), then the call's
    options (400): that order of checks is the contract's."""
    req, auth, run = c.req, c.app.auth, c.run
    env = req.env  # the headers read as the WSGI environ has them (req.get_header's own lookup, without its
    # name mangling and the KeyError of an absent header)
    # The Console's "try it" calls in-process as its signed-in administrator (qag/http/console: PRINCIPAL_ENV).
    principal = env.get("qag.console_principal") or auth.authenticate_caller(
        env.get("HTTP_X_API_KEY"), env.get("HTTP_AUTHORIZATION"), client_addr(req))
    c.principal = principal
    run["key_name"] = None if principal.admin else principal.caller
    if env.get("qag.via") == "mcp" or env.get("HTTP_X_QAG_VIA") == "mcp" and client_addr(req) in ("127.0.0.1",
                                                                                                  "::1"):
        run["served_by"], run["transport"] = "mcp", "mcp"   # a tool call of /mcp, or of `qag mcp` on this host
    if env.get("qag.too_many_calls"):  # the worker found this key's queue full (qag/server/gworker.py)
        raise ApiError(429, "too_many_calls", "This key has too many calls waiting in this worker; wait "
                       "for some to finish and retry in 1 s.", {"retry_after": 1}, {"Retry-After": "1"})
    limits = c.limits = auth.check_rate(principal)
    if limits is not None:
        for hk, hv in limits.headers.items():
            c.resp.set_header(hk, hv)
    c.opts = call_options(given, c.app.cfg)
    if principal.key is not None:
        g = principal.key["grants"]
        if g.get("max_rows") or g.get("query_timeout") or g.get("max_concurrent"):
            caller_limits(c, g)
    c.t_auth = time.perf_counter()


def caller_limits(c: Call, g: dict) -> None:
    """A key's or role's own limits, each narrowing the server's (issue 18, as QueryAPIGate's): `max_rows` lowers
    the page size to it (X-Page-Size says the size used) and stops a stream after it (X-Row-Limit);
    `query_timeout` narrows QAG_QUERY_TIMEOUT and ?timeout= (connectors S3); `max_concurrent` takes a place among
    the caller's calls in flight on the host (qag/capacity.py: 429 too_many_concurrent), given back by serve()."""
    opts, cfg = c.opts, c.app.cfg
    max_rows = g.get("max_rows")
    if max_rows:
        c.row_limit = max_rows
        if opts.page_size > max_rows:
            opts.page_size = max_rows
    own = g.get("query_timeout")
    if own:
        asked = own if opts.timeout is None else min(opts.timeout, own)
        opts.timeout = connectors.limit_ms(asked, cfg.query_timeout) / 1000
    most = g.get("max_concurrent")
    if most:
        caller = c.principal.caller
        c.app.caller_calls.acquire(caller, most)
        c.held = caller


def plan(c: Call) -> None:
    """The governed plan (qag/plan.py), from this worker's plan cache when its generations still hold."""
    rt = c.rt
    hits = rt.plan_hits
    c.plan, c.crow, c.connector = rt.plan(c.principal, c.name, c.opts.version, c.opts.connection)
    c.plan_hit = rt.plan_hits > hits
    c.run["version"], c.run["connection"] = c.plan.version, c.plan.connection
    c.t_plan = time.perf_counter()


def bind(c: Call, body_params: dict | None) -> None:
    """The parameters' values (a POST body's params, else the query string's), claim-bound ones from a signed-in
    caller's token, checked against the specs (400 param_invalid) and ordered as the driver's arguments."""
    plan = c.plan
    given_params = body_params if body_params is not None else c.opts.params
    if plan.claims or c.principal.claims is not None:
        given_params = _claims(c.principal, plan, given_params)
    values = P.bind(plan.specs, given_params, c.app.cfg.max_param_bytes)
    c.args = plan.bind_args(values)
    c.t_bind = time.perf_counter()


def execute(c: Call) -> None:
    """The statement (paged by the plan when it can be) on the connection's pool, counted against the
    connection's calls in flight (QAG_CONNECTION_CALLS)."""
    plan, opts, connector = c.plan, c.opts, c.connector
    in_flight = c.app.connection_calls
    in_flight.acquire(plan.connection)
    try:
        if plan.is_write:
            c.cols, c.rows, c.count = connector.run(plan.sql, c.args, write=True, timeout=opts.timeout,
                                                    max_rows=None)
        else:
            sql = plan.paged_sql(opts.page, opts.page_size)
            c.cols, c.rows, c.count = connector.run(sql, c.args, write=False, timeout=opts.timeout,
                                                    max_rows=None if plan.page_mode != "none"
                                                    else opts.page * opts.page_size + 1,
                                                    state_free=plan.state_free)
    finally:
        in_flight.release(plan.connection)
    c.t_exec = time.perf_counter()
    c.query_seconds = c.t_exec - c.t_bind


def govern(c: Call) -> None:
    """The plan's masking (hash, mask, null, drop) of the result's columns, and the typed formats' column types
    as masking leaves them."""
    plan = c.plan
    if plan.transforms is not None:
        typed = c.opts.format in formats.TYPED and formats.types_after_masking(c.cols, plan.transforms)
        c.cols, c.rows = apply_transforms(plan.transforms, c.cols, c.rows, c.rt.mask_key, plan.names, c.rt,
                                          plan.connection)
        if typed:
            c.cols = formats.Columns(c.cols, typed)
    c.t_gov = time.perf_counter()


def render(c: Call) -> None:
    """The body in the asked format: a write's affected rows, or one page of rows with the paging headers; then
    the cacheable answer's ETag (304 when If-None-Match names it) and the stage times as Server-Timing."""
    plan, opts, resp, rows = c.plan, c.opts, c.resp, c.rows
    # Falcon's own table of the answer's headers, by lower-case name, as resp.set_header(name, str) fills it:
    # the same headers in the same order, without set_header's lower() and str() per header.
    headers = resp._headers
    if plan.is_write and not c.cols:
        if opts.format != "json":
            body = b""
        elif type(c.count) is int:   # json.dumps's own text of it, without building an encoder per call
            body = b'{"affected_rows": %d}' % c.count
        else:
            body = json.dumps({"affected_rows": c.count}).encode()
        headers["x-affected-rows"] = str(c.count)
        nrows = 0
    else:
        if plan.page_mode == "none" and not plan.is_write:
            start = (opts.page - 1) * opts.page_size
            rows = rows[start:]
        has_more = not plan.is_write and len(rows) > opts.page_size
        c.has_more = has_more
        if has_more:
            rows = rows[:opts.page_size]
        body = RENDERERS[opts.format](c.cols, rows)
        nrows = len(rows)
        if plan.is_write:
            headers["x-affected-rows"] = str(c.count)
        else:
            headers["x-page"] = str(opts.page)
            headers["x-page-size"] = str(opts.page_size)
            headers["x-row-count"] = str(nrows)
            headers["x-has-more"] = "true" if has_more else "false"
            if c.row_limit is not None:
                headers["x-row-limit"] = str(c.row_limit)
    c.t_render = t_render = time.perf_counter()
    headers["content-type"] = FORMATS[opts.format]
    status = 200
    if c.cache_key is not None:
        store(c, body, nrows)
    if opts.format in formats.DOWNLOADS:
        resp.set_header("Content-Disposition", formats.disposition(plan.query, opts.format))
    if c.cache_key is not None:
        status = conditional(c.req, resp, body)
    else:
        resp.data = body
    c.status = status
    c.run["rows"], c.run["bytes"] = nrows, len(body) if status == 200 else 0
    t0, t_auth, t_plan, t_bind, t_exec, t_gov = c.t0, c.t_auth, c.t_plan, c.t_bind, c.t_exec, c.t_gov
    headers["server-timing"] = SERVER_TIMING % (
        (t_auth - t0) * 1000, (t_plan - t_auth) * 1000, (t_bind - t_plan) * 1000, (t_exec - t_bind) * 1000,
        (t_gov - t_exec) * 1000, (t_render - t_gov) * 1000)


def record(c: Call) -> None:
    """The run to the recorder, the metrics and the slow-call log; its rows to the key's row quota."""
    finish(c.app, c.req, c.run, c.status, None, c.t0, c.query_seconds, c.plan_hit)
    limits = c.limits
    if limits is not None and limits.rows_keys:
        c.app.auth.limiter.count_rows(limits, c.run["rows"])


# -- refusals --------------------------------------------------------------------------------------------------
def refused(c: Call, exc: ApiError | DomainError) -> ApiError | None:
    """The contract's answer to a call refused or failed at any stage (qag/http/errors.py; the database's own
    words only for administrators, connectors S7), recorded with its code; a 5xx and a governance refusal are
    logged. None: no run of the query (a store that is away), raised as it is."""
    err = http_errors.answer(exc, admin=c.principal is not None and c.principal.admin, data_call=True)
    if err is None:
        return None
    db_text = getattr(exc, "db_text", "")
    # The run keeps the database's words for administrators (history; LAYOUT.md [Run record] RR5), bounded and
    # without the call's parameter values; the caller's answer is err, as before.
    c.run["error"] = entries.run_error(db_text, getattr(c, "args", None))
    finish(c.app, c.req, c.run, err.status, err.code, c.t0, c.query_seconds, c.plan_hit)
    if err.status >= 500 or err.status == 403:
        # the log's words are the run's (parameter values replaced) unless QAG_LOG_PARAMS=1 asks for them
        log_refusal(c.req, c.run, err, db_text if c.app.cfg.log_params else (c.run["error"] or ""))
    return err


def log_refusal(req, run: dict, err, db_text: str = "") -> None:
    """One line per 5xx and per governance refusal (403), for the operator: who, what, which code, and the
    database's own words. Never a secret and never a parameter value (those stay in the caller's request)."""
    rid = req.context.get("request_id", "-") if hasattr(req.context, "get") else "-"
    key = run.get("key_name") or "(administrator)"
    _log.warning("%s %s: %s %s (request %s, key %s, query %s, version %s)%s", req.method, req.path, err.status,
                 err.code, rid, key, run.get("query"), run.get("version"),
                 f"; the database said: {db_text}" if db_text else "",
                 extra={"qag": {"event": "refusal" if err.status < 500 else "error", "request_id": rid, "key": key,
                                "query": run.get("query"), "version": run.get("version"), "status": err.status,
                                "code": err.code, **({"db_text": db_text} if db_text else {})}})


# -- what the stages use -----------------------------------------------------------------------------------------
def finish(app, req, run: dict, status: int, code: str | None, t0: float, query_seconds, plan_hit) -> None:
    """The call's run to the recorder (when this process has one) and its observation to the metrics; a call
    slower than QAG_SLOW_MS is logged."""
    duration = time.perf_counter() - t0
    recorded = None
    if app.recorder is not None:
        run["status"], run["code"], run["duration_us"] = status, code, int(duration * 1e6)
        run["request_id"], run["route"] = req.context.request_id, ROUTE
        recorded = app.recorder(run)
    app.observer.request(ROUTE, status, code, run["rows"], duration, query_seconds, plan_hit, recorded)
    slow = app.cfg.slow_ms
    if slow and duration * 1000 >= slow:
        _log.warning("slow call: %s %s took %.1f ms (QAG_SLOW_MS=%d; request %s, key %s, status %s)", req.method,
                     req.path, duration * 1000, slow, req.context.request_id, run.get("key_name") or
                     "(administrator)", status,
                     extra={"qag": {"event": "slow_call", "request_id": req.context.request_id,
                                    "key": run.get("key_name") or "(administrator)", "query": run.get("query"),
                                    "status": status, "duration_ms": round(duration * 1000, 3)}})


def _claims(principal, plan, given: dict) -> dict:
    """A signed-in caller's claim-bound parameters (qag/identity.py); a role may require one on every query."""
    from qag import identity
    role = (principal.key or {}).get("role") if principal.claims is not None else None
    if role and role.get("require_claims") and not plan.claims:
        raise ApiError(403, "claim_binding_required", f"The role '{role['name']}' runs only queries that bind "
                       "a parameter to the caller's token; this one binds none.")
    return identity.bind_claims(principal, plan.claims, given) if plan.claims else given


def apply_transforms(transforms, cols, rows, key, names=None, rt=None, connection=None):
    """The plan's masking; a result whose columns no longer match the plan (a table changed under
    SELECT *: a column added after the catalogue was read) is refused as 403 mask_unresolvable rather than
    masked by the wrong position or served unmasked; the connection's catalogue is then read again (its
    generation moves on, here and in the plane), so the next call is planned on the table as it is."""
    from qag import governance
    try:
        return governance.apply_transforms(transforms, cols, rows, key, names)
    except governance.GovernanceError as exc:
        if rt is not None and connection is not None:
            rt.catalogue_stale(connection)
        raise ApiError(exc.status, exc.code, exc.message, exc.extra) from None


def conditional(req, resp, body: bytes) -> int:
    """A cacheable answer: 304 without a body when If-None-Match names its ETag (RFC 9110 13.1.2)."""
    etag = resp.get_header("ETag")
    inm = req.get_header("If-None-Match")
    if etag and inm and (inm.strip() == "*" or etag in [t.strip().removeprefix("W/") for t in inm.split(",")]):
        resp.status = falcon.HTTP_304
        resp.data = None
        return 304
    resp.data = body
    return 200


# -- the response cache (shm/LAYOUT.md [Response cache]) ----------------------------------------------------------
def from_cache(c: Call) -> bool:
    """A cacheable call (a read with cache_ttl, not streamed) gets its key (R5) here; a fresh answer in the host's
    response cache answers it (X-Cache: hit, or 304). On a miss one caller per key fills (R13): it claims the key
    and render() stores its answer; a caller that finds the key claimed gets the previous answer at once, if there
    is one, else waits for the filler's answer (bounded by the filler's statement limit, and over as soon as the
    filler is gone), then runs the statement itself."""
    plan, opts = c.plan, c.opts
    if not (plan.cache_ttl and not plan.is_write and not opts.stream):
        return False
    c.cache_key = b""  # a cacheable answer (ETag, Cache-Control, X-Cache: miss) that is not stored, unless a key
    rc = c.app.responses
    gens = plan.gens
    if rc is None or gens[1] >= NOT_CURRENT or gens[2] >= NOT_CURRENT:
        c.app.observer.response_cache("bypass")
        return False
    prefix = plan.response_prefix
    if prefix is None:
        prefix = plan.response_prefix = entries.response_prefix(plan)
    suffix = R.suffix(opts.format, opts.page, opts.page_size, c.args)
    if suffix is None:
        c.app.observer.response_cache("bypass")
        return False
    key = c.cache_key = prefix + suffix
    h = c.cache_hash = R.key_hash(key)
    rec = rc.get(key, h)
    if rec is not None and not rec.stale:
        return answer(c, rc, rec, "hit")
    token, slot = rc.claim(h, opts.timeout or c.app.cfg.query_timeout)
    if token:
        c.fill = token if token > 0 else None  # -1: the fill slot is another key's; fill without a claim
        return from_tier(c, rc, suffix)
    if rec is not None and time.time_ns() < rec.expires_at_ns + rec.ttl_s * 1_000_000_000:
        return answer(c, rc, rec, "stale")  # the previous answer (expired within a ttl), while another makes it
    polls = 0
    while True:
        time.sleep(FILL_POLL_S[min(polls, len(FILL_POLL_S) - 1)])
        polls += 1
        rec = rc.get(key, h)
        if rec is not None and not rec.stale:
            return answer(c, rc, rec, "waited")
        if not rc.filling(h, slot):
            break
    token, _ = rc.claim(h, opts.timeout or c.app.cfg.query_timeout)  # the filler ended without an answer
    c.fill = token if token > 0 else None
    return from_tier(c, rc, suffix)


def from_tier(c: Call, rc, suffix: bytes) -> bool:
    """The filler of a key asks the Redis tier shared by the hosts (qag/response_tier.py) before running the
    statement: an answer another host made is stored in this host's segment and served as a hit."""
    tier = c.app.response_tier
    if tier is None:
        return False
    plan = c.plan
    shared = plan.shared_prefix
    if shared is None:
        from qag.response_tier import shared_prefix
        shared = plan.shared_prefix = shared_prefix(plan, c.crow, plan.response_prefix[-16:], c.rt.mask_key)
    c.tier_key, v = tier.get(plan.query, shared, suffix)
    if v is None:
        return False
    rows, has_more, ttl_s, etag, created, expires, body = v
    rc.put(c.cache_key, c.cache_hash, body, rows=rows, has_more=has_more, ttl_s=ttl_s, etag=etag,
           created_at_ns=created)
    c.tier_key = None  # it is there already
    return answer(c, rc, R.Record(body, rows, has_more, f'"{etag.hex()}"', ttl_s, created, expires, 0, -1, False,
                                  False), "redis")


def answer(c: Call, rc, rec, result: str) -> bool:
    """A cached answer (R15): the body, its paging headers, ETag, Cache-Control, X-Cache: hit; 304 when
    If-None-Match names its ETag. The run is recorded and counted toward quotas like any other (record())."""
    resp, opts, plan = c.resp, c.opts, c.plan
    resp.set_header("X-Page", str(opts.page))
    resp.set_header("X-Page-Size", str(opts.page_size))
    resp.set_header("X-Row-Count", str(rec.rows))
    resp.set_header("X-Has-More", "true" if rec.has_more else "false")
    if c.row_limit is not None:
        resp.set_header("X-Row-Limit", str(c.row_limit))
    resp.set_header("ETag", rec.etag)
    resp.set_header("Cache-Control", f"private, max-age={rec.ttl_s}")
    resp.set_header("X-Cache", "hit")
    if opts.format in formats.DOWNLOADS:
        resp.set_header("Content-Disposition", formats.disposition(plan.query, opts.format))
    resp.content_type = FORMATS[opts.format]
    c.status = status = conditional(c.req, resp, rec.body)
    c.run["rows"], c.run["bytes"] = rec.rows, len(rec.body) if status == 200 else 0
    if rec.way >= 0:  # not an answer from the Redis tier
        rc.hit(rec)
    if rec.old and not rec.stale:
        rc.refresh(c.cache_key, c.cache_hash, rec)  # R11: a used answer moves out of the arena's older half
    c.app.observer.response_cache(result)
    return True


def store(c: Call, body: bytes, nrows: int) -> None:
    """A cacheable answer made now: its ETag and Cache-Control, X-Cache: miss, and into the response cache when it
    has a key (R7; an answer larger than the largest record is not stored, counted)."""
    resp, ttl = c.resp, int(c.plan.cache_ttl)
    etag = hashlib.blake2b(body, digest_size=16).digest()
    resp.set_header("ETag", f'"{etag.hex()}"')
    resp.set_header("Cache-Control", f"private, max-age={ttl}")
    resp.set_header("X-Cache", "miss")
    if c.cache_key:
        stored = c.app.responses.put(c.cache_key, c.cache_hash, body, rows=nrows, has_more=c.has_more,
                                     ttl_s=ttl, etag=etag)
        c.app.observer.response_cache("miss" if stored else "rejected")
        if stored and c.tier_key is not None:  # the Redis tier, for the other hosts
            c.app.response_tier.put(c.tier_key, nrows, c.has_more, ttl, etag, time.time_ns(), body)


# -- ?stream=true ----------------------------------------------------------------------------------------------
def stream(c: Call) -> None:
    """`?stream=true`: the whole result from a server-side cursor, in bounded memory. A stream holds a thread
    and a database session while it lasts: they are capped per key and per instance (503
    too_many_streams), and a client that stops reading is dropped after QAG_SEND_TIMEOUT (the worker's
    send fails, the generators below close, the session is rolled back and released)."""
    app, req, resp, plan, opts, run, t0 = c.app, c.req, c.resp, c.plan, c.opts, c.run, c.t0
    if plan.is_write:
        raise ApiError(400, "invalid_stream", "A write cannot be streamed; call it without stream.")
    holder = c.principal.name if not c.principal.admin else "\x00admin"
    app.streams.acquire(holder)
    try:
        app.connection_calls.acquire(plan.connection)
    except BaseException:
        app.streams.release(holder)
        raise
    try:
        cols, batches = c.connector.stream(plan.sql, c.args, timeout=opts.timeout, state_free=plan.state_free)
    except BaseException:
        app.connection_calls.release(plan.connection)
        app.streams.release(holder)
        raise
    try:
        transforms = plan.transforms
        if transforms is not None:
            key = app.runtime.mask_key
            first_cols = cols

            def masked():
                for b in batches:
                    yield apply_transforms(transforms, first_cols, b, key, plan.names)[1]
            typed = opts.format in formats.TYPED and formats.types_after_masking(cols, transforms)
            cols = apply_transforms(transforms, cols, [], key, plan.names, app.runtime, plan.connection)[0]
            if typed:
                cols = formats.Columns(cols, typed)
            source = masked()
        else:
            source = batches
    except BaseException:  # e.g. mask_unresolvable: nothing streams, so give back what the stream holds
        getattr(batches, "close", lambda: None)()
        app.connection_calls.release(plan.connection)
        app.streams.release(holder)
        raise
    counted = {"rows": 0, "bytes": 0}
    cap = c.row_limit
    held, c.held = c.held, None  # from here the stream gives back its place in max_concurrent when it ends

    def count_rows(src):
        for b in src:
            if cap is not None and counted["rows"] + len(b) >= cap:
                b = b[:cap - counted["rows"]]  # the caller's max_rows: the stream ends here (X-Row-Limit)
                counted["rows"] += len(b)
                yield b
                return
            counted["rows"] += len(b)
            yield b

    def body():
        ok = False
        try:
            for chunk in STREAMERS[opts.format](cols, count_rows(source)):
                counted["bytes"] += len(chunk)
                yield chunk
            ok = True
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # the cursor's generator: rollback and release the session now, not at GC
            app.connection_calls.release(plan.connection)
            app.streams.release(holder)
            if held is not None:
                app.caller_calls.release(held)
            run["rows"], run["bytes"], run["transport"] = counted["rows"], counted["bytes"], "stream"
            finish(app, req, run, 200 if ok else 500, None if ok else "stream_aborted", t0, None, None)
    resp.content_type = FORMATS[opts.format]
    resp.set_header("Content-Disposition", formats.disposition(plan.query, opts.format))
    if cap is not None:
        resp.set_header("X-Row-Limit", str(cap))
    resp.stream = body()
