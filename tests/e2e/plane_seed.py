"""Shared by the plane's differential tests: one connection, the saved queries, and the four keys (plain,
governed with every masking action, IP-fenced, bogus) on a started `qag serve --plane`."""
from __future__ import annotations

import os

import requests


def seed(srv, connection: dict, queries: dict) -> None:
    adm = {**srv.admin, "Content-Type": "application/json"}

    def post(path, body):
        r = requests.post(srv.base + path, json=body, headers=adm, timeout=30)
        assert r.status_code in (200, 201), (path, r.status_code, r.text)
        return r.json()
    name = connection["name"]
    # the governed key uses the connection, which logs in as a superuser (connectors S8)
    post("/api/v1/connections", {**connection, "options": {**connection.get("options", {}), "allow_superuser": True}})
    for q, (sql, params) in queries.items():
        post("/api/v1/queries", {"name": q, "connection_name": name, "sql": sql, "parameters": params,
                                 "publish": True})
    srv.keys = {
        "plain": post("/api/v1/api-keys", {"name": "plain", "queries": ["*"], "connections": [name]})["secret"],
        "gov": post("/api/v1/api-keys", {"name": "gov", "queries": ["*"], "connections": [name],
                                         "mask": [{"column": "items.email", "action": "hash"},
                                                  {"column": "items.name", "action": "mask"},
                                                  {"column": "items.price", "action": "null"},
                                                  {"column": "items.code", "action": "drop"}]})["secret"],
        "fenced": post("/api/v1/api-keys", {"name": "fenced", "queries": ["*"], "connections": [name],
                                            "allowed_ips": ["10.0.0.0/8"]})["secret"],
        "bogus": "sk_not_a_key",
    }
    srv.sock = os.path.join(srv.env["QAG_HOME"], "gunicorn.sock")
    srv.port = int(srv.base.rsplit(":", 1)[1])
