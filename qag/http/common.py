"""What every route of qag/http shares: the request id, the caller's address, the JSON body, a JSON answer, the
administrator check, and the run store this worker reads. It imports nothing of qag/http, so every route module
(and app.py) may import it without a circle."""
from __future__ import annotations

import itertools
import json
import os
import re
import secrets

import falcon

from qag.errors import ApiError

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")

_RID_PREFIX = secrets.token_hex(4)  # per process (re-drawn after fork by _reseed), so ids never collide
_rid_counter = itertools.count(1)


def _reseed() -> None:
    global _RID_PREFIX, _rid_counter
    _RID_PREFIX = secrets.token_hex(4)
    _rid_counter = itertools.count(1)


os.register_at_fork(after_in_child=_reseed)


def request_id(req) -> str:
    """The caller's X-Request-Id when well-formed, else a fresh one: 16 hex characters without a syscall."""
    rid = req.env.get("HTTP_X_REQUEST_ID")  # req.get_header("X-Request-Id") without an absent header's KeyError
    if rid and REQUEST_ID_RE.fullmatch(rid):
        return rid
    return f"{_RID_PREFIX}{next(_rid_counter) & 0xFFFFFFFF:08x}"


def new_request_id() -> str:
    """A fresh request id, for an answer written before any request was read."""
    return f"{_RID_PREFIX}{next(_rid_counter) & 0xFFFFFFFF:08x}"


def client_addr(req) -> str | None:
    """The caller's address. Behind the data plane gunicorn listens only on a unix socket in QAG_HOME, the
    plane strips any X-Qag-Client-Addr a client sends and sets it to the caller's address: trusted then,
    and only then (on a TCP bind, a client could forge it)."""
    if req.env.get("qag.behind_plane"):
        forwarded = req.get_header("X-Qag-Client-Addr")
        if forwarded:
            return forwarded
    return req.remote_addr


def read_json(req, cfg, *, allow_empty: bool = False, nul_ok: bool = False) -> dict:
    """The request body as a JSON object: 413 when too large, 400 invalid_body otherwise. A NUL character (\\u0000)
    in any name or text is 400 invalid_body too (no store keeps one: PostgreSQL's text refuses it), unless
    `nul_ok` (a /q body, whose parameters say it themselves: param_invalid)."""
    length = req.content_length
    if length is not None and length > cfg.max_body_bytes:
        raise ApiError(413, "body_too_large", f"The request body is larger than {cfg.max_body_bytes} bytes.")
    if length is None and req.env.get("wsgi.input_terminated"):
        raw = req.stream.read(cfg.max_body_bytes + 1)  # chunked: the server ends the stream for us
    else:
        raw = req.bounded_stream.read(cfg.max_body_bytes + 1)
    if len(raw) > cfg.max_body_bytes:
        raise ApiError(413, "body_too_large", f"The request body is larger than {cfg.max_body_bytes} bytes.")
    if not raw.strip():
        if allow_empty:
            return {}
        raise ApiError(400, "invalid_body", "Send a JSON object as the request body.")
    ctype = req.content_type
    if ctype and not _is_json(ctype):
        raise ApiError(400, "invalid_body", f"The request body must be JSON (Content-Type: application/json), not "
                       f"{ctype.split(';')[0].strip()[:100]}.")
    body = parse_json(raw)
    if not nul_ok and b"\\u0000" in raw and _has_nul(body):
        raise ApiError(400, "invalid_body", "The request body holds a NUL character (\\u0000); names and texts "
                       "cannot contain one.")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(v) -> bool:
    if isinstance(v, str):
        return _SURROGATE.search(v) is not None
    if isinstance(v, dict):
        return any(_SURROGATE.search(k) is not None or _has_surrogate(x) for k, x in v.items())
    if isinstance(v, list):
        return any(_has_surrogate(x) for x in v)
    return False


def _has_nul(v) -> bool:
    if isinstance(v, str):
        return "\x00" in v
    if isinstance(v, dict):
        return any("\x00" in k or _has_nul(x) for k, x in v.items())
    if isinstance(v, list):
        return any(_has_nul(x) for x in v)
    return False


def _is_json(ctype: str) -> bool:
    media = ctype.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _no_duplicates(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _BodyProblem(f"the name {dup[:100]!r} appears twice in one object")
    return out


def _no_constant(name: str):
    raise _BodyProblem(f"{name} is not a JSON value")


class _BodyProblem(ValueError):
    pass


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object (RFC 8259 strictly: UTF-8, no NaN/Infinity, no name twice in an object, at
    most a few thousand levels deep); anything else is 400 invalid_body saying why."""
    try:
        # UTF-8 only (RFC 8259 8.1; json.loads would also read UTF-16 and UTF-32), and no \\ud800-style escape of
        # half a surrogate pair, which is no character: no store or driver can take one (a 500 before)
        body = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        if _SURROGATE_ESCAPE.search(raw) and _has_surrogate(body):
            raise _BodyProblem("a \\u escape names half of a UTF-16 surrogate pair, which is not a character")
    except _BodyProblem as exc:
        raise ApiError(400, "invalid_body", f"The request body is not valid JSON: {exc}.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_body", f"The request body is not valid JSON: {exc}.") from None
    except RecursionError:  # `[[[[…` a few thousand deep: the parser's recursion, not the server, gives up
        raise ApiError(400, "invalid_body", "The request body nests JSON too deeply.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_body", "The request body must be a JSON object.")
    return body


def ok(resp, body, status=200, no_store=False):
    resp.status = falcon.code_to_http_status(status)
    resp.content_type = "application/json"
    resp.text = json.dumps(body)
    if no_store:
        resp.set_header("Cache-Control", "no-store")


def require_admin(app, req):
    # The Console calls this API in-process as its signed-in administrator, through a WSGI environ key that no
    # request header can set (qag/http/console); everyone else authenticates as on /q: a bad credential is 401, a
    # good one that is not an administrator's (a key, a signed-in caller) 403.
    p = req.env.get("qag.console_principal") or app.auth.authenticate_caller(
        req.get_header("X-API-Key"), req.get_header("Authorization"), client_addr(req))
    if not p.admin:
        raise ApiError(403, "forbidden", "This route is for administrators; use QAG_ADMIN_KEY or an administrator "
                       "token.")
    return p


def run_store(app):
    """The run store, opened on first use by this worker (reads only: the recorder writes); 503
    run_store_unavailable when this server records no runs (`app.run_store_url` is empty)."""
    if app.opened_run_store is None:
        if not app.run_store_url:
            raise ApiError(503, "run_store_unavailable", "This server records no runs (no run store).")
        from qag.runstore import open_store
        app.opened_run_store = open_store(app.run_store_url)
    return app.opened_run_store
