"""The instance's shared-memory segment: generations, the shared cache, counters, slot metadata and rings.

The byte layout is shm/LAYOUT.md (normative); the section each method implements is named in its docstring.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
import time
import zlib
from bisect import bisect_left
from typing import Any, Self

import msgpack
import posix_ipc

from . import layout as L
from .fence import MODE as FENCE_MODE
from .fence import fence
from .lock import LockTimeout, WriterLock, owner_alive, proc_start
from .responses import Responses
from .responses import write_header as _write_responses_header
from .ring import Ring

CACHE_READ_RETRIES = 64  # LAYOUT.md [Cache] C4: a reader never waits for a writer; after this many tries it is a miss
_crc32 = zlib.crc32
_HIST_N = len(L.HIST_BOUNDS)
_WAYS = L.CACHE_WAYS
_SLOT_HDR = L.CACHE_SLOT_HEADER
_KEY_LEN_I, _VALUE_LEN_I, _KEY_CRC_I = L.CS_KEY_LEN // 4, L.CS_VALUE_LEN // 4, L.CS_KEY_CRC // 4
_TAGS = struct.Struct(f"<{L.CACHE_WAYS}I").unpack_from
_fence = None if FENCE_MODE == "none" else fence  # hot paths skip even the call on x86-64 (TSO)


class LayoutError(RuntimeError):
    """The segment is missing, not initialised, or of a layout this build does not read."""


class SegmentFull(RuntimeError):
    """A fixed table of the segment (series, counter cells) has no room left."""


def segment_name(instance: str) -> str:
    """The POSIX name of an instance's segment, e.g. segment_name(f"{QAG_HOME}|{bind}") -> "/qag-3f2a…"."""
    return "/qag-" + hashlib.blake2b(instance.encode(), digest_size=8).hexdigest()


def _sem_names(name: str) -> tuple[str, str]:
    return name + "-w", name + "-r"  # LAYOUT.md [Writer lock]


def _check_name(name: str) -> None:
    if not name.startswith("/") or "/" in name[1:] or len(name) > 200:
        raise ValueError(f"segment name must look like '/qag-…' (one leading slash), got {name!r}")


def _unlink_quietly(name: str) -> None:
    for unlink in (posix_ipc.unlink_shared_memory,):
        try:
            unlink(name)
        except posix_ipc.ExistentialError:
            pass
    for sem in _sem_names(name):
        try:
            posix_ipc.unlink_semaphore(sem)
        except posix_ipc.ExistentialError:
            pass


def _write_header(q: memoryview, mm: Any, g: L.Geometry, pid: int, start: int, now_ns: int) -> None:
    """LAYOUT.md [Header]: every field but the magic word, which the caller stores last."""
    U32, U64 = L.U32, L.U64
    U64.pack_into(mm, L.H_TOTAL_SIZE, g.size)
    U64.pack_into(mm, L.H_CREATED_AT_NS, now_ns)
    U32.pack_into(mm, L.H_CREATOR_PID, pid)
    U32.pack_into(mm, L.H_SLOTS, g.slots)
    U32.pack_into(mm, L.H_HEADER_SIZE, L.HEADER_SIZE)
    U32.pack_into(mm, L.H_REGION_COUNT, L.REGION_COUNT)
    U64.pack_into(mm, L.H_CREATOR_START, start)
    for off, value in (
        (L.H_GEN_SLOTS, g.gen_slots), (L.H_CACHE_SLOT_COUNT, g.cache_slot_count),
        (L.H_CACHE_SLOT_SIZE, g.cache_slot_size), (L.H_CACHE_WAYS, L.CACHE_WAYS),
        (L.H_RING_CAPACITY, g.ring_capacity), (L.H_RING_HEADER_SIZE, L.RING_HEADER_SIZE),
        (L.H_SERIES_MAX, g.series_max), (L.H_SERIES_ENTRY_SIZE, L.SERIES_ENTRY_SIZE),
        (L.H_CELLS_PER_SLOT, g.cells_per_slot), (L.H_SLOT_META_SIZE, L.SLOT_META_SIZE),
        (L.H_HIST_BUCKETS, _HIST_N), (L.H_RING_STRIDE, g.ring_stride),
    ):
        U32.pack_into(mm, off, value)
    for i, (off, size) in enumerate(g.regions):
        L.REGION.pack_into(mm, L.H_REGIONS + 16 * i, off, size)
    for i, bound in enumerate(L.HIST_BOUNDS):
        L.F64.pack_into(mm, L.H_HIST_BOUNDS + 8 * i, bound)
    _write_responses_header(mm, *g.region("responses"))  # [Response cache] R1/R2, before the magic word too


def _read_geometry(mm: Any, size: int) -> L.Geometry:
    u32 = lambda off: L.U32.unpack_from(mm, off)[0]
    total = L.U64.unpack_from(mm, L.H_TOTAL_SIZE)[0]
    if total != size:
        raise LayoutError(f"segment header says {total} bytes but the object has {size}")
    slots = u32(L.H_SLOTS)
    regions = tuple(L.REGION.unpack_from(mm, L.H_REGIONS + 16 * i) for i in range(u32(L.H_REGION_COUNT)))
    if len(regions) == L.REGION_COUNT_1_0:  # a 1.0 segment: no response cache
        regions += ((regions[-1][0] + regions[-1][1], 0),)
    if len(regions) < L.REGION_COUNT or any(off + sz > size for off, sz in regions):
        raise LayoutError("segment region table is inconsistent with its size")
    return L.Geometry(size, slots, u32(L.H_GEN_SLOTS), u32(L.H_SERIES_MAX), u32(L.H_CELLS_PER_SLOT),
                      u32(L.H_CACHE_SLOT_SIZE), u32(L.H_CACHE_SLOT_COUNT), u32(L.H_RING_CAPACITY),
                      u32(L.H_RING_STRIDE), regions[:L.REGION_COUNT])


class _BufferLock:
    """The writers' lock for a segment in a private buffer (golden vectors): one process, a fixed owner."""

    __slots__ = ("clock", "held", "pid", "q")

    def __init__(self, q: memoryview, pid: int, clock: Any) -> None:
        self.q, self.pid, self.clock, self.held = q, pid, clock, False

    def acquire(self, timeout: float = 5.0) -> None:
        q = self.q
        q[L.L_OWNER_PID // 8] = self.pid
        q[L.L_ACQUIRED_AT_NS // 8] = self.clock()
        q[L.L_SEQ // 8] += 1
        self.held = True

    def release(self) -> None:
        self.q[L.L_OWNER_PID // 8] = 0
        self.held = False

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Segment:
    """A mapped segment. Make one with Segment.create (the arbiter) or Segment.attach (everyone else)."""

    def __init__(self, name: str, mm: Any, geometry: L.Geometry) -> None:
        self.name = name
        self.geometry = g = geometry
        self.slots = g.slots
        self._mm = mm
        self._mv = memoryview(mm)
        self._q = self._mv.cast("Q")  # native = little-endian (layout.py refuses big-endian hosts)
        self._d = self._mv.cast("d")
        self._i = self._mv.cast("I")
        self._sems: tuple[Any, ...] = ()
        self._lock: Any = None
        self._clock = time.time_ns
        self._getpid = os.getpid
        self._proc_start = proc_start
        self._series_mutex = threading.Lock()  # threads of one process share the decoded series list
        self._rings: dict[int, Ring] = {}
        # generations [Generations]
        gen_off = g.region("generations")[0]
        self._gen_mask = g.gen_slots - 1
        self._gen_base = {k: gen_off // 8 + i * g.gen_slots for i, k in enumerate(L.GEN_KINDS)}
        # cache [Cache]
        self._cache_off = g.region("cache")[0]
        self._cache_sets = g.cache_slot_count // L.CACHE_WAYS
        self._cache_room = g.cache_slot_size - L.CACHE_SLOT_HEADER
        self.cache_room = self._cache_room  # bytes of key + value one cache slot holds (C2)
        self._cache_slot_size = g.cache_slot_size
        self._tags_off = g.region("cache_tags")[0]
        self._tags_i = self._tags_off // 4
        self._hits = self._misses = self._torn = 0
        # counters [Series], [Counters]
        self._series_off = g.region("series")[0]
        self._cells_base = g.region("counters")[0] // 8
        self._local: dict[int, dict[tuple, int]] = {L.KIND_COUNTER: {}, L.KIND_GAUGE: {}, L.KIND_HISTOGRAM: {}}
        self._by_norm: dict[tuple, tuple[int, int]] = {}  # (name, sorted labels) -> (kind, cell)
        self._decoded: list[tuple[int, str, tuple, int, int]] = []  # (kind, name, labels, cell, ncells)
        self._slot_meta_off = g.region("slot_meta")[0]
        self._responses: Responses | None = None

    # ---- life ----------------------------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, size: int | None = None, slots: int = 16, *,
               cache_slot_size: int = L.CACHE_SLOT_SIZE, force: bool = False, responses_size: int = 0) -> Segment:
        """LAYOUT.md [Life]: make the segment, replacing a stale one (its creator is dead); magic word last."""
        _check_name(name)
        g = L.geometry(size, slots, cache_slot_size, responses_size)
        try:
            old = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            old = None
        if old is not None:
            try:
                if old.size >= L.HEADER_SIZE and not force:
                    with mmap.mmap(old.fd, L.HEADER_SIZE) as hm:
                        pid = L.U32.unpack_from(hm, L.H_CREATOR_PID)[0]
                        start = L.U64.unpack_from(hm, L.H_CREATOR_START)[0]
                    if pid and pid != os.getpid() and owner_alive(pid, start):
                        raise LayoutError(f"segment {name} belongs to a running instance (creator pid {pid})")
            finally:
                old.close_fd()
        _unlink_quietly(name)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=g.size)
        try:
            mm = mmap.mmap(shm.fd, g.size)
        finally:
            shm.close_fd()
        w, r = _sem_names(name)
        sems = (posix_ipc.Semaphore(w, posix_ipc.O_CREX, mode=0o600, initial_value=1),
                posix_ipc.Semaphore(r, posix_ipc.O_CREX, mode=0o600, initial_value=1))
        pid = os.getpid()
        seg = cls(name, mm, g)
        _write_header(seg._q, mm, g, pid, proc_start(pid), time.time_ns())
        fence()  # every header field before the magic word (LAYOUT.md [Header] H1)
        seg._q[0] = L.MAGIC | L.MAJOR << 32 | L.MINOR << 48
        seg._sems = sems
        seg._lock = WriterLock(sems[0], sems[1], seg._q, seg._after_takeover)
        return seg

    @classmethod
    def attach(cls, name: str) -> Segment:
        """LAYOUT.md [Life]: map an existing segment; refuse a different major version, naming both."""
        _check_name(name)
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise LayoutError(f"no shared-memory segment named {name}") from None
        try:
            size = shm.size
            if size < L.HEADER_SIZE:
                raise LayoutError(f"segment {name} is {size} bytes, smaller than its header")
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        try:
            word = L.U64.unpack_from(mm, 0)[0]
            magic, major, minor = word & 0xFFFFFFFF, word >> 32 & 0xFFFF, word >> 48
            if magic == 0:
                raise LayoutError(f"segment {name} is not initialised (its creator is still writing it, or died)")
            if magic != L.MAGIC:
                raise LayoutError(f"segment {name} has magic {magic:#010x}, expected {L.MAGIC:#010x}: "
                                  "not a qag segment")
            if major != L.MAJOR:
                raise LayoutError(f"segment {name} has layout version {major}.{minor}, but this shm reads version "
                                  f"{L.MAJOR}.{L.MINOR}: major versions differ; restart the instance")
            fence()  # magic word before the header fields it publishes (H1)
            g = _read_geometry(mm, size)
        except BaseException:
            mm.close()
            raise
        w, r = _sem_names(name)
        try:
            sems = (posix_ipc.Semaphore(w), posix_ipc.Semaphore(r))
        except posix_ipc.ExistentialError:
            mm.close()
            raise LayoutError(f"segment {name} exists but its writer lock {w} does not (a stale, half-removed "
                              "segment)") from None
        seg = cls(name, mm, g)
        seg._sems = sems
        seg._lock = WriterLock(sems[0], sems[1], seg._q, seg._after_takeover)
        return seg

    @classmethod
    def in_buffer(cls, buf: bytearray, slots: int = 2, *, pid: int = 4242, now_ns: int = 1_700_000_000_000_000_000,
                  cache_slot_size: int = L.CACHE_SLOT_SIZE, responses_size: int = 0) -> Segment:
        """A segment formatted in a private buffer with a fixed pid and clock: the golden vectors (shm.vectors)."""
        g = L.geometry(len(buf), slots, cache_slot_size, responses_size)
        seg = cls("(buffer)", buf, g)
        seg._clock = lambda: now_ns
        seg._getpid = lambda: pid
        seg._proc_start = lambda _pid: 0
        _write_header(seg._q, buf, g, pid, 0, now_ns)
        seg._q[0] = L.MAGIC | L.MAJOR << 32 | L.MINOR << 48
        seg._lock = _BufferLock(seg._q, pid, seg._clock)
        return seg

    def close(self) -> None:
        """Unmap (the segment stays for the other processes)."""
        if self._mv is None:
            return
        self._rings.clear()
        self._responses = None
        for view in (self._q, self._d, self._i, self._mv):
            view.release()
        self._mv = None  # type: ignore[assignment]
        if isinstance(self._mm, mmap.mmap):
            self._mm.close()
        for sem in self._sems:
            sem.close()
        self._sems = ()

    def unlink(self) -> None:
        """Remove the names (clean stop); mapped processes keep their mapping until they close."""
        _unlink_quietly(self.name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def version(self) -> str:
        word = self._q[0]
        return f"{word >> 32 & 0xFFFF}.{word >> 48}"

    @property
    def responses(self) -> Responses:
        """The response cache region ([Response cache]); `enabled` is false when the segment has none."""
        r = self._responses
        if r is None:
            off, size = self.geometry.region("responses")
            r = self._responses = Responses(self._mm, self._q, off, size, self._lock, self._getpid, self._clock)
        return r

    def _after_takeover(self) -> None:
        """LAYOUT.md [Writer lock] K4: the dead owner may have left its cache slot odd, or published it
        without its tag or occupancy count; discard or finish it. [Response cache] R14: or a put half done."""
        if self.geometry.region("responses")[1]:
            self.responses.repair()
        q = self._q
        dirty = q[L.L_DIRTY_CACHE_SLOT // 8]
        if dirty:
            slot = dirty - 1
            base = self._cache_off + slot * self._cache_slot_size
            if not self._discard_if_odd(base):
                klen = self._i[(base + L.CS_KEY_LEN) // 4]
                self._i[self._tags_i + slot] = self._i[(base + L.CS_KEY_CRC) // 4] if klen else 0
                self._recount_used()
            q[L.L_DIRTY_CACHE_SLOT // 8] = 0

    # ---- generations [Generations] --------------------------------------------------------------------------

    def gen_index(self, kind: str, ident: str) -> int:
        """The u64 index (offset / 8) of ident's generation slot: callers may keep it and use gen_at()."""
        return self._gen_base[kind] + (_crc32(ident.encode()) & self._gen_mask)

    def gen(self, kind: str, ident: str) -> int:
        return self._q[self._gen_base[kind] + (_crc32(ident.encode()) & self._gen_mask)]

    def gen_at(self, index: int) -> int:
        return self._q[index]

    def global_gen(self) -> int:
        return self._q[L.H_GLOBAL_GEN // 8]

    def bump(self, kind: str, ident: str) -> int:
        """G2: under the writers' lock, slot first, then the global generation; visible to all when this returns."""
        i = self._gen_base[kind] + (_crc32(ident.encode()) & self._gen_mask)
        q = self._q
        with self._lock:
            value = q[i] + 1
            q[i] = value
            fence()
            q[L.H_GLOBAL_GEN // 8] += 1
        return value  # the lock's sem_post is a locked RMW: the stores above are globally visible now

    def bump_all(self) -> None:
        """G4: every slot of every kind, then the global generation, under the writers' lock: every cached entry
        of this segment (a worker's, the plane's) is stale when this returns. For a process that cannot tell
        which changes it missed (the change watcher, qag/server/changes.py)."""
        q = self._q
        with self._lock:
            for base in self._gen_base.values():
                for i in range(base, base + self._gen_mask + 1):
                    q[i] += 1  # one aligned 8-byte store per slot, as G2 (a slice copy may tear a value)
            fence()
            q[L.H_GLOBAL_GEN // 8] += 1

    # ---- cache [Cache] --------------------------------------------------------------------------------------

    def _slot_order(self, crc: int) -> range:
        first = (crc % self._cache_sets) * _WAYS
        return range(first, first + _WAYS)

    def cache_get(self, key: bytes) -> bytes | None:
        """C3/C4: seqlock read, never blocks; a slot being written (or left odd by a dead writer) is a miss."""
        crc = _crc32(key)
        klen = len(key)
        set_ = crc % self._cache_sets
        tags = _TAGS(self._mm, self._tags_off + set_ * L.CACHE_TAG_SET)  # one 32-byte read finds candidates (C5)
        if crc in tags:
            q, u32, mm = self._q, self._i, self._mm
            size, room = self._cache_slot_size, self._cache_room
            first = self._cache_off + set_ * _WAYS * size
            for way, tag in enumerate(tags):
                if tag != crc:
                    continue
                base = first + way * size
                i4, i8 = base >> 2, base >> 3
                for _ in range(CACHE_READ_RETRIES):
                    s1 = q[i8]
                    if s1 & 1:
                        continue
                    if _fence:
                        _fence()
                    k_now = u32[i4 + _KEY_LEN_I]
                    n = k_now + u32[i4 + _VALUE_LEN_I]
                    data = mm[base + _SLOT_HDR:base + _SLOT_HDR + n] if n <= room else b""
                    if _fence:
                        _fence()
                    if q[i8] != s1:
                        continue
                    if n > room or k_now != klen or data[:klen] != key:
                        break  # a consistent slot holding another key (stale tag or crc collision)
                    self._hits += 1
                    return data[klen:]
                else:
                    self._torn += 1
        self._misses += 1
        return None

    def _discard_if_odd(self, base: int) -> bool:
        q, u32 = self._q, self._i
        seq = q[base // 8]
        if not seq & 1:
            return False
        u32[(base + L.CS_KEY_LEN) // 4] = 0
        u32[(base + L.CS_VALUE_LEN) // 4] = 0
        u32[(base + L.CS_KEY_CRC) // 4] = 0
        fence()
        q[base // 8] = seq + 1
        u32[self._tags_i + (base - self._cache_off) // self._cache_slot_size] = 0
        q[L.H_CACHE_REPAIRS // 8] += 1
        self._recount_used()
        return True

    def _recount_used(self) -> None:
        """Rare path (K4): count occupied slots rather than guess what a dead writer had counted."""
        u32 = self._i
        first = self._cache_off // 4 + _KEY_LEN_I
        step = self._cache_slot_size // 4
        self._q[L.H_CACHE_USED // 8] = sum(1 for j in range(self.geometry.cache_slot_count) if u32[first + j * step])

    def cache_put(self, key: bytes, value: bytes) -> bool:
        """C2: under the writers' lock; same key overwrites, else an empty way, else the oldest (FIFO per set)."""
        q, u32, mm = self._q, self._i, self._mm
        klen, vlen = len(key), len(value)
        if klen == 0:
            raise ValueError("cache key must not be empty")
        if klen + vlen > self._cache_room:
            with self._lock:
                q[L.H_CACHE_REJECTS // 8] += 1
            return False
        crc = _crc32(key)
        size = self.geometry.cache_slot_size
        with self._lock:
            target = empty = oldest = -1
            oldest_stamp = 1 << 64
            for slot in self._slot_order(crc):
                base = self._cache_off + slot * size
                self._discard_if_odd(base)  # a dead writer's leftover (K4), found on the way
                n = u32[(base + L.CS_KEY_LEN) // 4]
                if n == 0:
                    if empty < 0:
                        empty = slot
                    continue
                if (n == klen and u32[(base + L.CS_KEY_CRC) // 4] == crc
                        and mm[base + L.CACHE_SLOT_HEADER:base + L.CACHE_SLOT_HEADER + klen] == key):
                    target = slot
                    break
                stamp = q[(base + L.CS_STAMP) // 8]
                if stamp < oldest_stamp:
                    oldest, oldest_stamp = slot, stamp
            filling = False
            if target < 0:
                if empty >= 0:
                    target, filling = empty, True
                else:
                    target = oldest
                    q[L.H_CACHE_EVICTIONS // 8] += 1
            base = self._cache_off + target * size
            puts = q[L.H_CACHE_PUTS // 8] + 1
            q[L.L_DIRTY_CACHE_SLOT // 8] = target + 1
            seq = q[base // 8]
            q[base // 8] = seq + 1  # odd: readers stay out (C1)
            fence()
            L.CACHE_SLOT_FIELDS.pack_into(mm, base + L.CS_KEY_LEN, klen, vlen, puts, self._getpid() & 0xFFFFFFFF, crc)
            start = base + L.CACHE_SLOT_HEADER
            mm[start:start + klen] = key
            mm[start + klen:start + klen + vlen] = value
            fence()
            q[base // 8] = seq + 2  # even again: published
            u32[self._tags_i + target] = crc  # C5: the hint follows the published slot
            q[L.L_DIRTY_CACHE_SLOT // 8] = 0
            q[L.H_CACHE_PUTS // 8] = puts
            if filling:
                q[L.H_CACHE_USED // 8] += 1
        return True

    def cache_stats(self) -> dict[str, int]:
        q, g = self._q, self.geometry
        return {
            "slots": g.cache_slot_count, "slot_size": g.cache_slot_size, "ways": L.CACHE_WAYS,
            "max_entry": self._cache_room, "used": q[L.H_CACHE_USED // 8], "puts": q[L.H_CACHE_PUTS // 8],
            "evictions": q[L.H_CACHE_EVICTIONS // 8], "repairs": q[L.H_CACHE_REPAIRS // 8],
            "rejects": q[L.H_CACHE_REJECTS // 8],
            # this process only: readers write nothing shared (every field has one writer)
            "hits": self._hits, "misses": self._misses, "busy_misses": self._torn,
        }

    # ---- rings [Rings] --------------------------------------------------------------------------------------

    def ring(self, slot: int) -> Ring:
        r = self._rings.get(slot)
        if r is None:
            r = self._rings[slot] = Ring(self, slot)
        return r

    def ring_count(self) -> int:
        return self.slots

    # ---- counters [Series], [Counters] ----------------------------------------------------------------------

    def _sync_series(self) -> None:
        """Decode series entries other processes published since we last looked (S2)."""
        with self._series_mutex:
            self._sync_series_locked()

    def _sync_series_locked(self) -> None:
        count = self._q[L.H_SERIES_COUNT // 8]
        fence()
        mm = self._mm
        for idx in range(len(self._decoded), count):
            off = self._series_off + idx * L.SERIES_ENTRY_SIZE
            cell, ncells, kind, _r, dlen = L.SE_FIELDS.unpack_from(mm, off)
            name, labels = msgpack.unpackb(mm[off + L.SE_DESC:off + L.SE_DESC + dlen], raw=False)
            norm = tuple((k, v) for k, v in labels)
            self._decoded.append((kind, name, norm, cell, ncells))
            self._by_norm[(name, norm)] = (kind, cell)

    def _register(self, kind: int, name: str, labels: tuple) -> int:
        norm = tuple(sorted((str(k), str(v)) for k, v in labels))
        found = self._by_norm.get((name, norm))
        if found is None:
            self._sync_series()
            found = self._by_norm.get((name, norm))
        if found is None:
            q = self._q
            with self._lock:
                self._sync_series()
                found = self._by_norm.get((name, norm))
                if found is None:
                    g = self.geometry
                    count, used = q[L.H_SERIES_COUNT // 8], q[L.H_CELLS_USED // 8]
                    ncells = _HIST_N + 1 if kind == L.KIND_HISTOGRAM else 1
                    if count >= g.series_max or used + ncells > g.cells_per_slot:
                        raise SegmentFull(f"no room for series {name}{dict(norm)}: {count}/{g.series_max} series, "
                                          f"{used}/{g.cells_per_slot} cells used")
                    desc = msgpack.packb([name, [list(p) for p in norm]], use_bin_type=True)
                    if len(desc) > L.SE_DESC_MAX:
                        raise ValueError(f"series {name}{dict(norm)} is {len(desc)} bytes encoded, max {L.SE_DESC_MAX}")
                    off = self._series_off + count * L.SERIES_ENTRY_SIZE
                    self._mm[off:off + L.SERIES_ENTRY_SIZE] = bytes(L.SERIES_ENTRY_SIZE)
                    L.SE_FIELDS.pack_into(self._mm, off, used, ncells, kind, 0, len(desc))
                    self._mm[off + L.SE_DESC:off + L.SE_DESC + len(desc)] = desc
                    q[L.H_CELLS_USED // 8] = used + ncells
                    fence()  # the entry before the count that publishes it (S2)
                    q[L.H_SERIES_COUNT // 8] = count + 1
                    self._sync_series()
                    found = self._by_norm[(name, norm)]
        if found[0] != kind:
            raise ValueError(f"series {name} is a {L.KIND_NAMES[found[0]]}, not a {L.KIND_NAMES[kind]}")
        self._local[kind][(name, labels)] = found[1]
        return found[1]

    def _cell(self, slot: int, kind: int, name: str, labels: tuple) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range 0..{self.slots - 1}")
        cell = self._local[kind].get((name, labels))
        if cell is None:
            cell = self._register(kind, name, labels)
        return self._cells_base + slot * self.geometry.cells_per_slot + cell

    def counter_cell(self, slot: int, name: str, labels: tuple = ()) -> int:
        """The index into cells() of slot's cell of a counter series (registered on first use): a hot writer
        resolves it once and adds to the cell itself, as counter_add does (N1)."""
        return self._cell(slot, L.KIND_COUNTER, name, labels)

    def histogram_cell(self, slot: int, name: str, labels: tuple = ()) -> int:
        """The index into cells() of slot's first cell of a histogram series: bucket i at +i (value <=
        HIST_BOUNDS[i]), the sum at +len(HIST_BOUNDS), as histogram_observe writes them (N2)."""
        return self._cell(slot, L.KIND_HISTOGRAM, name, labels)

    def cells(self) -> memoryview:
        """The segment as f64 cells, for a writer of the cells it located through counter_cell() or
        histogram_cell() (one writer per slot, N1)."""
        return self._d

    def counter_add(self, slot: int, name: str, labels: tuple = (), value: float = 1) -> None:
        """N1: only slot's process writes its cells, from one thread at a time (a load and a store, not an RMW)."""
        i = self._cell(slot, L.KIND_COUNTER, name, labels)
        self._d[i] += value

    def gauge_set(self, slot: int, name: str, labels: tuple = (), value: float = 0) -> None:
        """Gauges are summed over slots like counters, but zeroed when a new process claims the slot."""
        self._d[self._cell(slot, L.KIND_GAUGE, name, labels)] = value

    def gauge_cells(self, name: str, labels: tuple = ()) -> list[float]:
        """One gauge series' value in every slot, in slot order (each slot's cell has its one writer, N1):
        what a cross-process budget, such as a key's rate limit, sums over the slots it counts."""
        i0 = self._cell(0, L.KIND_GAUGE, name, labels)
        step = self.geometry.cells_per_slot
        d = self._d
        return [d[i0 + s * step] for s in range(self.slots)]

    def gauge_cells_bounded(self, name: str, labels: tuple = ()) -> list[float] | None:
        """gauge_cells() of a series named by a caller (a key, a signed-in subject: a set with no bound), or None
        when it is not registered yet and registering it would leave less than a quarter of the series table or
        of a slot's cells: those stay for the instance's own series, which a full table would otherwise fail
        (SegmentFull) for every worker until the segment is made anew."""
        if (name, labels) not in self._local[L.KIND_GAUGE]:
            norm = tuple(sorted((str(k), str(v)) for k, v in labels))
            if (name, norm) not in self._by_norm:
                self._sync_series()
                if (name, norm) not in self._by_norm:
                    g, q = self.geometry, self._q
                    if (g.series_max - q[L.H_SERIES_COUNT // 8] <= g.series_max // 4
                            or g.cells_per_slot - q[L.H_CELLS_USED // 8] <= g.cells_per_slot // 4):
                        return None
        try:
            return self.gauge_cells(name, labels)
        except SegmentFull:
            return None

    def histogram_observe(self, slot: int, name: str, labels: tuple, value: float) -> None:
        """N2: bucket i counts value <= HIST_BOUNDS[i] (non-cumulative), then the sum."""
        i = self._cell(slot, L.KIND_HISTOGRAM, name, labels)
        d = self._d
        d[i + bisect_left(L.HIST_BOUNDS, value)] += 1
        d[i + _HIST_N] += value

    def collect(self) -> list[dict[str, Any]]:
        """Every series summed over all slots (live and dead): what a Prometheus collector renders (N3)."""
        self._sync_series()
        d = self._d
        cps = self.geometry.cells_per_slot
        out: list[dict[str, Any]] = []
        for kind, name, labels, cell, ncells in self._decoded:
            sums = [0.0] * ncells
            for s in range(self.slots):
                b = self._cells_base + s * cps + cell
                for j, v in enumerate(d[b:b + ncells].tolist()):
                    sums[j] += v
            item: dict[str, Any] = {"name": name, "kind": L.KIND_NAMES[kind], "labels": labels}
            if kind == L.KIND_HISTOGRAM:
                acc = 0.0
                buckets = []
                for bound, n in zip(L.HIST_BOUNDS, sums):
                    acc += n
                    buckets.append((bound, acc))
                item.update(buckets=buckets, count=acc, sum=sums[_HIST_N])
            else:
                item["value"] = sums[0]
            out.append(item)
        return out

    def _slot_series(self, slot: int) -> dict[str, float]:
        self._sync_series()
        d = self._d
        b0 = self._cells_base + slot * self.geometry.cells_per_slot
        out = {}
        for kind, name, labels, cell, ncells in self._decoded:
            vals = d[b0 + cell:b0 + cell + ncells].tolist()
            text = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")
            if kind == L.KIND_HISTOGRAM:
                if any(vals[:_HIST_N]):
                    out[text + ":count"] = sum(vals[:_HIST_N])
                    out[text + ":sum"] = vals[_HIST_N]
            elif vals[0]:
                out[text] = vals[0]
        return out

    # ---- slot metadata [Slots] ------------------------------------------------------------------------------

    def set_slot(self, slot: int, role: str, pid: int | None = None) -> None:
        """M1: the process now occupying `slot` says who it is; its gauges restart from zero."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range 0..{self.slots - 1}")
        q = self._q
        b = (self._slot_meta_off + slot * L.SLOT_META_SIZE) // 8
        now = self._clock()
        seq = q[b]
        seq += seq & 1  # a predecessor that died mid-claim left it odd
        q[b] = seq + 1  # odd while the fields change
        fence()
        pid = self._getpid() if pid is None else pid
        q[b + L.SM_PID // 8] = pid
        q[b + L.SM_PROC_START // 8] = self._proc_start(pid)
        q[b + L.SM_ROLE // 8] = L.ROLES[role]
        q[b + L.SM_STARTED_AT_NS // 8] = now
        q[b + L.SM_HEARTBEAT_NS // 8] = now
        q[b + L.SM_HEARTBEAT_VALUE // 8] = 0
        fence()
        q[b] = seq + 2
        self._sync_series()
        base = self._cells_base + slot * self.geometry.cells_per_slot
        for kind, _n, _l, cell, _c in self._decoded:
            if kind == L.KIND_GAUGE:
                self._d[base + cell] = 0.0

    def set_heartbeat(self, slot: int, value: int | None = None) -> None:
        """M2: two independent 8-byte stores; value is role-defined (the recorder's durable position)."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range 0..{self.slots - 1}")
        b = (self._slot_meta_off + slot * L.SLOT_META_SIZE) // 8
        if value is not None:
            self._q[b + L.SM_HEARTBEAT_VALUE // 8] = value
        self._q[b + L.SM_HEARTBEAT_NS // 8] = self._clock()

    def heartbeat_indexes(self, slot: int) -> tuple[int, int]:
        """The u64 indexes (offset / 8) of slot's `heartbeat_ns` and `heartbeat_value`, for gen_at() (M2)."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range 0..{self.slots - 1}")
        b = (self._slot_meta_off + slot * L.SLOT_META_SIZE) // 8
        return b + L.SM_HEARTBEAT_NS // 8, b + L.SM_HEARTBEAT_VALUE // 8

    def words(self) -> memoryview:
        """The segment as u64 words (index = offset / 8), for a hot reader of fixed fields it located through
        gen_index() or heartbeat_indexes(): one item read is one aligned 8-byte load (see Memory ordering)."""
        return self._q

    def heartbeat(self, slot: int) -> tuple[int, int]:
        """(heartbeat_ns, heartbeat_value) of slot: two 8-byte loads, no seqlock (M2)."""
        i_ns, i_value = self.heartbeat_indexes(slot)
        return self._q[i_ns], self._q[i_value]

    def slot_info(self, slot: int) -> dict[str, Any]:
        q = self._q
        b = (self._slot_meta_off + slot * L.SLOT_META_SIZE) // 8
        for _ in range(CACHE_READ_RETRIES):
            s1 = q[b]
            if s1 & 1:
                continue
            fence()
            pid, role, started, start = q[b + 1], q[b + 2], q[b + 3], q[b + 6]
            fence()
            if q[b] == s1:
                break
        else:
            pid, role, started, start = 0, 0, 0, 0
        return {"slot": slot, "pid": pid, "role": L.ROLE_NAMES.get(role, "?"), "started_at_ns": started,
                "heartbeat_ns": q[b + 4], "heartbeat_value": q[b + 5],
                "alive": bool(pid) and owner_alive(pid, start)}

    # ---- introspection (STYLE 12) ---------------------------------------------------------------------------

    def stat(self) -> dict[str, Any]:
        """Everything `qag shm stat` and GET /-/shm show; JSON-ready."""
        q, g = self._q, self.geometry
        gens: dict[str, Any] = {"global": self.global_gen()}
        for kind, base in self._gen_base.items():
            vals = q[base:base + g.gen_slots].tolist()
            gens[kind] = {str(i): v for i, v in enumerate(vals) if v}
        slots = []
        for s in range(self.slots):
            info = self.slot_info(s)
            info["ring"] = self.ring(s).stat()
            info["counters"] = self._slot_series(s)
            slots.append(info)
        return {
            "name": self.name,
            "layout_version": self.version,
            "size": g.size,
            "slots": g.slots,
            "gen_slots": g.gen_slots,
            "created_at_ns": q[L.H_CREATED_AT_NS // 8],
            "creator_pid": self._i[L.H_CREATOR_PID // 4],
            "regions": {n: {"offset": o, "size": sz} for n, (o, sz) in zip(L.REGION_NAMES, g.regions)},
            "generations": gens,
            "cache": self.cache_stats(),
            "responses": self.responses.stats(),
            "series": {"count": q[L.H_SERIES_COUNT // 8], "max": g.series_max,
                       "cells_used": q[L.H_CELLS_USED // 8], "cells_per_slot": g.cells_per_slot},
            "lock": {"owner_pid": q[L.L_OWNER_PID // 8], "acquisitions": q[L.L_SEQ // 8],
                     "takeovers": q[L.L_RECOVERIES // 8], "dirty_cache_slot": q[L.L_DIRTY_CACHE_SLOT // 8]},
            "process_slots": slots,
        }


__all__ = ["LayoutError", "LockTimeout", "Segment", "SegmentFull", "segment_name"]
