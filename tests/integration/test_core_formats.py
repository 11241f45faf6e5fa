"""Every format of the data API in-process, on a real SQLite file and a real PostgreSQL database: TSV, XML, YAML,
XLSX and Parquet beside JSON, NDJSON and CSV; streams of csv/tsv/ndjson/parquet; Content-Disposition on
downloads and streams; masking in every format; Parquet's schema from the cursor's column types."""
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

from tests.conftest import pg_exec, pg_fresh_db

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
