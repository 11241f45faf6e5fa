"""`qag mcp` in front of a real `qag serve`, driven by the MCP SDK's own client over streamable HTTP: the tools are
the queries the caller's key may run (with a JSON schema from their typed parameters), a tool call is governed
(masking), refused like /q (the same parameter errors, in the tool's error), and recorded with served_by mcp."""
from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time

import pytest
import requests

from tests.conftest import ROOT, free_port

mcp = pytest.importorskip("mcp")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.conftest import start_server
    data = str(tmp_path_factory.mktemp("mcp") / "d.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE people (id INTEGER, name TEXT, email TEXT);"
                     "INSERT INTO people VALUES (1, 'Ada', 'ada@example.com'), (2, 'Bob', 'bob@example.com');")
    db.commit()
    db.close()
    srv = start_server(args=("--workers", "1"))
    post = lambda p, b: requests.post(srv.base + p, json=b, headers=srv.admin, timeout=10)
    assert post("/api/v1/connections", {"name": "d", "db": "sqlite", "database": data}).status_code == 201
    for name, sql, params in (("person", "SELECT id, name, email FROM people WHERE id = :id", {"id": {"type": "int",
                                                                                                   "min": 1}}),
                              ("everyone", "SELECT id, name FROM people ORDER BY id", {}),
                              ("hidden", "SELECT 1 AS one", {})):
        assert post("/api/v1/queries", {"name": name, "connection_name": "d", "sql": sql, "parameters": params,
                                        "publish": True, "description": f"the {name} query"}).status_code == 201
    key = post("/api/v1/api-keys", {"name": "agent", "queries": ["person", "everyone"],
                                    "mask": [{"column": "people.email", "action": "hash"}]}).json()["secret"]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qag.cli", "mcp", "--bind", f"127.0.0.1:{port}", "--upstream",
                             srv.base], cwd=ROOT, env=srv.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            requests.get(url, timeout=1)
            break
        except requests.RequestException:
            time.sleep(0.1)
    yield {"srv": srv, "key": key, "url": url, "serve": srv.base + "/mcp"}
    proc.terminate()
    proc.wait(10)


def run(url, headers, fn):
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def go():
        async with httpx2.AsyncClient(headers=headers, timeout=30) as http:
            async with Client(streamable_http_client(url, http_client=http)) as client:
                return await fn(client)
    return asyncio.run(go())


def test_tools_are_the_callers_queries_and_calls_are_governed_and_recorded(stack):
    async def tools(c):
        return await c.list_tools()
    listed = run(stack["url"], {"X-API-Key": stack["key"]}, tools)
    names = {t.name: t for t in listed.tools}
    assert set(names) == {"person", "everyone"}, "a tool per query this key may run, and no other"
    schema = names["person"].input_schema
    assert schema["properties"]["id"] == {"type": "integer", "minimum": 1} and schema["required"] == ["id"]

    async def call(c):
        return await c.call_tool("person", {"id": 1})
    out = run(stack["url"], {"X-API-Key": stack["key"], "X-Request-Id": "mcp-call-1"}, call)
    assert not out.is_error
    rows = out.structured_content["rows"]
    assert rows[0]["name"] == "Ada" and rows[0]["email"] != "ada@example.com" and len(rows[0]["email"]) == 16

    async def bad(c):
        return await c.call_tool("person", {"id": 0})
    err = run(stack["url"], {"X-API-Key": stack["key"]}, bad)
    assert err.is_error and err.structured_content["code"] == "param_invalid" and "id" in \
        err.structured_content["errors"]

    async def hidden(c):
        return await c.call_tool("hidden", {})
    assert run(stack["url"], {"X-API-Key": stack["key"]}, hidden).structured_content["code"] == "query_not_found"

    srv = stack["srv"]
    deadline = time.time() + 10
    while time.time() < deadline:
        items = requests.get(srv.base + "/api/v1/history", params={"query": "person"}, headers=srv.admin,
                             timeout=10).json()["items"]
        mine = [i for i in items if i["request_id"] == "mcp-call-1"]
        if mine:
            break
        time.sleep(0.2)
    assert mine and mine[0]["served_by"] == "mcp" and mine[0]["key_name"] == "agent"


def test_no_key_no_tools(stack):
    async def tools(c):
        return await c.list_tools()
    from mcp.shared.exceptions import MCPError
    with pytest.raises(BaseException) as refused:   # the SDK raises MCPError, inside its task group's group
        run(stack["url"], {"X-API-Key": "sk_wrong"}, tools)
    errors = [refused.value]
    while errors and isinstance(errors[0], BaseExceptionGroup):
        errors = list(errors[0].exceptions)
    assert isinstance(errors[0], MCPError) and "API key" in errors[0].message, refused.value


def test_a_tool_name_is_a_query_name_not_a_path(stack):
    """A tool name that is not a saved query's name never reaches another route or the call's options: `?stream=`
    would lift the row limit, `../` would reach the Management API."""
    for name in ("everyone?stream=true&format=csv", "everyone#x", "../api/v1/api-keys", "everyone/../person",
                 "everyone%3Fstream%3Dtrue"):
        async def call(c, name=name):
            return await c.call_tool(name, {})
        out = run(stack["url"], {"X-API-Key": stack["key"]}, call)
        assert out.is_error and out.structured_content["code"] == "query_not_found", (name, out)


# -- /mcp on qag serve's own address (qag/http/mcp.py) --------------------------------------------------------------
def history_of(srv, request_id):
    deadline = time.time() + 10
    while time.time() < deadline:
        items = requests.get(srv.base + "/api/v1/history", headers=srv.admin, timeout=10).json()["items"]
        mine = [i for i in items if i["request_id"] == request_id]
        if mine:
            return mine
        time.sleep(0.2)
    return []


def test_serve_mcp_tools_are_the_callers_queries_governed_and_recorded(stack):
    url, key = stack["serve"], stack["key"]

    async def tools(c):
        return await c.list_tools()
    listed = run(url, {"X-API-Key": key}, tools)
    names = {t.name: t for t in listed.tools}
    assert set(names) == {"person", "everyone"}, "a tool per query this key may run, and no other"
    assert names["person"].input_schema["properties"]["id"] == {"type": "integer", "minimum": 1}
    assert names["person"].input_schema["required"] == ["id"]
    admin_tools = {t.name for t in run(url, stack["srv"].admin, tools).tools}
    assert admin_tools == {"person", "everyone", "hidden"}

    async def call(c):
        return await c.call_tool("person", {"id": 1})
    out = run(url, {"X-API-Key": key, "X-Request-Id": "serve-mcp-1"}, call)
    assert not out.is_error
    row = out.structured_content["rows"][0]
    assert row["name"] == "Ada" and row["email"] != "ada@example.com" and len(row["email"]) == 16, "masked"
    assert out.structured_content["has_more"] is False

    async def bad(c):
        return await c.call_tool("person", {"id": 0})
    err = run(url, {"X-API-Key": key}, bad)
    assert err.is_error and err.structured_content["code"] == "param_invalid" and "id" in \
        err.structured_content["errors"]
    for name in ("hidden", "nope", "everyone?stream=true&format=csv", "../api/v1/api-keys"):
        async def refused(c, name=name):
            return await c.call_tool(name, {})
        got = run(url, {"X-API-Key": key}, refused)
        assert got.is_error and got.structured_content["code"] == "query_not_found", name
    mine = history_of(stack["srv"], "serve-mcp-1")
    assert mine and mine[0]["served_by"] == "mcp" and mine[0]["key_name"] == "agent" and mine[0]["query"] == "person"


def test_serve_mcp_needs_a_credential_and_refuses_malformed_json_rpc(stack):
    url, key = stack["serve"], stack["key"]
    rpc = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    for headers in ({}, {"X-API-Key": "sk_wrong"}, {"Authorization": "Bearer not.a.token"}):
        r = requests.post(url, json=rpc, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", headers
    h = {"X-API-Key": key}
    r = requests.post(url, json=rpc, headers=h, timeout=10)
    assert r.status_code == 200 and {t["name"] for t in r.json()["result"]["tools"]} == {"person", "everyone"}
    cases = {
        "not json": (b"{", -32700), "a batch": (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', -32600),
        "wrong version": (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', -32600),
        "no version": (b'{"id": 1, "method": "ping"}', -32600),
        "method not a string": (b'{"jsonrpc": "2.0", "id": 1, "method": 5}', -32600),
        "id an object": (b'{"jsonrpc": "2.0", "id": {}, "method": "ping"}', -32600),
        "params a list": (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": []}', -32602),
        "a string": (b'"ping"', -32600), "deep": (b"[" * 100000 + b"]" * 100000, -32700),
    }
    for why, (body, code) in cases.items():
        r = requests.post(url, data=body, headers={**h, "Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (why, r.status_code, r.text[:200])
    r = requests.post(url, json={"jsonrpc": "2.0", "id": 7, "method": "resources/list"}, headers=h, timeout=10)
    assert r.status_code == 200 and r.json() == {"jsonrpc": "2.0", "id": 7, "error": {
        "code": -32601, "message": r.json()["error"]["message"]}}
    r = requests.post(url, json={"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"arguments": {}}},
                      headers=h, timeout=10)
    assert r.json()["error"]["code"] == -32602
    r = requests.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=h, timeout=10)
    assert r.status_code == 202 and r.content == b""
    r = requests.post(url, data=b"x" * (2 << 20), headers=h, timeout=10)
    assert r.status_code == 413
    assert requests.get(url, headers=h, timeout=10).status_code == 405
    assert requests.delete(url, headers=h, timeout=10).status_code == 405


def test_serve_mcp_calls_are_limited_like_q(stack):
    srv = stack["srv"]
    key = requests.post(srv.base + "/api/v1/api-keys", json={"name": "agent-limited", "queries": ["everyone"],
                                                             "rate_limit": "2/minute"},
                        headers=srv.admin, timeout=10).json()["secret"]
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "everyone", "arguments": {}}}
    got = []
    for _ in range(3):
        r = requests.post(stack["serve"], json=call, headers={"X-API-Key": key}, timeout=10).json()["result"]
        got.append(r["structuredContent"].get("code") if r["isError"] else "ok")
    assert got == ["ok", "ok", "rate_limited"], got
    r = requests.get(srv.base + "/q/everyone", headers={"X-API-Key": key}, timeout=10)
    assert r.status_code == 429, "MCP calls and /q calls share the key's limit"
