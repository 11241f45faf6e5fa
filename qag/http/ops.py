"""Operations routes: /health and /metrics (the whole instance); /openapi.json and /docs are qag/http/openapi.py's."""
from __future__ import annotations

import hmac

from qag import __version__
from qag.errors import ApiError
from qag.http import openapi
from qag.http.common import client_addr


class Health:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        resp.content_type = "application/json"
        resp.text = f'{{"status": "ok", "version": "{__version__}"}}'

    def on_head(self, req, resp):
        """HEAD /health, as load balancers probe: GET's status and headers, no body (RFC 9110 9.3.2)."""
        self.on_get(req, resp)


class Metrics:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        token = self.app.cfg.metrics_token
        if token:
            scheme, _, given = (req.get_header("Authorization") or "").partition(" ")
            # the scheme is case-insensitive (RFC 9110 11.1); the token is compared in constant time
            if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())) \
                    and not self._administrator(req):
                raise ApiError(401, "unauthorized", "Give the metrics token as Authorization: Bearer <token>.")
        resp.content_type = "text/plain; version=0.0.4; charset=utf-8"
        resp.data = self.app.observer.render()

    def _administrator(self, req) -> bool:
        """An administrator's X-API-Key (QAG_ADMIN_KEY or a named token) opens /metrics too; a scoped key does not."""
        secret = req.get_header("X-API-Key")
        if not secret:
            return False
        try:
            return self.app.auth.authenticate(secret, client_addr(req)).admin
        except ApiError:
            return False


def register(app) -> None:
    f = app.falcon
    f.add_route("/health", Health(app))
    f.add_route("/metrics", Metrics(app))
    openapi.register(app)  # /openapi.json, /docs and /
