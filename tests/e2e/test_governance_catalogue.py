"""A masked key's plan is never served on a stale column list (docs/api.md "Masking and a changing schema"),
through a real `qag serve --plane` and a real PostgreSQL: ALTER TABLE ... ADD COLUMN between two calls.

- `SELECT *`: the plan traced the table's columns as the catalogue listed them; the result of a call after a
  column was added (a generated lower(email), or a column a rule names) has other columns. That call is
  refused (403 mask_unresolvable) whether the plane or Python took it, the connection's catalogue is read
  again, and the next call is planned on the table as it is: the new column masked, dropped or refused as
  its rule says. Never a value in clear.
- A name the catalogue does not list (`SELECT email_lc`) is read again before it is refused.
- `GET /connections/{name}/schema` flags what a call would get: a view's column over a masked one, a
  generated column computed from one, a partition's.
- A search_path set on the role (ALTER ROLE ... SET search_path) decides bare names, as the sessions see it.
"""
from __future__ import annotations

import json
import os
import time

import pytest
import requests

from tests.conftest import PG_ADMIN_DSN, pg_exec, pg_fresh_db, start_server
from tests.e2e.test_plane_differential import UnixConn, _call

pytestmark = pytest.mark.usefixtures("plane")  # built by `make plane`, never under a test timeout

DB = "qag_gov_catalogue"
CLEAR_SSN = "123-45-6789"


@pytest.fixture(scope="module")
def stack():
    dsn = pg_fresh_db(DB)
    for t in ("cust_p", "cust_d", "same_p", "same_d"):
        pg_exec(dsn, f"CREATE TABLE {t} (id int PRIMARY KEY, name text, email text)", None)
        pg_exec(dsn, f"INSERT INTO {t} SELECT i, 'name' || i, 'user' || i || '@example.com' "
                     "FROM generate_series(1, 3) i", None)
    pg_exec(dsn, "CREATE VIEW contacts AS SELECT id, email AS contact FROM cust_p", None)
    pg_exec(dsn, "CREATE TABLE gen (id int, email text, email_lc text GENERATED ALWAYS AS (lower(email)) STORED)",
            None)
    pg_exec(dsn, "CREATE TABLE parted (id int, email text) PARTITION BY RANGE (id)", None)
    pg_exec(dsn, "CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM (0) TO (100)", None)
    pg_exec(dsn, "CREATE SCHEMA billing", None)
    pg_exec(dsn, "CREATE TABLE billing.customers (id int, email text, card text)", None)
    pg_exec(dsn, "INSERT INTO billing.customers VALUES (1, 'b@example.com', '4111111111111111')", None)
    pg_exec(dsn, "CREATE TABLE public.customers (id int, email text)", None)
    pg_exec(dsn, "INSERT INTO public.customers VALUES (1, 'p@example.com')", None)
    # set on the database, not in the connection's options: the server gives it to every new session
    pg_exec(dsn, f"ALTER DATABASE {DB} SET search_path = billing, public", None)
    srv = start_server({"QAG_WORKERS": "1"}, args=("--workers", "1", "--plane", "--plane-threads", "1"))
    adm = {**srv.admin, "Content-Type": "application/json"}

    def post(path, body):
        r = requests.post(srv.base + path, json=body, headers=adm, timeout=30)
        assert r.status_code in (200, 201), (path, r.status_code, r.text)
        return r.json()
    post("/api/v1/connections", {"name": "cat_pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                 "user": "postgres", "database": DB, "options": {"allow_superuser": True}})
    for t in ("cust_p", "cust_d", "same_p", "same_d"):
        post("/api/v1/queries", {"name": f"star_{t}", "connection_name": "cat_pg", "publish": True,
                                 "sql": f"SELECT * FROM {t} ORDER BY id"})
    post("/api/v1/queries", {"name": "bare", "connection_name": "cat_pg", "publish": True,
                             "sql": "SELECT id, email FROM customers ORDER BY id"})
    post("/api/v1/queries", {"name": "qualified", "connection_name": "cat_pg", "publish": True,
                             "sql": "SELECT id, email FROM public.customers ORDER BY id"})
    rules = [{"column": f"{t}.{c}", "action": a} for t in ("cust_p", "cust_d", "same_p", "same_d")
             for c, a in (("email", "mask"), ("ssn", "drop"))]
    srv.keys = {
        "masked": post("/api/v1/api-keys", {"name": "cat_masked", "queries": ["*"], "connections": ["cat_pg"],
                                            "mask": rules})["secret"],
        "ssn": post("/api/v1/api-keys", {"name": "cat_ssn", "queries": ["*"], "connections": ["cat_pg"],
                                         "mask": [r for r in rules if r["column"].endswith(".ssn")]})["secret"],
        "views": post("/api/v1/api-keys", {"name": "cat_views", "queries": ["*"], "connections": ["cat_pg"],
                                           "mask": [{"column": "cust_p.email", "action": "mask"},
                                                    {"column": "gen.email", "action": "hash"},
                                                    {"column": "parted.email", "action": "null"}]})["secret"],
        "public": post("/api/v1/api-keys", {"name": "cat_public", "queries": ["*"], "connections": ["cat_pg"],
                                            "allowed_tables": ["public.customers"]})["secret"],
    }
    srv.sock = os.path.join(srv.env["QAG_HOME"], "gunicorn.sock")
    srv.port = int(srv.base.rsplit(":", 1)[1])
    srv.dsn = dsn
    yield srv
    srv.stop()
    import psycopg2
    conn = psycopg2.connect(PG_ADMIN_DSN)
    conn.autocommit = True
    conn.cursor().execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (DB,))
    conn.cursor().execute(f"DROP DATABASE IF EXISTS {DB}")
    conn.close()


def _get(srv, path: str, who: str, via: str, rid: str):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30) if via == "plane" else UnixConn(srv.sock)
    try:
        status, body, _ = _call(conn, path, {"X-API-Key": srv.keys[who], "X-Request-Id": rid})
    finally:
        conn.close()
    return status, body


def _served_by(srv, query: str, rid: str, timeout: float = 15) -> str | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = requests.get(srv.base + "/api/v1/history", params={"query": query, "limit": 1000}, headers=srv.admin,
                         timeout=30)
        for run in r.json()["items"]:
            if run["request_id"] == rid:
                return run["served_by"]
        time.sleep(0.3)
    return None


def _no_clear(body: bytes, n: int = 3) -> None:
    assert CLEAR_SSN.encode() not in body, body
    for i in range(1, n + 1):
        assert f"user{i}@example.com".encode() not in body, body


@pytest.mark.parametrize("via,table", [("plane", "cust_p"), ("python", "cust_d")])
def test_a_column_added_under_select_star_is_never_served_in_clear(stack, via, table):
    srv = stack
    q = f"/q/star_{table}"
    for i in range(4):   # the plans are built and (for the plane) published; the later calls are the plane's
        status, body = _get(srv, q, "masked", via, f"{table}-before-{i}")
        assert status == 200, body
        assert json.loads(body)[0] == {"id": 1, "name": "name1", "email": "u***@example.com"}, body
        _no_clear(body)
        status, body = _get(srv, q, "ssn", via, f"{table}-ssn-before-{i}")
        assert status == 200, body
        assert json.loads(body)[0] == {"id": 1, "name": "name1", "email": "user1@example.com"}, body
    if via == "plane":
        assert _served_by(srv, f"star_{table}", f"{table}-before-3") == "plane"
        assert _served_by(srv, f"star_{table}", f"{table}-ssn-before-3") == "plane"
    pg_exec(srv.dsn, f"ALTER TABLE {table} ADD COLUMN ssn text DEFAULT '{CLEAR_SSN}'", None)
    # The plans were built on the columns before the ALTER: a call on one is refused (or, when the catalogue
    # was already read again, planned anew); never the new column in clear. Then every call is planned on
    # the table as it is: ssn dropped, email masked.
    # (the catalogue is read again at most every 2 s per connection: a call in between is refused too)
    deadline, n, ok = time.time() + 8, 0, set()
    while ok != {"ssn", "masked"}:
        assert time.time() < deadline, "still refused 8 s after the ALTER"
        for who in ("ssn", "masked"):
            n += 1
            status, body = _get(srv, q, who, via, f"{table}-{who}-0-{n}")
            assert CLEAR_SSN.encode() not in body, body
            if status == 403:
                assert json.loads(body)["code"] == "mask_unresolvable", body
                continue
            assert status == 200, body
            row = json.loads(body)[0]
            assert "ssn" not in row and row["email"] == ("u***@example.com" if who == "masked"
                                                         else "user1@example.com"), body
            ok.add(who)
        time.sleep(0.3)
    for i in range(3):
        status, body = _get(srv, q, "ssn", via, f"{table}-ssn-{i + 1}")
        assert status == 200, body
        assert json.loads(body)[0] == {"id": 1, "name": "name1", "email": "user1@example.com"}, body
        status, body = _get(srv, q, "masked", via, f"{table}-masked-{i + 1}")
        assert status == 200, body
        assert json.loads(body)[0] == {"id": 1, "name": "name1", "email": "u***@example.com"}, body
        _no_clear(body)
    # a generated column computed from the masked email: a value derived from it, refused under mask
    time.sleep(2.1)   # (a connection's catalogue is read again at most every 2 s)
    pg_exec(srv.dsn, f"ALTER TABLE {table} ADD COLUMN email_lc text GENERATED ALWAYS AS (lower(email)) STORED",
            None)
    r = requests.post(srv.base + "/api/v1/queries", headers=srv.admin, timeout=30,
                      json={"name": f"named_{table}", "connection_name": "cat_pg", "publish": True,
                            "sql": f"SELECT id, email_lc FROM {table} ORDER BY id"})
    assert r.status_code == 201, r.text
    for i in range(3):
        status, body = _get(srv, q, "masked", via, f"{table}-gen-{i}")
        assert status == 403 and json.loads(body)["code"] == "mask_unresolvable", (i, body)
        _no_clear(body)
        status, body = _get(srv, f"/q/named_{table}", "masked", via, f"{table}-named-{i}")
        assert status == 403 and json.loads(body)["code"] == "mask_unresolvable", (i, body)
        _no_clear(body)


def test_the_schema_flags_what_a_call_gets(stack):
    """A view's column over a masked one, a generated column computed from one, a partition's column: flagged
    as a call through them is masked (the same analysis decides both)."""
    srv = stack
    r = requests.get(srv.base + "/connections/cat_pg/schema", headers={"X-API-Key": srv.keys["views"]}, timeout=30)
    assert r.status_code == 200, r.text
    got = {(t["schema"], t["name"]): {c["name"]: c["mask"] for c in t["columns"]} for t in r.json()["tables"]}
    assert got[("public", "contacts")] == {"id": None, "contact": "mask"}, got[("public", "contacts")]
    assert got[("public", "gen")] == {"id": None, "email": "hash", "email_lc": "hash"}, got[("public", "gen")]
    assert got[("public", "parted")] == {"id": None, "email": "null"}
    assert got[("public", "parted_1")] == {"id": None, "email": "null"}, got[("public", "parted_1")]
    assert got[("public", "customers")] == {"id": None, "email": None}
    flags = {c["name"]: c["masked"] for t in r.json()["tables"] if t["name"] == "contacts" for c in t["columns"]}
    assert flags == {"id": False, "contact": True}
    # the same key's call through the view is masked as the schema says
    r = requests.post(srv.base + "/api/v1/queries", headers=srv.admin, timeout=30,
                      json={"name": "via_view", "connection_name": "cat_pg", "publish": True,
                            "sql": "SELECT id, contact FROM contacts ORDER BY id"})
    assert r.status_code == 201, r.text
    status, body = _get(srv, "/q/via_view", "views", "python", "via-view-1")
    assert status == 200 and json.loads(body)[0]["contact"].endswith("***@example.com"), body


def test_a_search_path_set_on_the_database_decides_bare_names(stack):
    """ALTER DATABASE ... SET search_path = billing, public: a bare customers is billing.customers for the
    server's sessions, so a key limited to public.customers may not read it (qag read the path from the server;
    it took "$user", public before, and the call read billing's card table as public's)."""
    srv = stack
    for via in ("python", "plane"):
        for i in range(3):
            status, body = _get(srv, "/q/bare", "public", via, f"bare-{via}-{i}")
            assert status == 403, body
            err = json.loads(body)
            assert err["code"] == "table_not_allowed" and err["tables"] == ["billing.customers"], err
            assert b"b@example.com" not in body
            status, body = _get(srv, "/q/qualified", "public", via, f"qual-{via}-{i}")
            assert status == 200 and json.loads(body) == [{"id": 1, "email": "p@example.com"}], body
    # the sessions keep the path governance resolved with, whatever the database says later
    pg_exec(srv.dsn, f"ALTER DATABASE {DB} SET search_path = public", None)
    try:
        status, body = _get(srv, "/q/bare", "public", "plane", "bare-after")
        assert status == 403 and json.loads(body)["code"] == "table_not_allowed", body
    finally:
        pg_exec(srv.dsn, f"ALTER DATABASE {DB} SET search_path = billing, public", None)


@pytest.mark.parametrize("via,table", [("plane", "same_p"), ("python", "same_d")])
def test_a_column_swapped_in_at_the_same_width_is_never_served_in_clear(stack, via, table):
    """DROP COLUMN name, ADD COLUMN ssn: the result has the width the plan traced, and the new column sits where
    the plan traced an unmasked one; every position's name is checked (the plane's too), not only masked ones."""
    srv = stack
    q = f"/q/star_{table}"
    for i in range(4):
        status, body = _get(srv, q, "ssn", via, f"{table}-before-{i}")
        assert status == 200 and json.loads(body)[0] == {"id": 1, "name": "name1", "email": "user1@example.com"}, body
    if via == "plane":
        assert _served_by(srv, f"star_{table}", f"{table}-before-3") == "plane"
    time.sleep(2.1)   # (a connection's catalogue is read again at most every 2 s)
    pg_exec(srv.dsn, f"ALTER TABLE {table} DROP COLUMN name, ADD COLUMN ssn text DEFAULT '{CLEAR_SSN}'", None)
    # another page: a statement text the plane's session has not prepared, so it prepares it anew and sees the
    # new columns (no "cached plan must not change result type" from the server to stop it)
    status, body = _get(srv, q + "?page_size=2&page=2", "ssn", via, f"{table}-after-0")
    assert CLEAR_SSN.encode() not in body, body
    assert status == 403 and json.loads(body)["code"] == "mask_unresolvable", body
    time.sleep(0.2)
    for i in range(3):   # planned on the table as it is: ssn dropped
        status, body = _get(srv, q + "?page_size=2&page=2", "ssn", via, f"{table}-after-{i + 1}")
        assert status == 200 and json.loads(body) == [{"id": 3, "email": "user3@example.com"}], body
