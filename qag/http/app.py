"""The Falcon application: routing, the error contract, and the data API's request path.

`DataResource.serve` is the request path, top to bottom, one line per stage:
authenticate → plan → bind → execute → govern → render → record. Each stage is timed; the times go
to histograms and to a `Server-Timing` header.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from typing import Any

import falcon

from qag import __version__, formats, params as P, render
from qag import connectors
from qag.auth import Auth
from qag.errors import ApiError, DomainError
from qag.http import errors as http_errors
from qag.http.common import client_addr, read_json, request_id
from qag.metrics import Observer
from qag.runtime import Runtime

TRUE = frozenset(("1", "true", "yes", "on"))
FALSE = frozenset(("0", "false", "no", "off", ""))


def send_error(req, resp, err: ApiError) -> None:
    rid = req.context.get("request_id") or request_id(req)
    resp.status = falcon.code_to_http_status(err.status)
    resp.content_type = "application/json"
    resp.text = json.dumps(err.body(rid))
    resp.set_header("X-Request-Id", rid)
    resp.set_header("Cache-Control", "no-store")
    for k, v in err.headers.items():
        resp.set_header(k, v)




class RequestIdMiddleware:
    def __init__(self, app: "QagApp"):
        self.app = app

    def process_request(self, req, resp):
        if self.app.behind_plane:
            req.env["qag.behind_plane"] = True
        req.context.request_id = request_id(req)
        req.context.started = time.perf_counter()

    def process_response(self, req, resp, resource, req_succeeded):
        rid = req.context.get("request_id")
        if rid:
            resp.set_header("X-Request-Id", rid)
        # Answers are data or errors for one caller: never sniffed, never stored by a shared cache unless a
        # saved query's cache_ttl said otherwise (it set Cache-Control: private, max-age=<ttl>).
        resp.set_header("X-Content-Type-Options", "nosniff")
        if resp.get_header("Cache-Control") is None:
            resp.set_header("Cache-Control", "no-store")
        route = req.uri_template
        if route != DataResource.ROUTE:  # data calls are observed by finish(), with their rows and timings
            status = resp.status if isinstance(resp.status, int) else int(str(resp.status).split()[0])
            code = req.context.get("error_code")
            self.app.observer.request(route or "other", status, code, 0,
                                      time.perf_counter() - req.context.get("started", time.perf_counter()))


CORS_METHODS = "GET, POST, PATCH, DELETE, OPTIONS"
CORS_HEADERS = "X-API-Key, Authorization, Content-Type, X-Request-Id, If-None-Match, Last-Event-ID"
CORS_EXPOSE = ("X-Request-Id, X-Page, X-Page-Size, X-Row-Count, X-Has-More, X-Affected-Rows, X-Cache, ETag, "
               "Retry-After, RateLimit-Limit, RateLimit-Remaining, RateLimit-Reset, Server-Timing")


class CorsMiddleware:
    """CORS for the origins in QAG_CORS_ORIGINS only (off when empty): a listed origin's preflight is answered
    204, its answers carry Access-Control-Allow-Origin; any other origin gets no CORS header (the browser
    refuses). No credentials mode: keys travel in headers, the Console's cookie is same-origin."""

    def __init__(self, origins: tuple[str, ...]):
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def _allowed(self, origin: str | None) -> bool:
        return bool(origin) and (self.any or origin in self.origins)

    def process_request(self, req, resp):
        origin = req.get_header("Origin")
        if req.method == "OPTIONS" and req.get_header("Access-Control-Request-Method") and self._allowed(origin):
            resp.status = falcon.HTTP_204
            resp.set_header("Access-Control-Allow-Methods", CORS_METHODS)
            resp.set_header("Access-Control-Allow-Headers", CORS_HEADERS)
            resp.set_header("Access-Control-Max-Age", "600")
            resp.complete = True

    def process_response(self, req, resp, resource, req_succeeded):
        origin = req.get_header("Origin")
        resp.append_header("Vary", "Origin")
        if self._allowed(origin):
            resp.set_header("Access-Control-Allow-Origin", origin)
            resp.set_header("Access-Control-Expose-Headers", CORS_EXPOSE)


class DataResource:
    """`GET|POST /q/<name>`."""

    ROUTE = "/q/{name}"
    POST_FIELDS = frozenset(("params", "format", "page", "page_size", "version", "timeout", "stream",
                             "connection_name"))

    def __init__(self, app: "QagApp"):
        self.app = app

    def on_get(self, req, resp, name):
        given = {}
        for k, v in req.params.items():
            given[k] = v
        self.serve(req, resp, name, given, None)

    def on_post(self, req, resp, name):
        body = read_json(req, self.app.cfg, allow_empty=True)
        unknown = [k for k in body if k not in self.POST_FIELDS]
        if unknown:
            raise ApiError(400, "unknown_field", f"Unknown field(s) {', '.join(sorted(unknown))}; allowed: "
                           f"{', '.join(sorted(self.POST_FIELDS))}.")
        params = body.get("params", {})
        if not isinstance(params, dict):
            raise ApiError(400, "invalid_body", "params must be a JSON object of parameter values.")
        given = dict(req.params)
        given.update({k: v for k, v in body.items() if k != "params" and v is not None})
        self.serve(req, resp, name, given, params)

    def serve(self, req, resp, name: str, given: dict, body_params: dict | None) -> None:
        app, rt = self.app, self.app.runtime
        t0 = time.perf_counter()
        run: dict[str, Any] = {"at_us": time.time_ns() // 1000, "query": name, "version": None, "key_name": None, "connection": None,
                               "rows": 0, "bytes": 0, "transport": "http"}
        query_seconds = None
        plan_hit = None
        try:
            # The Console's "try it" calls in-process as its signed-in administrator (qag/http/console: PRINCIPAL_ENV).
            principal = req.env.get("qag.console_principal") or app.auth.authenticate_caller(
                req.get_header("X-API-Key"), req.get_header("Authorization"), client_addr(req))
            run["key_name"] = None if principal.admin else principal.caller
            if req.get_header("X-Qag-Via") == "mcp" and client_addr(req) in ("127.0.0.1", "::1"):
                run["served_by"], run["transport"] = "mcp", "mcp"   # a tool call of `qag mcp` on this host
            if req.env.get("qag.too_many_calls"):  # the worker found this key's queue full (qag/server/gworker.py)
                raise ApiError(429, "too_many_calls", "This key has too many calls waiting in this worker; wait "
                               "for some to finish and retry in 1 s.", {"retry_after": 1}, {"Retry-After": "1"})
            limits = app.auth.check_rate(principal)
            if limits is not None:
                for hk, hv in limits.headers.items():
                    resp.set_header(hk, hv)
            opts = call_options(given, app.cfg)
            t_auth = time.perf_counter()
            hits = rt.plan_hits
            plan, crow, connector = rt.plan(principal, name, opts.version, opts.connection)
            plan_hit = rt.plan_hits > hits
            run["version"], run["connection"] = plan.version, plan.connection
            t_plan = time.perf_counter()
            given_params = body_params if body_params is not None else opts.params
            if plan.claims or principal.claims is not None:
                given_params = _claims(principal, plan, given_params)
            values = P.bind(plan.specs, given_params, app.cfg.max_param_bytes)
            args = plan.bind_args(values)
            t_bind = time.perf_counter()
            cache_key = None
            if plan.cache_ttl and not plan.is_write and not opts.stream:
                cache_key = (principal.name, plan.query, plan.version, plan.connection, plan.gens, args, opts.page,
                             opts.page_size, opts.format)
                hit = app.result_cache.get(cache_key)
                if hit is not None and hit[0] > time.monotonic():
                    _, body, headers, nrows = hit
                    for hk, hv in headers:
                        resp.set_header(hk, hv)
                    resp.set_header("X-Cache", "hit")
                    if opts.format in formats.DOWNLOADS:
                        resp.set_header("Content-Disposition", formats.disposition(plan.query, opts.format))
                    resp.content_type = render.FORMATS[opts.format]
                    status = app.conditional(req, resp, body)
                    run["rows"], run["bytes"] = nrows, len(body) if status == 200 else 0
                    app.finish(req, run, status, None, t0, None, plan_hit)
                    if limits is not None and limits.rows_keys:
                        app.auth.limiter.count_rows(limits, nrows)
                    return
            if opts.stream:
                if plan.is_write:
                    raise ApiError(400, "invalid_stream", "A write cannot be streamed; call it without stream.")
                self.stream(req, resp, plan, connector, args, opts, principal, run, t0)
                return
            in_flight = app.connection_calls
            in_flight.acquire(plan.connection)
            try:
                if plan.is_write:
                    cols, rows, count = connector.run(plan.sql, args, write=True, timeout=opts.timeout,
                                                      max_rows=None)
                else:
                    sql = plan.paged_sql(opts.page, opts.page_size)
                    cols, rows, count = connector.run(sql, args, write=False, timeout=opts.timeout,
                                                      max_rows=None if plan.page_mode != "none"
                                                      else opts.page * opts.page_size + 1,
                                                      state_free=plan.state_free)
            finally:
                in_flight.release(plan.connection)
            t_exec = time.perf_counter()
            query_seconds = t_exec - t_bind
            if plan.transforms is not None:
                typed = opts.format in formats.TYPED and formats.types_after_masking(cols, plan.transforms)
                cols, rows = app.apply_transforms(plan.transforms, cols, rows, rt.mask_key, plan.names)
                if typed:
                    cols = formats.Columns(cols, typed)
            t_gov = time.perf_counter()
            if plan.is_write and not cols:
                body = json.dumps({"affected_rows": count}).encode() if opts.format == "json" else b""
                resp.set_header("X-Affected-Rows", str(count))
                nrows = 0
            else:
                if plan.page_mode == "none" and not plan.is_write:
                    start = (opts.page - 1) * opts.page_size
                    rows = rows[start:]
                has_more = not plan.is_write and len(rows) > opts.page_size
                if has_more:
                    rows = rows[:opts.page_size]
                body = render.RENDERERS[opts.format](cols, rows)
                nrows = len(rows)
                if plan.is_write:
                    resp.set_header("X-Affected-Rows", str(count))
                else:
                    resp.set_header("X-Page", str(opts.page))
                    resp.set_header("X-Page-Size", str(opts.page_size))
                    resp.set_header("X-Row-Count", str(nrows))
                    resp.set_header("X-Has-More", "true" if has_more else "false")
            t_render = time.perf_counter()
            resp.content_type = render.FORMATS[opts.format]
            status = 200
            if cache_key is not None:
                app.cache_result(cache_key, plan.cache_ttl, body, nrows, resp)
                resp.set_header("X-Cache", "miss")
            if opts.format in formats.DOWNLOADS:
                resp.set_header("Content-Disposition", formats.disposition(plan.query, opts.format))
            if cache_key is not None:
                status = app.conditional(req, resp, body)
            else:
                resp.data = body
            run["rows"], run["bytes"] = nrows, len(body) if status == 200 else 0
            resp.set_header("Server-Timing", SERVER_TIMING % (
                (t_auth - t0) * 1000, (t_plan - t_auth) * 1000, (t_bind - t_plan) * 1000, (t_exec - t_bind) * 1000,
                (t_gov - t_exec) * 1000, (t_render - t_gov) * 1000))
            app.finish(req, run, status, None, t0, query_seconds, plan_hit)
            if limits is not None and limits.rows_keys:
                app.auth.limiter.count_rows(limits, run["rows"])
        except (ApiError, DomainError) as exc:
            # the database's own words only for administrators (connectors S7)
            err = http_errors.answer(exc, admin="principal" in locals() and principal.admin, data_call=True)
            if err is None:
                raise
            app.finish(req, run, err.status, err.code, t0, query_seconds, plan_hit)
            if err.status >= 500 or err.status == 403:
                log_refusal(req, run, err, getattr(exc, "db_text", ""))
            raise err from None

    def stream(self, req, resp, plan, connector, args, opts, principal, run, t0):
        """`?stream=true`: the whole result from a server-side cursor, in bounded memory. A stream holds a thread
        and a database session while it lasts: they are capped per key and per instance (503
        too_many_streams), and a client that stops reading is dropped after QAG_SEND_TIMEOUT (the worker's
        send fails, the generators below close, the session is rolled back and released)."""
        app = self.app
        holder = principal.name if not principal.admin else "\x00admin"
        app.streams.acquire(holder)
        try:
            app.connection_calls.acquire(plan.connection)
        except BaseException:
            app.streams.release(holder)
            raise
        try:
            cols, batches = connector.stream(plan.sql, args, timeout=opts.timeout, state_free=plan.state_free)
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
                        yield app.apply_transforms(transforms, first_cols, b, key, plan.names)[1]
                typed = opts.format in formats.TYPED and formats.types_after_masking(cols, transforms)
                cols = app.apply_transforms(transforms, cols, [], key, plan.names)[0]
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

        def count_rows(src):
            for b in src:
                counted["rows"] += len(b)
                yield b

        def body():
            ok = False
            try:
                for chunk in render.STREAMERS[opts.format](cols, count_rows(source)):
                    counted["bytes"] += len(chunk)
                    yield chunk
                ok = True
            finally:
                close = getattr(batches, "close", None)
                if close is not None:
                    close()  # the cursor's generator: rollback and release the session now, not at GC
                app.connection_calls.release(plan.connection)
                app.streams.release(holder)
                run["rows"], run["bytes"], run["transport"] = counted["rows"], counted["bytes"], "stream"
                app.finish(req, run, 200 if ok else 500, None if ok else "stream_aborted", t0, None, None)
        resp.content_type = render.FORMATS[opts.format]
        resp.set_header("Content-Disposition", formats.disposition(plan.query, opts.format))
        resp.stream = body()


_log = logging.getLogger("qag.calls")


def log_refusal(req, run: dict, err, db_text: str = "") -> None:
    """One line per 5xx and per governance refusal (403), for the operator: who, what, which code, and the
    database's own words. Never a secret and never a parameter value (those stay in the caller's request)."""
    _log.warning("%s %s: %s %s (request %s, key %s, query %s, version %s)%s", req.method, req.path, err.status,
                 err.code, req.context.get("request_id", "-") if hasattr(req.context, "get") else "-",
                 run.get("key_name") or "(administrator)", run.get("query"), run.get("version"),
                 f"; the database said: {db_text}" if db_text else "")


def _claims(principal, plan, given: dict) -> dict:
    """A signed-in caller's claim-bound parameters (qag/identity.py); a role may require one on every query."""
    from qag import identity
    role = (principal.key or {}).get("role") if principal.claims is not None else None
    if role and role.get("require_claims") and not plan.claims:
        raise ApiError(403, "claim_binding_required", f"The role '{role['name']}' runs only queries that bind "
                       "a parameter to the caller's token; this one binds none.")
    return identity.bind_claims(principal, plan.claims, given) if plan.claims else given


SERVER_TIMING = ("auth;dur=%.3f, plan;dur=%.3f, bind;dur=%.3f, execute;dur=%.3f, govern;dur=%.3f, "
                 "render;dur=%.3f")


FORMAT_NAMES = ", ".join(render.FORMATS)


class CallOptions:
    __slots__ = ("format", "page", "page_size", "version", "timeout", "stream", "params", "connection")


def call_options(given: dict, cfg) -> CallOptions:
    """Split reserved names (format, page, page_size, version, timeout, stream) from parameters."""
    o = CallOptions()
    fmt = given.get("format", "json")
    if not isinstance(fmt, str) or fmt.lower() not in render.FORMATS:
        raise ApiError(400, "invalid_format", f"format must be one of {FORMAT_NAMES}, not {fmt!r}.")
    o.format = fmt.lower()
    formats.available(o.format)
    o.page = _int_opt(given, "page", 1, 1, None)
    o.page_size = _int_opt(given, "page_size", cfg.default_page_size, 1, cfg.max_page_size)
    if o.page > MAX_OFFSET // o.page_size:
        # The offset (page - 1) * page_size must stay a signed 64-bit integer on every database; the data
        # plane forwards exactly these calls here (rustplane/src/params.rs, "page beyond 64-bit offsets").
        raise ApiError(400, "invalid_paging", f"page must be between 1 and {MAX_OFFSET // o.page_size} for a "
                       f"page_size of {o.page_size}.")
    v = given.get("version")
    if v is None or v == "":
        o.version = None
    else:
        try:
            o.version = int(v)
            if o.version < 1 or o.version >= 2 ** 63 or isinstance(v, bool):
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise ApiError(400, "param_invalid", "version must be a positive integer.",
                           {"errors": {"version": "must be a positive integer"}}) from None
    t = given.get("timeout")
    if t is None or t == "":
        o.timeout = None
    else:
        # connectors S3: a positive number of seconds, clamped to [0.01, QAG_QUERY_TIMEOUT] and rounded up to
        # whole milliseconds, so no value asks the server for "no limit"
        try:
            if isinstance(t, bool) or not isinstance(t, (str, int, float)):
                raise ValueError
            asked = float(t)
            if not (asked > 0 and math.isfinite(asked)):
                raise ValueError
        except (TypeError, ValueError):
            raise ApiError(400, "invalid_timeout", f"timeout must be a positive number of seconds (at least "
                           f"{connectors.MIN_TIMEOUT:g} is used, at most {cfg.query_timeout:g}).") from None
        o.timeout = connectors.limit_ms(asked, cfg.query_timeout) / 1000
    s = given.get("stream")
    if s is None:
        o.stream = False
    elif isinstance(s, bool):
        o.stream = s
    elif isinstance(s, str) and s.lower() in TRUE | FALSE:
        o.stream = s.lower() in TRUE
    else:
        raise ApiError(400, "invalid_stream", "stream must be true or false.")
    if o.stream:
        if o.format not in render.STREAMERS:
            raise ApiError(400, "invalid_stream", f"stream=true needs format={', '.join(render.STREAMERS)}; "
                           f"{o.format} is not streamed.")
        if "page" in given or "page_size" in given:
            raise ApiError(400, "invalid_stream", "stream=true returns the whole result; leave out page and "
                           "page_size.")
    c = given.get("connection_name")
    if c is None or c == "":
        o.connection = None
    elif not isinstance(c, str):
        raise ApiError(400, "param_invalid", "connection_name must be the name of a connection.",
                       {"errors": {"connection_name": "must be a connection's name"}})
    else:
        o.connection = c
    o.params = {k: v for k, v in given.items() if k not in P.RESERVED}
    return o


MAX_OFFSET = (2 ** 63 - 1) // 2


def _int_opt(given: dict, name: str, default: int, lo: int, hi: int | None) -> int:
    raw = given.get(name)
    if raw is None or raw == "":
        return default
    try:
        if isinstance(raw, bool) or isinstance(raw, list):
            raise ValueError
        v = int(raw)
        if isinstance(raw, float) and not raw.is_integer():
            raise ValueError
    except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON body's Infinity
        raise ApiError(400, "invalid_paging", f"{name} must be an integer.") from None
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ApiError(400, "invalid_paging", f"{name} must be {bound}.")
    return v


class QagApp:
    """The WSGI application and what its resources share."""

    def __init__(self, cfg, runtime: Runtime, *, observer: Observer | None = None, recorder=None, segment=None):
        self.cfg = cfg
        self.runtime = runtime
        self.auth = Auth(runtime)
        self.observer = observer or Observer()
        self.auth.limiter.observe_fallback = self.observer.limit_fallback
        self.recorder = recorder  # callable(run: dict) or None
        self.segment = segment
        self.run_store_url: str | None = None
        self.result_cache: dict = {}
        from qag.capacity import InFlight, OpenCount
        slot = getattr(runtime, "slot", 0)
        self.streams = OpenCount("stream", cfg.key_streams, cfg.max_streams, segment, slot)
        self.subscribers = OpenCount("subscriber", cfg.key_subscribers, cfg.max_subscribers, segment, slot)
        self.connection_calls = InFlight(cfg.connection_calls)
        self.behind_plane = bool(getattr(cfg, "public_bind", None)) and str(cfg.bind).startswith("unix:")
        self.opened_run_store = None
        middleware: list = [RequestIdMiddleware(self)]
        if getattr(cfg, "cors_origins", ()):
            middleware.insert(0, CorsMiddleware(cfg.cors_origins))
        self.falcon = falcon.App(middleware=middleware)
        self.falcon.req_options.auto_parse_qs_csv = False
        self.falcon.req_options.keep_blank_qs_values = True
        self.falcon.resp_options.secure_cookies_by_default = False
        self.falcon.add_error_handler(Exception, self._on_exception)
        self.falcon.add_error_handler(falcon.HTTPError, self._on_http_error)
        self.falcon.add_error_handler(ApiError, self._on_api_error)
        self.falcon.add_error_handler(DomainError, self._on_domain_error)
        self.falcon.add_route(DataResource.ROUTE, DataResource(self))
        from qag.http import console
        from qag.http import catalog, manage, ops, roles, runs
        catalog.register(self)
        roles.register(self)
        console.register(self)
        manage.register(self)
        ops.register(self)
        runs.register(self)
        self.falcon.add_sink(self._not_found, r"/")

    def __call__(self, environ, start_response):
        return self.falcon(environ, start_response)

    def cache_result(self, key, ttl: int, body: bytes, nrows: int, resp) -> None:
        """A saved query's cache_ttl: repeat calls within ttl seconds are answered without the database."""
        if len(self.result_cache) >= 4096:
            now = time.monotonic()
            self.result_cache = {k: v for k, v in self.result_cache.items() if v[0] > now}
            if len(self.result_cache) >= 4096:
                self.result_cache.clear()
        etag = '"%s"' % hashlib.blake2b(body, digest_size=12).hexdigest()
        resp.set_header("ETag", etag)
        resp.set_header("Cache-Control", f"private, max-age={int(ttl)}")
        headers = [(h, resp.get_header(h)) for h in ("X-Page", "X-Page-Size", "X-Row-Count", "X-Has-More", "ETag",
                                                     "Cache-Control") if resp.get_header(h) is not None]
        self.result_cache[key] = (time.monotonic() + ttl, body, headers, nrows)

    @staticmethod
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

    def apply_transforms(self, transforms, cols, rows, key, names=None):
        """The plan's masking; a result whose columns no longer match the plan (a table changed under
        SELECT *) is refused as 403 mask_unresolvable rather than masked by the wrong position."""
        from qag import governance
        try:
            return governance.apply_transforms(transforms, cols, rows, key, names)
        except governance.GovernanceError as exc:
            raise ApiError(exc.status, exc.code, exc.message, exc.extra) from None

    def finish(self, req, run: dict, status: int, code: str | None, t0: float, query_seconds, plan_hit) -> None:
        duration = time.perf_counter() - t0
        recorded = None
        if self.recorder is not None:
            run["status"], run["code"], run["duration_us"] = status, code, int(duration * 1e6)
            run["request_id"], run["route"] = req.context.request_id, DataResource.ROUTE
            recorded = self.recorder(run)
        self.observer.request(DataResource.ROUTE, status, code, run["rows"], duration, query_seconds, plan_hit,
                              recorded)
        slow = self.cfg.slow_ms
        if slow and duration * 1000 >= slow:
            _log.warning("slow call: %s %s took %.1f ms (QAG_SLOW_MS=%d; request %s, key %s, status %s)", req.method,
                         req.path, duration * 1000, slow, req.context.request_id, run.get("key_name") or
                         "(administrator)", status)

    # -- errors --------------------------------------------------------------------------------
    def _on_api_error(self, req, resp, err, params):
        send_error(req, resp, err)
        req.context.error_code = err.code

    def _on_domain_error(self, req, resp, exc, params):
        err = http_errors.answer(exc)
        if err is None:
            return self._on_exception(req, resp, exc, params)
        self._on_api_error(req, resp, err, params)

    def _on_http_error(self, req, resp, err, params):
        status = int(str(err.status).split()[0]) if not isinstance(err.status, int) else err.status
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large", 415: "unsupported_media_type",
                400: "invalid_request"}.get(status, "http_error")
        msg = err.title or "HTTP error"
        if err.description:
            msg = f"{msg}: {err.description}"
        if status == 405:
            msg = f"{req.method} is not allowed on {req.path}."
        send_error(req, resp, ApiError(status, code, msg))
        if status == 405 and getattr(err, "headers", None):
            allow = err.headers.get("Allow")
            if allow:
                resp.set_header("Allow", allow)
        req.context.error_code = code

    def _on_exception(self, req, resp, exc, params):
        import logging
        logging.getLogger("qag").exception("unhandled error on %s %s", req.method, req.path)
        err = ApiError(500, "internal_error", "qag failed to handle this request; the error is in its log.")
        send_error(req, resp, err)
        req.context.error_code = err.code

    def _not_found(self, req, resp, **kw):
        raise ApiError(404, "not_found", f"There is no route {req.method} {req.path}; see /openapi.json.")


def create_app(cfg=None, *, store=None, generations=None, observer=None, recorder=None, segment=None) -> QagApp:
    """Build the application for one process (tests call this directly; gunicorn via qag.server.serve)."""
    from qag import config
    from qag.runtime import LocalGenerations
    from qag.store import Store
    cfg = cfg or config.load()
    if store is None:
        store = Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key)
        store.migrate()
    if generations is None:
        generations = LocalGenerations()
    return QagApp(cfg, Runtime(cfg, store, generations), observer=observer, recorder=recorder, segment=segment)


VERSION = __version__
