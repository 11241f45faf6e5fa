"""Golden vectors for LAYOUT.md: `python -m shm.vectors` writes shm/vectors/*.bin (deterministic bytes).

What each file holds is listed in LAYOUT.md [Golden vectors]; the Python and the Rust tests decode them field by field.
The entry and run record vectors are made by qag's own writers (qag/entries.py): this command is a development tool
above both packages, so it is the one module of shm/ that imports qag (inside build(), never at import).
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from . import layout as L
from .segment import Segment

VECTOR_DIR = Path(__file__).with_name("vectors")
SIZE = 1024 * 1024
SLOTS = 2
PID = 4242
RECORDER_PID = 4243
NOW_NS = 1_700_000_000_000_000_000
DEAD_PID = 0x7FFFFFFF  # above Linux's pid_max (2^22): never a live process

PLAN_KEY = b"p:alice\x00orders_by_id"  # the cache key of alice's plan of orders_by_id ([Entries] E5)
KEY_SECRET = "qag-vector-secret"  # alice's secret: her key entry is at k:<sha256 hex of it>
CONNECTION_KEY = b"c:main"
ROW_KEY = b"row:key:alice"
ROW_VALUE = b"\x01\x02\x03"
RING0_RECORDS = [b"run-0", b"run-1 twelve", b"run-2"]
RING1_FILL = (65528, 65512)  # two records that take ring 1's head to capacity - 16, then released
RING1_WRAPPED = b"wrapped-record-payload!!"  # 24 bytes: does not fit in the last 16, so a pad word precedes it
COUNTER = ("qag_requests_total", (("route", "/q/{name}"), ("status", "200")))
HISTOGRAM = ("qag_query_duration_seconds", (("query", "orders_by_id"),))
GAUGE = ("qag_pool_in_use", ())


# The entries' inputs ([Entries], [Run record]): alice's key, her plan of orders_by_id on connection main, and one
# call the plane served. Their generations are the segment vector's: key alice 2, query orders_by_id 1, main 1.
KEY_ROW = {"name": "alice", "active": 1, "expires_at": "2027-01-01T00:00:00Z", "prev_valid_until": None,
           "grants": {"queries": ["orders_by_id"], "connections": ["main"], "allowed_ips": ["10.0.0.0/8"],
                      "rate_limit": None}}
PLAN_SQL = "SELECT id, total FROM orders WHERE id = :id"
PLAN = {"query": "orders_by_id", "version": 1, "connection": "main", "dialect": "postgres",
        "sql": "SELECT id, total FROM orders WHERE id = %(id)s", "arg_names": ("id",), "transforms": (None, "mask"),
        "names": ("id", "total"), "tables": frozenset({"orders"}), "page_mode": "append", "gens": (2, 1, 1),
        "cache_ttl": None, "key_name": "alice", "is_write": False, "write_ops": frozenset(), "state_free": True,
        "write_grant": (False, False, None)}
PLAN_PARAMS = {"id": {"type": "int", "required": True, "min": 1}}
PLAN_CFG = {"default_page_size": 100, "max_page_size": 1000, "query_timeout": 30.0}
CONNECTION_ROW = {"name": "main", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "qag",
                  "database": "shop", "options": {"search_path": "app", "allow_superuser": True}, "active": 1}
RUN = {"at_us": NOW_NS // 1000, "key_name": "alice", "query": "orders_by_id", "version": 1, "connection": "main",
       "status": 200, "code": None, "rows": 1, "duration_us": 812, "bytes": 120, "request_id": "0123456789abcdef",
       "served_by": "plane", "transport": "http", "route": "/q/{name}", "error": None}
# A failed call with the database's words (LAYOUT.md [Run record] RR5; a str8 with a non-ASCII character).
RUN_FAILED = {**RUN, "status": 500, "code": "query_failed", "rows": 0, "bytes": 150, "served_by": "worker:1",
              "error": 'relation "public.ordres" does not exist (é)'}


# [Response cache]: a 64 KiB region on its own (offsets are the region's), alice's two cached answers, then fillers
# that lap the arena: the first answer is evicted, the second was refreshed (R11) and stays.
RESPONSES_SIZE = 65536
ANSWER_ARGS = (42,)  # orders_by_id?id=42, json, page 1, page size 100
ANSWER_BODY = b'[{"id":42,"total":"****"}]'
TYPES_ARGS = (None, False, True, -7, 1.5, "\u00e9 x")  # one argument of each tag (R5)
TYPES_BODY = b"id,total\r\n1,****\r\n2,****\r\n"
FILLER_BODY = 6000  # bytes of each filler's body ("F" * 6000)
FILLERS = 12


def entry_vectors() -> dict[str, bytes]:
    """key_entry.bin, plan_entry.bin, connection_entry.bin, run_record.bin: as qag/entries.py writes them."""
    from types import SimpleNamespace

    import msgpack

    from qag import entries, params

    pack = msgpack.Packer(use_bin_type=True).pack  # the writers' packer (qag/entries.py)
    plan = SimpleNamespace(**PLAN, specs=params.build_specs(PLAN_PARAMS))
    cached = SimpleNamespace(**{**PLAN, "cache_ttl": 60}, specs=params.build_specs(PLAN_PARAMS))
    return {
        "key_entry.bin": pack(entries.key_entry(KEY_ROW, False, 2)),
        "plan_entry.bin": pack(entries.plan_entry(plan, SimpleNamespace(**PLAN_CFG), PLAN_SQL, 1)),
        # the same plan of a query with cache_ttl 60: its response_prefix (LAYOUT.md [Response cache] R5)
        "plan_entry_cached.bin": pack(entries.plan_entry(cached, SimpleNamespace(**PLAN_CFG), PLAN_SQL, 1)),
        "connection_entry.bin": pack(entries.connection_entry(CONNECTION_ROW, 1, 3.0)),
        "run_record.bin": entries.encode_run(**RUN),
        "run_record_failed.bin": entries.encode_run(**RUN_FAILED),
    }


def response_vectors(prefix: bytes) -> dict[str, bytes]:
    """response_key.bin, response_key_types.bin and responses.bin (LAYOUT.md [Response cache], [Golden vectors])."""
    from . import responses as R

    key = prefix + R.suffix("json", 1, 100, ANSWER_ARGS)
    types_key = prefix + R.suffix("csv", 2, 5, TYPES_ARGS)
    buf = bytearray(RESPONSES_SIZE)
    R.write_header(buf, 0, RESPONSES_SIZE)
    lock = _BufferLock()
    rc = R.Responses(buf, memoryview(buf).cast("Q"), 0, RESPONSES_SIZE, lock, lambda: PID, lambda: NOW_NS)
    etag = lambda body: hashlib.blake2b(body, digest_size=16).digest()  # noqa: E731  (qag's validator)
    assert rc.put(key, R.key_hash(key), ANSWER_BODY, rows=1, has_more=False, ttl_s=60, etag=etag(ANSWER_BODY))
    assert rc.put(types_key, R.key_hash(types_key), TYPES_BODY, rows=2, has_more=True, ttl_s=30,
                  etag=etag(TYPES_BODY))
    for i in range(FILLERS):
        filler = prefix + R.suffix("json", 1, 100, (1000 + i,))
        assert rc.put(filler, R.key_hash(filler), b"F" * FILLER_BODY, rows=100, has_more=True, ttl_s=60,
                      etag=etag(b"F" * FILLER_BODY))
        if i == 4:  # the types answer is now in the older half: served, it is re-appended (R11)
            rec = rc.get(types_key, R.key_hash(types_key))
            rc.hit(rec)
            assert rc.refresh(types_key, R.key_hash(types_key), rec)
    assert rc.get(key, R.key_hash(key)) is None and rc.get(types_key, R.key_hash(types_key)) is not None
    return {"response_key.bin": key, "response_key_types.bin": types_key, "responses.bin": bytes(buf)}


class _BufferLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def build() -> dict[str, bytes]:
    """The vector files by name."""
    vectors = entry_vectors()
    import msgpack
    vectors.update(response_vectors(msgpack.unpackb(vectors["plan_entry_cached.bin"])["response_prefix"]))
    buf = bytearray(SIZE)
    seg = Segment.in_buffer(buf, SLOTS, pid=PID, now_ns=NOW_NS)
    seg.bump("key", "alice")
    seg.bump("key", "alice")
    seg.bump("query", "orders_by_id")
    seg.bump("connection", "main")
    seg.cache_put(PLAN_KEY, vectors["plan_entry.bin"])
    seg.cache_put(ROW_KEY, ROW_VALUE)
    seg.cache_put(b"k:" + hashlib.sha256(KEY_SECRET.encode()).hexdigest().encode(), vectors["key_entry.bin"])
    seg.cache_put(CONNECTION_KEY, vectors["connection_entry.bin"])
    seg.set_slot(0, "worker", pid=PID)
    seg.set_slot(1, "recorder", pid=RECORDER_PID)
    seg.counter_add(0, *COUNTER, 3)
    seg.counter_add(1, *COUNTER, 2)
    seg.histogram_observe(0, *HISTOGRAM, 0.003)
    seg.histogram_observe(1, *HISTOGRAM, 0.2)
    seg.gauge_set(0, *GAUGE, 2)
    r0 = seg.ring(0)
    for rec in RING0_RECORDS:
        assert r0.push(rec)
    r0.release(r0.read(1)[0][0])  # the first record consumed: tail = 16
    r1 = seg.ring(1)
    for fill, n in zip(b"AB", RING1_FILL):
        assert r1.push(bytes([fill]) * n)
        r1.release(r1.head)
    assert r1.push(RING1_WRAPPED)
    seg.set_heartbeat(1, value=r0.tail)
    healthy = bytes(buf)

    # The state a writer killed inside cache_put leaves (LAYOUT.md [Writer lock] K4): lock owned by a dead pid,
    # its slot odd and half-overwritten, the dirty-slot field naming it.
    crashed = bytearray(healthy)
    slot = _slot_of(seg, PLAN_KEY)
    base = seg.geometry.region("cache")[0] + slot * seg.geometry.cache_slot_size
    seq = L.U64.unpack_from(crashed, base)[0]
    L.U64.pack_into(crashed, base, seq + 1)
    crashed[base + L.CACHE_SLOT_HEADER:base + L.CACHE_SLOT_HEADER + 8] = b"\xde\xad\xbe\xef" * 2
    L.U64.pack_into(crashed, L.L_OWNER_PID, DEAD_PID)
    L.U64.pack_into(crashed, L.L_OWNER_START, 1)
    L.U64.pack_into(crashed, L.L_SEQ, L.U64.unpack_from(crashed, L.L_SEQ)[0] + 1)
    L.U64.pack_into(crashed, L.L_DIRTY_CACHE_SLOT, slot + 1)
    seg.close()
    return {"header.bin": healthy[:L.HEADER_SIZE], "segment.bin": healthy, "segment_crashed.bin": bytes(crashed),
            **vectors}


def _slot_of(seg: Segment, key: bytes) -> int:
    g = seg.geometry
    for slot in range(g.cache_slot_count):
        base = g.region("cache")[0] + slot * g.cache_slot_size
        klen = L.U32.unpack_from(seg._mm, base + L.CS_KEY_LEN)[0]
        start = base + L.CACHE_SLOT_HEADER
        if klen == len(key) and bytes(seg._mm[start:start + klen]) == key:
            return slot
    raise KeyError(key)


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0]) if argv else VECTOR_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, data in build().items():
        (out / name).write_bytes(data)
        print(f"{out / name}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
