"""Operations routes: /health, /metrics (the whole instance) and /openapi.json."""
from __future__ import annotations

import hmac
import json

from qag import __version__
from qag.app import client_addr
from qag.errors import ApiError


class Health:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        resp.content_type = "application/json"
        resp.text = '{"status": "ok", "version": "%s"}' % __version__


class Metrics:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        token = self.app.cfg.metrics_token
        if token:
            auth = req.get_header("Authorization") or ""
            if not (auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), token.encode())):
                raise ApiError(401, "unauthorized", "Give the metrics token as Authorization: Bearer <token>.")
        resp.content_type = "text/plain; version=0.0.4; charset=utf-8"
        resp.data = self.app.observer.render()


ERROR_SCHEMA = {"type": "object", "required": ["error", "code", "request_id"],
                "properties": {"error": {"type": "string"}, "code": {"type": "string"},
                               "request_id": {"type": "string"}}}
PARAM_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}


def _err(desc):
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _admin_op(summary, body=False, ok="200"):
    op = {"summary": summary, "security": [{"apiKey": []}],
          "responses": {ok: {"description": "OK"}, "400": _err("Bad input"), "401": _err("No or bad key"),
                        "403": _err("Not an administrator")}}
    if body:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
    return op


STATIC_PATHS = {
    "/health": {"get": {"summary": "Liveness", "responses": {"200": {"description": "ok"}}}},
    "/metrics": {"get": {"summary": "Prometheus text for the whole instance",
                         "responses": {"200": {"description": "metrics"}}}},
    "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3.1"}}}},
    "/q/{name}": {"parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                  "get": {"summary": "Run a saved query", "security": [{"apiKey": []}],
                          "responses": {"200": {"description": "rows"}, "400": _err("Bad parameters"),
                                        "401": _err("Unauthorized"), "403": _err("Forbidden by governance"),
                                        "404": _err("Unknown query"), "429": _err("Rate limited"),
                                        "500": _err("Query failed"), "502": _err("Database unreachable"),
                                        "504": _err("Timed out")}},
                  "post": {"summary": "Run a saved query with a JSON body", "security": [{"apiKey": []}],
                           "requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}},
                           "responses": {"200": {"description": "rows"}, "400": _err("Bad parameters")}}},
    "/api/v1/connections": {"get": _admin_op("List connections"), "post": _admin_op("Create a connection", True, "201")},
    "/api/v1/connections/test": {"post": _admin_op("Test a connection", True)},
    "/api/v1/connections/{name}": {"get": _admin_op("Get a connection"), "patch": _admin_op("Change a connection", True),
                                   "delete": _admin_op("Delete a connection", ok="204")},
    "/api/v1/queries": {"get": _admin_op("List saved queries"), "post": _admin_op("Save a query", True, "201")},
    "/api/v1/queries/{name}": {"get": _admin_op("Get a saved query"), "delete": _admin_op("Delete a query", ok="204")},
    "/api/v1/queries/{name}/versions": {"get": _admin_op("List versions"),
                                        "post": _admin_op("Add a version", True, "201")},
    "/api/v1/queries/{name}/publish": {"post": _admin_op("Publish a version", True)},
    "/api/v1/api-keys": {"get": _admin_op("List API keys"), "post": _admin_op("Create an API key", True, "201")},
    "/api/v1/api-keys/{name}": {"get": _admin_op("Get an API key"), "patch": _admin_op("Change or revoke a key", True),
                                "delete": _admin_op("Delete a key", ok="204")},
    "/api/v1/api-keys/{name}/rotate": {"post": _admin_op("Rotate a key's secret", True)},
    "/api/v1/audit": {"get": _admin_op("The audit log")},
    "/api/v1/history": {"get": _admin_op("Run history, newest first")},
    "/api/v1/usage": {"get": _admin_op("Usage per period")},
    "/events": {"get": {"summary": "Server-Sent Events of runs", "security": [{"apiKey": []}],
                        "responses": {"200": {"description": "text/event-stream"}}}},
    "/-/shm": {"get": _admin_op("The shared segment's state")},
    "/catalog": {"get": {"summary": "The saved queries this caller may run, with parameters, formats and masking",
                         "security": [{"apiKey": []}],
                         "responses": {"200": {"description": "items"}, "401": _err("Unauthorized")}}},
    "/connections/{name}/schema": {
        "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
        "get": {"summary": "Tables and columns of a granted connection, as this caller's grants see them",
                "security": [{"apiKey": []}],
                "responses": {"200": {"description": "tables"}, "401": _err("Unauthorized"),
                              "403": _err("Connection not granted")}}},
}


class OpenAPI:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        paths = {k: v for k, v in STATIC_PATHS.items()}
        rt = self.app.runtime
        principal = None
        secret = req.get_header("X-API-Key")
        if secret:
            try:
                principal = rt.authenticate(secret, client_addr(req))
            except ApiError:
                principal = None
        if principal is not None:
            from qag.runtime import _granted
            store = rt.store
            for q in store.list_queries():
                if q["published_version"] is None:
                    continue
                if not principal.admin and not _granted(principal.key, q):
                    continue
                v = store.get_version(q["name"], q["published_version"])
                params = []
                for pname, spec in (v["parameters"] if v else {}).items():
                    schema = {"type": PARAM_TYPES.get(spec["type"], "string")}
                    for f_src, f_dst in (("enum", "enum"), ("min", "minimum"), ("max", "maximum"),
                                         ("min_length", "minLength"), ("max_length", "maxLength"),
                                         ("pattern", "pattern"), ("default", "default")):
                        if f_src in spec:
                            schema[f_dst] = spec[f_src]
                    params.append({"name": pname, "in": "query", "required": bool(spec.get("required")),
                                   "schema": schema})
                for opt in ("format", "page", "page_size", "stream"):
                    params.append({"name": opt, "in": "query", "required": False,
                                   "schema": {"type": "string" if opt in ("format",) else
                                              ("boolean" if opt == "stream" else "integer")}})
                paths[f"/q/{q['name']}"] = {"get": {"summary": q["description"] or f"Run {q['name']}",
                                                    "operationId": f"run_{q['name']}", "parameters": params,
                                                    "security": [{"apiKey": []}],
                                                    "responses": {"200": {"description": "rows"},
                                                                  "400": _err("Bad parameters")}}}
        doc = {"openapi": "3.1.0",
               "info": {"title": "qag", "version": __version__,
                        "description": "Saved SQL queries served as governed REST endpoints."},
               "paths": paths,
               "components": {"schemas": {"Error": ERROR_SCHEMA},
                              "securitySchemes": {"apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}}}
        resp.content_type = "application/json"
        resp.text = json.dumps(doc)


def register(app) -> None:
    f = app.falcon
    f.add_route("/health", Health(app))
    f.add_route("/metrics", Metrics(app))
    f.add_route("/openapi.json", OpenAPI(app))
