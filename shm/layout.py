"""The segment's byte layout as constants and precompiled structs; shm/LAYOUT.md is normative, this mirrors it.

Every offset here is named in LAYOUT.md (section in brackets); change both together and bump the version.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

if sys.byteorder != "little":  # LAYOUT.md [Byte order]: native 8-byte stores are used as LE stores
    raise ImportError("shm: the segment layout is little-endian; big-endian hosts are not supported")

# [Header] the magic word: u32 magic, u16 major, u16 minor, published by one 8-byte store, written last.
MAGIC = 0x53474151  # b"QAGS" read as a little-endian u32
MAJOR = 1
MINOR = 1  # 1.1: region 7, `responses` (LAYOUT.md [Response cache])

PAGE = 4096
LINE = 64  # cache line; hot fields each get their own
DEFAULT_SIZE = 64 * 1024 * 1024
MIN_SIZE = 1024 * 1024
SMALL_PROFILE_BELOW = 16 * 1024 * 1024
MAX_SLOTS = 256
MAX_RING_CAPACITY = 64 * 1024 * 1024  # beyond this a ring only delays back-pressure; the rest goes to the cache

HEADER_SIZE = PAGE

# [Header] line 0: identity
H_MAGIC_WORD = 0  # u64: magic | major << 32 | minor << 48
H_TOTAL_SIZE = 8  # u64
H_CREATED_AT_NS = 16  # u64, CLOCK_REALTIME ns
H_CREATOR_PID = 24  # u32
H_SLOTS = 28  # u32
H_HEADER_SIZE = 32  # u32
H_REGION_COUNT = 36  # u32
H_CREATOR_START = 40  # u64, /proc/<pid>/stat starttime of the creator (a live creator's segment is not replaced)
# [Header] line 1: geometry (all u32)
H_GEN_SLOTS = 64
H_CACHE_SLOT_COUNT = 68
H_CACHE_SLOT_SIZE = 72
H_CACHE_WAYS = 76
H_RING_CAPACITY = 80
H_RING_HEADER_SIZE = 84
H_SERIES_MAX = 88
H_SERIES_ENTRY_SIZE = 92
H_CELLS_PER_SLOT = 96
H_SLOT_META_SIZE = 100
H_HIST_BUCKETS = 104
H_RING_STRIDE = 108
# [Header] region table: REGION_COUNT x (u64 offset, u64 size)
H_REGIONS = 128
REGION_NAMES = ("slot_meta", "generations", "series", "counters", "cache_tags", "cache", "rings", "responses")
REGION_COUNT = len(REGION_NAMES)
REGION_COUNT_1_0 = 7  # a 1.0 segment has no `responses` region
# [Header] histogram upper bounds: HIST_MAX x f64, unused entries zero, +Inf last used entry
H_HIST_BOUNDS = 256
HIST_MAX = 32
# [Header] hot lines, each on its own cache line
H_GLOBAL_GEN = 512  # u64, writer: lock holder
H_LOCK = 576  # lock line (see L_*)
L_OWNER_PID = 576  # u64
L_OWNER_START = 584  # u64, /proc/<pid>/stat starttime of the owner (defeats pid reuse)
L_ACQUIRED_AT_NS = 592  # u64
L_SEQ = 600  # u64, +1 at every acquisition
L_DIRTY_CACHE_SLOT = 608  # u64, cache slot index + 1 being written, 0 = none
L_RECOVERIES = 616  # u64, times a dead owner's lock was taken over
H_SERIES_COUNT = 640  # u64, published series entries (writer: lock holder)
H_CELLS_USED = 648  # u64
H_CACHE_PUTS = 704  # u64, also the stamp for FIFO eviction
H_CACHE_EVICTIONS = 712
H_CACHE_REPAIRS = 720
H_CACHE_REJECTS = 728
H_CACHE_USED = 736  # u64, slots holding an entry

# [Histogram buckets] seconds; fits query, stage and request durations (0.1 ms .. 10 s)
HIST_BOUNDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    float("inf"),
)

# [Slot metadata] one 64-byte line per process slot, writer: the slot's process
SLOT_META_SIZE = 64
SM_SEQ = 0  # u64 seqlock over pid/role/started_at
SM_PID = 8  # u64
SM_ROLE = 16  # u64, ROLES code
SM_STARTED_AT_NS = 24  # u64
SM_HEARTBEAT_NS = 32  # u64
SM_HEARTBEAT_VALUE = 40  # u64
SM_PROC_START = 48  # u64, occupant's /proc/<pid>/stat start time (alive = same pid and same start)
ROLES = {"": 0, "worker": 1, "recorder": 2, "plane": 3, "other": 4}
ROLE_NAMES = {v: k for k, v in ROLES.items()}

# [Generations] three tables of gen_slots u64, in this order
GEN_KINDS = ("key", "query", "connection")

# [Cache] set-associative slots
CACHE_SLOT_SIZE = 4096
CACHE_WAYS = 8
CACHE_SLOT_HEADER = 64
CACHE_TAG_SET = 32  # [Cache tags] per set: CACHE_WAYS x u32 crc32(key) of each way, a hint for readers
CS_SEQ = 0  # u64 seqlock, odd while being written
CS_KEY_LEN = 8  # u32
CS_VALUE_LEN = 12  # u32
CS_STAMP = 16  # u64, H_CACHE_PUTS value when written (FIFO eviction)
CS_WRITER_PID = 24  # u32
CS_KEY_CRC = 28  # u32, crc32(key)
CACHE_SLOT_FIELDS = struct.Struct("<IIQII")  # key_len, value_len, stamp, writer_pid, key_crc at +8

# [Response cache] region 7: header page (R2), index (R3), arena of records (R4)
RESP_MIN_SIZE = 65536
RESP_WAYS = 8
RESP_WAY_SIZE = 32  # u64 hash, u64 pos, u64 hits, 8 reserved
RESP_MAX_RECORD = 1024 * 1024
RESP_FILL_SLOTS = 64
RESP_FILL_OFFSET = 2048
RESP_HEADER_FIELDS = ((0, "capacity"), (8, "arena_offset"), (16, "index_offset"), (24, "index_buckets"),
                      (32, "index_ways"), (40, "max_record"), (48, "fill_slots"), (56, "fill_offset"))
RESP_WPOS = 64  # u64, own line
RESP_WLIMIT = 128  # u64, own line
RESP_STATS = ((192, "tail"), (200, "dirty"), (208, "live_bytes"), (216, "live_entries"), (224, "puts"),
              (232, "evictions"), (240, "rejects"), (248, "repairs"), (256, "removals"), (264, "refreshes"))
RESP_MAGIC = 0x52474151  # b"QAGR"
RESP_PAD_MAGIC = 0x50474151  # b"QAGP"
# R4: magic, length, key_hash, key_len, body_len, created_at_ns, expires_at_ns, ttl_s, rows, flags, writer_pid, etag
RESP_RECORD = struct.Struct("<IIQIIQQIIII16s8x")
RESP_RECORD_HEADER = RESP_RECORD.size  # 80

# [Series] interned series table
SERIES_ENTRY_SIZE = 256
SE_FIELDS = struct.Struct("<IHBBH6x")  # cell_index, cell_count, kind, reserved, desc_len  (16 bytes)
SE_DESC = 16
SE_DESC_MAX = SERIES_ENTRY_SIZE - SE_DESC
KIND_COUNTER, KIND_GAUGE, KIND_HISTOGRAM = 1, 2, 3
KIND_NAMES = {KIND_COUNTER: "counter", KIND_GAUGE: "gauge", KIND_HISTOGRAM: "histogram"}

# [Rings]
RING_HEADER_SIZE = 128
R_HEAD = 0  # u64, writer: producer, own cache line
R_TAIL = 64  # u64, writer: consumer, own cache line
RECORD_HEADER = 8  # u64 word: length (low 32) | crc32(payload) << 32, written after the payload
PAD_LENGTH = 0xFFFFFFFF

U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
F64 = struct.Struct("<d")
REGION = struct.Struct("<QQ")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Geometry:
    """Every region's place and shape, derived from (size, slots, cache_slot_size) by LAYOUT.md [Geometry]."""

    size: int
    slots: int
    gen_slots: int
    series_max: int
    cells_per_slot: int
    cache_slot_size: int
    cache_slot_count: int
    ring_capacity: int
    ring_stride: int
    regions: tuple[tuple[int, int], ...]  # (offset, size) in REGION_NAMES order

    def region(self, name: str) -> tuple[int, int]:
        return self.regions[REGION_NAMES.index(name)]


def max_responses_size(size: int, slots: int = 16) -> int:
    """The largest `responses_size` [Geometry] accepts for a segment of `size` bytes: half of what the first four
    regions leave, rounded down to a page."""
    small = size < SMALL_PROFILE_BELOW
    fixed = HEADER_SIZE + sum((
        _round_up(slots * SLOT_META_SIZE, PAGE), _round_up(len(GEN_KINDS) * (256 if small else 4096) * 8, PAGE),
        _round_up((128 if small else 2048) * SERIES_ENTRY_SIZE, PAGE),
        _round_up(slots * (1024 if small else 8192) * 8, PAGE)))
    return max(0, (size - fixed) // 2 // PAGE * PAGE)


def geometry(size: int | None = None, slots: int = 16, cache_slot_size: int = CACHE_SLOT_SIZE,
             responses_size: int = 0) -> Geometry:
    """Derive the regions deterministically; the result is recorded in the header so readers never recompute it."""
    size = DEFAULT_SIZE if size is None else int(size)
    if size < MIN_SIZE or size % PAGE:
        raise ValueError(f"segment size must be a multiple of {PAGE} and at least {MIN_SIZE}, got {size}")
    if not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {slots}")
    if cache_slot_size % LINE or cache_slot_size < 2 * CACHE_SLOT_HEADER:
        raise ValueError(f"cache_slot_size must be a multiple of {LINE} and >= {2 * CACHE_SLOT_HEADER}")
    small = size < SMALL_PROFILE_BELOW
    gen_slots = 256 if small else 4096
    series_max = 128 if small else 2048
    cells_per_slot = 1024 if small else 8192
    off = HEADER_SIZE
    regions = []
    for region_size in (
        _round_up(slots * SLOT_META_SIZE, PAGE),
        _round_up(len(GEN_KINDS) * gen_slots * 8, PAGE),
        _round_up(series_max * SERIES_ENTRY_SIZE, PAGE),
        _round_up(slots * cells_per_slot * 8, PAGE),
    ):
        regions.append((off, region_size))
        off += region_size
    if responses_size and (responses_size % PAGE or responses_size < RESP_MIN_SIZE):
        raise ValueError(f"the response cache is 0 or a multiple of {PAGE} of at least {RESP_MIN_SIZE} bytes, "
                         f"not {responses_size}")
    if responses_size > (size - off) // 2:
        raise ValueError(f"a response cache of {responses_size} bytes does not fit in a segment of {size} bytes "
                         f"(at most {max_responses_size(size, slots)})")
    remaining = size - off - responses_size
    per_ring = min(remaining // 2 // slots - RING_HEADER_SIZE, MAX_RING_CAPACITY)
    ring_capacity = 1 << (per_ring.bit_length() - 1) if per_ring > 0 else 0
    if ring_capacity < PAGE:
        raise ValueError(f"segment size {size} too small for {slots} slots (ring capacity {ring_capacity})")
    ring_stride = _round_up(RING_HEADER_SIZE + ring_capacity, PAGE)
    rings_size = slots * ring_stride
    cache_bytes = remaining - rings_size - PAGE  # one page of slack for rounding the tag region up
    cache_sets = cache_bytes // (CACHE_WAYS * cache_slot_size + CACHE_TAG_SET)
    if cache_sets < 1:
        raise ValueError(f"segment size {size} too small for the cache")
    cache_slot_count = cache_sets * CACHE_WAYS
    tags_size = _round_up(cache_sets * CACHE_TAG_SET, PAGE)
    regions.append((off, tags_size))
    off += tags_size
    cache_size = _round_up(cache_slot_count * cache_slot_size, PAGE)
    regions.append((off, cache_size))
    off += cache_size
    regions.append((off, rings_size))
    off += rings_size
    regions.append((off, responses_size))
    off += responses_size
    assert off <= size
    return Geometry(size, slots, gen_slots, series_max, cells_per_slot, cache_slot_size, cache_slot_count,
                    ring_capacity, ring_stride, tuple(regions))
