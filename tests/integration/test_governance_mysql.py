"""Governance against a real MariaDB/MySQL: the six-databases layout, cross-database grants, masked results
value by value, and SELECT * expansion checked against the columns the server really returns."""

from __future__ import annotations

import hashlib
import hmac
import re

import pytest

from qag.governance import GovernanceError, apply_transforms, plan_governance

mysql_connector = pytest.importorskip("mysql.connector")

PREFIX = "qag_gov_"   # the seeds' crm/orders/... names, prefixed so other suites' databases are untouched
DBS = ["crm", "orders", "inventory", "org", "billing", "catalog"]
KEY = b"integration-mask-key"

SCHEMA = {
    "crm": ["CREATE TABLE customer (id INT PRIMARY KEY, name VARCHAR(50), email VARCHAR(80), phone VARCHAR(20))",
            ("INSERT INTO customer VALUES (1, 'Alice', 'alice@example.com', '555-0101'),"
            " (2, 'Bob', 'bob@example.org', NULL), (3, 'Carol', NULL, '555-0103')")],
    "orders": ["CREATE TABLE orders (id INT PRIMARY KEY, customer_id INT, total DECIMAL(10,2), status VARCHAR(10))",
               "INSERT INTO orders VALUES (10, 1, 99.50, 'paid'), (11, 1, 5.00, 'open'), (12, 2, 12.25, 'paid')"],
    "inventory": ["CREATE TABLE item (id INT PRIMARY KEY, sku VARCHAR(20), name VARCHAR(50), stock INT)",
                  "INSERT INTO item VALUES (1, 'SKU-1', 'Widget', 7)"],
    "org": ["CREATE TABLE employee (id INT PRIMARY KEY, name VARCHAR(50), email VARCHAR(80), salary INT)",
            "INSERT INTO employee VALUES (1, 'Dan', 'dan@corp.example', 5000)"],
    "billing": [("CREATE TABLE customer (id INT PRIMARY KEY, card_number VARCHAR(20), email VARCHAR(80), "
                 "iban VARCHAR(34))"),
                ("INSERT INTO customer VALUES (1, '4111111111111111', 'alice@bank.example', 'DE00123'),"
                " (2, '5500000000000004', 'bob@bank.example', NULL)")],
    "catalog": ["CREATE TABLE product (id INT PRIMARY KEY, sku VARCHAR(20), name VARCHAR(50), price DECIMAL(8,2))",
                "INSERT INTO product VALUES (1, 'SKU-1', 'Widget', 3.50)"],
}


def h(text):
    return hmac.new(KEY, text.encode(), hashlib.sha256).hexdigest()[:16]


@pytest.fixture(scope="module")
def conn():
    try:
        c = mysql_connector.connect(host="127.0.0.1", port=3306, user="root", password="", autocommit=True)
    except mysql_connector.Error as e:  # pragma: no cover - environment without MariaDB
        pytest.skip(f"MariaDB not reachable: {e}")
    cur = c.cursor()
    for db in DBS:
        cur.execute(f"DROP DATABASE IF EXISTS {PREFIX}{db}")
        cur.execute(f"CREATE DATABASE {PREFIX}{db}")
        cur.execute(f"USE {PREFIX}{db}")
        for stmt in SCHEMA[db]:
            cur.execute(stmt)
    cur.execute(f"USE {PREFIX}crm")
    yield c
    cur = c.cursor()
    for db in DBS:
        cur.execute(f"DROP DATABASE IF EXISTS {PREFIX}{db}")
    c.close()


def n(sql):
    """Write the seeds' names (crm.customer) as this suite's prefixed databases."""
    return re.sub(r"(?<![\w.`])(" + "|".join(DBS) + r")\.", lambda m: f"{PREFIX}{m.group(1)}.", sql)


@pytest.fixture(scope="module")
def columns_of(conn):
    cache = {}

    def columns_of(schema, table):
        if (schema, table) not in cache:
            cur = conn.cursor()
            cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = %s "
                        "AND table_name = %s ORDER BY ordinal_position", (schema, table))
            cache[(schema, table)] = [r[0] for r in cur.fetchall()] or None
        return cache[(schema, table)]
    return columns_of


def gov(sql, columns_of, allowed=None, mask=(), **kw):
    args = {"sql": sql, "dialect": "mysql", "default_schema": f"{PREFIX}crm",
                "allowed_tables": [n(a) for a in allowed] if allowed is not None else None,
                "mask_rules": [{"column": c, "action": a} for c, a in mask], "server_allows_writes": False,
                "key_allows_writes": False, "allowed_write_ops": None, "allow_unsafe": False, "columns_of": columns_of}
    args.update(kw)
    return plan_governance(**args)


def run(conn, sql, plan):
    cur = conn.cursor()
    cur.execute(sql)
    rows = cur.fetchall()
    cols = [d[0] for d in cur.description]
    return apply_transforms(plan.transforms, cols, rows, KEY, names=plan.output_names)


def test_cross_database_join_needs_both_grants(conn, columns_of):
    sql = n("SELECT c.name, o.total FROM crm.customer c JOIN orders.orders o ON o.customer_id = c.id ORDER BY o.id")
    with pytest.raises(GovernanceError) as info:
        gov(sql, columns_of, allowed=["crm.customer"])
    assert info.value.code == "table_not_allowed"
    assert info.value.extra["tables"] == [f"{PREFIX}orders.orders"]
    plan = gov(sql, columns_of, allowed=["crm.customer", "orders.orders"])
    assert plan.tables == {f"{PREFIX}crm.customer", f"{PREFIX}orders.orders"}
    _cols, rows = run(conn, sql, plan)
    assert rows == [("Alice", pytest.approx(99.5)), ("Alice", pytest.approx(5)), ("Bob", pytest.approx(12.25))]


def test_billing_customer_never_readable_with_crm_customer(conn, columns_of):
    for sql in ["SELECT * FROM billing.customer",
                "SELECT c.id FROM customer c JOIN billing.customer b ON b.id = c.id",
                "SELECT email FROM customer UNION SELECT card_number FROM billing.customer",
                "SELECT id FROM customer WHERE id IN (SELECT id FROM billing.customer)",
                "WITH customer AS (SELECT * FROM billing.customer) SELECT * FROM customer",
                "SELECT * FROM `billing`.`customer`", "SELECT * FROM BILLING.CUSTOMER"]:
        sql = n(sql).replace("`billing`", f"`{PREFIX}billing`").replace("BILLING.", f"{PREFIX}billing.")
        with pytest.raises(GovernanceError) as info:
            gov(sql, columns_of, allowed=["crm.customer"])
        assert info.value.code == "table_not_allowed", sql
        assert f"{PREFIX}billing.customer" in info.value.extra["tables"], sql


def test_masked_results_value_by_value(conn, columns_of):
    sql = n("SELECT c.id, c.name, c.email, c.phone, o.total FROM crm.customer c "
            "LEFT JOIN orders.orders o ON o.customer_id = c.id ORDER BY c.id, o.id")
    plan = gov(sql, columns_of, allowed=["crm.customer", "orders.orders"],
               mask=[(f"{PREFIX}crm.customer.email", "mask"), ("customer.phone", "hash"), ("orders.total", "null"),
                     (f"{PREFIX}crm.customer.name", "drop")])
    assert plan.transforms == (None, "drop", "mask", "hash", "null")
    cols, rows = run(conn, sql, plan)
    assert cols == ["id", "email", "phone", "total"]
    assert rows == [(1, "a***@example.com", h("555-0101"), None),
                    (1, "a***@example.com", h("555-0101"), None),
                    (2, "b***@example.org", None, None),
                    (3, None, h("555-0103"), None)]


def test_star_over_cross_database_join_matches_the_server(conn, columns_of):
    """Positions are everything: the plan's expansion of * must be the server's, column for column."""
    queries = [
        "SELECT * FROM crm.customer c JOIN billing.customer b ON b.id = c.id",
        "SELECT * FROM crm.customer JOIN billing.customer USING (id)",
        "SELECT * FROM crm.customer JOIN billing.customer USING (email, id)",
        "SELECT * FROM crm.customer NATURAL JOIN billing.customer",
        "SELECT b.*, c.name FROM crm.customer c JOIN billing.customer b ON b.id = c.id",
        "SELECT * FROM (SELECT id, email AS e FROM billing.customer) x JOIN crm.customer c ON c.id = x.id",
        "WITH b AS (SELECT * FROM billing.customer) SELECT * FROM b JOIN orders.orders o ON o.customer_id = b.id",
    ]
    rules = [("*.email", "mask"), (f"{PREFIX}billing.customer.card_number", "drop"), ("*.iban", "hash")]
    for sql in queries:
        sql = n(sql)
        plan = gov(sql, columns_of, mask=rules)
        cur = conn.cursor()
        cur.execute(sql)
        cur.fetchall()
        names = [d[0] for d in cur.description]
        assert [x.lower() for x in plan.output_names] == [x.lower() for x in names], sql
        want = [("drop" if nm == "card_number" else "mask" if nm in ("email", "e") else
                 "hash" if nm == "iban" else None) for nm in names]
        assert list(plan.transforms) == want, sql


def test_masked_star_values(conn, columns_of):
    sql = n("SELECT * FROM billing.customer ORDER BY id")
    plan = gov(sql, columns_of, allowed=["billing.customer"],
               mask=[(f"{PREFIX}billing.customer.card_number", "hash"), ("*.email", "mask"), ("*.iban", "drop")])
    cols, rows = run(conn, sql, plan)
    assert cols == ["id", "card_number", "email"]
    assert rows == [(1, h("4111111111111111"), "a***@bank.example"), (2, h("5500000000000004"), "b***@bank.example")]


def test_refused_writes_change_nothing(conn, columns_of):
    def snapshot():
        cur = conn.cursor()
        cur.execute(n("SELECT * FROM crm.customer ORDER BY id"))
        a = cur.fetchall()
        cur.execute(n("SELECT * FROM billing.customer ORDER BY id"))
        return a, cur.fetchall()

    before = snapshot()
    attempts = ["DELETE FROM customer", "UPDATE customer SET email = NULL",
                "REPLACE INTO customer (id, name) VALUES (1, 'x')",
                "INSERT INTO customer (id) VALUES (9) ON DUPLICATE KEY UPDATE name = 'x'",
                "SELECT 1 /*! ; DELETE FROM customer */", "SELECT 1 --1; DELETE FROM customer",
                "SELECT * FROM customer FOR UPDATE", "SELECT email INTO @e FROM customer LIMIT 1",
                "EXPLAIN DELETE FROM customer", "TRUNCATE TABLE billing.customer", "USE billing",
                "SELECT * FROM customer INTO OUTFILE '/tmp/qag_gov_x.csv'", "SELECT LOAD_FILE('/etc/passwd')"]
    for sql in attempts:
        sql = n(sql).replace("USE billing", f"USE {PREFIX}billing")
        try:
            plan = gov(sql, columns_of, server_allows_writes=False)
        except GovernanceError:
            continue   # refused before it would run
        raise AssertionError(f"not refused: {sql} -> {plan}")
    assert snapshot() == before


def test_permitted_write_runs_and_returns_masked_rows(conn, columns_of):
    """MariaDB's RETURNING: the written row comes back masked."""
    sql = n("INSERT INTO crm.customer (id, name, email) VALUES (50, 'Eve', 'eve@example.net') RETURNING id, email")
    plan = gov(sql, columns_of, allowed=["crm.customer"], mask=[(f"{PREFIX}crm.customer.email", "mask")],
               server_allows_writes=True, key_allows_writes=True, allowed_write_ops=["insert"])
    assert plan.is_write and plan.write_ops == {"insert"}
    try:
        _cols, rows = run(conn, sql, plan)
    except mysql_connector.Error as e:  # pragma: no cover - MySQL (not MariaDB) has no RETURNING
        pytest.skip(f"server has no INSERT ... RETURNING: {e}")
    finally:
        conn.cursor().execute(n("DELETE FROM crm.customer WHERE id = 50"))
    assert rows == [(50, "e***@example.net")]
