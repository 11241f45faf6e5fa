"""`qag mcp`: an MCP server (the official `mcp` SDK, streamable HTTP at /mcp) in front of a running `qag serve`.

Each saved query the caller may run is a tool: its name, description and a JSON schema from its typed parameters,
listed from the caller's own `/catalog`. Calling a tool is a `POST /q/<name>` on the instance with the caller's own
credentials (the API key in X-API-Key, or the Bearer token), so it is authenticated, governed, limited, recorded
(`served_by: mcp`) and counted exactly as any `/q` call: this process decides nothing itself and holds no secret.

It is a process of its own, not a route of `qag serve`, because the workers are WSGI (gunicorn threads serving one
request each), while streamable HTTP keeps sessions and server-sent streams open on an event loop: an ASGI app.
"""
from __future__ import annotations

import json
import re
from typing import Any

ROW_LIMIT = 1000
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # a saved query's name (qag/http/manage.py NAME_RE)
PARAM_TYPES = {"int": "integer", "integer": "integer", "float": "number", "number": "number", "str": "string",
               "string": "string", "bool": "boolean", "boolean": "boolean"}


def input_schema(parameters: dict) -> dict:
    props: dict[str, Any] = {}
    required = []
    for name, spec in (parameters or {}).items():
        spec = spec if isinstance(spec, dict) else {"type": spec}
        if spec.get("from_claim"):
            continue
        s: dict[str, Any] = {"type": PARAM_TYPES.get(spec.get("type"), "string")}
        for src, dst in (("enum", "enum"), ("min", "minimum"), ("max", "maximum"), ("min_length", "minLength"),
                         ("max_length", "maxLength"), ("pattern", "pattern"), ("default", "default"),
                         ("description", "description")):
            if src in spec:
                s[dst] = spec[src]
        props[name] = s
        if spec.get("required", "default" not in spec):  # the contract's rule: required unless it has a default
            required.append(name)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _creds(request) -> dict[str, str]:
    h = {}
    if request is not None:
        for name in ("x-api-key", "authorization", "x-request-id"):
            v = request.headers.get(name)
            if v:
                h[name] = v
    return h


def build_app(upstream: str, *, host: str = "127.0.0.1", row_limit: int = ROW_LIMIT):
    import httpx2
    from mcp import types
    from mcp.server.lowlevel import Server
    from mcp.shared.exceptions import MCPError

    from qag import __version__

    base = upstream.rstrip("/")

    def _denied(r) -> None:
        if r.status_code in (401, 403):
            raise MCPError(-32001, r.json().get("error", "unauthorized")
                           if r.headers.get("content-type", "").startswith("application/json") else "unauthorized")

    async def list_tools(ctx, params):
        async with httpx2.AsyncClient(timeout=30) as c:
            r = await c.get(base + "/catalog", headers=_creds(ctx.request))
        _denied(r)
        r.raise_for_status()
        tools = []
        for item in r.json()["items"]:
            if item.get("writes"):
                continue  # a write is not offered to agents as a tool
            tools.append(types.Tool(name=item["name"], description=item.get("description") or f"Run {item['name']}",
                                    input_schema=input_schema(item.get("parameters") or {}),
                                    output_schema={"type": "object", "properties": {
                                        "rows": {"type": "array", "items": {"type": "object"}},
                                        "has_more": {"type": "boolean"}}, "required": ["rows", "has_more"]}))
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx, params):
        headers = {**_creds(ctx.request), "x-qag-via": "mcp"}
        if not isinstance(params.name, str) or not TOOL_NAME_RE.fullmatch(params.name):
            # a tool is a saved query's name; anything else (`../api/v1/…`, `q?stream=true`) would reach another
            # route or options of the call, around the row limit
            payload = {"error": "There is no tool by that name; list the tools to see yours.",
                       "code": "query_not_found"}
            return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(payload))],
                                        structured_content=payload, is_error=True)
        body = {"params": params.arguments or {}, "page_size": row_limit}
        async with httpx2.AsyncClient(timeout=60) as c:
            r = await c.post(f"{base}/q/{params.name}", json=body, headers=headers)
        if r.status_code == 401:
            _denied(r)
        try:
            payload = r.json()
        except ValueError:
            payload = {"error": r.text, "code": "internal_error"}
        if r.status_code != 200:
            # The same error a /q caller gets (code, sentence, per-parameter errors), as the tool's own error.
            return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(payload))],
                                        structured_content=payload, is_error=True)
        out = {"rows": payload, "has_more": r.headers.get("x-has-more") == "true"}
        return types.CallToolResult(content=[types.TextContent(type="text", text=json.dumps(payload))],
                                    structured_content=out)

    server = Server("qag", version=__version__, on_list_tools=list_tools, on_call_tool=call_tool)
    return server.streamable_http_app(streamable_http_path="/mcp", host=host, json_response=True,
                                      stateless_http=True)


def main(bind: str, upstream: str) -> int:
    import uvicorn
    host, _, port = bind.rpartition(":")
    uvicorn.run(build_app(upstream, host=host), host=host, port=int(port), log_level="warning")
    return 0
