"""`/openapi.json` (OpenAPI 3.1 of the whole API, plus one path per saved query the caller may run) and `/docs`
(Swagger UI from the `swagger-ui-py` package, served by qag itself under its own Content-Security-Policy).

Request bodies are described from the field tuples the handlers validate with (qag/http/manage.py), so a field
added to a handler and not here fails tests/unit/test_core_openapi.py.
"""
from __future__ import annotations

import json
import mimetypes
import os

import falcon

from qag import __version__, render
from qag.errors import ApiError
from qag.http import manage as M
from qag.http.common import client_addr
from qag.http.roles import ROLE_FIELDS
from qag.store import GRANT_FIELDS

NAME = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"}
TS = {"type": ["string", "null"], "format": "date-time"}
STR_LIST = {"type": ["array", "null"], "items": {"type": "string", "minLength": 1}}
MASK_RULES = {"type": ["array", "null"], "items": {
    "type": "object", "required": ["column", "action"], "additionalProperties": False,
    "properties": {"column": {"type": "string"}, "action": {"enum": ["hash", "mask", "null", "drop"]}}}}
PARAM_SPEC = {"oneOf": [
    {"enum": ["int", "integer", "float", "number", "str", "string", "bool", "boolean"]},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["int", "integer", "float", "number", "str", "string", "bool", "boolean"]},
        "required": {"type": "boolean"}, "default": {}, "enum": {"type": "array"}, "min": {"type": "number"},
        "max": {"type": "number"}, "min_length": {"type": "integer"}, "max_length": {"type": "integer"},
        "pattern": {"type": "string"}, "description": {"type": "string"}}}]}

# One property schema per field name the Management API accepts; the handlers' tuples pick from it.
FIELD_SCHEMAS = {
    "name": NAME, "db": {"enum": ["postgres", "mysql", "sqlite", "clickhouse"]},
    "host": {"type": ["string", "null"]}, "port": {"type": ["integer", "null"], "minimum": 1, "maximum": 65535},
    "user": {"type": ["string", "null"]}, "password": {"type": ["string", "null"], "writeOnly": True},
    "database": {"type": ["string", "null"]}, "active": {"type": "boolean"}, "options": {"type": ["object", "null"]},
    "connection_name": NAME, "sql": {"type": "string", "minLength": 1},
    "parameters": {"type": ["object", "null"], "additionalProperties": PARAM_SPEC},
    "description": {"type": ["string", "null"]}, "publish": {"type": ["boolean", "null"]},
    "cache_ttl": {"type": ["integer", "null"], "minimum": 0}, "mask": MASK_RULES,
    "allow_unsafe": {"type": ["boolean", "null"]}, "expires_at": TS,
    "queries": STR_LIST, "connections": STR_LIST, "allowed_tables": STR_LIST,
    "allow_writes": {"type": ["boolean", "null"]},
    "allowed_write_ops": STR_LIST, "allowed_ips": STR_LIST,
    "rate_limit": {"type": ["string", "null"], "examples": ["60/minute"]},
    "quota": {"type": ["string", "object", "null"], "examples": ["10000/day"]},
    "max_rows": {"type": ["integer", "null"], "minimum": 1, "maximum": 2 ** 63 - 1,
                 "description": "the most rows one call returns: a larger page_size is lowered to it, a stream stops"},
    "query_timeout": {"type": ["number", "null"], "minimum": 0.01,
                      "description": "seconds; narrows the server's QAG_QUERY_TIMEOUT and any ?timeout="},
    "max_concurrent": {"type": ["integer", "null"], "minimum": 1, "maximum": 2 ** 63 - 1,
                       "description": "calls in flight at once across every worker of the host"},
    "version": {"type": "integer", "minimum": 1}, "grace_minutes": {"type": ["number", "null"], "minimum": 0},
    "role": {"type": ["string", "null"], "description": "create the key from this role's grants"},
    "require_claims": {"type": "boolean"},
}


def body_schema(fields, required=()) -> dict:
    return {"type": "object", "additionalProperties": False, "required": list(required),
            "properties": {f: FIELD_SCHEMAS[f] for f in fields}}


def _list_of(ref: str) -> dict:
    return {"type": "object", "required": ["items", "next_cursor"],
            "properties": {"items": {"type": "array", "items": {"$ref": ref}},
                           "next_cursor": {"type": ["string", "null"]}}}


ERROR = {"type": "object", "required": ["error", "code", "request_id"], "additionalProperties": True,
         "properties": {"error": {"type": "string"}, "code": {"type": "string"}, "request_id": {"type": "string"},
                        "errors": {"type": "object", "additionalProperties": {"type": "string"}},
                        "retry_after": {"type": "number"}, "timeout": {"type": "number"},
                        "max_concurrent": {"type": "integer"}}}
CONNECTION = {"type": "object", "properties": {
    "name": NAME, "db": FIELD_SCHEMAS["db"], "host": {"type": ["string", "null"]},
    "port": {"type": ["integer", "null"]}, "user": {"type": ["string", "null"]},
    "password": {"type": ["string", "null"], "description": "\"********\" when one is stored"},
    "database": {"type": ["string", "null"]}, "active": {"type": "boolean"}, "options": {"type": ["object", "null"]},
    "created_at": TS, "updated_at": TS}}
QUERY = {"type": "object", "properties": {
    "name": NAME, "connection_name": NAME, "description": {"type": ["string", "null"]},
    "published_version": {"type": ["integer", "null"]}, "cache_ttl": {"type": ["integer", "null"]},
    "sql": {"type": "string"}, "parameters": {"type": ["object", "null"]}}}
VERSION = {"type": "object", "properties": {
    "query_name": NAME, "version": {"type": "integer"}, "sql": {"type": "string"},
    "parameters": {"type": ["object", "null"]}, "description": {"type": ["string", "null"]}, "created_at": TS}}
KEY = {"type": "object", "properties": {
    "name": NAME, "prefix": {"type": "string"}, "active": {"type": "boolean"}, "expires_at": TS,
    "description": {"type": ["string", "null"]}, "secret": {"type": "string", "description": "only in the 201"},
    **{f: FIELD_SCHEMAS[f] for f in GRANT_FIELDS},
    "created_at": TS, "updated_at": TS}}
RUN = {"type": "object", "properties": {
    "event_id": {"type": "integer"}, "at": TS, "query": {"type": ["string", "null"]},
    "version": {"type": ["integer", "null"]}, "key_name": {"type": ["string", "null"]},
    "connection_name": {"type": ["string", "null"]}, "status": {"type": "integer"},
    "code": {"type": ["string", "null"]},
    "rows": {"type": "integer"}, "duration_ms": {"type": "number"}, "request_id": {"type": ["string", "null"]},
    "served_by": {"type": ["string", "null"]},
    "error": {"type": ["string", "null"], "maxLength": 500,
              "description": "history only (administrators): what the database said of a failed call"}}}
USAGE = {"type": "object", "properties": {
    "period": {"type": "string"}, "calls": {"type": "integer"}, "errors": {"type": "integer"},
    "rows": {"type": "integer"}}}
ANY = {"type": "object"}
CACHE_TOTALS = {"type": "object", "required": ["enabled", "capacity_bytes", "bytes_used", "entries"], "properties": {
    "enabled": {"type": "boolean"}, "capacity_bytes": {"type": "integer"}, "bytes_used": {"type": "integer"},
    "entries": {"type": "integer"}, "max_entry_bytes": {"type": "integer"}, "puts": {"type": "integer"},
    "evictions": {"type": "integer"}, "removals": {"type": "integer"}, "rejects": {"type": "integer"},
    "refreshes": {"type": "integer"}, "repairs": {"type": "integer"}}}
CACHE_ENTRY = {"type": "object", "properties": {
    "query": {"type": "string"}, "version": {"type": "integer"}, "connection": {"type": "string"},
    "format": {"type": "string"}, "page": {"type": "integer"}, "page_size": {"type": "integer"},
    "bytes": {"type": "integer"}, "body_bytes": {"type": "integer"}, "rows": {"type": "integer"},
    "age_s": {"type": "number"}, "ttl_s": {"type": "integer"}, "ttl_left_s": {"type": "number"},
    "fresh": {"type": "boolean"}, "hits": {"type": "integer"}, "etag": {"type": "string"},
    "masking": {"type": "string", "description": "the masking fingerprint: equal for callers whose masking "
                                                 "shapes the answer alike"}}}

COMPONENTS = {"Error": ERROR, "Connection": CONNECTION, "ConnectionList": _list_of("#/components/schemas/Connection"),
              "Query": QUERY, "QueryList": _list_of("#/components/schemas/Query"), "Version": VERSION,
              "VersionList": _list_of("#/components/schemas/Version"), "ApiKey": KEY,
              "ApiKeyList": _list_of("#/components/schemas/ApiKey"), "Run": RUN,
              "RunList": _list_of("#/components/schemas/Run"), "Usage": USAGE,
              "UsageList": _list_of("#/components/schemas/Usage"), "Rows": {"type": "array", "items": ANY},
              "CacheList": {"type": "object", "required": ["items", "totals"], "properties": {
                  "items": {"type": "array", "items": CACHE_ENTRY}, "totals": CACHE_TOTALS,
                  "next_cursor": {"type": "null"}}},
              "CacheEviction": {"type": "object", "required": ["evicted"], "properties": {
                  "evicted": {"type": "integer", "description": "answers evicted on this host"},
                  "query": {"type": ["string", "null"]}, "totals": CACHE_TOTALS}}}


def _err(desc: str) -> dict:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(schema: dict | str, desc: str = "OK") -> dict:
    s = {"$ref": f"#/components/schemas/{schema}"} if isinstance(schema, str) else schema
    return {"description": desc, "content": {"application/json": {"schema": s}}}


ADMIN_ERRORS = {"400": _err("Bad input"), "401": _err("No or bad key"), "403": _err("Not an administrator"),
                "503": _err("A store is unavailable")}
PATH_NAME = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]


# A JSON-RPC 2.0 answer of /mcp: a result, or an error with its code and message.
JSONRPC_MESSAGE = {"type": "object", "required": ["jsonrpc"],
                   "properties": {"jsonrpc": {"const": "2.0"}, "id": {"type": ["string", "integer", "null"]},
                                  "result": {"type": "object"},
                                  "error": {"type": "object", "required": ["code", "message"],
                                            "properties": {"code": {"type": "integer"},
                                                           "message": {"type": "string"}}}}}


# One Server-Sent Event of /events (OpenAPI 3.1 has no itemSchema: the schema of a text/event-stream response is
# the schema of each event, as its fields are parsed): `data` is one run as JSON.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"event": {"type": "string", "enum": ["run"]}, "id": {"type": "string"},
                            "retry": {"type": "integer"},
                            "data": {"type": "string", "contentMediaType": "application/json",
                                     "contentSchema": {"$ref": "#/components/schemas/Run"}}}}


def _op(op_id: str, summary: str, ok: dict, *, status="200", body: dict | None = None, errors=None,
        params=None) -> dict:
    signed_in = op_id in ("run_query", "run_query_post", "catalog", "connection_schema", "mcp")
    out = {"operationId": op_id, "summary": summary,
           "security": [{"apiKey": []}, {"bearer": []}] if signed_in else [{"apiKey": []}],
           "responses": {status: ok, **(errors or ADMIN_ERRORS)}}
    if body is not None:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        out["parameters"] = params
    return out


def _q(name: str, desc: str, schema=None) -> dict:
    return {"name": name, "in": "query", "required": False, "description": desc,
            "schema": schema or {"type": "string"}}


def list_params() -> list[dict]:
    """?limit=&cursor= of every paged list (qag/http/manage.py list_page)."""
    return [_q("limit", "Page size (1-1000, default 100)", {"type": "integer", "minimum": 1, "maximum": 1000}),
            _q("cursor", "The previous page's next_cursor")]


def _call_options() -> list[dict]:
    return [_q("format", "Output format", {"enum": list(render.FORMATS)}),
            _q("page", "Page number, from 1", {"type": "integer", "minimum": 1}),
            _q("page_size", "Rows per page", {"type": "integer", "minimum": 1}),
            _q("stream", "Stream the whole result (csv, tsv, ndjson, parquet)", {"type": "boolean"}),
            _q("timeout", "Statement time limit in seconds", {"type": "number", "exclusiveMinimum": 0}),
            _q("connection_name", "Run on another granted connection of the same kind", {"type": "string"})]


DATA_ERRORS = {"400": _err("Bad parameters or call options"), "401": _err("No or bad key"),
               "403": _err("Refused by governance"), "404": _err("Unknown query or version"),
               "429": _err("Rate limit, quota or the key's max_concurrent"),
               "500": _err("The database rejected the statement"),
               "502": _err("The database is unreachable"), "503": _err("Too many streams"),
               "504": _err("Over the time limit"),
               "304": {"description": "Not modified: If-None-Match names the ETag of a query's cached answer "
                                      "(cache_ttl); no body"}}


def _rows_response() -> dict:
    content = {ct.split(";")[0]: {"schema": {"$ref": "#/components/schemas/Rows"} if f == "json"
                                  else {"type": "string"}} for f, ct in render.FORMATS.items()}
    return {"description": "Rows, in select-list order", "content": content}


def static_paths() -> dict:
    conn_body = body_schema(M.CONN_FIELDS, ("name", "db"))
    conn_patch = body_schema([f for f in M.CONN_FIELDS if f != "name"])
    query_body = body_schema(M.QUERY_FIELDS, ("name", "connection_name", "sql"))
    version_body = body_schema(M.VERSION_FIELDS, ("sql",))
    key_body = body_schema(M.KEY_FIELDS, ("name",))
    key_patch = body_schema([f for f in M.KEY_FIELDS if f != "name"])
    public = {"400": _err("Bad input"), "401": _err("No or bad key")}
    return {
        "/health": {"get": {"operationId": "health", "summary": "Liveness", "responses": {"200": _json(
            {"type": "object", "required": ["status", "version"],
             "properties": {"status": {"const": "ok"}, "version": {"type": "string"}}})}}},
        "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus text for the whole instance",
                             "responses": {"200": {"description": "Prometheus text format 0.0.4",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           "401": _err("Metrics token required")}}},
        "/": {"get": {"operationId": "root", "summary": "Redirects to /docs",
                      "responses": {"302": {"description": "to /docs"}}}},
        "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document",
                                  "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")}}},
        "/console": {"get": {"operationId": "console", "summary": "The operators' Console (administrators sign in)",
                             "responses": {"200": {"description": "HTML",
                                                   "content": {"text/html": {"schema": {"type": "string"}}}},
                                           "303": {"description": "to /console/login"}}}},
        "/docs": {"get": {"operationId": "docs", "summary": "The API reference (Swagger UI)",
                          "responses": {"200": {"description": "HTML",
                                                "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        "/q/{name}": {"parameters": PATH_NAME,
                      "get": _op("run_query", "Run a saved query", _rows_response(), errors=DATA_ERRORS,
                                 params=_call_options() + [_q("version", "A version other than the published one "
                                                              "(administrators only)", {"type": "integer"})]),
                      "post": _op("run_query_post", "Run a saved query with a JSON body", _rows_response(),
                                  errors=DATA_ERRORS, body={"type": "object", "additionalProperties": False,
                                                            "properties": {
                                                                "params": {"type": "object"},
                                                                "format": {"enum": list(render.FORMATS)},
                                                                "page": {"type": "integer"},
                                                                "page_size": {"type": "integer"},
                                                                "version": {"type": "integer"},
                                                                "timeout": {"type": "number"},
                                                                "stream": {"type": "boolean"},
                                                                "connection_name": {"type": "string"}}})},
        "/mcp": {"post": _op("mcp", "MCP over streamable HTTP, stateless (JSON-RPC 2.0, one message a request): "
                             "initialize, ping, tools/list (the queries this caller may run that read), tools/call "
                             "(run as /q, recorded with served_by mcp)", _json(JSONRPC_MESSAGE, "A JSON-RPC answer"),
                             body={"type": "object"},
                             errors={"202": {"description": "A notification or the client's response: accepted"},
                                     "400": _json(JSONRPC_MESSAGE, "A malformed JSON-RPC message (its error)"),
                                     "401": _err("No or bad key or token"), "413": _err("Body too large")})},
        "/catalog": {"get": _op("catalog", "The saved queries this caller may run", _json(_list_of(
            "#/components/schemas/CatalogEntry")), errors=public, params=list_params())},
        "/connections/{name}/schema": {"parameters": PATH_NAME, "get": _op(
            "connection_schema", "Tables and columns of a granted connection, as this caller's grants see them",
            _json({"type": "object"}), errors={**public, "403": _err("Connection not granted"),
                                              "404": _err("No such connection")})},
        "/api/v1/connections": {
            "get": _op("list_connections", "List connections", _json("ConnectionList"),
                       params=list_params()),
            "post": _op("create_connection", "Create a connection", _json("Connection", "Created"), status="201",
                        body=conn_body, errors={**ADMIN_ERRORS, "409": _err("Exists"),
                                                "502": _err("Unreachable (an active connection is reached first)")})},
        "/api/v1/connections/test": {"post": _op("test_connection", "Test a connection (by name or definition)",
                                                 _json({"type": "object"}), body={"type": "object"},
                                                 errors={**ADMIN_ERRORS, "404": _err("No such connection"),
                                                         "502": _err("Unreachable")})},
        "/api/v1/connections/{name}": {
            "parameters": PATH_NAME,
            "get": _op("get_connection", "Get a connection", _json("Connection"),
                       errors={**ADMIN_ERRORS, "404": _err("No such connection")}),
            "patch": _op("change_connection", "Change a connection", _json("Connection"), body=conn_patch,
                         errors={**ADMIN_ERRORS, "404": _err("No such connection"),
                                 "502": _err("Unreachable (an active connection is reached first)")}),
            "delete": _op("delete_connection", "Delete a connection", {"description": "Deleted"}, status="204",
                          errors={**ADMIN_ERRORS, "404": _err("No such connection"), "409": _err("In use")})},
        "/api/v1/queries": {
            "get": _op("list_queries", "List saved queries", _json("QueryList"),
                       params=list_params()),
            "post": _op("create_query", "Save a query", _json("Query", "Created"), status="201", body=query_body,
                        errors={**ADMIN_ERRORS, "404": _err("No such connection"), "409": _err("Exists")})},
        "/api/v1/queries/validate": {"post": _op(
            "validate_query", "The checks a save makes, as data (never runs the statement)", _json(
                {"type": "object", "required": ["valid", "errors", "parameters", "tables"],
                 "properties": {"valid": {"type": "boolean"}, "errors": {"type": "array", "items": {"type": "object"}},
                                "parameters": {"type": "object"}, "tables": {"type": "array",
                                                                             "items": {"type": "string"}}}}),
            body={"type": "object"})},
        "/api/v1/queries/{name}": {
            "parameters": PATH_NAME,
            "get": _op("get_query", "Get a saved query", _json("Query"),
                       errors={**ADMIN_ERRORS, "404": _err("No such query")}),
            "delete": _op("delete_query", "Delete a query", {"description": "Deleted"}, status="204",
                          errors={**ADMIN_ERRORS, "404": _err("No such query")})},
        "/api/v1/queries/{name}/versions": {
            "parameters": PATH_NAME,
            "get": _op("list_versions", "List a query's versions", _json("VersionList"),
                       errors={**ADMIN_ERRORS, "404": _err("No such query")}, params=list_params()),
            "post": _op("add_version", "Add a version", _json("Version", "Created"), status="201", body=version_body,
                        errors={**ADMIN_ERRORS, "404": _err("No such query")})},
        "/api/v1/queries/{name}/publish": {
            "parameters": PATH_NAME,
            "post": _op("publish_version", "Publish a version", _json("Query"), body=body_schema(("version",),
                                                                                                ("version",)),
                        errors={**ADMIN_ERRORS, "404": _err("No such query or version")})},
        "/api/v1/api-keys": {
            "get": _op("list_keys", "List API keys", _json("ApiKeyList"),
                       params=list_params()),
            "post": _op("create_key", "Create an API key (the secret is in this answer only)",
                        _json("ApiKey", "Created"), status="201", body=key_body,
                        errors={**ADMIN_ERRORS, "404": _err("No such role"), "409": _err("Exists")})},
        "/api/v1/api-keys/{name}": {
            "parameters": PATH_NAME,
            "get": _op("get_key", "Get an API key", _json("ApiKey"),
                       errors={**ADMIN_ERRORS, "404": _err("No such key")}),
            "patch": _op("change_key", "Change or revoke a key", _json("ApiKey"), body=key_patch,
                         errors={**ADMIN_ERRORS, "404": _err("No such key")}),
            "delete": _op("delete_key", "Delete a key", {"description": "Deleted"}, status="204",
                          errors={**ADMIN_ERRORS, "404": _err("No such key")})},
        "/api/v1/api-keys/{name}/rotate": {
            "parameters": PATH_NAME,
            "post": _op("rotate_key", "Rotate a key's secret", _json("ApiKey"),
                        body=body_schema(("grace_minutes",)), errors={**ADMIN_ERRORS, "404": _err("No such key")})},
        "/api/v1/audit": {"get": _op("audit", "The audit log, newest first", _json({"type": "object"}),
                                     params=list_params())},
        "/api/v1/cache": {
            "get": _op("list_cache", "This host's cached answers of saved queries (cache_ttl), newest first, and "
                       "the response cache's totals", _json("CacheList"),
                       params=[_q("query", "Only this query's answers"),
                               _q("limit", "Most entries listed (1-1000, default 100)",
                                  {"type": "integer", "minimum": 1, "maximum": 1000})]),
            "delete": _op("evict_cache", "Evict cached answers, on every host (all, or one query's)",
                          _json("CacheEviction"), params=[_q("query", "Only this query's answers")],
                          errors={**ADMIN_ERRORS, "404": _err("No such query")})},
        "/api/v1/cache/{name}": {
            "parameters": PATH_NAME,
            "delete": _op("evict_cache_query", "Evict one query's cached answers, on every host",
                          _json("CacheEviction"), errors={**ADMIN_ERRORS, "404": _err("No such query")})},
        "/api/v1/history": {"get": _op("history", "Run history, newest first", _json("RunList"), params=[
            _q(n, d) for n, d in (("query", "Query name"), ("key", "Key name"), ("status", "HTTP status"),
                                  ("since", "RFC 3339"), ("until", "RFC 3339"), ("cursor", "From next_cursor"))]
            + [_q("limit", "Page size (1-1000, default 100)", {"type": "integer", "minimum": 1, "maximum": 1000})])},
        "/api/v1/usage": {"get": _op("usage", "Calls, errors and rows per period", _json("UsageList"), params=[
            _q("per", "minute, hour or day", {"enum": ["minute", "hour", "day"]}), _q("since", "RFC 3339"),
            _q("until", "RFC 3339"), _q("key", "Key name"), _q("query", "Query name")])},
        "/events": {"get": _op("events", "Server-Sent Events of runs (resumable by Last-Event-ID)",
                               {"description": "text/event-stream: one event per run",
                                "content": {"text/event-stream": {"schema": SSE_EVENT}}},
                               errors={"400": _err("Malformed Last-Event-ID"), "401": _err("No or bad key"),
                                       "503": _err("Too many subscribers")},
                               params=[_q("last_event_id", "Resume after this event id", {"type": "integer"})])},
        "/-/shm": {"get": _op("shm_stat", "The shared segment's state", _json({"type": "object"}))},
        "/api/v1/roles": {
            "get": _op("list_roles", "List roles", _json({"type": "object"}), params=list_params()),
            "post": _op("create_role", "Create a role (a grant template for signed-in callers and keys)",
                        _json({"type": "object"}, "Created"), status="201", body=_role_body(True),
                        errors={**ADMIN_ERRORS, "409": _err("Exists")})},
        "/api/v1/roles/{name}": {
            "parameters": PATH_NAME,
            "get": _op("get_role", "Get a role", _json({"type": "object"}),
                       errors={**ADMIN_ERRORS, "404": _err("No such role")}),
            "patch": _op("change_role", "Change a role", _json({"type": "object"}), body=_role_body(False),
                         errors={**ADMIN_ERRORS, "404": _err("No such role")}),
            "delete": _op("delete_role", "Delete a role", {"description": "Deleted"}, status="204",
                          errors={**ADMIN_ERRORS, "404": _err("No such role")})},
    }


def _role_body(create: bool) -> dict:
    fields = ROLE_FIELDS if create else tuple(f for f in ROLE_FIELDS if f != "name")
    return body_schema(fields, ("name",) if create else ())


CATALOG_ENTRY = {"type": "object", "properties": {
    "name": NAME, "description": {"type": "string"}, "version": {"type": "integer"},
    "connection_name": NAME, "parameters": {"type": "object"},
    "formats": {"type": "array", "items": {"type": "string"}},
    "stream_formats": {"type": "array", "items": {"type": "string"}}, "cache_ttl": {"type": ["integer", "null"]},
    "writes": {"type": ["boolean", "null"]}, "masking": {"type": ["array", "null"]}, "path": {"type": "string"}}}

PARAM_TYPES = {"int": "integer", "integer": "integer", "float": "number", "number": "number", "str": "string",
               "string": "string", "bool": "boolean", "boolean": "boolean"}


def _query_path(q: dict, v: dict | None) -> dict:
    params = []
    for pname, spec in ((v or {}).get("parameters") or {}).items():
        if not isinstance(spec, dict):
            spec = {"type": spec}
        if spec.get("from_claim"):
            continue  # bound from a verified claim: never the caller's to give
        schema: dict = {"type": PARAM_TYPES.get(spec.get("type"), "string")}
        for src, dst in (("enum", "enum"), ("min", "minimum"), ("max", "maximum"), ("min_length", "minLength"),
                         ("max_length", "maxLength"), ("pattern", "pattern"), ("default", "default")):
            if src in spec:
                schema[dst] = spec[src]
        params.append({"name": pname, "in": "query", "required": bool(spec.get("required", "default" not in spec)),
                       "schema": schema})
    params += _call_options()
    return {"get": {"summary": q.get("description") or f"Run {q['name']}", "operationId": f"run_{q['name']}",
                    "parameters": params, "security": [{"apiKey": []}, {"bearer": []}],
                    "responses": {"200": _rows_response(), **DATA_ERRORS}}}


def document(app, principal) -> dict:
    paths = static_paths()
    if principal is not None:
        from qag.http import catalog
        store = app.runtime.store
        # the queries this caller may run, by the very rule of /catalog (granted, and not refused by governance)
        runnable = {i["name"] for i in catalog.items(app, principal)}
        for q in store.list_queries():
            if q["name"] not in runnable:
                continue
            path = f"/q/{q['name']}"
            if path in paths:
                continue
            paths[path] = _query_path(q, store.get_version(q["name"], q["published_version"]))
    return {"openapi": "3.1.0",
            "info": {"title": "qag", "version": __version__,
                     "description": "Saved SQL queries served as governed REST endpoints."},
            "paths": paths,
            "components": {"schemas": {**COMPONENTS, "CatalogEntry": CATALOG_ENTRY},
                           "securitySchemes": {"apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
                                               "bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT",
                                                          "description": "a signed-in caller's token; its role "
                                                                         "claim names the grants"}}}}


class OpenAPI:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        principal = None
        secret, bearer = req.get_header("X-API-Key"), req.get_header("Authorization")
        if secret or bearer:
            try:
                principal = self.app.auth.authenticate_caller(secret, bearer, client_addr(req))
            except ApiError:
                principal = None
        resp.content_type = "application/json"
        resp.text = json.dumps(document(self.app, principal))


# -- /docs ---------------------------------------------------------------------------------------------------
DOCS_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
            "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
DOCS_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>qag API reference</title>
<link rel="stylesheet" href="/docs/static/swagger-ui.css"><link rel="icon" href="/docs/static/favicon-32x32.png">
</head><body><div id="swagger-ui"></div>
<script src="/docs/static/swagger-ui-bundle.js"></script><script src="/docs/qag-init.js"></script>
</body></html>
"""
# No inline script: the CSP allows scripts from this origin only.
INIT_JS = """window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis], layout: "BaseLayout", persistAuthorization: false});
});
"""
DOC_ASSET_ROUTES = ("/docs/qag-init.js", "/docs/static/{filename}")  # files of /docs, not operations
STATIC_FILES = ("swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png", "favicon-16x16.png", "LICENSE")


def _static_dir() -> str | None:
    try:
        import swagger_ui
    except ImportError:
        return None
    d = os.path.join(os.path.dirname(swagger_ui.__file__), "static")
    return d if os.path.isdir(d) else None


def _security_headers(resp) -> None:
    resp.set_header("Content-Security-Policy", DOCS_CSP)
    resp.set_header("X-Content-Type-Options", "nosniff")
    resp.set_header("X-Frame-Options", "DENY")
    resp.set_header("Referrer-Policy", "no-referrer")


class Docs:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        if _static_dir() is None:
            raise ApiError(501, "docs_unavailable", "The API reference needs the 'swagger-ui-py' package "
                           "(pip install 'qag[server]'); /openapi.json serves the same document.")
        _security_headers(resp)
        resp.content_type = "text/html; charset=utf-8"
        resp.text = DOCS_HTML


class DocsInit:
    def on_get(self, req, resp):
        _security_headers(resp)
        resp.content_type = "text/javascript; charset=utf-8"
        resp.text = INIT_JS


class DocsStatic:
    def on_get(self, req, resp, filename):
        d = _static_dir()
        if d is None or filename not in STATIC_FILES:
            raise ApiError(404, "not_found", f"There is no file /docs/static/{filename}.")
        _security_headers(resp)
        resp.content_type = mimetypes.guess_type(filename)[0] or "text/plain"
        if filename == "LICENSE":
            resp.content_type = "text/plain; charset=utf-8"
        resp.set_header("Cache-Control", "public, max-age=86400")
        with open(os.path.join(d, filename), "rb") as f:
            resp.data = f.read()


class Root:
    def on_get(self, req, resp):
        resp.status = falcon.HTTP_302
        resp.set_header("Location", "/docs")


def register(app) -> None:
    f = app.falcon
    f.add_route("/openapi.json", OpenAPI(app))
    f.add_route("/docs", Docs(app))
    f.add_route("/docs/qag-init.js", DocsInit())
    f.add_route("/docs/static/{filename}", DocsStatic())
    f.add_route("/", Root())
