"""The run record's `error` (shm/LAYOUT.md [Run record] RR2, RR5) in each run store against its real engine: SQLite
(a file), PostgreSQL (qag_runerr_*) and ClickHouse (chDB). The text round-trips byte for byte through history and
never appears in the event stream; a 1.0 record (15 fields, from a journal written before the upgrade) is stored
with a null error."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import msgpack
import pytest

from qag import entries
from qag.runstore import StoreSettings, open_store

PG_ADMIN = os.environ.get("QAG_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
KINDS = ["sqlite", "postgresql", "clickhouse"]

# Every character COPY text and the MsgPack body must carry: tab, newline, backslash, quotes, \N, non-ASCII, HTML.
TEXT = 'relation "public.ordres" does not exist\tat\ncharacter 15 \\N \\ \'q\' <script>x</script> é✓'
LONG = "y" * entries.RUN_ERROR_MAX


def pg_fresh(name: str) -> str:
    import psycopg2

    conn = psycopg2.connect(PG_ADMIN)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                "AND pid <> pg_backend_pid()", (name,))
    cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + name


@pytest.fixture()
def url(request):
    kind = request.param
    tmp = tempfile.mkdtemp(prefix="qag-runerr-")
    if kind == "sqlite":
        yield kind, os.path.join(tmp, "runs.db")
    elif kind == "postgresql":
        yield kind, pg_fresh("qag_runerr_store")
    else:
        yield kind, f"chdb://{tmp}/ch"
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
