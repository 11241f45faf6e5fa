"""The Rust data plane against Python: the same calls answered byte-identically, revocation, recording.

`qag serve --plane` on a real PostgreSQL database; every call is made twice, once through the plane (the
public port) and once straight to gunicorn's internal socket, and the two answers must be identical
(status, body, headers apart from timing). The plane must actually serve most of them itself.
"""
from __future__ import annotations

import http.client
import os
import random
import socket
import threading
import time
import urllib.parse

import pytest

from tests.conftest import need_plane, pg_exec, pg_fresh_db

IGNORED_HEADERS = {"date", "server", "server-timing", "connection", "transfer-encoding", "keep-alive"}

SCHEMA = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE items (
  id int PRIMARY KEY, small smallint, big bigint, name text, code varchar(10), flag char(3), ok boolean,
  price numeric(10,2), ratio float8, r4 real, created timestamp, created_tz timestamptz, day date, at time,
  blob bytea, uid uuid, doc json, docb jsonb, email text, m mood);
INSERT INTO items
SELECT i, (i % 300)::smallint, i::bigint * 1000000007,
  'name ' || i || CASE WHEN i % 7 = 0 THEN ', with "quotes"' WHEN i % 5 = 0 THEN E'\\nnew line é' ELSE '' END,
  'c' || (i % 10), 'f' || (i % 3), i % 2 = 0, (i * 1.25)::numeric(10,2), i / 3.0, (i / 7.0)::real,
  timestamp '2026-01-01 00:00:00' + i * interval '1 hour 1.5 second',
  timestamptz '2026-01-01 00:00:00+00' + i * interval '61 minutes',
  date '2026-01-01' + i, time '00:00:00' + i * interval '1.000001 second', decode(lpad(to_hex(i), 6, '0'), 'hex'),
  md5(i::text)::uuid, ('{"b": ' || i || ', "a": [1, 2.50, 1e2, "é"], "b": "dup"}')::json,
  ('{"k": ' || i || ', "z": null, "f": 0.1}')::jsonb, 'user' || i || '@example.com',
  (ARRAY['sad','ok','happy'])[i % 3 + 1]::mood
FROM generate_series(1, 500) AS i;
UPDATE items SET name = NULL, price = NULL, doc = NULL WHERE id % 11 = 0;
ALTER TABLE items ADD COLUMN exact numeric, ADD COLUMN tiny numeric, ADD COLUMN wide numeric(40,12);
UPDATE items SET exact = CASE WHEN id IN (97, 194) THEN 'NaN'::numeric
                              ELSE id * 12345678901234567890.123456789 END,
  tiny = id * 0.0000001, wide = (id * 1.1)::numeric(40,12) + 10::numeric ^ 25 * (id % 3);
"""
# Numbers as the database has them: numeric keeps its digits (12345678901234567890.123456789, the scale's trailing
# zeros of 2.50 and 1.100000000000, 0.0000001 without Decimal's 1E-7, 10^25 past any int64), NaN null in JSON
# (the plane forwards a NaN: Python answers it).

QUERIES = {
    "item": (("SELECT id, small, big, name, code, flag, ok, price, ratio, r4, created, created_tz, day, at, blob, "
              "uid, doc, docb, email, m FROM items WHERE id = :id"),
             {"id": {"type": "int", "required": True, "min": 1}}),
    "items": (("SELECT id, name, price, ratio, email, code FROM items WHERE id >= :lo "
               "AND (:code IS NULL OR code = :code) ORDER BY id"),
              {"lo": {"type": "int", "default": 1}, "code": {"type": "str", "required": False, "pattern": "c[0-9]"}}),
    "limited": ("SELECT id, email, price FROM items ORDER BY id LIMIT 25", {}),
    "typed": ("SELECT id, name, m FROM items WHERE ratio > :r AND ok = :ok AND m = :m ORDER BY id",
              {"r": {"type": "float", "max": 1000, "min": -5}, "ok": "bool",
               "m": {"type": "str", "enum": ["sad", "ok", "happy"]}}),
    "named": ("SELECT id, name AS who, :greeting AS greeting FROM items WHERE name LIKE :pat ORDER BY id",
              {"greeting": {"type": "str", "default": "hello", "max_length": 12},
               "pat": {"type": "str", "min_length": 1}}),
    "boom": ("SELECT 1 / (id - id) AS x FROM items WHERE id = :id", {"id": "int"}),
    "nums": ("SELECT id, price, exact, tiny, wide, ratio, r4, price * 3 AS tripled FROM items WHERE id >= :lo "
             "ORDER BY id LIMIT 20", {"lo": {"type": "int", "default": 1}}),
}


class UnixConn(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=30)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.unix_path)


def _call(conn, path: str, headers: dict):
    conn.request("GET", path, headers=headers)
    r = conn.getresponse()
    body = r.read()
    return r.status, body, {k.lower(): v for k, v in r.getheaders() if k.lower() not in IGNORED_HEADERS}


@pytest.fixture(scope="module")
def plane_stack():
    need_plane()
    from tests.conftest import start_server
    dsn = pg_fresh_db("qag_plane_e2e")
    for stmt in SCHEMA.split(";\n"):
        if stmt.strip():
            pg_exec(dsn, stmt, None)  # no args: the % in the SQL are literal
    srv = start_server({"QAG_MASK_KEY": "plane-e2e-mask", "QAG_WORKERS": "1"},
                       args=("--workers", "1", "--plane", "--plane-threads", "2"))
    from tests.e2e.plane_seed import seed
    seed(srv, {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "postgres",
               "database": "qag_plane_e2e"}, QUERIES)
    yield srv
    srv.stop()


def _random_path(rnd: random.Random) -> str:
    q = rnd.choice(list(QUERIES))
    p: list[tuple[str, str]] = []
    if q in ("item", "boom"):
        p.append(("id", rnd.choice([str(rnd.randint(1, 520)), str(rnd.randint(1, 520)), "0", "-3", "abc", "", "1.5",
                                    " 7 ", "+8", "99999999999999999999"])))
    elif q == "nums":
        if rnd.random() < 0.9:
            p.append(("lo", str(rnd.randint(1, 500))))
    elif q == "items":
        if rnd.random() < 0.7:
            p.append(("lo", str(rnd.randint(-5, 520))))
        if rnd.random() < 0.6:
            p.append(("code", rnd.choice(["c1", "c7", "x", "c", "", "c12"])))
    elif q == "typed":
        p.append(("r", rnd.choice(["10.5", "1e2", "-1", "nan", "abc", "2000", "0", "", "inf", "  3.5"])))
        p.append(("ok", rnd.choice(["yes", "no", "TRUE", "0", "maybe", ""])))
        if rnd.random() < 0.9:
            p.append(("m", rnd.choice(["sad", "ok", "happy", "meh"])))
    elif q == "named":
        p.append(("pat", rnd.choice(["name 1%", "name 2_", "%quotes%", "", "%é%"])))
        if rnd.random() < 0.5:
            p.append(("greeting", rnd.choice(["hi", "hello there, you", "ça va", "a,b\"c"])))
    if rnd.random() < 0.5:
        p.append(("format", rnd.choice(["json"] * 4 + ["ndjson"] * 3 + ["csv"] * 3 + ["CSV"] * 2
                                       + ["xml", "tsv", "yaml", "bogus"])))
    if rnd.random() < 0.3:
        p.append(("page", rnd.choice(["1", "2", "3", "0", "x", "40"])))
    if rnd.random() < 0.3:
        p.append(("page_size", rnd.choice(["1", "5", "50", "1001", "", "2"])))
    if rnd.random() < 0.05:
        p.append(("bogus_param", "1"))
    rnd.shuffle(p)
    return f"/q/{q}?" + urllib.parse.urlencode(p) if p else f"/q/{q}"


def _history(srv, query: str) -> dict[str, dict]:
    import requests
    out, cursor = {}, None
    while True:
        params = {"query": query, "limit": 1000}
        if cursor:
            params["cursor"] = cursor
        r = requests.get(srv.base + "/api/v1/history", params=params, headers=srv.admin, timeout=30)
        assert r.status_code == 200, r.text
        doc = r.json()
        for run in doc["items"]:
            out[run["request_id"]] = run
        cursor = doc.get("next_cursor")
        if not cursor:
            return out


def test_differential_byte_identical(plane_stack):
    srv = plane_stack
    rnd = random.Random(20261130)
    plane, direct = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30), UnixConn(srv.sock)
    pairs = 5000  # 10,000 calls
    diffs = []
    rids = []
    skipped = 0
    for i in range(pairs):
        path = _random_path(rnd)
        who = rnd.choice(["plain", "plain", "gov", "gov", "fenced", "bogus"])
        minted = rnd.random() < 0.05
        rid_p, rid_y = (f"d{i}-p", f"d{i}-y") if not minted else ("bad id!", "bad id!")
        for _attempt in range(3):
            a = _call(plane, path, {"X-API-Key": srv.keys[who], "X-Request-Id": rid_p})
            b = _call(direct, path, {"X-API-Key": srv.keys[who], "X-Request-Id": rid_y})
            if 502 not in (a[0], b[0]):
                break
            time.sleep(0.2)  # a shared PostgreSQL out of connection slots: not the plane's doing; try again
        else:
            skipped += 1
            continue
        norm = []
        for status, body, headers in (a, b):
            rid = headers.pop("x-request-id", None)
            if rid is not None:
                body = body.replace(rid.encode(), b"<rid>")
            norm.append((status, body, headers, rid is not None))
        if norm[0] != norm[1]:
            diffs.append((who, path, a, b))
        if not minted:
            rids.append((who, path, rid_p, rid_y))
    assert not diffs, f"{len(diffs)} of {pairs} differ; first: {diffs[:3]}"
    assert skipped < pairs // 20, f"{skipped} pairs met an unreachable database"

    # Run records: the plane's and Python's agree field by field, and the plane served most calls itself.
    time.sleep(2.0)  # the recorder's batches
    runs: dict[str, dict] = {}
    for q in QUERIES:
        runs.update(_history(srv, q))
    served = {"plain": 0, "fenced": 0, "gov": 0, "bogus": 0}
    calls = dict.fromkeys(served, 0)
    for who, path, rid_p, rid_y in rids:
        rp, ry = runs.get(rid_p), runs.get(rid_y)
        assert rp is not None and ry is not None, f"run missing for {path}: {rid_p} {rp} / {rid_y} {ry}"
        assert ry["served_by"].startswith("worker"), ry
        served[who] += rp["served_by"] == "plane"
        calls[who] += 1
        for f in ("query", "version", "key_name", "connection_name", "status", "code", "rows"):
            assert rp[f] == ry[f], (f, path, rp, ry)
    assert sum(calls.values()) > 4000
    # plain keys: everything but the first call of each plan; a key outside its allowed_ips: 401 by the plane
    for who in ("plain", "fenced"):
        assert served[who] > 0.8 * calls[who], f"the plane served only {served[who]} of {calls[who]} {who} calls"
    assert served["bogus"] == 0, "an unknown key is Python's to answer"
    from qag import entries
    if "names" in entries.PLAN_FIELDS:  # masking plans are servable once names are published
        assert served["gov"] > 0.8 * calls["gov"], f"the plane served only {served['gov']} of {calls['gov']} gov calls"


def test_the_plane_prints_a_numerics_digits(plane_stack):
    """The plane's own answer (not a forwarded one) carries each numeric's exact digits, byte for byte Python's."""
    srv = plane_stack
    plane, direct = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30), UnixConn(srv.sock)
    h = {"X-API-Key": srv.keys["plain"]}
    for fmt, want in (("json", b'[{"id":2,"price":2.50,"exact":24691357802469135780.246913578,"tiny":0.0000002,'
                               b'"wide":20000000000000000000000002.200000000000,"ratio":0.6666666666666666,'
                               b'"r4":0.2857143,"tripled":7.50}'),
                      ("csv", b"id,price,exact,tiny,wide,ratio,r4,tripled\r\n2,2.50,24691357802469135780.246913578,"
                              b"0.0000002,20000000000000000000000002.200000000000,0.6666666666666666,0.2857143,7.50\r\n")):
        b = _call(direct, f"/q/nums?lo=2&page_size=1&format={fmt}", {**h, "X-Request-Id": f"num-{fmt}-y"})
        # the first call of a plan is Python's (it publishes the plan for the plane), and a generation bumped
        # meanwhile sends one more to Python: every answer must be Python's bytes, and the plane must serve some
        for k in range(5):
            a = _call(plane, f"/q/nums?lo=2&page_size=1&format={fmt}", {**h, "X-Request-Id": f"num-{fmt}-{k}"})
            assert a[0] == 200 and a[1].startswith(want) and a[1] == b[1], (fmt, k, a, b)
    time.sleep(2.0)  # the recorder's batches
    runs = [r for rid, r in _history(srv, "nums").items() if rid.startswith("num-")]
    assert any(r["served_by"] == "plane" for r in runs), runs
    a = _call(plane, "/q/nums?lo=97&page_size=1", h)  # NaN: null (forwarded to Python)
    assert a[0] == 200 and b'"exact":null' in a[1], a


def test_revocation_through_the_plane(plane_stack):
    import requests
    srv = plane_stack
    secret = requests.post(srv.base + "/api/v1/api-keys",
                           json={"name": "victim", "queries": ["*"], "connections": ["pg"]},
                           headers=srv.admin, timeout=30).json()["secret"]
    s = requests.Session()
    h = {"X-API-Key": secret}
    for _ in range(5):
        assert s.get(srv.base + "/q/item?id=3", headers=h, timeout=10).status_code == 200
    stop = threading.Event()

    def hammer():
        t = requests.Session()
        while not stop.is_set():
            t.get(srv.base + "/q/item?id=4", headers=h, timeout=10)
    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    r = requests.patch(srv.base + "/api/v1/api-keys/victim", json={"active": False}, headers=srv.admin, timeout=30)
    assert r.status_code == 200, r.text
    served_after = [s.get(srv.base + "/q/item?id=5", headers=h, timeout=10).status_code for _ in range(1000)]
    stop.set()
    for t in threads:
        t.join()
    assert set(served_after) == {401}, {c: served_after.count(c) for c in set(served_after)}
    body = s.get(srv.base + "/q/item?id=5", headers={**h, "X-Request-Id": "after-revoke"}, timeout=10).text
    assert body == ('{"error": "Give a valid, active API key in the X-API-Key header.", "code": "unauthorized", '
                    '"request_id": "after-revoke"}')


def _metric_total(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_burst_recorded_and_counted(plane_stack):
    import requests
    srv = plane_stack
    s = requests.Session()
    h = {"X-API-Key": srv.keys["plain"]}
    for _ in range(3):  # warm the key and plan entries (Python publishes them on the calls it answers)
        s.get(srv.base + "/q/limited", headers=h, timeout=10)
    before = s.get(srv.base + "/metrics", timeout=10).text
    n = 600
    tag = f"burst{random.randrange(1 << 30)}"
    for i in range(n):
        r = s.get(srv.base + "/q/limited", headers={**h, "X-Request-Id": f"{tag}-{i}"}, timeout=10)
        assert r.status_code == 200
    deadline = time.time() + 20
    while True:
        runs = {rid: run for rid, run in _history(srv, "limited").items() if rid.startswith(tag + "-")}
        if len(runs) == n or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(runs) == n, f"{len(runs)} of {n} runs recorded"
    # a generation bumped while the burst runs (the change watcher's first pass over the store just after start
    # when this test runs alone) sends a call or two to Python, which republishes the entry: correct, not served
    by_python = [r for r in runs.values() if r["served_by"] != "plane"]
    assert len(by_python) <= 3, str(by_python)
    assert all(r["rows"] == 10 and r["status"] == 200 for r in runs.values())
    after = s.get(srv.base + "/metrics", timeout=10).text
    grew = (_metric_total(after, "qag_requests_total", route="/q/{name}", status="200")
            - _metric_total(before, "qag_requests_total", route="/q/{name}", status="200"))
    assert grew >= n, f"/metrics counted {grew} of the plane's {n} calls"
    assert _metric_total(after, "qag_rows_total") - _metric_total(before, "qag_rows_total") >= 10 * n
    assert _metric_total(after, "qag_runs_lost_total") == 0


def _child_with_title(arbiter: int, title: str) -> int | None:
    """The arbiter's child named `title`: its process title, or its program's name (the plane)."""
    from tests.e2e.test_core_serve import children
    from tests.e2e.test_core_serve import title as title_of
    for pid in children(arbiter):
        t = title_of(pid)
        if t.startswith(title) or t.split(" ", 1)[0].endswith("/" + title):
            return pid
    return None


def test_crashes_of_the_recorder_and_of_the_plane_lose_no_run(plane_stack):
    """Callers keep calling through the plane while the recorder is killed (SIGKILL), and then the plane
    itself. Every call answered 200 is in history afterwards: a run is in the plane's ring before its answer
    leaves, the recorder resumes from its committed position, and the restarted plane appends to the ring
    where the killed one stopped. The restarted plane serves again."""
    import signal

    import requests
    srv = plane_stack
    h = {"X-API-Key": srv.keys["plain"]}
    arbiter = srv.proc.pid
    recorder, plane = _child_with_title(arbiter, "qag: recorder"), _child_with_title(arbiter, "qag-plane")
    assert recorder and plane
    tag = f"crash{random.randrange(1 << 30)}"
    answered: list[str] = []
    stop = threading.Event()

    def caller(k: int):
        s = requests.Session()
        i = 0
        while not stop.is_set():
            rid = f"{tag}-{k}-{i}"
            i += 1
            try:
                r = s.get(srv.base + "/q/limited", headers={**h, "X-Request-Id": rid}, timeout=10)
            except requests.RequestException:
                s = requests.Session()  # the plane is down for its restart: nothing was answered
                time.sleep(0.01)
                continue
            assert r.status_code == 200, r.text
            answered.append(rid)
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        os.kill(recorder, signal.SIGKILL)
        time.sleep(1.5)
        at_plane_kill = len(answered)
        os.kill(plane, signal.SIGKILL)
        deadline = time.time() + 20
        while time.time() < deadline and len(answered) < at_plane_kill + 200:
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(answered) >= at_plane_kill + 200, "the plane did not come back"
    new_plane = _child_with_title(arbiter, "qag-plane")
    assert new_plane and new_plane != plane and _child_with_title(arbiter, "qag: recorder") not in (None, recorder)
    deadline = time.time() + 30
    while True:
        runs = {rid: run for rid, run in _history(srv, "limited").items() if rid.startswith(tag + "-")}
        if len(runs) >= len(answered) or time.time() > deadline:
            break
        time.sleep(0.5)
    missing = set(answered) - set(runs)
    assert not missing, f"{len(missing)} of {len(answered)} answered calls not in history, e.g. {sorted(missing)[:3]}"
    after_kill = set(answered[at_plane_kill:])
    served = sum(1 for rid in after_kill if runs[rid]["served_by"] == "plane")
    assert served >= 100, "the restarted plane served nothing"
    text = requests.get(srv.base + "/metrics", timeout=10).text
    assert _metric_total(text, "qag_runs_lost_total") == 0
