"""Issue 12 through `qag serve` (database qag_govparse_e2e): what the analysis reads is what PostgreSQL runs
(class 1), whole-row values are refused before they run (class 2), quoted names do not capture (class 4),
and failing closed is never a 500 (class 9)."""
from __future__ import annotations

import json

import pytest
import requests

from tests.conftest import pg_exec, pg_fresh_db, start_server

J = {"Content-Type": "application/json"}
DB = "qag_govparse_e2e"


@pytest.fixture(scope="module")
def srv():
    dsn = pg_fresh_db(DB)
    pg_exec(dsn, "CREATE TABLE customers (id int PRIMARY KEY, name text, email text);"
                 "INSERT INTO customers VALUES (1, 'Ada', 'ada@example.com'), (2, 'Bob', 'bob@example.org')")
    s = start_server({"QAG_MASK_KEY": "k"})
    yield s
    s.stop()


def post(s, path, body, expect=(200, 201)):
    r = requests.post(s.base + path, headers={**s.admin, **J}, data=json.dumps(body))
    assert r.status_code in expect, r.text
    return r


QUERIES = {
    "percent": ("SELECT 7 % 2 AS m, count(*) AS n FROM customers WHERE name LIKE 'A%'", {}),
    "estring": ("SELECT E'it\\'s :p' AS a /* a /* b */ :p */, :q AS b", {"q": "str"}),
    "escaped_udf": ("SELECT U&\"pg\\005fread\\005ffile\"('PG_VERSION') AS v", {}),
    "escaped_col": ("SELECT id, U&\"em\\0061il\" AS e FROM customers ORDER BY id", {}),
    "quoted_alias": ("SELECT c.email FROM (SELECT 'x' AS email) \"C\", customers c ORDER BY c.id", {}),
    "attr_row": ("SELECT c.row_to_json FROM customers c", {}),
    "whole_row": ("SELECT c FROM customers c", {}),
    "unnamed": ("SELECT id FROM (SELECT lower(email), id FROM customers) s ORDER BY id", {}),
}


@pytest.fixture(scope="module")
def key(srv):
    post(srv, "/api/v1/connections", {"name": "db", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                      "user": "postgres", "database": DB,
                                      "options": {"allow_superuser": True}})  # governed keys, superuser (S8)
    for name, (sql, params) in QUERIES.items():
        post(srv, "/api/v1/queries", {"name": name, "connection_name": "db", "sql": sql, "parameters": params,
                                      "publish": True})
    return post(srv, "/api/v1/api-keys", {"name": "masked", "queries": list(QUERIES), "connections": [],
                                          "mask": [{"column": "customers.email", "action": "mask"}]}).json()["secret"]


def get(srv, path, key):
    return requests.get(srv.base + path, headers={"X-API-Key": key})


def test_literal_percent_is_not_a_500(srv, key):
    for k in (key, srv.admin["X-API-Key"]):
        r = get(srv, "/q/percent", k)
        assert r.status_code == 200, r.text
        assert r.json() == [{"m": 1, "n": 1}]


def test_marker_inside_e_string_and_nested_comment_is_not_bound(srv, key):
    r = get(srv, "/q/estring?q=x%27)%20--", key)
    assert r.status_code == 200, r.text
    assert r.json() == [{"a": "it's :p", "b": "x') --"}]


def test_unicode_escapes_are_read_as_postgresql_decodes_them(srv, key):
    r = get(srv, "/q/escaped_udf", key)
    assert r.status_code == 403 and r.json()["code"] == "unsafe_function" and "pg_read_file" in r.text, r.text
    r = get(srv, "/q/escaped_col", key)
    assert r.status_code == 200, r.text
    assert [row["e"] for row in r.json()] == ["a***@example.com", "b***@example.org"]


def test_quoted_alias_does_not_capture_the_masked_column(srv, key):
    r = get(srv, "/q/quoted_alias", key)
    assert r.status_code == 200, r.text
    assert r.json() == [{"email": "a***@example.com"}, {"email": "b***@example.org"}]


def test_whole_row_values_are_refused_before_they_run(srv, key):
    for name in ("attr_row", "whole_row"):
        r = get(srv, f"/q/{name}", key)
        assert r.status_code == 403 and r.json()["code"] == "mask_unresolvable", r.text
        assert "example" not in r.text


def test_unnamed_expression_in_a_derived_table_answers(srv, key):
    r = get(srv, "/q/unnamed", key)
    assert r.status_code == 200, r.text
    assert r.json() == [{"id": 1}, {"id": 2}]
