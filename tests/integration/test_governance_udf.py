"""Governance and user-defined functions, on real PostgreSQL and MariaDB through the app: a function's body
can read any table, so a key limited by allowed_tables (or by masking rules) may not call one (403
function_not_allowed, issue 12: only the dialect's allow-list and trusted functions), while the databases'
built-in functions stay callable and keys without limits are unaffected."""
from __future__ import annotations

import json

import pytest

from tests.conftest import mysql_exec, pg_exec, pg_fresh_db

J = {"Content-Type": "application/json"}
ADM = {"X-API-Key": "adm", **J}
PG_DB = "qag_gov_udf"
MY_DB = "qag_gov_udf"

PG_SETUP = """
CREATE SCHEMA billing;
CREATE TABLE public.customer (id int PRIMARY KEY, name text, email text);
INSERT INTO public.customer VALUES (1, 'Alice', 'alice@example.com'), (2, 'Bob', 'bob@example.org');
CREATE TABLE billing.card (customer_id int, card_number text);
INSERT INTO billing.card VALUES (1, '4111111111111111'), (2, '5500000000000004');
CREATE FUNCTION public.card_of(cid int) RETURNS text LANGUAGE sql STABLE
  AS 'SELECT card_number FROM billing.card WHERE customer_id = cid';
CREATE FUNCTION billing.secret_count() RETURNS bigint LANGUAGE sql STABLE AS 'SELECT count(*) FROM billing.card';
"""


def post(client, path, body):
    r = client.simulate_post(path, headers=ADM, body=json.dumps(body))
    assert r.status_code in (200, 201), r.text
    return r.json


def query(client, name, sql):
    post(client, "/api/v1/queries", {"name": name, "connection_name": "db", "sql": sql, "publish": True})


def call(client, key, name):
    return client.simulate_get(f"/q/{name}", headers={"X-API-Key": key})


@pytest.fixture()
def pg_app(app_client):
    pg_fresh_db(PG_DB)
    pg_exec(f"postgresql://postgres@127.0.0.1:5432/{PG_DB}", PG_SETUP)
    post(app_client, "/api/v1/connections", {"name": "db", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                             "user": "postgres", "database": PG_DB,
                                             "options": {"allow_superuser": True}})  # connectors S8
    return app_client


def keys(client, queries):
    plain = post(client, "/api/v1/api-keys", {"name": "plain", "queries": queries, "connections": []})["secret"]
    listed = post(client, "/api/v1/api-keys", {"name": "listed", "queries": queries, "connections": [],
                                               "allowed_tables": ["customer"]})["secret"]
    masked = post(client, "/api/v1/api-keys", {"name": "masked", "queries": queries, "connections": [],
                                               "mask": [{"column": "*.card_number", "action": "hash"}]})["secret"]
    return plain, listed, masked


def test_postgresql_user_defined_functions_refused_to_limited_keys(pg_app):
    c = pg_app
    query(c, "card_via_udf", "SELECT id, card_of(id) AS c FROM customer ORDER BY id")
    query(c, "qualified_udf", "SELECT billing.secret_count() AS n")
    query(c, "builtins", "SELECT id, lower(name) AS n, pg_size_pretty(1024::bigint) AS s, "
                         "pg_catalog.upper(name) AS u, md5(email) AS m FROM customer ORDER BY id")
    plain, listed, masked = keys(c, ["card_via_udf", "qualified_udf", "builtins"])

    # a key without limits runs the function: the card numbers come back (what the others must not get)
    r = call(c, plain, "card_via_udf")
    assert r.status_code == 200 and r.json[0]["c"] == "4111111111111111"
    assert call(c, plain, "qualified_udf").json == [{"n": 2}]

    for name, fn in (("card_via_udf", "card_of"), ("qualified_udf", "billing.secret_count")):
        r = call(c, listed, name)
        assert r.status_code == 403 and r.json["code"] == "function_not_allowed", r.text
        assert fn in r.json["error"] and "user-defined" in r.json["error"]
        r = call(c, masked, name)
        assert r.status_code == 403 and r.json["code"] == "function_not_allowed", r.text
        assert "4111" not in r.text

    # built-ins (modelled by sqlglot or not, qualified with pg_catalog or not) stay callable
    for key in (listed, masked):
        r = call(c, key, "builtins")
        assert r.status_code == 200, r.text
        assert r.json[0] == {"id": 1, "n": "alice", "s": "1024 bytes", "u": "ALICE",
                             "m": "c160f8cc69a4f0bf2b0362752353d060"}


@pytest.fixture()
def my_app(app_client):
    mysql_exec(f"DROP DATABASE IF EXISTS {MY_DB}")
    mysql_exec(f"DROP DATABASE IF EXISTS {MY_DB}_billing")
    mysql_exec(f"CREATE DATABASE {MY_DB}")
    mysql_exec(f"CREATE DATABASE {MY_DB}_billing")
    mysql_exec("CREATE TABLE customer (id INT PRIMARY KEY, name VARCHAR(50), email VARCHAR(80))", database=MY_DB)
    mysql_exec("INSERT INTO customer VALUES (1, 'Alice', 'alice@example.com'), (2, 'Bob', 'bob@example.org')",
               database=MY_DB)
    mysql_exec("CREATE TABLE card (customer_id INT, card_number VARCHAR(20))", database=f"{MY_DB}_billing")
    mysql_exec("INSERT INTO card VALUES (1, '4111111111111111'), (2, '5500000000000004')",
               database=f"{MY_DB}_billing")
    mysql_exec(f"CREATE FUNCTION card_of(cid INT) RETURNS VARCHAR(20) READS SQL DATA "
               f"RETURN (SELECT card_number FROM {MY_DB}_billing.card WHERE customer_id = cid)", database=MY_DB)
    post(app_client, "/api/v1/connections", {"name": "db", "db": "mysql", "host": "127.0.0.1", "port": 3306,
                                             "user": "root", "database": MY_DB,
                                             "options": {"allow_superuser": True}})
    yield app_client
    mysql_exec(f"DROP DATABASE IF EXISTS {MY_DB}")
    mysql_exec(f"DROP DATABASE IF EXISTS {MY_DB}_billing")


def test_mariadb_stored_functions_refused_to_limited_keys(my_app):
    c = my_app
    query(c, "card_via_udf", "SELECT id, card_of(id) AS c FROM customer ORDER BY id")
    query(c, "qualified_udf", f"SELECT {MY_DB}.card_of(2) AS c")
    query(c, "builtins", "SELECT id, lower(name) AS n, ifnull(email, '-') AS e, concat_ws('-', id, name) AS w, "
                         "date_format('2026-11-30', '%Y') AS y FROM customer ORDER BY id")
    plain, listed, masked = keys(c, ["card_via_udf", "qualified_udf", "builtins"])
    assert call(c, plain, "card_via_udf").json[1]["c"] == "5500000000000004"
    assert call(c, plain, "qualified_udf").json == [{"c": "5500000000000004"}]
    for name in ("card_via_udf", "qualified_udf"):
        r = call(c, listed, name)
        assert r.status_code == 403 and r.json["code"] == "function_not_allowed", r.text
        assert "card_of" in r.json["error"]
        r = call(c, masked, name)
        assert r.status_code == 403 and r.json["code"] == "function_not_allowed", r.text
        assert "5500" not in r.text
    for key in (listed, masked):
        r = call(c, key, "builtins")
        assert r.status_code == 200, r.text
        assert r.json[0] == {"id": 1, "n": "alice", "e": "alice@example.com", "w": "1-Alice", "y": "2026"}
