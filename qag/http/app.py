"""The Falcon application: the wiring (`create_app`, `QagApp`, the middleware, the routes) and the one place
that answers errors in the contract's shape: the error handlers, which map domain errors through
qag/http/errors.py.

The routes live in their own modules and import nothing from this one: the data API `/q` (`data`, its call
options in `options`), the Management API (`manage`, `roles`), the run history (`runs`), the operations
routes (`ops`), the caller's catalog (`catalog`), OpenAPI and /docs (`openapi`) and the Console (`console`);
what they share is `common`.
"""
from __future__ import annotations

import json
import logging
import time
import urllib.parse

import falcon

from qag import __version__
from qag.auth import Auth
from qag.errors import ApiError, DomainError
from qag.http import cache, catalog, console, data, manage, mcp, ops, roles, runs
from qag.http import errors as http_errors
from qag.http.common import request_id
from qag.metrics import Observer
from qag.runtime import Runtime


class RequestIdMiddleware:
    def __init__(self, app: QagApp):
        self.app = app

    def process_request(self, req, resp):
        if self.app.behind_plane:
            req.env["qag.behind_plane"] = True
        req.context.request_id = request_id(req)
        req.context.started = time.perf_counter()
        if req.method in NO_BODY and (req.content_length or req.get_header("Transfer-Encoding")):
            # A GET's or DELETE's body means nothing here: what it says would be silently ignored (DELETE
            # /api/v1/cache with {"query": "x"} evicted every query), so the call is refused rather than run
            # without it.
            raise ApiError(400, "invalid_body", f"A {req.method} carries no body here; send the values in the query "
                           "string (POST /q/<name> takes a JSON body {\"params\": {...}}).")

    def process_resource(self, req, resp, resource, params):
        qs = req.query_string
        if qs and "%" in qs:
            try:
                urllib.parse.unquote_to_bytes(qs.replace("+", " ")).decode("utf-8")
            except UnicodeDecodeError:
                # Falcon would read the bytes as U+FFFD and pass the value on: a parameter the caller did not send
                raise ApiError(400, "param_invalid" if req.uri_template == data.ROUTE else "invalid_request",
                               "The query string is not UTF-8 once its %-escapes are decoded.") from None
        template = req.uri_template
        if qs and (template in NO_QUERY_NAMES or (req.method != "GET" and template in LISTS)):
            names = sorted(req.params)
            if names:
                raise ApiError(400, "unknown_field", f"Unknown parameter(s) {', '.join(names)[:300]}; "
                               f"{req.method} {template} takes none in its query string.", {"fields": names[:20]})

    def process_response(self, req, resp, resource, req_succeeded):
        headers = resp._headers  # Falcon's table of the answer's headers by lower-case name (set_header's)
        rid = req.context.get("request_id")
        if rid:
            headers["x-request-id"] = rid
        # Answers are data or errors for one caller: never sniffed, never stored by a shared cache unless a
        # saved query's cache_ttl said otherwise (it set Cache-Control: private, max-age=<ttl>).
        headers["x-content-type-options"] = "nosniff"
        if "cache-control" not in headers:
            headers["cache-control"] = "no-store"
        route = req.uri_template
        if route != data.ROUTE:  # data calls are observed by finish(), with their rows and timings
            status = resp.status if isinstance(resp.status, int) else int(str(resp.status).split()[0])
            code = req.context.get("error_code")
            self.app.observer.request(route or "other", status, code, 0,
                                      time.perf_counter() - req.context.get("started", time.perf_counter()))


NO_BODY = frozenset(("GET", "HEAD", "DELETE"))

# Routes whose query string carries nothing (any name given there is 400 unknown_field, not silently ignored), and
# collections whose GET is a list (?limit=&cursor=, checked by manage.list_page) but whose POST takes none.
NO_QUERY_NAMES = frozenset((
    "/api/v1/connections/{name}", "/api/v1/connections/test", "/api/v1/queries/{name}", "/api/v1/queries/validate",
    "/api/v1/queries/{name}/publish", "/api/v1/api-keys/{name}",
    "/api/v1/api-keys/{name}/rotate", "/api/v1/roles/{name}", "/connections/{name}/schema"))
LISTS = frozenset(("/api/v1/connections", "/api/v1/queries", "/api/v1/api-keys", "/api/v1/roles",
                   "/api/v1/queries/{name}/versions"))

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
        self.run_store_url: str | None = None  # set by the worker; opened on first use by common.run_store
        self.opened_run_store = None
        from qag.capacity import CallerCalls, InFlight, OpenCount
        slot = getattr(runtime, "slot", 0)
        self.streams = OpenCount("stream", cfg.key_streams, cfg.max_streams, segment, slot)
        self.subscribers = OpenCount("subscriber", cfg.key_subscribers, cfg.max_subscribers, segment, slot)
        self.connection_calls = InFlight(cfg.connection_calls)
        self.caller_calls = CallerCalls(segment, slot)  # keys' and roles' max_concurrent
        self.responses = response_cache(cfg, segment)  # saved queries' cached answers (qag/http/data.py)
        self.response_tier = None  # their second tier across hosts, in Redis (qag/response_tier.py)
        if self.responses is not None and getattr(cfg, "redis_url", "") and getattr(cfg, "response_cache_redis", 0):
            from qag.response_tier import RedisTier
            self.response_tier = RedisTier(cfg.redis_url, self.observer)
        self.behind_plane = bool(getattr(cfg, "public_bind", None)) and str(cfg.bind).startswith("unix:")
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
        self.falcon.add_route(data.ROUTE, data.DataResource(self))
        catalog.register(self)
        roles.register(self)
        console.register(self)
        manage.register(self)
        cache.register(self)
        ops.register(self)
        runs.register(self)
        mcp.register(self)
        self.falcon.add_sink(self._not_found, r"/")

    def __call__(self, environ, start_response):
        return self.falcon(environ, start_response)

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
        logging.getLogger("qag").exception("unhandled error on %s %s", req.method, req.path)
        err = ApiError(500, "internal_error", "qag failed to handle this request; the error is in its log.")
        send_error(req, resp, err)
        req.context.error_code = err.code

    def _not_found(self, req, resp, **kw):
        raise ApiError(404, "not_found", f"There is no route {req.method} {req.path}; see /openapi.json.")


def response_cache(cfg, segment):
    """The host's response cache: the segment's region (shm/LAYOUT.md [Response cache]), or, for an app without a
    segment (in-process tools and tests), one in this process of QAG_RESPONSE_CACHE_MB (auto or at most: 16); None when
    QAG_RESPONSE_CACHE_MB is 0."""
    if segment is not None:
        rc = segment.responses
        return rc if rc.enabled else None
    mb = getattr(cfg, "response_cache_mb", 0) or 0
    mb = min(16 if mb == "auto" else int(mb), 16)
    if not mb:
        return None
    from shm.responses import Responses
    return Responses.private(mb << 20)


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



# -- the error contract: {"error", "code", "request_id"} (API.md) ------------------------------------------------
def send_error(req, resp, err: ApiError) -> None:
    rid = req.context.get("request_id") or request_id(req)
    resp.status = falcon.code_to_http_status(err.status)
    resp.content_type = "application/json"
    resp.text = json.dumps(err.body(rid))
    resp.set_header("X-Request-Id", rid)
    resp.set_header("Cache-Control", "no-store")
    for k, v in err.headers.items():
        resp.set_header(k, v)


VERSION = __version__
