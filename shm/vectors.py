"""Golden vectors for LAYOUT.md: `python -m shm.vectors` writes shm/vectors/*.bin (deterministic bytes).

What each file holds is listed in LAYOUT.md [Golden vectors]; the Python and the Rust tests decode them field by field.
"""
from __future__ import annotations

import sys
from pathlib import Path

from . import layout as L
from .entry import pack_entry
from .segment import Segment

VECTOR_DIR = Path(__file__).with_name("vectors")
SIZE = 1024 * 1024
SLOTS = 2
PID = 4242
RECORDER_PID = 4243
NOW_NS = 1_700_000_000_000_000_000
DEAD_PID = 0x7FFFFFFF  # above Linux's pid_max (2^22): never a live process

PLAN_KEY = b"plan:alice:orders_by_id:1"
PLAN_GENS = [("key", "alice", 2), ("query", "orders_by_id", 1), ("connection", "main", 1)]
PLAN_PAYLOAD = {"sql": "SELECT id, total FROM orders WHERE id = %(id)s", "params": ["id"]}
ROW_KEY = b"row:key:alice"
ROW_VALUE = b"\x01\x02\x03"
RING0_RECORDS = [b"run-0", b"run-1 twelve", b"run-2"]
RING1_FILL = (65528, 65512)  # two records that take ring 1's head to capacity - 16, then released
RING1_WRAPPED = b"wrapped-record-payload!!"  # 24 bytes: does not fit in the last 16, so a pad word precedes it
COUNTER = ("qag_requests_total", (("route", "/q/{name}"), ("status", "200")))
HISTOGRAM = ("qag_query_duration_seconds", (("query", "orders_by_id"),))
GAUGE = ("qag_pool_in_use", ())


def build() -> dict[str, bytes]:
    """The vector files by name."""
    buf = bytearray(SIZE)
    seg = Segment.in_buffer(buf, SLOTS, pid=PID, now_ns=NOW_NS)
    seg.bump("key", "alice")
    seg.bump("key", "alice")
    seg.bump("query", "orders_by_id")
    seg.bump("connection", "main")
    seg.cache_put(PLAN_KEY, pack_entry(PLAN_PAYLOAD, PLAN_GENS))
    seg.cache_put(ROW_KEY, ROW_VALUE)
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
    return {"header.bin": healthy[:L.HEADER_SIZE], "segment.bin": healthy, "segment_crashed.bin": bytes(crashed)}


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
