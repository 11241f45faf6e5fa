"""The run record's `error` (shm/LAYOUT.md [Run record] RR2, RR5) in each run store against its real engine: SQLite
(a file), PostgreSQL (qag_runerr_*) and ClickHouse (chDB). The text round-trips byte for byte through history and
never appears in the event stream; a 1.0 record (15 fields, from a journal written before the upgrade) is stored
with a null error; a store made by the schema before `error` is upgraded in place by ensure_schema, keeps its runs
(their error null) and stores the new field from then on."""
from __future__ import annotations

import shutil
import tempfile
import time

import msgpack
import pytest

from qag import entries
from qag.runstore import StoreSettings, open_store

from .test_runstore import make_url

KINDS = ["sqlite", "postgresql", "clickhouse"]

# Every character COPY text and the MsgPack body must carry: tab, newline, backslash, quotes, \N, non-ASCII, HTML.
TEXT = 'relation "public.ordres" does not exist\tat\ncharacter 15 \\N \\ \'q\' <script>x</script> é✓'
LONG = "y" * entries.RUN_ERROR_MAX


@pytest.fixture()
def url(request):
    kind = request.param
    tmp = tempfile.mkdtemp(prefix="qag-runerr-")
    yield kind, make_url(kind, tmp, db="qag_runerr_store")
    shutil.rmtree(tmp, ignore_errors=True)


def _rec(i: int, error=None, status=500, code="query_failed") -> bytes:
    return entries.encode_run(at_us=time.time_ns() // 1000, key_name="k", query="q", version=1, connection="c",
                              status=status, code=code, request_id=f"r{i}", route="/q/{name}", error=error)


def _rec_1_0(i: int) -> bytes:
    """A format 1.0 record: the 15 fields before `error`."""
    t = msgpack.unpackb(_rec(i))[:entries.RUN_NFIELDS_1_0]
    assert len(t) == 15
    return msgpack.packb(t)


def _by_request(items) -> dict:
    return {it["request_id"]: it for it in items}


def _write(store, recs, start=0):
    store.write_batch("src", [(0, start + i + 1, r) for i, r in enumerate(recs)])


@pytest.mark.parametrize("url", KINDS, indirect=True)
def test_error_round_trips_in_history_and_never_in_events(url):
    kind, u = url
    store = open_store(u, StoreSettings())
    try:
        store.ensure_schema()
        _write(store, [_rec(0, TEXT), _rec(1, LONG), _rec(2, None, 200, None), _rec_1_0(3), _rec(4, "")])
        items, _ = store.history(limit=10)
        got = {rid: it["error"] for rid, it in _by_request(items).items()}
        assert got == {"r0": TEXT, "r1": LONG, "r2": None, "r3": None, "r4": ""}, kind
        assert store.bad_records == 0
        events = store.events_after(0)
        assert len(events) == 5 and all("error" not in ev for ev in events), "the event stream never carries it"
        keyed = store.events_after(0, "k")
        assert keyed and all("error" not in ev for ev in keyed)
    finally:
        store.close()


# -- an existing store, made by the schema before `error` -----------------------------------------------------

def _old_sql_store(kind: str, u: str) -> None:
    """The run tables exactly as layout 2 (format 1.0) made them, one failed run in history."""
    name = 'TEXT COLLATE "C"' if kind == "postgresql" else "TEXT"
    pk = "BIGINT PRIMARY KEY" if kind == "postgresql" else "INTEGER PRIMARY KEY"
    cols = (f"event_id {pk}, at_us BIGINT NOT NULL, key_name {name}, query {name}, version INTEGER, "
            "connection_name TEXT, status INTEGER NOT NULL, code TEXT, \"rows\" BIGINT NOT NULL, "
            "duration_us BIGINT NOT NULL, bytes BIGINT NOT NULL, request_id TEXT NOT NULL, "
            "served_by TEXT NOT NULL, transport TEXT NOT NULL, route TEXT NOT NULL")
    stmts = [f"CREATE TABLE qag_events ({cols})", f"CREATE TABLE qag_history ({cols})",
             "CREATE TABLE qag_runstore_layout (version INTEGER NOT NULL)",
             "INSERT INTO qag_runstore_layout (version) VALUES (2)",
             "INSERT INTO qag_history VALUES (1, 1700000000000000, 'k', 'q', 1, 'c', 500, 'query_failed', 0, 5, 0, "
             "'old-run', 'worker:0', 'http', '/q/{name}')"]
    if kind == "postgresql":
        import psycopg2
        conn = psycopg2.connect(u)
        with conn.cursor() as cur:
            for s in stmts:
                cur.execute(s)
        conn.commit()
        conn.close()
    else:
        import sqlite3
        conn = sqlite3.connect(u)
        conn.executescript(";".join(stmts))
        conn.commit()
        conn.close()


def _old_clickhouse_store(u: str) -> None:
    """The tables and views as the schema before `error` made them (today's DDL without the column: checked to
    differ), one failed run written through the events table and the history view."""
    from qag.runstore import clickhouse
    store = open_store(u, StoreSettings())
    new = store.schema_sql()
    old = [s.replace(", error Nullable(String)", "").replace("route, error,", "route,") for s in new]
    assert sum(a != b for a, b in zip(new, old)) == 3, "events, history and the history view lose the column"
    for s in old:
        store.client.command(s)
    from qag.runstore.eventid import id_floor, now_ms
    cols = [c for c in clickhouse.INSERT_COLUMNS if c != "error"]
    eid = id_floor(now_ms() - 60_000)  # a run of a minute ago (the tables' TTL keeps it)
    store.client.command(f"INSERT INTO qag_events ({', '.join(cols)}) VALUES (1, 'old', {eid}, 0, 1, 1, "
                         "fromUnixTimestamp64Micro(1700000000000000, 'UTC'), 'k', 'q', 1, 'c', 500, 'query_failed', "
                         "0, 5, 0, 'old-run', 'worker:0', 'http', '/q/{name}')")
    assert store.client.query("SELECT count() FROM qag_history").result_rows[0][0] == 1
    store.close()


def _columns(store, kind: str, table: str) -> list[str]:
    if kind == "clickhouse":
        return [r[0] for r in store.client.query(
            f"SELECT name FROM system.columns WHERE database = currentDatabase() AND table = '{table}' "
            "ORDER BY position").result_rows]
    rows = store._read("SELECT column_name FROM information_schema.columns WHERE table_name = %s "
                       "ORDER BY ordinal_position", (table,)) if kind == "postgresql" else \
        store.conn.execute(f"PRAGMA table_info({table})").fetchall()
    return [r[0] if kind == "postgresql" else r[1] for r in rows]


@pytest.mark.parametrize("url", KINDS, indirect=True)
def test_a_store_made_before_error_is_upgraded_in_place(url):
    kind, u = url
    if kind == "clickhouse":
        _old_clickhouse_store(u)
    else:
        _old_sql_store(kind, u)
    store = open_store(u, StoreSettings())
    try:
        before = _columns(store, kind, "qag_history")
        assert "error" not in before
        store.ensure_schema()
        store.ensure_schema()  # idempotent: a second start adds nothing and fails on nothing
        for table in ("qag_events", "qag_history"):
            cols = _columns(store, kind, table)
            assert cols.count("error") == 1, (table, cols)
            assert cols.index("error") == cols.index("route") + 1, "after the field before it"
        items, _ = store.history(limit=10)
        assert [(it["request_id"], it["error"]) for it in items] == [("old-run", None)], "old runs kept, error null"
        _write(store, [_rec(0, TEXT), _rec(1, None, 200, None)])
        items, _ = store.history(limit=10)
        assert {it["request_id"]: it["error"] for it in items} == {"old-run": None, "r0": TEXT, "r1": None}
        assert all("error" not in ev for ev in store.events_after(0))
    finally:
        store.close()
