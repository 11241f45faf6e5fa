"""shm/vectors/*.bin decoded field by field with plain struct, each test naming the shm/LAYOUT.md rule it checks."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import msgpack
import pytest

VECTORS = Path(__file__).resolve().parents[2] / "shm" / "vectors"
SEG = (VECTORS / "segment.bin").read_bytes()
CRASHED = (VECTORS / "segment_crashed.bin").read_bytes()
REGION_NAMES = ("slot_meta", "generations", "series", "counters", "cache_tags", "cache", "rings", "responses")
BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
          float("inf"))


def u32(buf: bytes, off: int) -> int:
    return struct.unpack_from("<I", buf, off)[0]


def u64(buf: bytes, off: int) -> int:
    return struct.unpack_from("<Q", buf, off)[0]


def f64(buf: bytes, off: int) -> float:
    return struct.unpack_from("<d", buf, off)[0]


def region(buf: bytes, name: str) -> tuple[int, int]:
    return struct.unpack_from("<QQ", buf, 128 + 16 * REGION_NAMES.index(name))


def test_header_magic_word_H1():
    """[Header] H1: magic 'QAGS' then major 1, minor 1 in one little-endian u64 at offset 0."""
    assert SEG[0:4] == b"QAGS"
    word = u64(SEG, 0)
    assert word & 0xFFFFFFFF == 0x53474151
    assert (word >> 32) & 0xFFFF == 1
    assert word >> 48 == 1  # [Versions] 1.1: the responses region
    assert (VECTORS / "header.bin").read_bytes() == SEG[:4096]


def test_header_identity_fields():
    """[Header] line 0: total_size, created_at_ns, creator_pid, slots, header_size, region_count."""
    assert u64(SEG, 8) == len(SEG) == 1024 * 1024
    assert u64(SEG, 16) == 1_700_000_000_000_000_000
    assert u32(SEG, 24) == 4242
    assert u32(SEG, 28) == 2
    assert u32(SEG, 32) == 4096
    assert u32(SEG, 36) == 8  # 1.1: region 7, responses
    assert SEG[48:64] == bytes(16)  # reserved stays zero


def test_header_geometry_line_and_small_profile():
    """[Geometry] small profile (< 16 MiB) and [Header] line 1 values."""
    g = struct.unpack_from("<12I", SEG, 64)
    (gen_slots, cache_slot_count, cache_slot_size, ways, ring_cap, ring_hdr, series_max, entry, cells, meta, hb,
     stride) = g
    assert (gen_slots, series_max, cells) == (256, 128, 1024)
    assert (cache_slot_size, ways, ring_hdr, entry, meta, hb) == (4096, 8, 128, 256, 64, 17)
    assert cache_slot_count % 8 == 0
    assert ring_cap & (ring_cap - 1) == 0  # power of two
    assert stride == (128 + ring_cap + 4095) // 4096 * 4096
    assert SEG[112:128] == bytes(16)


def test_region_table_geometry():
    """[Geometry]: regions in order, page-aligned, contiguous from 4096, sizes derived as documented."""
    slots, gen_slots, series_max, cells, slot_size = 2, 256, 128, 1024, 4096
    rnd = lambda n: (n + 4095) // 4096 * 4096
    off = 4096
    expected_fixed = [rnd(slots * 64), rnd(3 * gen_slots * 8), rnd(series_max * 256), rnd(slots * cells * 8)]
    for name, size in zip(REGION_NAMES[:4], expected_fixed):
        assert region(SEG, name) == (off, size), name
        off += size
    remaining = len(SEG) - off
    per_ring = remaining // 2 // slots - 128
    ring_cap = 1 << (per_ring.bit_length() - 1)
    assert u32(SEG, 80) == ring_cap
    stride = rnd(128 + ring_cap)
    sets = (remaining - slots * stride - 4096) // (8 * slot_size + 32)
    assert u32(SEG, 68) == 8 * sets
    assert region(SEG, "cache_tags") == (off, rnd(sets * 32))
    off += rnd(sets * 32)
    assert region(SEG, "cache") == (off, rnd(8 * sets * slot_size))
    off += rnd(8 * sets * slot_size)
    assert region(SEG, "rings") == (off, slots * stride)
    assert off + slots * stride <= len(SEG)
    assert region(SEG, "responses") == (off + slots * stride, 0)  # the vector segment has no response cache
    for name in REGION_NAMES:
        assert region(SEG, name)[0] % 4096 == 0


def test_histogram_bounds_in_header():
    """[Histogram buckets]: 17 f64 bounds at 256, +Inf last, unused entries zero."""
    assert u32(SEG, 104) == 17
    assert tuple(f64(SEG, 256 + 8 * i) for i in range(17)) == BOUNDS
    assert SEG[256 + 8 * 17:512] == bytes(512 - 256 - 8 * 17)


def test_generations_G1_G2():
    """[Generations] G1 slot = crc32(ident) & (gen_slots-1), kinds key/query/connection; G2 global counts bumps."""
    off, size = region(SEG, "generations")
    gen_slots = u32(SEG, 64)
    assert size == (3 * gen_slots * 8 + 4095) // 4096 * 4096
    assert SEG[off + 3 * gen_slots * 8:off + size] == bytes(size - 3 * gen_slots * 8)  # rounding: reserved
    table = struct.unpack_from(f"<{3 * gen_slots}Q", SEG, off)
    expect = {(0, "alice"): 2, (1, "orders_by_id"): 1, (2, "main"): 1}
    for (kind, ident), value in expect.items():
        slot = zlib.crc32(ident.encode()) & (gen_slots - 1)
        assert table[kind * gen_slots + slot] == value
    assert zlib.crc32(b"alice") & 255 == 71
    assert sum(table) == 4
    assert u64(SEG, 512) == 4  # global_gen on its own line
    assert SEG[520:576] == bytes(56)


def _cache_slot(buf: bytes, n: int) -> dict:
    off = region(buf, "cache")[0] + n * u32(buf, 72)
    seq, klen, vlen, stamp, pid, kcrc = struct.unpack_from("<QIIQII", buf, off)
    key = buf[off + 64:off + 64 + klen]
    value = buf[off + 64 + klen:off + 64 + klen + vlen]
    return {"seq": seq, "klen": klen, "vlen": vlen, "stamp": stamp, "pid": pid, "kcrc": kcrc, "key": key,
            "value": value, "reserved": buf[off + 32:off + 64]}


PLAN_KEY = b"p:alice\x00orders_by_id"
KEY_KEY = b"k:577d63245a20fb42908e5dacb12ee30532da351028e571d2121705bf92e04cc9"  # sha256("qag-vector-secret")


def test_cache_slots_C1_C2_and_entries_E5():
    """[Cache] C1 even seq when published, C2 set = crc32(key) % sets, first empty way; [Cache entries] the
    values are the entry vectors' bytes under their E5 cache keys."""
    sets = u32(SEG, 68) // 8
    assert zlib.crc32(PLAN_KEY) % sets == 12
    plan = _cache_slot(SEG, 96)
    assert plan["seq"] == 2 and plan["key"] == PLAN_KEY and plan["kcrc"] == zlib.crc32(PLAN_KEY)
    assert plan["stamp"] == 1 and plan["pid"] == 4242 and plan["reserved"] == bytes(32)
    assert plan["value"] == (VECTORS / "plan_entry.bin").read_bytes()
    # E1: the segment's generations of alice, orders_by_id and main
    assert msgpack.unpackb(plan["value"])["gens"] == [2, 1, 1]
    row = _cache_slot(SEG, 56)
    assert zlib.crc32(b"row:key:alice") % sets == 7
    assert (row["seq"], row["key"], row["value"], row["stamp"]) == (2, b"row:key:alice", b"\x01\x02\x03", 2)
    key = _cache_slot(SEG, 48)
    assert zlib.crc32(KEY_KEY) % sets == 6
    assert (key["key"], key["value"], key["stamp"]) == (KEY_KEY, (VECTORS / "key_entry.bin").read_bytes(), 3)
    conn = _cache_slot(SEG, 40)
    assert zlib.crc32(b"c:main") % sets == 5
    conn_value = (VECTORS / "connection_entry.bin").read_bytes()
    assert (conn["key"], conn["value"], conn["stamp"]) == (b"c:main", conn_value, 4)
    used = [n for n in range(u32(SEG, 68)) if _cache_slot(SEG, n)["klen"]]
    assert used == [40, 48, 56, 96]
    assert (u64(SEG, 704), u64(SEG, 712), u64(SEG, 720), u64(SEG, 728), u64(SEG, 736)) == (4, 0, 0, 0, 4)


def test_cache_tags_C5():
    """[Cache] C5: per set 8 x u32 crc32 of each way's key, 0 when empty."""
    off = region(SEG, "cache_tags")[0]
    tags = struct.unpack_from("<8I", SEG, off + 32 * 12)
    assert tags == (zlib.crc32(PLAN_KEY), 0, 0, 0, 0, 0, 0, 0)
    assert struct.unpack_from("<8I", SEG, off + 32 * 7)[0] == zlib.crc32(b"row:key:alice")
    assert struct.unpack_from("<8I", SEG, off + 32 * 2) == (0,) * 8


def _series(buf: bytes) -> list[tuple]:
    off = region(buf, "series")[0]
    out = []
    for i in range(u64(buf, 640)):
        e = off + 256 * i
        cell, ncells, kind, reserved, dlen = struct.unpack_from("<IHBBH", buf, e)
        assert reserved == 0 and buf[e + 10:e + 16] == bytes(6)
        name, labels = msgpack.unpackb(buf[e + 16:e + 16 + dlen], raw=False)
        assert buf[e + 16 + dlen:e + 256] == bytes(240 - dlen)
        out.append((name, tuple(map(tuple, labels)), kind, cell, ncells))
    return out


def test_series_table_S1_S2_S3():
    """[Series] S2 series_count publishes entries; S3 labels sorted; kinds and cell ranges."""
    assert u64(SEG, 640) == 3
    assert u64(SEG, 648) == 20
    assert _series(SEG) == [
        ("qag_requests_total", (("route", "/q/{name}"), ("status", "200")), 1, 0, 1),
        ("qag_query_duration_seconds", (("query", "orders_by_id"),), 3, 1, 18),
        ("qag_pool_in_use", (), 2, 19, 1),
    ]


def test_counter_cells_N1_N2_N3():
    """[Counters] N1 one f64 block per slot; N2 non-cumulative buckets then sum; N3 totals are sums over slots."""
    off = region(SEG, "counters")[0]
    cells = u32(SEG, 96)
    block = lambda s: struct.unpack_from(f"<{cells}d", SEG, off + 8 * cells * s)
    b0, b1 = block(0), block(1)
    assert (b0[0], b1[0]) == (3.0, 2.0)
    hist0, hist1 = b0[1:19], b1[1:19]
    assert hist0[5] == 1.0 and sum(hist0[:17]) == 1.0 and hist0[17] == 0.003
    assert hist1[10] == 1.0 and sum(hist1[:17]) == 1.0 and hist1[17] == 0.2
    assert BOUNDS[4] < 0.003 <= BOUNDS[5] and BOUNDS[9] < 0.2 <= BOUNDS[10]
    assert (b0[19], b1[19]) == (2.0, 0.0)
    assert not any(b0[20:]) and not any(b1[20:])


def test_slot_metadata_M1_M2():
    """[Slot metadata] M1 seqlock even after a claim; role codes; M2 heartbeat value."""
    off = region(SEG, "slot_meta")[0]
    s0 = struct.unpack_from("<8Q", SEG, off)
    s1 = struct.unpack_from("<8Q", SEG, off + 64)
    assert s0[:6] == (2, 4242, 1, 1_700_000_000_000_000_000, 1_700_000_000_000_000_000, 0)
    assert s1[:6] == (2, 4243, 2, 1_700_000_000_000_000_000, 1_700_000_000_000_000_000, 16)
    assert s0[6:] == s1[6:] == (0, 0)  # proc_start (0 in vectors: a fixed pid) and the reserved word


def _ring(buf: bytes, slot: int) -> tuple[int, int, int, int]:
    off = region(buf, "rings")[0] + slot * u32(buf, 108)
    return off, u64(buf, off), u64(buf, off + 64), u32(buf, 80)


def _walk(buf: bytes, slot: int) -> list[tuple[int, bytes]]:
    """R4 done by hand: from tail to head, pad words skip to the next lap, crc32 checked."""
    off, head, tail, cap = _ring(buf, slot)
    data = off + 128
    pos, out = tail, []
    while pos < head:
        o = pos & (cap - 1)
        word = u64(buf, data + o)
        length, crc = word & 0xFFFFFFFF, word >> 32
        if length == 0xFFFFFFFF:
            assert crc == 0
            pos += cap - o
            continue
        payload = buf[data + o + 8:data + o + 8 + length]
        assert zlib.crc32(payload) == crc
        pos += 8 + (length + 7) // 8 * 8
        out.append((pos, payload))
    assert pos == head
    return out


def test_ring_header_lines_and_records_R2_R3():
    """[Rings] head and tail on their own lines; R2 record word = length | crc32 << 32; R3 head after records."""
    off, head, tail, cap = _ring(SEG, 0)
    assert (head, tail, cap) == (56, 16, 131072)
    assert SEG[off + 8:off + 64] == bytes(56) and SEG[off + 72:off + 128] == bytes(56)
    assert u64(SEG, off + 128) == 5 | zlib.crc32(b"run-0") << 32  # released but still there
    assert _walk(SEG, 0) == [(40, b"run-1 twelve"), (56, b"run-2")]
    assert SEG[off + 128 + 16 + 8 + 12:off + 128 + 16 + 24] == bytes(4)  # padding to 8 is zero


def test_ring_wrap_pad_word_R1():
    """[Rings] R1: a record that does not fit before the end follows a pad word and starts at offset 0."""
    off, head, tail, cap = _ring(SEG, 1)
    assert (tail, head) == (cap - 16, cap + 32)
    assert u64(SEG, off + 128 + cap - 16) == 0xFFFFFFFF
    assert _walk(SEG, 1) == [(cap + 32, b"wrapped-record-payload!!")]


def test_crashed_vector_K4_state():
    """[Writer lock] K2/K4 and [Cache] C4: the state a writer killed in cache_put leaves behind."""
    plan = _cache_slot(CRASHED, 96)
    assert plan["seq"] == 3 and plan["seq"] & 1  # odd: readers must treat it as a miss
    assert u64(CRASHED, 576) == 0x7FFFFFFF and u64(CRASHED, 584) == 1
    assert u64(CRASHED, 600) == u64(SEG, 600) + 1
    assert u64(CRASHED, 608) == 97  # dirty slot = index + 1
    diff = [i for i in range(len(SEG)) if SEG[i] != CRASHED[i]]
    slot_off = region(SEG, "cache")[0] + 96 * 4096
    assert all(i < 1024 or slot_off <= i < slot_off + 4096 for i in diff)


def test_lock_line_released_in_healthy_vector_K2():
    """[Writer lock] K2: a released lock has owner 0; lock_seq counts acquisitions (4 bumps, 4 puts, 3 series)."""
    assert u64(SEG, 576) == 0 and u64(SEG, 608) == 0 and u64(SEG, 616) == 0
    assert u64(SEG, 600) == 11


def test_vectors_are_current():
    """[Golden vectors]: `python -m shm.vectors` reproduces the committed files byte for byte."""
    vectors = pytest.importorskip("shm.vectors")
    for name, data in vectors.build().items():
        assert (VECTORS / name).read_bytes() == data, f"{name} is stale: run python -m shm.vectors"
