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
    yield {"srv": srv, "key": key, "url": url}
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
