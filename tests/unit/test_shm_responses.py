"""shm/LAYOUT.md [Response cache]: the golden vectors (responses.bin, response_key*.bin, plan_entry_cached.bin)
decoded field by field with plain struct, then the Python reader and writer (shm/responses.py) on private buffers:
the key encoding (R5, R6), reads (R9), the byte bound and eviction (R7, R8), refresh (R11), removal (R12), fills
(R13) and the repair of a killed writer's half-done put (R14). The multi-process cases are
tests/integration/test_shm_responses.py's."""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import msgpack

from shm import layout as L
from shm import responses as R

VECTORS = Path(__file__).resolve().parents[2] / "shm" / "vectors"
REGION = (VECTORS / "responses.bin").read_bytes()
KEY = (VECTORS / "response_key.bin").read_bytes()
TYPES_KEY = (VECTORS / "response_key_types.bin").read_bytes()
NOW = 1_700_000_000_000_000_000


def u32(off):
    return struct.unpack_from("<I", REGION, off)[0]


def u64(off):
    return struct.unpack_from("<Q", REGION, off)[0]


def prefix_of_plan() -> bytes:
    return msgpack.unpackb((VECTORS / "plan_entry_cached.bin").read_bytes())["response_prefix"]


def test_region_header_R1_R2():
    """R1: 64 KiB: 16 buckets (65536 / 4096), index at 4096, arena after it, max_record capacity / 8."""
    assert len(REGION) == 65536
    assert [u64(o) for o in range(0, 64, 8)] == [57344, 8192, 4096, 16, 8, 7168, 64, 2048]
    assert (u64(64), u64(128)) == (75872, 75872)  # wpos, wlimit: no put in progress
    stats = {name: u64(off) for off, name in L.RESP_STATS}
    assert stats == {"tail": 18952, "dirty": 0, "live_bytes": 55808, "live_entries": 10, "puts": 15, "evictions": 4,
                     "rejects": 0, "repairs": 0, "removals": 0, "refreshes": 1}
    assert REGION[272:2048] == bytes(2048 - 272) and REGION[2048:4096] == bytes(2048)  # reserved, no fill claimed


def test_key_encoding_R5_field_by_field():
    pre = prefix_of_plan()
    assert pre[:2] == b"r1"
    assert struct.unpack_from("<H", pre, 2)[0] == 12 and pre[4:16] == b"orders_by_id"
    assert struct.unpack_from("<Q", pre, 16)[0] == 1  # version
    assert struct.unpack_from("<H", pre, 24)[0] == 4 and pre[26:30] == b"main"
    assert struct.unpack_from("<QQ", pre, 30) == (1, 1)  # query and connection generations
    assert len(pre) == 30 + 16 + 16  # the masking fingerprint
    assert KEY[:len(pre)] == pre and TYPES_KEY[:len(pre)] == pre
    s = KEY[len(pre):]
    assert s == b"\x04json" + struct.pack("<QQH", 1, 100, 1) + b"\x03" + struct.pack("<q", 42)
    t = TYPES_KEY[len(pre):]
    assert t == (b"\x03csv" + struct.pack("<QQH", 2, 5, 6) + b"\x00\x01\x02" + b"\x03" + struct.pack("<q", -7)
                 + b"\x04" + struct.pack("<d", 1.5) + b"\x05" + struct.pack("<I", 4) + "é x".encode())
    assert (len(KEY), len(TYPES_KEY)) == (94, 114)
    assert R.suffix("json", 1, 100, (42,)) == s and R.suffix("csv", 2, 5, (None, False, True, -7, 1.5, "é x")) == t


def test_fingerprint_is_the_masking_R5():
    """Equal masking, equal prefix; any change of a column's masking, another prefix."""
    from types import SimpleNamespace

    from qag import entries
    base = {"query": "q", "version": 1, "connection": "c", "gens": (5, 2, 3), "sql": "SELECT a, b FROM t",
            "page_mode": "append", "names": ("a", "b")}
    masked = SimpleNamespace(**base, transforms=(None, "mask"))
    same = SimpleNamespace(**{**base, "gens": (9, 2, 3)}, transforms=(None, "mask"))  # another key's generation
    plain = SimpleNamespace(**base, transforms=None)
    hashed = SimpleNamespace(**base, transforms=(None, "hash"))
    assert entries.response_prefix(masked) == entries.response_prefix(same)
    assert len({entries.response_prefix(p) for p in (masked, plain, hashed)}) == 3
    moved = SimpleNamespace(**{**base, "gens": (5, 3, 3)}, transforms=None)  # a publish bumped the query
    assert entries.response_prefix(moved) != entries.response_prefix(plain)


def test_key_hash_R6():
    h = int.from_bytes(hashlib.sha256(TYPES_KEY).digest()[:8], "little")
    assert R.key_hash(TYPES_KEY) == h == 0x999906bbd56334b9 and h % 16 == 9


def test_index_and_record_R3_R4():
    """The types answer: bucket 9, way 0, at 31304 (refreshed), hits 1; its record field by field."""
    way = 4096 + (9 * 8 + 0) * 32
    assert (u64(way), u64(way + 8), u64(way + 16)) == (0x999906bbd56334b9, 31304, 1)
    a = 8192 + 31304 % 57344
    (magic, length, kh, kl, bl, created, expires, ttl, rows, flags, pid, etag) = L.RESP_RECORD.unpack_from(REGION, a)
    body = b"id,total\r\n1,****\r\n2,****\r\n"
    assert REGION[a:a + 4] == b"QAGR" and magic == 0x52474151
    assert (kh, kl, bl, rows, flags, pid, ttl) == (0x999906bbd56334b9, 114, len(body), 2, 1, 4242, 30)
    assert length == (80 + 114 + len(body) + 7) // 8 * 8 == 224
    assert (created, expires) == (NOW, NOW + 30 * 10 ** 9)
    assert etag == hashlib.blake2b(body, digest_size=16).digest()
    assert REGION[a + 72:a + 80] == bytes(8)
    assert REGION[a + 80:a + 80 + kl] == TYPES_KEY and REGION[a + 80 + kl:a + 80 + kl + bl] == body
    assert REGION[a + 80 + kl + bl:a + length] == bytes(length - 80 - kl - bl)


def test_pad_at_the_lap_end_R4_R7():
    assert REGION[8192 + 56232:8192 + 56236] == b"QAGP" and u32(8192 + 56236) == 57344 - 56232


def test_reader_on_the_vector_R9():
    """The first answer was lapped: a miss; the types answer is found with its fields; R15's headers follow."""
    buf = bytearray(REGION)
    rc = R.Responses(buf, memoryview(buf).cast("Q"), 0, len(buf), None, clock=lambda: NOW)
    assert rc.get(KEY, R.key_hash(KEY)) is None
    rec = rc.get(TYPES_KEY, R.key_hash(TYPES_KEY))
    assert rec.body == b"id,total\r\n1,****\r\n2,****\r\n" and (rec.rows, rec.has_more, rec.ttl_s) == (2, True, 30)
    assert rec.etag == '"' + hashlib.blake2b(rec.body, digest_size=16).hexdigest() + '"' and not rec.stale
    assert R.decode_key(TYPES_KEY) == {"query": "orders_by_id", "version": 1, "connection": "main", "format": "csv",
                                       "page": 2, "page_size": 5, "masking": prefix_of_plan()[46:62].hex()}
    late = R.Responses(buf, memoryview(buf).cast("Q"), 0, len(buf), None, clock=lambda: NOW + 31 * 10 ** 9)
    assert late.get(TYPES_KEY, R.key_hash(TYPES_KEY)).stale  # R10


def _region(size=65536, clock=None):
    import threading
    buf = bytearray(size)
    R.write_header(buf, 0, size)
    t = [NOW]
    rc = R.Responses(buf, memoryview(buf).cast("Q"), 0, size, threading.Lock(), clock=clock or (lambda: t[0]))
    return rc, buf


def _put(rc, key, body=b"x", ttl=60):
    return rc.put(key, R.key_hash(key), body, rows=1, has_more=False, ttl_s=ttl, etag=b"\0" * 16)


def test_reader_refuses_an_overwritten_or_reserved_record_R9():
    """A record whose bytes a writer has reserved (wlimit past pos + capacity) is a miss, even if still intact."""
    rc, buf = _region()
    _put(rc, b"k1", b"hello")
    assert rc.get(b"k1", R.key_hash(b"k1")).body == b"hello"
    q = memoryview(buf).cast("Q")
    q[128 // 8] = rc.capacity + 1  # a writer reserved the byte after position 0's lap
    assert rc.get(b"k1", R.key_hash(b"k1")) is None
    q[128 // 8] = q[64 // 8]
    q[4096 // 8 + 4 * (R.key_hash(b"k1") % 16 * 8) + 1] = 8  # the index way names a position mid-record
    assert rc.get(b"k1", R.key_hash(b"k1")) is None


def test_byte_bound_eviction_and_totals_R7_R8():
    rc, buf = _region()
    keys = [b"key-%d" % i for i in range(400)]
    for k in keys:
        assert _put(rc, k, b"v" * 500)
    st = rc.stats()
    assert st["live_bytes"] <= rc.capacity and st["puts"] == 400 and st["evictions"] > 0
    live = [k for k in keys if rc.get(k, R.key_hash(k))]
    assert keys[-1] in live and keys[0] not in live
    assert sum(e["bytes"] for e in rc.entries()) == st["live_bytes"] and len(live) == st["live_entries"]
    assert not _put(rc, b"big", b"x" * rc.max_record) and rc.stats()["rejects"] == 1  # larger than max_record


def test_same_key_replaces_and_refresh_keeps_a_used_entry_R7_R11():
    rc, _ = _region()
    _put(rc, b"hot", b"1")
    _put(rc, b"hot", b"2")
    assert rc.get(b"hot", R.key_hash(b"hot")).body == b"2" and rc.stats()["live_entries"] == 1
    for i in range(300):  # several laps; "hot" is served (and refreshed when old) between writes
        _put(rc, b"cold-%d" % i, b"c" * 400)
        rec = rc.get(b"hot", R.key_hash(b"hot"))
        assert rec is not None, f"a used entry was lapped after {i} writes"
        rc.refresh(b"hot", R.key_hash(b"hot"), rec)
    assert rc.stats()["refreshes"] > 0
    assert rc.get(b"cold-0", R.key_hash(b"cold-0")) is None


def test_removal_R12():
    rc, _ = _region()
    a = R.prefix("alpha", 1, "c", 1, 1, b"\0" * 16) + R.suffix("json", 1, 10, ())
    b = R.prefix("beta", 1, "c", 1, 1, b"\0" * 16) + R.suffix("json", 1, 10, ())
    _put(rc, a)
    _put(rc, b)
    assert rc.remove(lambda e: e.get("query") == "alpha") == 1
    assert rc.get(a, R.key_hash(a)) is None and rc.get(b, R.key_hash(b)) is not None
    assert rc.remove() == 1 and rc.stats()["live_entries"] == 0 and rc.stats()["removals"] == 2


def test_fills_one_per_key_R13():
    rc, _ = _region()
    h = R.key_hash(b"k")
    token, _ = rc.claim(h, 1.0)
    assert token > 0
    other, slot = rc.claim(h, 1.0)
    assert other == 0 and rc.filling(h, slot)  # the same key: wait
    rc.release(h, token)
    assert not rc.filling(h, slot)
    again, _ = rc.claim(h, 1.0)
    assert again > 0
    rc.release(h, again)


def test_fill_of_a_dead_or_late_filler_stops_R13():
    t = [NOW]
    rc, buf = _region(clock=lambda: t[0])
    h = R.key_hash(b"k")
    token, _ = rc.claim(h, 1.0)
    _, slot = rc.claim(h, 1.0)
    t[0] += 3 * 10 ** 9  # past until_ns (limit + 1 s)
    assert not rc.filling(h, slot)
    t[0] = NOW
    memoryview(buf).cast("Q")[slot + 1] = 0x7FFFFFFF  # a pid above pid_max: dead
    assert not rc.filling(h, slot)
    assert rc.claim(h, 1.0)[0] > 0  # the dead one's claim is taken


def test_repair_of_a_killed_writer_R14():
    """A writer killed after reserving (wlimit) and writing half a record, before wpos and the index."""
    rc, buf = _region()
    _put(rc, b"before", b"ok")
    q = memoryview(buf).cast("Q")
    w = q[64 // 8]
    q[200 // 8] = 1  # dirty
    q[128 // 8] = w + 4096  # reserved
    buf[8192 + w:8192 + w + 16] = b"\xde\xad\xbe\xef" * 4
    assert rc.get(b"before", R.key_hash(b"before")).body == b"ok"  # readers are unaffected
    assert rc.repair()
    assert q[64 // 8] == q[128 // 8] == w + 4096 and q[200 // 8] == 0 and rc.stats()["repairs"] == 1
    assert buf[8192 + w:8192 + w + 4] == b"QAGP"
    for i in range(200):  # the tail walks over the pad: later laps are sound
        assert _put(rc, b"after-%d" % i, b"a" * 600)
    assert rc.get(b"after-199", R.key_hash(b"after-199")).body == b"a" * 600
    assert rc.stats()["live_bytes"] == sum(e["bytes"] for e in rc.entries())


def test_unencodable_values_are_not_cached_R5():
    assert R.suffix("json", 1, 10, (2 ** 63,)) is None
    assert R.suffix("json", 1, 10, ([1],)) is None
    assert R.suffix("json", 1, 10, (-(2 ** 63), 0.0, -0.0)) != R.suffix("json", 1, 10, (-(2 ** 63), 0.0, 0.0))


def test_geometry_and_bound_R1():
    assert R.geometry(16 << 20)["index_buckets"] == 4096 and R.geometry(16 << 20)["max_record"] == 1 << 20
    g = L.geometry(64 << 20, 16, 4096, 16 << 20)
    assert g.region("responses") == (50307072, 16777216) and g.cache_slot_count == 7752
    assert L.max_responses_size(64 << 20, 16) == 32714752
    import pytest
    with pytest.raises(ValueError, match="does not fit"):
        L.geometry(64 << 20, 16, 4096, 48 << 20)
