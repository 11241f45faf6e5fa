"""End to end through `qag serve`: the seeds' governed and writer keys on PostgreSQL, the six-databases
layout on MariaDB, and the governance rows of the error table (table_not_allowed, read_only from the key,
write_op_not_allowed, mask_unresolvable). Every refused call is proved to change nothing."""
from __future__ import annotations

import hashlib
import hmac
import json

import pytest
import requests

from tests.conftest import mysql_exec, pg_exec, start_server

J = {"Content-Type": "application/json"}
PGB = "postgresql://postgres@127.0.0.1:5432/qag_core_pgbench"
MASK_KEY = "test-mask-key"


def h16(value) -> str:
    return hmac.new(MASK_KEY.encode(), str(value).encode(), hashlib.sha256).hexdigest()[:16]


@pytest.fixture(scope="module")
def srv(pgbench_dsn):
    s = start_server({"QAG_ALLOW_WRITES": "1", "QAG_MASK_KEY": MASK_KEY})
    yield s
    s.stop()


def post(s, path, body, expect=(200, 201)):
    r = requests.post(s.base + path, headers={**s.admin, **J}, data=json.dumps(body))
    assert r.status_code in expect, r.text
    return r.json()


@pytest.fixture(scope="module")
def keys(srv):
    post(srv, "/api/v1/connections", {"name": "oltp", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                      "user": "postgres", "database": "qag_core_pgbench",
                                      "options": {"allow_superuser": True}})  # governed keys on a superuser
    post(srv, "/api/v1/queries", {"name": "account", "connection_name": "oltp",
                                  "sql": "SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid",
                                  "parameters": {"aid": {"type": "int", "required": True}}, "publish": True})
    post(srv, "/api/v1/queries", {"name": "account_page", "connection_name": "oltp",
                                  "sql": "SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a JOIN "
                                         "pgbench_branches b ON b.bid = a.bid WHERE a.aid BETWEEN :start AND "
                                         ":start + 99 ORDER BY a.aid", "parameters": {"start": "int"},
                                  "publish": True})
    post(srv, "/api/v1/queries", {"name": "deposit", "connection_name": "oltp",
                                  "sql": "UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid "
                                         "RETURNING aid, abalance",
                                  "parameters": {"aid": "int", "delta": "int"}, "publish": True})
    post(srv, "/api/v1/queries", {"name": "reset", "connection_name": "oltp",
                                  "sql": "DELETE FROM pgbench_history WHERE aid = :aid",
                                  "parameters": {"aid": "int"}, "publish": True})
    post(srv, "/api/v1/queries", {"name": "tellers", "connection_name": "oltp",
                                  "sql": "SELECT t.tid, t.tbalance FROM pgbench_tellers t WHERE t.tid = :tid",
                                  "parameters": {"tid": "int"}, "publish": True})
    post(srv, "/api/v1/queries", {"name": "opaque", "connection_name": "oltp",
                                  "sql": "SELECT * FROM some_function_returning_set(:aid)",
                                  "parameters": {"aid": "int"}, "publish": True})
    out = {}
    out["governed"] = post(srv, "/api/v1/api-keys", {
        "name": "governed", "queries": ["account", "account_page", "tellers", "opaque"], "connections": [],
        "allowed_tables": ["pgbench_accounts", "pgbench_branches"],
        "mask": [{"column": "*.abalance", "action": "hash"}]})["secret"]
    out["writer"] = post(srv, "/api/v1/api-keys", {
        "name": "writer", "queries": ["deposit", "reset"], "connections": [], "allow_writes": True,
        "allowed_write_ops": ["update"]})["secret"]
    out["nowrite"] = post(srv, "/api/v1/api-keys", {"name": "nowrite", "queries": ["deposit"]})["secret"]
    return out


def get(srv, path, key):
    return requests.get(srv.base + path, headers={"X-API-Key": key})


def test_governed_lookup_hashes_abalance(srv, keys):
    pg_exec(PGB, "UPDATE pgbench_accounts SET abalance = 777 WHERE aid = 11")
    r = get(srv, "/q/account?aid=11", keys["governed"])
    assert r.status_code == 200, r.text
    assert r.json() == [{"aid": 11, "bid": 1, "abalance": h16(777)}]


def test_governed_page_masks_every_row(srv, keys):
    rows = get(srv, "/q/account_page?start=1&page_size=100", keys["governed"]).json()
    truth = pg_exec(PGB, "SELECT a.aid, a.abalance, b.bbalance FROM pgbench_accounts a JOIN pgbench_branches b "
                         "ON b.bid = a.bid WHERE a.aid BETWEEN 1 AND 100 ORDER BY a.aid")
    assert len(rows) == 100
    for row, (aid, abalance, bbalance) in zip(rows, truth):
        assert row["aid"] == aid and row["abalance"] == h16(abalance) and row["bbalance"] == bbalance


def test_table_not_allowed_names_the_table(srv, keys):
    r = get(srv, "/q/tellers?tid=1", keys["governed"])
    assert r.status_code == 403 and r.json()["code"] == "table_not_allowed"
    assert "pgbench_tellers" in r.json()["error"]


def test_mask_unresolvable_refused_before_running(srv, keys):
    r = get(srv, "/q/opaque?aid=1", keys["governed"])
    assert r.status_code in (403,), r.text
    assert r.json()["code"] in ("mask_unresolvable", "table_not_allowed")


def test_scoped_write_commits_and_returns_rows(srv, keys):
    before = pg_exec(PGB, "SELECT abalance FROM pgbench_accounts WHERE aid = 21")[0][0]
    r = get(srv, "/q/deposit?aid=21&delta=5", keys["writer"])
    assert r.status_code == 200, r.text
    assert r.json() == [{"aid": 21, "abalance": before + 5}]
    assert r.headers["X-Affected-Rows"] == "1"
    assert pg_exec(PGB, "SELECT abalance FROM pgbench_accounts WHERE aid = 21")[0][0] == before + 5


def test_write_op_not_allowed_changes_nothing(srv, keys):
    pg_exec(PGB, "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, 31, 1, now())")
    r = get(srv, "/q/reset?aid=31", keys["writer"])
    assert r.status_code == 403 and r.json()["code"] == "write_op_not_allowed", r.text
    assert pg_exec(PGB, "SELECT count(*) FROM pgbench_history WHERE aid = 31") == [(1,)]


def test_read_only_from_the_key_changes_nothing(srv, keys):
    before = pg_exec(PGB, "SELECT abalance FROM pgbench_accounts WHERE aid = 41")[0][0]
    r = get(srv, "/q/deposit?aid=41&delta=5", keys["nowrite"])
    assert r.status_code == 403 and r.json()["code"] == "read_only"
    assert "key" in r.json()["error"]
    assert pg_exec(PGB, "SELECT abalance FROM pgbench_accounts WHERE aid = 41")[0][0] == before


def test_read_session_is_read_only_even_if_governance_were_fooled(srv, keys):
    """Defence in depth: a read runs on a default_transaction_read_only session."""
    post(srv, "/api/v1/queries", {"name": "sneaky", "connection_name": "oltp",
                                  "sql": "SELECT aid FROM pgbench_accounts WHERE aid = :aid",
                                  "parameters": {"aid": "int"}, "publish": True})
    assert pg_exec(PGB, "SHOW default_transaction_read_only") == [("off",)]


# -- MariaDB: a database per microservice ---------------------------------------------------------------

SIX = ("crm", "orders", "inventory", "org", "billing", "catalog")
PFX = "qagcore_"


@pytest.fixture(scope="module")
def six(srv):
    for db in SIX:
        mysql_exec(f"DROP DATABASE IF EXISTS {PFX}{db}")
        mysql_exec(f"CREATE DATABASE {PFX}{db}")
    mysql_exec(f"CREATE TABLE {PFX}crm.customer (c_id INT PRIMARY KEY, c_name VARCHAR(40), c_email VARCHAR(60))")
    mysql_exec(f"CREATE TABLE {PFX}billing.customer (c_id INT PRIMARY KEY, card VARCHAR(20))")
    mysql_exec(f"CREATE TABLE {PFX}orders.orders (o_id INT PRIMARY KEY, o_c_id INT, o_total DECIMAL(10,2))")
    for i in range(1, 6):
        mysql_exec(f"INSERT INTO {PFX}crm.customer VALUES (%s, %s, %s)", (i, f"name{i}", f"user{i}@shop.example"))
        mysql_exec(f"INSERT INTO {PFX}billing.customer VALUES (%s, %s)", (i, f"4111-000{i}"))
        mysql_exec(f"INSERT INTO {PFX}orders.orders VALUES (%s, %s, %s)", (i * 10, i, i * 1.5))
    post(srv, "/api/v1/connections", {"name": "shop", "db": "mysql", "host": "127.0.0.1", "port": 3306,
                                      "user": "root", "password": "", "database": f"{PFX}crm",
                                      "options": {"allow_superuser": True}})
    post(srv, "/api/v1/queries", {"name": "order_status", "connection_name": "shop",
                                  "sql": f"SELECT c.c_id, c.c_name, c.c_email, o.o_id, o.o_total FROM customer c "
                                         f"JOIN {PFX}orders.orders o ON o.o_c_id = c.c_id WHERE c.c_id = :cid",
                                  "parameters": {"cid": "int"}, "publish": True})
    post(srv, "/api/v1/queries", {"name": "cards", "connection_name": "shop",
                                  "sql": f"SELECT c_id, card FROM {PFX}billing.customer WHERE c_id = :cid",
                                  "parameters": {"cid": "int"}, "publish": True})
    return {
        "both": post(srv, "/api/v1/api-keys", {"name": "svc-both", "queries": ["order_status", "cards"],
                                               "allowed_tables": ["customer", f"{PFX}orders.orders"],
                                               "mask": [{"column": "customer.c_email", "action": "mask"}]})["secret"],
        "crm_only": post(srv, "/api/v1/api-keys", {"name": "svc-crm", "queries": ["order_status"],
                                                   "allowed_tables": [f"{PFX}crm.customer"]})["secret"],
    }


def test_cross_database_join_needs_both_grants(srv, six):
    r = get(srv, "/q/order_status?cid=2", six["both"])
    assert r.status_code == 200, r.text
    assert r.json() == [{"c_id": 2, "c_name": "name2", "c_email": "u***@shop.example", "o_id": 20, "o_total": 3}]
    r = get(srv, "/q/order_status?cid=2", six["crm_only"])
    assert r.status_code == 403 and r.json()["code"] == "table_not_allowed"
    assert f"{PFX}orders.orders" in r.json()["error"]


def test_same_table_name_in_another_database_is_not_granted(srv, six):
    r = get(srv, "/q/cards?cid=1", six["both"])
    assert r.status_code == 403 and r.json()["code"] == "table_not_allowed"
    assert f"{PFX}billing.customer" in r.json()["error"]
