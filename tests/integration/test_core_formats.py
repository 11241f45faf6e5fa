"""Every format of the data API in-process, on a real SQLite file and a real PostgreSQL database: TSV, XML, YAML,
XLSX and Parquet beside JSON, NDJSON and CSV; streams of csv/tsv/ndjson/parquet; Content-Disposition on
downloads and streams; masking in every format; Parquet's schema from the cursor's column types,
decimals included (every value read back, none replaced by a null when values widen after the first row group)."""
from __future__ import annotations

import csv
import io
import json
import sqlite3
import xml.etree.ElementTree as ET

import openpyxl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import mysql_exec, pg_exec, pg_fresh_db

A = {"X-API-Key": "adm"}
EMAIL = "zed.secret@hidden.example"


def post(c, path, body, status=201):
    r = c.simulate_post(path, json=body, headers=A)
    assert r.status_code == status, r.text
    return r


@pytest.fixture()
def sqlite_client(app_client, tmp_path):
    path = str(tmp_path / "data.db")
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE people (id INTEGER PRIMARY KEY, name TEXT, email TEXT, score REAL);"
                     f"INSERT INTO people VALUES (1, 'ann <&> \"x\"', '{EMAIL}', 1.5), (2, 'bob', 'b@y.org', NULL),"
                     "(3, 'ćé\tx', 'c@z.org', -2.25);")
    db.commit()
    db.close()
    c = app_client
    post(c, "/api/v1/connections", {"name": "lite", "db": "sqlite", "database": path})
    post(c, "/api/v1/queries", {"name": "people", "connection_name": "lite", "publish": True,
                                "sql": "SELECT id, name, email, score FROM people ORDER BY id"})
    plain = post(c, "/api/v1/api-keys", {"name": "plain", "queries": ["people"], "connections": ["lite"]}).json
    masked = post(c, "/api/v1/api-keys", {"name": "masked", "queries": ["people"], "connections": ["lite"],
                                          "mask": [{"column": "people.email", "action": "hash"}]}).json
    c.keys = {"plain": {"X-API-Key": plain["secret"]}, "masked": {"X-API-Key": masked["secret"]}}
    return c


def get(c, key, qs, status=200):
    r = c.simulate_get("/q/people", query_string=qs, headers=c.keys[key])
    assert r.status_code == status, r.text
    return r


def test_every_format_carries_the_rows_and_its_content_type(sqlite_client):
    c = sqlite_client
    want = [(1, 'ann <&> "x"', EMAIL, 1.5), (2, "bob", "b@y.org", None), (3, "ćé\tx", "c@z.org", -2.25)]
    r = get(c, "plain", "format=tsv")
    assert r.headers["content-type"].startswith("text/tab-separated-values")
    assert r.headers["content-disposition"] == 'attachment; filename="people.tsv"'
    rows = list(csv.reader(io.StringIO(r.text), delimiter="\t"))
    assert rows[0] == ["id", "name", "email", "score"] and rows[2] == ["2", "bob", "b@y.org", ""]
    assert rows[3][1] == "ćé\tx"

    r = get(c, "plain", "format=xml")
    assert r.headers["content-type"].startswith("application/xml") and "content-disposition" not in r.headers
    root = ET.fromstring(r.content)
    items = root.findall("item")
    assert root.tag == "data" and len(items) == 3
    assert items[0].find("name").text == 'ann <&> "x"' and items[1].find("score").get("null") == "true"

    r = get(c, "plain", "format=yaml")
    assert yaml.safe_load(r.text) == [dict(zip(["id", "name", "email", "score"], w)) for w in want]

    r = get(c, "plain", "format=xlsx")
    assert r.headers["content-disposition"] == 'attachment; filename="people.xlsx"'
    ws = openpyxl.load_workbook(io.BytesIO(r.content)).active
    assert [tuple(x) for x in ws.iter_rows(values_only=True)] == [("id", "name", "email", "score"), *want]

    r = get(c, "plain", "format=parquet")
    assert r.headers["content-type"] == "application/vnd.apache.parquet"
    t = pq.read_table(io.BytesIO(r.content))
    assert t.column_names == ["id", "name", "email", "score"]
    assert [tuple(d.values()) for d in t.to_pylist()] == want

    r = get(c, "plain", "format=csv")
    assert r.headers["content-disposition"] == 'attachment; filename="people.csv"'
    assert get(c, "plain", "format=JSON").headers.get("content-disposition") is None


def test_masking_holds_in_every_format(sqlite_client):
    c = sqlite_client
    for fmt in ("json", "ndjson", "csv", "tsv", "xml", "yaml", "xlsx", "parquet"):
        body = get(c, "masked", f"format={fmt}").content
        assert EMAIL.encode() not in body and b"zed.secret" not in body, fmt
        if fmt == "xlsx":
            ws = openpyxl.load_workbook(io.BytesIO(body)).active
            assert EMAIL not in [v for row in ws.iter_rows(values_only=True) for v in row]
        if fmt == "parquet":
            emails = pq.read_table(io.BytesIO(body)).column("email").to_pylist()
            assert len(emails[0]) == 16 and EMAIL not in emails


def test_streams_and_bad_combinations(sqlite_client):
    c = sqlite_client
    for fmt in ("csv", "tsv", "ndjson", "parquet"):
        r = get(c, "masked", f"format={fmt}&stream=true")
        assert r.headers["content-disposition"] == f'attachment; filename="people.{fmt}"'
        assert EMAIL.encode() not in r.content
        if fmt == "parquet":
            assert pq.read_table(io.BytesIO(r.content)).num_rows == 3
    for fmt in ("json", "xml", "yaml", "xlsx"):
        assert get(c, "plain", f"format={fmt}&stream=true", 400).json["code"] == "invalid_stream"
    r = get(c, "plain", "format=html", 400)
    assert r.json["code"] == "invalid_format" and "parquet" in r.json["error"]


def test_a_stream_of_many_parquet_row_groups(sqlite_client, tmp_path):
    c = sqlite_client
    db = sqlite3.connect(str(tmp_path / "data.db"))
    db.executemany("INSERT INTO people VALUES (?, ?, ?, ?)", ((i, f"n{i}", f"e{i}@x.org", i / 4) for i in
                                                               range(10, 30010)))
    db.commit()
    db.close()
    r = get(c, "plain", "format=parquet&stream=true")
    f = pq.ParquetFile(io.BytesIO(r.content))
    assert f.metadata.num_rows == 30003 and f.metadata.num_row_groups >= 3
    assert f.read().column("id").to_pylist()[-1] == 30009


def test_parquet_schema_comes_from_the_cursor_types_on_postgres(app_client):
    dsn = pg_fresh_db("qag_core_formats")
    pg_exec(dsn, "CREATE TABLE m (id bigint, amount numeric(10,2), at timestamptz, day date, flag boolean, "
                 "doc jsonb, note text, raw bytea);"
                 "INSERT INTO m VALUES (1, 12.50, '2026-12-01 10:00:00+00', '2026-12-01', true, '{\"a\": 1}', "
                 "'x', '\\x0102'), (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL)")
    c = app_client
    post(c, "/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                    "user": "postgres", "database": "qag_core_formats"})
    post(c, "/api/v1/queries", {"name": "m", "connection_name": "pg", "publish": True,
                                "sql": "SELECT id, amount, at, day, flag, doc, note, raw FROM m WHERE id = :id"})
    key = post(c, "/api/v1/api-keys", {"name": "k", "queries": ["m"], "connections": ["pg"]}).json["secret"]
    # Row 2 is all NULL: guessing from its values would give null columns; the cursor's types say otherwise.
    r = c.simulate_get("/q/m", query_string="id=2&format=parquet", headers={"X-API-Key": key})
    assert r.status_code == 200, r.text
    schema = pq.read_table(io.BytesIO(r.content)).schema
    assert schema.field("id").type == pa.int64()
    assert schema.field("at").type == pa.timestamp("us", tz="UTC")
    assert schema.field("day").type == pa.date32() and schema.field("flag").type == pa.bool_()
    assert schema.field("note").type == pa.string() and schema.field("raw").type == pa.binary()
    r = c.simulate_get("/q/m", query_string="id=1&format=parquet", headers={"X-API-Key": key})
    row = pq.read_table(io.BytesIO(r.content)).to_pylist()[0]
    assert row["raw"] == b"\x01\x02" and json.loads(row["doc"]) == {"a": 1} and str(row["amount"]) == "12.50"
    r = c.simulate_get("/q/m", query_string="id=1&format=yaml", headers={"X-API-Key": key})
    assert yaml.safe_load(r.text)[0]["at"] == "2026-12-01T10:00:00+00:00"


# -- decimals: declared from the cursor, never nulls -------------------------------------------------------
# 20,000 rows: the first row group (8,192 rows) holds small values only, rows past 9,000 values that need every digit
# the column declares (the bug: a schema guessed from the first group, later groups replaced by nulls).
DEC_ROWS = 20000


def _text(v):
    from decimal import Decimal
    return format(v, "f") if isinstance(v, Decimal) else str(v)


def _check_decimals(c, key, query, want):
    """Every value of the stream and of a page of big values read back with pyarrow, equal to the database's
    (same digits, trailing zeros kept), none null; yields each answer's schema."""
    for qs, rows_want, groups in (("format=parquet&stream=true", want, 2),
                                  ("format=parquet&page=10&page_size=1000", want[9000:10000], 1)):
        r = c.simulate_get(f"/q/{query}", query_string=qs, headers={"X-API-Key": key})
        assert r.status_code == 200, r.text
        assert pq.ParquetFile(io.BytesIO(r.content)).metadata.num_row_groups >= groups
        t = pq.read_table(io.BytesIO(r.content))
        got = [tuple(row.values()) for row in t.to_pylist()]
        assert len(got) == len(rows_want)
        bad = [(g, w) for g, w in zip(got, rows_want) if tuple(map(_text, g)) != tuple(map(_text, w))]
        assert not bad, (len(bad), bad[:3])
        yield t.schema


def test_parquet_decimals_keep_every_value_on_postgres(app_client):
    dsn = pg_fresh_db("qag_decimals_parquet")
    pg_exec(dsn, "CREATE TABLE d (id int, fixed numeric(12,2), free numeric, wide numeric(50,10), nan numeric);"
                 "INSERT INTO d SELECT i,"
                 " CASE WHEN i <= 9000 THEN (i %% 100) + (i %% 7) / 10.0"
                 "      WHEN i %% 2 = 1 THEN 9999999999.99 ELSE -1234567890.05 END,"
                 " CASE WHEN i <= 9000 THEN (i %% 10) + 0.5"  # unconstrained: grows to 51 digits
                 "      ELSE (i::text || repeat('0', 30) || '.' || repeat('1234567890', 2))::numeric END,"
                 " CASE WHEN i <= 9000 THEN i + 0.0000000001"  # numeric(50,10): over decimal128's 38 digits
                 "      ELSE (repeat('9', 39) || '.' || lpad(i::text, 10, '0'))::numeric END,"
                 f" 'NaN' FROM generate_series(1, {DEC_ROWS}) i")
    want = [tuple(r) for r in pg_exec(dsn, "SELECT id, fixed, free, wide FROM d ORDER BY id")]
    c = app_client
    post(c, "/api/v1/connections", {"name": "pgd", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                    "user": "postgres", "database": "qag_decimals_parquet"})
    post(c, "/api/v1/queries", {"name": "d", "connection_name": "pgd", "publish": True,
                                "sql": "SELECT id, fixed, free, wide FROM d ORDER BY id"})
    post(c, "/api/v1/queries", {"name": "dnan", "connection_name": "pgd", "publish": True,
                                "sql": "SELECT fixed, nan FROM d ORDER BY id LIMIT 3"})
    key = post(c, "/api/v1/api-keys", {"name": "kd", "queries": ["d", "dnan"],
                                       "connections": ["pgd"]}).json["secret"]
    for schema in _check_decimals(c, key, "d", want):
        # numeric(12,2) is decimal128(12,2) from the cursor, not the first group's decimal128(4,2); unconstrained
        # numeric and numeric(50,10) (over 38 digits) are their exact text
        assert schema.field("fixed").type == pa.decimal128(12, 2)
        assert schema.field("free").type == pa.string() and schema.field("wide").type == pa.string()
    r = c.simulate_get("/q/dnan", query_string="format=parquet", headers={"X-API-Key": key})
    t = pq.read_table(io.BytesIO(r.content))
    assert t.column("nan").to_pylist() == [None] * 3  # NaN has no Parquet decimal: null, as JSON writes it
    assert [str(v) for v in t.column("fixed").to_pylist()] == ["1.10", "2.20", "3.30"]


def test_parquet_decimals_keep_every_value_on_mariadb(app_client):
    mysql_exec("DROP DATABASE IF EXISTS qag_decimals_parquet; CREATE DATABASE qag_decimals_parquet; "
               "CREATE TABLE qag_decimals_parquet.d (id int primary key, fixed decimal(12,2), "
               "wide decimal(65,30), pos decimal(7,3) unsigned)", multi=True)
    digits = "(" + " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10)) + ")"
    mysql_exec("INSERT INTO qag_decimals_parquet.d SELECT i,"
               " CASE WHEN i <= 9000 THEN (i % 100) + (i % 7) / 10.0"
               "      WHEN i % 2 = 1 THEN 9999999999.99 ELSE -1234567890.05 END,"
               " CASE WHEN i <= 9000 THEN i + 0.5 ELSE CONCAT(REPEAT('9', 30), '.', LPAD(i, 30, '0')) END,"
               " CASE WHEN i <= 9000 THEN 1.5 ELSE (i % 9999) + 0.125 END FROM (SELECT 1 + a.d + 10 * b.d + 100 * c.d"
               f" + 1000 * e.d + 10000 * f.d AS i FROM {digits} a, {digits} b, {digits} c, {digits} e, {digits} f) s"
               f" WHERE i <= {DEC_ROWS}")
    want = mysql_exec("SELECT id, fixed, wide, pos FROM qag_decimals_parquet.d ORDER BY id")
    c = app_client
    post(c, "/api/v1/connections", {"name": "myd", "db": "mysql", "host": "127.0.0.1", "port": 3306,
                                    "user": "root", "database": "qag_decimals_parquet"})
    post(c, "/api/v1/queries", {"name": "d", "connection_name": "myd", "publish": True,
                                "sql": "SELECT id, fixed, wide, pos FROM d ORDER BY id"})
    key = post(c, "/api/v1/api-keys", {"name": "kd", "queries": ["d"], "connections": ["myd"]}).json["secret"]
    for schema in _check_decimals(c, key, "d", want):
        assert schema.field("fixed").type == pa.decimal128(12, 2)  # the column's DECIMAL(12,2), from the cursor
        assert schema.field("pos").type == pa.decimal128(7, 3)
        assert schema.field("wide").type == pa.string()  # DECIMAL(65,30): over decimal128's 38 digits, its text
