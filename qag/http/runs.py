"""Runs as the recorder stored them: /api/v1/history, /api/v1/usage (administrators) and /events (SSE).

/events sends each run as `id: <event id>` and resumes after any id given (Last-Event-ID or
?last_event_id=). Event ids are assigned by the one recorder in commit order, so reading `id > last`
never misses a run committed later with a smaller id (see qag/runstore).
"""
from __future__ import annotations

import json
import re

from qag import params as P
from qag import timeutil
from qag.errors import ApiError
from qag.http.common import client_addr, ok, require_admin, run_store


def _int(req, name, default, lo, hi):
    raw = req.params.get(name)
    if raw is None or raw == "":
        return default
    if not isinstance(raw, str) or not P.INT_RE.fullmatch(raw):
        raise ApiError(400, "invalid_paging", f"{name} must be an integer.")
    v = P.text_int(raw)
    if not lo <= v <= hi:
        raise ApiError(400, "invalid_paging", f"{name} must be between {lo} and {hi}.")
    return v


def _store_call(app, fn):
    """One read of the run store: a bad filter is 400; a store that cannot be reached or read is 503
    store_unavailable (the runs are not lost: the recorder keeps them in its journal meanwhile)."""
    try:
        return fn(run_store(app))
    except ApiError:
        raise
    except ValueError as exc:
        raise ApiError(400, "invalid_filter", f"{exc}.") from None
    except Exception as exc:
        if not store_unavailable(exc):
            raise
        import logging
        logging.getLogger("qag.runs").warning("run store unavailable for a read: %s: %s", type(exc).__name__, exc)
        raise ApiError(503, "store_unavailable", "The run store cannot be read right now, so history and usage "
                       "cannot be shown; no run is lost (the recorder keeps them until the store is back). "
                       "Retry shortly.", headers={"Retry-After": "5"}) from None


def store_unavailable(exc: BaseException) -> bool:
    """A run store failure (connection refused or lost, a database error, a locked file), as opposed
    to a bug in qag: these are the driver families the run stores use."""
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    for klass in type(exc).__mro__:
        mod = klass.__module__ or ""
        if mod.split(".")[0] in ("psycopg2", "sqlite3", "clickhouse_connect", "urllib3", "requests", "http"):
            return True
    return False


_STATUS_RE = re.compile(r"[1-5][0-9][0-9]|[1-5]xx|ok|error|errors|failed", re.I)


def _filters(req, *, status: bool) -> dict:
    """The filters every read of runs shares, checked here so that one the store would read otherwise is a 400:
    since/until RFC 3339 with their offset (`since` before `until`), status an HTTP status (100-599), a class
    such as 5xx, ok or error; and each given once."""
    out = {}
    for name in ("query", "key", "since", "until") + (("status",) if status else ()):
        v = req.params.get(name)
        if isinstance(v, list):
            raise ApiError(400, "invalid_filter", f"{name} must be given once.")
        if v is not None and "\x00" in v:
            raise ApiError(400, "invalid_filter", f"{name} cannot contain a NUL character.")
        out[name] = v if v != "" else None
    bounds = {}
    for name in ("since", "until"):
        if out[name] is not None:
            try:
                bounds[name] = timeutil.parse_input(out[name])
            except ValueError as exc:
                raise ApiError(400, "invalid_filter", f"{name}: {exc}.") from None
    if len(bounds) == 2 and bounds["since"] >= bounds["until"]:
        raise ApiError(400, "invalid_filter", "since must be earlier than until.")
    if status and out["status"] is not None and not _STATUS_RE.fullmatch(out["status"]):
        raise ApiError(400, "invalid_filter", "status must be a code such as 404 (100 to 599), a class such as "
                       "5xx, 'ok' or 'error'.")
    return out


class History:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        unknown = set(req.params) - {"query", "key", "status", "since", "until", "limit", "cursor"}
        if unknown:
            raise ApiError(400, "unknown_field", f"Unknown filter(s) {', '.join(sorted(unknown))}.")
        limit = _int(req, "limit", 100, 1, 1000)
        f = _filters(req, status=True)
        cursor = req.params.get("cursor")
        if cursor and (not isinstance(cursor, str) or not cursor.isascii() or not cursor.isdigit()
                       or not 0 < int(cursor) < 2 ** 63):
            raise ApiError(400, "invalid_filter", "cursor is not one this server gave; use the next_cursor of the "
                           "previous page.")
        items, nxt = _store_call(self.app, lambda store: store.history(limit=limit, cursor=cursor or None, **f))
        ok(resp, {"items": items, "next_cursor": nxt})


class Usage:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        unknown = set(req.params) - {"per", "since", "until", "key", "query"}
        if unknown:
            raise ApiError(400, "unknown_field", f"Unknown filter(s) {', '.join(sorted(unknown))}.")
        f = _filters(req, status=False)
        per = req.params.get("per")
        if per is not None and per not in ("minute", "hour", "day"):
            raise ApiError(400, "invalid_filter", "per must be minute, hour or day.")
        items = _store_call(self.app, lambda store: store.usage(per=per or "hour", **f))
        ok(resp, {"items": items, "next_cursor": None})


_EVENT_ID = re.compile(r"[0-9]{1,19}")


def event_id(req) -> int:
    """The id to resume after: Last-Event-ID, else ?last_event_id=, else 0. Only plain decimal digits (no sign,
    space, underscore or other script's digits, which int() would take), below 2**63; else 400."""
    raw = req.get_header("Last-Event-ID")
    if raw is None:
        values = req.get_param_as_list("last_event_id") or []
        if len(values) > 1:
            raise ApiError(400, "invalid_event_id", "Give last_event_id once.")
        raw = values[0] if values else None
    if raw is None or raw == "":
        return 0
    if not _EVENT_ID.fullmatch(raw) or int(raw) >= 2 ** 63:
        raise ApiError(400, "invalid_event_id", "Last-Event-ID must be an event id (a non-negative integer).")
    return int(raw)


class Events:
    """Server-Sent Events of runs; a key sees its own, an administrator all. Capped per key and per instance
    (QAG_KEY_SUBSCRIBERS, QAG_MAX_SUBSCRIBERS: 503 too_many_streams); served off the request threads by the
    worker's event hub (qag/http/eventhub.py)."""

    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        from qag.http.eventhub import Feed, Subscription
        app = self.app
        secret, bearer, addr = req.get_header("X-API-Key"), req.get_header("Authorization"), client_addr(req)
        # every way in, as /q: a key sees its own runs, a signed-in caller the runs recorded under it
        p = app.auth.authenticate_caller(secret, bearer, addr)
        unknown = set(req.params) - {"last_event_id", "limit"}
        if unknown:
            raise ApiError(400, "unknown_field", f"Unknown parameter(s) {', '.join(sorted(unknown))}; allowed: "
                           "last_event_id, limit.")
        last = event_id(req)
        limit_total = _int(req, "limit", 0, 0, 10_000_000)  # 0: follow for ever
        key_name = None if p.admin else p.caller
        store = run_store(app)
        holder = p.caller if not p.admin else "\x00admin"
        app.subscribers.acquire(holder)
        feed = Feed(store=store, auth=app.auth, secret=secret, addr=addr, admin=p.admin,
                    key_name=key_name, last=last, limit_total=limit_total,
                    release=lambda: app.subscribers.release(holder),
                    bearer=None if secret or p.admin else bearer,
                    not_before=None if p.admin or p.claims is not None else (p.key or {}).get("created_at"))
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-store")
        resp.set_header("X-Accel-Buffering", "no")
        resp.stream = Subscription(feed, app.cfg.send_timeout)


class ShmStat:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        seg = self.app.segment
        if seg is None:
            raise ApiError(404, "not_found", "This process has no shared segment.")
        resp.content_type = "application/json"
        resp.text = json.dumps(seg.stat(), default=str)


def register(app) -> None:
    f = app.falcon
    f.add_route("/api/v1/history", History(app))
    f.add_route("/api/v1/usage", Usage(app))
    f.add_route("/events", Events(app))
    f.add_route("/-/shm", ShmStat(app))
