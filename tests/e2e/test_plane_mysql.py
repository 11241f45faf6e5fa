"""The Rust data plane against Python on MariaDB: the same calls answered byte-identically, served by the plane.

`qag serve --plane` on a real MariaDB database (qag_plane_test_e2e); every call is made through the plane and
straight to gunicorn's socket, and the answers must be identical (status, body, headers apart from timing),
the run records equal, and the plane must have served most of them itself (not forwarded).
"""
from __future__ import annotations

import http.client
import random
import time
import urllib.parse

import pytest

from tests.conftest import mysql_exec, need_plane
from tests.e2e.test_plane_differential import UnixConn, _call, _history

DB = "qag_plane_test_e2e"

SCHEMA = f"""
DROP DATABASE IF EXISTS {DB};
CREATE DATABASE {DB} CHARACTER SET utf8mb4;
USE {DB};
CREATE TABLE items (
  id int PRIMARY KEY, small smallint, tiny tinyint, big bigint, ubig bigint unsigned, name varchar(100),
  code varchar(10), flag char(3), ok tinyint(1), price decimal(10,2), ratio double, r4 float, fixed2 double(10,2),
  created datetime(3), stamp timestamp NULL, day date, at time(6), yr year, bits bit(8), blob_ varbinary(16),
  doc json, email text, m enum('sad','ok','happy'), big_dec decimal(30,10));
INSERT INTO items
SELECT seq, seq % 300, seq % 127, seq * 1000000007, 18446744073709551615 - seq,
  CONCAT('name ', seq, CASE WHEN seq % 7 = 0 THEN ', with "quotes"' WHEN seq % 5 = 0 THEN '\\nnew line é' ELSE '' END),
  CONCAT('c', seq % 10), CONCAT('f', seq % 3), seq % 2 = 0, seq * 1.25, seq / 3.0e0, seq / 7.0e0, seq / 3.0e0,
  TIMESTAMP '2026-01-01 00:00:00' + INTERVAL seq HOUR + INTERVAL seq * 1500 MICROSECOND,
  TIMESTAMP '2026-01-01 00:00:00' + INTERVAL seq * 61 MINUTE,
  DATE '2026-01-01' + INTERVAL seq DAY, SEC_TO_TIME(seq * 1000.000001 - 250000), 1990 + seq % 50, seq % 256,
  UNHEX(LPAD(HEX(seq), 6, '0')), CONCAT('{{"b": ', seq, ', "a": [1, 2.50, "é"]}}'),
  CONCAT('user', seq, '@example.com'), ELT(seq % 3 + 1, 'sad', 'ok', 'happy'),
  (CAST(seq AS SIGNED) - 250) * 1234567.0123456789
FROM seq_1_to_500;
UPDATE items SET name = NULL, price = NULL, doc = NULL, stamp = NULL, at = NULL WHERE id % 11 = 0;
UPDATE items SET day = '0000-00-00', created = '0000-00-00 00:00:00' WHERE id = 13;
UPDATE items SET at = '-00:00:01.5' WHERE id = 14;
UPDATE items SET name = 'ab\\tc\\u0001', blob_ = '' WHERE id = 15
"""

QUERIES = {
    "item": (("SELECT id, small, tiny, big, ubig, name, code, flag, ok, price, ratio, r4, fixed2, created, stamp, day, "
              "at, yr, bits, blob_, doc, email, m, big_dec FROM items WHERE id = :id"),
             {"id": {"type": "int", "required": True, "min": 1}}),
    "items": (("SELECT id, name, price, ratio, email, code FROM items WHERE id >= :lo "
               "AND (:code IS NULL OR code = :code) ORDER BY id"),
              {"lo": {"type": "int", "default": 1}, "code": {"type": "str", "required": False, "pattern": "c[0-9]"}}),
    "limited": ("SELECT id, email, price FROM items ORDER BY id LIMIT 25", {}),
    "typed": ("SELECT id, name, m FROM items WHERE ratio > :r AND ok = :ok AND m = :m ORDER BY id",
              {"r": {"type": "float", "max": 1000, "min": -5}, "ok": "bool",
               "m": {"type": "str", "enum": ["sad", "ok", "happy"]}}),
    "flags": ("SELECT id, ok, m FROM items WHERE ok = :ok AND m = :m ORDER BY id",
              {"ok": "bool", "m": {"type": "str", "enum": ["sad", "ok", "happy"]}}),
    "named": ("SELECT id, name AS who, :greeting AS greeting FROM items WHERE name LIKE :pat ORDER BY id",
              {"greeting": {"type": "str", "default": "hello", "max_length": 12},
               "pat": {"type": "str", "min_length": 1}}),
    "stats": (("SELECT code, COUNT(*) AS n, SUM(price) AS total, AVG(ratio) AS avg_ratio, MAX(created) AS last, "
               "ROUND(AVG(r4), 3) AS r3, MIN(at) AS first_at FROM items WHERE id <= :hi GROUP BY code ORDER BY code"),
              {"hi": {"type": "int", "default": 500}}),
    # a float goes into the statement as mysql-connector writes it (repr): 0.1 is a DECIMAL literal to the server,
    # 1e+16 a DOUBLE, and the echoed column shows which
    "scaled": ("SELECT id, price * :f AS scaled, :f AS f, :label AS label FROM items "
               "WHERE ratio > :f ORDER BY id LIMIT 7",
               {"f": {"type": "float", "required": True}, "label": {"type": "str", "default": "x"}}),
    "session": ("SELECT @@session.tx_read_only AS ro, @@session.max_statement_time AS mst", {}),
    # more than one row from a scalar subquery: an error at execution (500), not at prepare
    "boom": ("SELECT id, (SELECT id FROM items WHERE id <= :id) AS x FROM items WHERE id = 1", {"id": "int"}),
}


@pytest.fixture(scope="module")
def mysql_stack():
    need_plane()
    from tests.conftest import start_server
    try:
        mysql_exec("SELECT 1")
    except Exception as exc:  # pragma: no cover - the CI has MariaDB
        pytest.skip(f"no MariaDB: {exc}")
    mysql_exec(SCHEMA, multi=True)
    srv = start_server({"QAG_MASK_KEY": "plane-e2e-mask", "QAG_WORKERS": "1"},
                       args=("--workers", "1", "--plane", "--plane-threads", "2"))
    from tests.e2e.plane_seed import seed
    seed(srv, {"name": "my", "db": "mysql", "host": "127.0.0.1", "port": 3306, "user": "root", "database": DB}, QUERIES)
    yield srv
    srv.stop()
    mysql_exec(f"DROP DATABASE IF EXISTS {DB}")


def _random_path(rnd: random.Random) -> str:
    q = rnd.choice(list(QUERIES))
    p: list[tuple[str, str]] = []
    if q in ("item", "boom"):
        p.append(("id", rnd.choice([str(rnd.randint(1, 520)), str(rnd.randint(1, 20)), "1", "0", "-3", "abc", "",
                                    "1.5", " 7 ", "+8", "99999999999999999999"])))
    elif q == "items":
        if rnd.random() < 0.7:
            p.append(("lo", str(rnd.randint(-5, 520))))
        if rnd.random() < 0.6:
            p.append(("code", rnd.choice(["c1", "c7", "x", "c", "", "c12"])))
    elif q in ("typed", "flags"):
        if q == "typed":
            p.append(("r", rnd.choice(["10.5", "1e2", "-1", "nan", "abc", "2000", "0", "", "inf", "  3.5"])))
        p.append(("ok", rnd.choice(["yes", "no", "TRUE", "0", "maybe", "", "1", "false"])))
        if rnd.random() < 0.9:
            p.append(("m", rnd.choice(["sad", "ok", "happy", "meh"])))
    elif q == "named":
        p.append(("pat", rnd.choice(["name 1%", "name 2_", "%quotes%", "", "%é%", "%\\n%", "ab%"])))
        if rnd.random() < 0.5:
            p.append(("greeting", rnd.choice(["hi", "hello there, you", "ça va", "a,b\"c", "it's"])))
    elif q == "scaled":
        p.append(("f", rnd.choice(["0.1", "1e16", "-2.5", "1e-5", "123456789.125", "3", "0", "-0", "1.5e300", "abc",
                                   "nan", "", "2.675", "100.0"])))
        if rnd.random() < 0.5:
            p.append(("label", rnd.choice(["a", "it's", "ça"])))
    elif q == "stats":
        if rnd.random() < 0.7:
            p.append(("hi", rnd.choice(["500", "20", "0", "x", "13"])))
    if rnd.random() < 0.5:
        p.append(("format", rnd.choice(["json", "ndjson", "csv", "CSV", "xml"])))
    if rnd.random() < 0.3:
        p.append(("page", rnd.choice(["1", "2", "3", "0", "x", "40"])))
    if rnd.random() < 0.3:
        p.append(("page_size", rnd.choice(["1", "5", "50", "1001", "", "2"])))
    if rnd.random() < 0.05:
        p.append(("bogus_param", "1"))
    rnd.shuffle(p)
    return f"/q/{q}?" + urllib.parse.urlencode(p) if p else f"/q/{q}"


def test_mysql_differential_byte_identical(mysql_stack):
    srv = mysql_stack
    rnd = random.Random(20261130)
    plane, direct = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30), UnixConn(srv.sock)
    # every row of the item query once per key kind (all the types and the odd rows), then random calls
    paths = [f"/q/item?id={i}&format={f}" for i in range(1, 24) for f in ("json", "csv", "ndjson")]
    paths += [f"/q/scaled?f={v}&format={f}" for v in ("0.1", "1e16", "-2.5", "1e-5", "123456789.125", "3", "-0",
                                                      "1.5e300", "2.675") for f in ("json", "csv")]
    pairs = 1250  # 2,500 calls: the PostgreSQL test keeps its 10,000
    diffs, rids = [], []
    for i in range(pairs):
        path = paths[i] if i < len(paths) else _random_path(rnd)
        who = (rnd.choice(["plain", "plain", "gov", "gov", "fenced", "bogus"]) if i >= len(paths)
               else ["plain", "gov"][i % 2])
        rid_p, rid_y = f"m{i}-p", f"m{i}-y"
        a = _call(plane, path, {"X-API-Key": srv.keys[who], "X-Request-Id": rid_p})
        b = _call(direct, path, {"X-API-Key": srv.keys[who], "X-Request-Id": rid_y})
        norm = []
        for status, body, headers in (a, b):
            rid = headers.pop("x-request-id", None)
            if rid is not None:
                body = body.replace(rid.encode(), b"<rid>")
            norm.append((status, body, headers))
        if norm[0] != norm[1]:
            diffs.append((who, path, a, b))
        rids.append((who, path, rid_p, rid_y))
    assert not diffs, f"{len(diffs)} of {pairs} differ; first: {diffs[:3]}"

    time.sleep(2.0)  # the recorder's batches
    runs: dict[str, dict] = {}
    for q in QUERIES:
        runs.update(_history(srv, q))
    served: dict[str, int] = {}
    calls: dict[str, int] = {}
    served_queries: set[str] = set()
    for who, path, rid_p, rid_y in rids:
        rp, ry = runs.get(rid_p), runs.get(rid_y)
        assert rp is not None and ry is not None, f"run missing for {path}: {rid_p} {rp} / {rid_y} {ry}"
        assert ry["served_by"].startswith("worker"), ry
        by_plane = rp["served_by"] == "plane"
        q = path.split("?")[0][3:]
        served[who] = served.get(who, 0) + by_plane
        calls[who] = calls.get(who, 0) + 1
        if by_plane and rp["status"] == 200:
            served_queries.add(q)
        for f in ("query", "version", "key_name", "connection_name", "status", "code", "rows"):
            assert rp[f] == ry[f], (f, path, rp, ry)
    for who in ("plain", "fenced", "gov"):
        assert served[who] > 0.8 * calls[who], f"the plane served only {served[who]} of {calls[who]} {who} calls"
    assert served.get("bogus", 0) == 0, "an unknown key is Python's to answer"
    assert served_queries >= {"item", "items", "limited", "flags", "named", "stats", "typed", "scaled"}, served_queries
    failed = [runs[r[2]] for r in rids if runs[r[2]]["status"] == 500]
    assert failed and all(rp["served_by"].startswith("worker") for rp in failed), \
        "a statement the database rejects (500 query_failed) is forwarded to Python, which records its words"
    assert all(rp.get("error") for rp in failed), ("an administrator reads the database's words in history", failed)


def test_mysql_sessions_read_only_with_the_time_limit(mysql_stack):
    """The plane's sessions are set up as MySQLConnector's: read-only, with max_statement_time."""
    import requests
    srv = mysql_stack
    s = requests.Session()
    h = {"X-API-Key": srv.keys["plain"]}
    direct = UnixConn(srv.sock)
    for i in range(3):
        r = s.get(srv.base + "/q/session", headers={**h, "X-Request-Id": f"sess-{i}"}, timeout=10)
        assert r.status_code == 200, r.text
        status, body, _ = _call(direct, "/q/session", h)
        assert (status, body) == (200, r.content)
    assert r.json() == [{"ro": 1, "mst": 30}], r.text  # max_statement_time 30.000000 (cfg.query_timeout)
    time.sleep(1.5)
    runs = _history(srv, "session")
    assert runs["sess-2"]["served_by"] == "plane", runs["sess-2"]


def test_mysql_decimals_keep_their_digits(mysql_stack):
    """DECIMAL through the plane's own answer: the server's digits (2.50, trailing zeros kept), Python's bytes."""
    from decimal import Decimal
    srv = mysql_stack
    plane, direct = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30), UnixConn(srv.sock)
    h = {"X-API-Key": srv.keys["plain"]}
    big = format(Decimal(2 - 250) * Decimal("1234567.0123456789"), "f")
    for fmt, want in (("json", '"price":2.50,'), ("csv", ",2.50,"), ("ndjson", f'"big_dec":{big}}}')):
        b = _call(direct, f"/q/item?id=2&format={fmt}", {**h, "X-Request-Id": f"dec-{fmt}-y"})
        # the first call of a plan is Python's (it publishes the plan for the plane), and a generation bumped
        # meanwhile sends one more to Python: every answer must be Python's bytes, and the plane must serve some
        for k in range(5):
            a = _call(plane, f"/q/item?id=2&format={fmt}", {**h, "X-Request-Id": f"dec-{fmt}-{k}"})
            assert a[0] == 200 and want.encode() in a[1] and a[1] == b[1], (fmt, k, a, b)
    assert big == "-306172619.0617283672"
    time.sleep(2.0)  # the recorder's batches
    runs = [r for r in _history(srv, "item").values() if r["request_id"].startswith("dec-")]
    assert any(r["served_by"] == "plane" for r in runs), runs
