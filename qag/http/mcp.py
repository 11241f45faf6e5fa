"""`/mcp` on qag serve's own address: MCP's streamable HTTP transport, stateless, every answer one JSON body.

Each saved query the caller may run is a tool: the queries `/catalog` lists for this caller (catalog.items: granted,
published, not refused by governance), reads only, each with a JSON schema from its typed parameters (claim-bound
ones left out). `tools/call` is a `POST /q/<name>` made in-process with the caller's own credentials and address, so
it is authenticated, governed, limited, recorded (`served_by: mcp`) and counted exactly as any `/q` call; its
answer is the page of rows (at most ROW_LIMIT, `has_more`), or the very error `/q` gives, as the tool's error.

The caller authenticates on every request (X-API-Key or a Bearer token), before the body is read: no credential,
no MCP (401, the contract's `unauthorized`). JSON-RPC 2.0 requests one at a time (a batch is -32600, as MCP has
had no batches since 2025-06-18); a notification or a response from the client is 202 with no body; GET and
DELETE are 405 (no server-to-client stream, no session to end). `qag mcp` (qag/mcpserver.py) serves the same from
a process of its own in front of an instance.
"""
from __future__ import annotations

import io
import json
import re
import sys

import falcon

from qag import __version__
from qag.errors import ApiError
from qag.http.common import client_addr, request_id

ROUTE = "/mcp"
ROW_LIMIT = 1000
VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")  # the initialize handshake's revisions
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")       # a saved query's name (manage.NAME_RE)
VIA_ENV = "qag.via"  # a dotted WSGI key: no request header maps to it; data.authenticate records served_by mcp

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
OUTPUT_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": {"type": "object"}},
                                                  "has_more": {"type": "boolean"}},
                 "required": ["rows", "has_more"]}


class _Refused(Exception):
    def __init__(self, code: int, message: str, rid=None, status: int = 200):
        super().__init__(message)
        self.code, self.message, self.rid, self.status = code, message, rid, status


class Mcp:
    def __init__(self, app):
        self.app = app

    def on_post(self, req, resp):
        app = self.app
        principal = app.auth.authenticate_caller(req.get_header("X-API-Key"), req.get_header("Authorization"),
                                                 client_addr(req))
        try:
            msg = self._message(req)
            if "method" not in msg:
                if "id" in msg and ("result" in msg or "error" in msg):
                    resp.status = falcon.HTTP_202  # the client's answer to a request this server never makes
                    return
                raise _Refused(INVALID_REQUEST, "A JSON-RPC request needs a method.", _id(msg), 400)
            method, params = msg["method"], msg.get("params")
            if not isinstance(method, str):
                raise _Refused(INVALID_REQUEST, "method must be a string.", None, 400)
            if params is not None and not isinstance(params, dict):
                raise _Refused(INVALID_PARAMS, "params must be an object.", _id(msg), 400)
            if "id" not in msg:
                resp.status = falcon.HTTP_202  # a notification (notifications/initialized, …): nothing to answer
                return
            rid = msg["id"]
            if not _valid_id(rid):
                raise _Refused(INVALID_REQUEST, "id must be a string or an integer.", None, 400)
            result = self._dispatch(req, principal, method, params or {}, rid)
            _answer(resp, {"jsonrpc": "2.0", "id": rid, "result": result})
        except _Refused as r:
            _answer(resp, {"jsonrpc": "2.0", "id": r.rid, "error": {"code": r.code, "message": r.message}}, r.status)

    def _message(self, req) -> dict:
        cap = self.app.cfg.max_body_bytes
        if req.content_length is not None and req.content_length > cap:
            raise ApiError(413, "body_too_large", f"The request body is larger than {cap} bytes.")
        raw = req.bounded_stream.read(cap + 1)
        if len(raw) > cap:
            raise ApiError(413, "body_too_large", f"The request body is larger than {cap} bytes.")
        try:
            msg = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise _Refused(PARSE_ERROR, "The body is not JSON.", None, 400) from None
        if isinstance(msg, list):
            raise _Refused(INVALID_REQUEST, "Send one JSON-RPC message per request; batches are not served.", None,
                           400)
        if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
            raise _Refused(INVALID_REQUEST, 'A JSON-RPC 2.0 message is an object with "jsonrpc": "2.0".',
                           _id(msg) if isinstance(msg, dict) else None, 400)
        return msg

    def _dispatch(self, req, principal, method: str, params: dict, rid):
        if method == "initialize":
            asked = params.get("protocolVersion")
            return {"protocolVersion": asked if asked in VERSIONS else VERSIONS[0],
                    "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": {"name": "qag", "version": __version__},
                    "instructions": "Each tool runs a saved SQL query of this qag instance that your credentials may "
                                    "run; results are rows, governed and recorded like /q."}
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": self._tools(principal)}
        if method == "tools/call":
            return self._call(req, params, rid)
        raise _Refused(METHOD_NOT_FOUND, f"There is no method {method[:100]!r} here; this server offers tools.",
                       rid)

    def _tools(self, principal) -> list[dict]:
        from qag.http import catalog
        from qag.mcpserver import input_schema
        tools = []
        for item in catalog.items(self.app, principal):
            if item.get("writes"):
                continue  # a write is not offered to agents as a tool
            tools.append({"name": item["name"], "description": item.get("description") or f"Run {item['name']}",
                          "inputSchema": input_schema(item.get("parameters") or {}), "outputSchema": OUTPUT_SCHEMA})
        return tools

    def _call(self, req, params: dict, rid) -> dict:
        name, args = params.get("name"), params.get("arguments")
        if not isinstance(name, str):
            raise _Refused(INVALID_PARAMS, "tools/call needs a tool name.", rid)
        if args is not None and not isinstance(args, dict):
            raise _Refused(INVALID_PARAMS, "arguments must be an object.", rid)
        if not TOOL_NAME_RE.fullmatch(name):
            # a tool is a saved query's name: anything else would reach another route or the call's options
            return _tool_error({"error": "There is no tool by that name; list the tools to see yours.",
                                "code": "query_not_found", "request_id": req.context.get("request_id") or ""})
        status, headers, body = self._q(req, name, {"params": args or {},
                                                    "page_size": min(ROW_LIMIT, self.app.cfg.max_page_size)})
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        if status != 200 or not isinstance(payload, list):
            if not isinstance(payload, dict):
                payload = {"error": "The query did not answer rows.", "code": "internal_error"}
            return _tool_error(payload)
        out = {"rows": payload, "has_more": headers.get("x-has-more") == "true"}
        return {"content": [{"type": "text", "text": json.dumps(payload)}], "structuredContent": out,
                "isError": False}

    def _q(self, req, name: str, body: dict):
        """POST /q/<name> in this process as the caller: its credentials, address and request id; recorded with
        served_by mcp (VIA_ENV)."""
        data = json.dumps(body).encode()
        environ = {
            "REQUEST_METHOD": "POST", "PATH_INFO": f"/q/{name}", "SCRIPT_NAME": "", "QUERY_STRING": "",
            "SERVER_NAME": "mcp", "SERVER_PORT": "0", "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": client_addr(req) or "", "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(data)), "wsgi.version": (1, 0), "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(data), "wsgi.errors": sys.stderr, "wsgi.multithread": True,
            "wsgi.multiprocess": True, "wsgi.run_once": False, VIA_ENV: "mcp",
            "HTTP_X_REQUEST_ID": req.context.get("request_id") or request_id(req)}
        for header, key in (("X-API-Key", "HTTP_X_API_KEY"), ("Authorization", "HTTP_AUTHORIZATION")):
            v = req.get_header(header)
            if v is not None:
                environ[key] = v
        out = {}

        def start_response(status, headers, exc_info=None):
            out["status"] = int(status.split()[0])
            out["headers"] = {k.lower(): v for k, v in headers}
        chunks = self.app.falcon(environ, start_response)
        try:
            raw = b"".join(chunks)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        return out["status"], out["headers"], raw


def _valid_id(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (str, int))


def _id(msg: dict):
    """The message's id when it is a valid one, for an error answer; else null (JSON-RPC 2.0 section 5)."""
    v = msg.get("id")
    return v if _valid_id(v) else None


def _tool_error(payload: dict) -> dict:
    """The /q error (code, sentence, per-parameter errors) as the tool's own error result."""
    return {"content": [{"type": "text", "text": json.dumps(payload)}], "structuredContent": payload,
            "isError": True}


def _answer(resp, message: dict, status: int = 200) -> None:
    resp.status = falcon.code_to_http_status(status)
    resp.content_type = "application/json"
    resp.text = json.dumps(message)


def register(app) -> None:
    app.falcon.add_route(ROUTE, Mcp(app))
