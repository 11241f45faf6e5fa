"""The response cache: region `responses` of the segment (shm/LAYOUT.md [Response cache], rules R1-R16).

A log of records in an arena used as a circle, a write position that only increases, and an index of 8-way
buckets from a key's hash to the position of its newest record. Readers (`get`) never lock and write nothing but
an advisory hit count; writers (`put`, `remove`, `claim`, `release`) hold the segment's writers' lock. The key
encoding (R5) is `prefix()` + `suffix()`, the same bytes the Rust plane builds.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import struct
import time
from typing import Any, NamedTuple

from . import layout as L
from .fence import MODE as FENCE_MODE
from .fence import fence

_fence = None if FENCE_MODE == "none" else fence
_sha256 = hashlib.sha256
_U16, _U32, _U64, _I64, _F64 = (struct.Struct(f) for f in ("<H", "<I", "<Q", "<q", "<d"))
_HDR = L.RESP_RECORD  # magic, length, key_hash, key_len, body_len, created, expires, ttl_s, rows, flags, pid, etag
_HASHES = struct.Struct("<" + "Q24x" * L.RESP_WAYS).unpack_from  # the 8 ways' `hash` of one bucket, one read
_H = L.RESP_RECORD_HEADER
_INT_MIN, _INT_MAX = -(2 ** 63), 2 ** 63 - 1
_tokens = itertools.count(1)


class Record(NamedTuple):
    """A record R9 found, with where it was (for R11 and R16)."""

    body: bytes
    rows: int
    has_more: bool
    etag: str          # the ETag header's value, quotes included
    ttl_s: int
    created_at_ns: int
    expires_at_ns: int
    pos: int
    way: int           # u64 index of its index way (for R16)
    stale: bool        # expired (R10)
    old: bool          # in the older half of the arena (R11)


# -- the key (R5, R6) ---------------------------------------------------------------------------------------------
def prefix(query: str, version: int, connection: str, query_gen: int, connection_gen: int,
           fingerprint: bytes) -> bytes:
    """R5's prefix: what the plan fixes (its entry carries it as `response_prefix`)."""
    if len(fingerprint) != 16:
        raise ValueError("the masking fingerprint is 16 bytes")
    q, c = query.encode(), connection.encode()
    return b"".join((b"r1", _U16.pack(len(q)), q, _U64.pack(version), _U16.pack(len(c)), c,
                     _U64.pack(query_gen), _U64.pack(connection_gen), fingerprint))


def suffix(fmt: str, page: int, page_size: int, args) -> bytes | None:
    """R5's suffix: format, page, page size and the bound arguments; None when a value has no encoding (the call
    is then answered without the cache)."""
    f = fmt.encode()
    if not (0 <= page < 1 << 64 and 0 <= page_size < 1 << 64 and len(f) < 256 and len(args) < 1 << 16):
        return None
    out = [bytes((len(f),)), f, _U64.pack(page), _U64.pack(page_size), _U16.pack(len(args))]
    for a in args:
        t = type(a)
        if a is None:
            out.append(b"\x00")
        elif t is bool:
            out.append(b"\x02" if a else b"\x01")
        elif t is int:
            if not _INT_MIN <= a <= _INT_MAX:
                return None
            out.append(b"\x03" + _I64.pack(a))
        elif t is float:
            out.append(b"\x04" + _F64.pack(a))
        elif t is str:
            b = a.encode()
            out.append(b"\x05" + _U32.pack(len(b)) + b)
        else:
            return None
    return b"".join(out)


def key_hash(key: bytes) -> int:
    """R6: the first 8 bytes of sha256(key), little-endian; 0 is 1."""
    return int.from_bytes(_sha256(key).digest()[:8], "little") or 1


def decode_key(key: bytes) -> dict[str, Any] | None:
    """The fields of an R5 key (for GET /api/v1/cache); None when it is not one."""
    try:
        if key[:2] != b"r1":
            return None
        i = 2
        n = _U16.unpack_from(key, i)[0]
        query = key[i + 2:i + 2 + n].decode()
        i += 2 + n
        version = _U64.unpack_from(key, i)[0]
        i += 8
        n = _U16.unpack_from(key, i)[0]
        connection = key[i + 2:i + 2 + n].decode()
        i += 2 + n + 16 + 16
        fingerprint = key[i - 16:i].hex()
        n = key[i]
        fmt = key[i + 1:i + 1 + n].decode()
        i += 1 + n
        page, page_size = _U64.unpack_from(key, i)[0], _U64.unpack_from(key, i + 8)[0]
        return {"query": query, "version": version, "connection": connection, "format": fmt, "page": page,
                "page_size": page_size, "masking": fingerprint}
    except (IndexError, struct.error, UnicodeDecodeError):
        return None


def geometry(size: int) -> dict[str, int]:
    """R1: the region's parts from its size (0: no response cache)."""
    if size == 0:
        return {"capacity": 0, "arena_offset": 0, "index_offset": 0, "index_buckets": 0, "index_ways": 0,
                "max_record": 0, "fill_slots": 0, "fill_offset": 0}
    if size % L.PAGE or size < L.RESP_MIN_SIZE:
        raise ValueError(f"the response cache region is 0 or a multiple of {L.PAGE} of at least "
                         f"{L.RESP_MIN_SIZE} bytes, not {size}")
    buckets = 1 << ((size // L.PAGE).bit_length() - 1)
    arena = L.PAGE + L._round_up(buckets * L.RESP_WAYS * L.RESP_WAY_SIZE, L.PAGE)
    capacity = size - arena
    return {"capacity": capacity, "arena_offset": arena, "index_offset": L.PAGE, "index_buckets": buckets,
            "index_ways": L.RESP_WAYS, "max_record": min(capacity // 8 // 8 * 8, L.RESP_MAX_RECORD),
            "fill_slots": L.RESP_FILL_SLOTS, "fill_offset": L.RESP_FILL_OFFSET}


def write_header(buf, offset: int, size: int) -> None:
    """R1/R2: the creator's fields (before the segment's magic word)."""
    g = geometry(size)
    if not size:
        return
    for off, name in L.RESP_HEADER_FIELDS:
        _U64.pack_into(buf, offset + off, g[name])


def record_length(key_len: int, body_len: int) -> int:
    return (_H + key_len + body_len + 7) // 8 * 8


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Responses:
    """The region of one mapped segment (or of a private buffer: `Responses.private`)."""

    def __init__(self, mm, q: memoryview, offset: int, size: int, lock, getpid=os.getpid, clock=time.time_ns):
        self._mm, self._q, self._lock = mm, q, lock
        self._getpid, self._clock = getpid, clock
        self.offset, self.size = offset, size
        self.enabled = size > 0
        u = lambda off: q[(offset + off) // 8]  # noqa: E731
        self.capacity = u(0) if size else 0
        self.arena = offset + (u(8) if size else 0)
        self.index = offset + (u(16) if size else 0)
        self.buckets = u(24) if size else 0
        self.max_record = u(40) if size else 0
        self.fill_slots = u(48) if size else 0
        self.fills = offset + (u(56) if size else 0)
        self._bmask = self.buckets - 1
        self._wpos = (offset + L.RESP_WPOS) // 8
        self._wlimit = (offset + L.RESP_WLIMIT) // 8
        self._f = {name: (offset + off) // 8 for off, name in L.RESP_STATS}
        self._index_q = self.index // 8

    @classmethod
    def private(cls, size: int) -> Responses:
        """A region in this process's memory, for an app without a segment (tests, in-process tools)."""
        import threading
        buf = bytearray(size + 8)
        q = memoryview(buf).cast("Q")
        write_header(buf, 0, size)
        return cls(buf, q, 0, size, threading.Lock())

    # -- R9: read ----------------------------------------------------------------------------------------------
    def get(self, key: bytes, h: int, now_ns: int | None = None) -> Record | None:
        """R9/R10: the newest valid record of key (fresh or expired), or None. Never blocks, never retries."""
        if not self.buckets:
            return None
        q = self._q
        b_off = self.index + (h & self._bmask) * (L.RESP_WAYS * L.RESP_WAY_SIZE)
        hashes = _HASHES(self._mm, b_off)
        if h not in hashes:
            return None
        for w, hv in enumerate(hashes):
            if hv != h:
                continue
            wi = (b_off >> 3) + 4 * w
            rec = self.read_at(q[wi + 1], key, wi, now_ns)
            if rec is not None:
                return rec
        return None

    def read_at(self, p: int, key: bytes, wi: int = 0, now_ns: int | None = None) -> Record | None:
        """R9 steps 2-4 at position p: the record there if it is key's and no byte of it was overwritten."""
        q, mm, cap = self._q, self._mm, self.capacity
        wpos = q[self._wpos]
        if p & 7 or p + _H > wpos or p + cap < wpos:
            return None
        a = self.arena + p % cap
        (magic, length, _kh, kl, bl, created, expires, ttl_s, rows, flags, _pid, etag) = _HDR.unpack_from(mm, a)
        if (magic != L.RESP_MAGIC or length & 7 or not _H + kl + bl <= length <= self.max_record
                or p % cap + length > cap or p + length > wpos or kl != len(key)):
            return None
        data = mm[a + _H:a + _H + kl + bl]
        if _fence:
            _fence()
        if q[self._wlimit] > p + cap or data[:kl] != key:
            return None
        now = self._clock() if now_ns is None else now_ns
        return Record(bytes(data[kl:]), rows, bool(flags & 1), f'"{etag.hex()}"', ttl_s, created, expires, p, wi,
                      now >= expires, p + cap // 2 < wpos)

    def hit(self, rec: Record) -> None:
        """R16: an advisory count on the record's way (a plain load and store)."""
        self._q[rec.way + 2] += 1

    # -- R7: write ---------------------------------------------------------------------------------------------
    def put(self, key: bytes, h: int, body: bytes, *, rows: int, has_more: bool, ttl_s: int, etag: bytes,
            created_at_ns: int | None = None) -> bool:
        """R7: store an answer; False (rejects + 1) when its record exceeds max_record or there is no region."""
        if not self.buckets:
            return False
        n = record_length(len(key), len(body))
        if n > self.max_record or len(key) > 0xFFFFFFFF:
            with self._lock:
                self._q[self._f["rejects"]] += 1
            return False
        created = self._clock() if created_at_ns is None else created_at_ns
        head = _HDR.pack(L.RESP_MAGIC, n, h, len(key), len(body), created, created + ttl_s * 1_000_000_000, ttl_s,
                         rows, 1 if has_more else 0, self._getpid() & 0xFFFFFFFF, etag)
        with self._lock:
            self._write(key, h, head, body, n, 0)
        return True

    def refresh(self, key: bytes, h: int, rec: Record) -> bool:
        """R11: re-append a record served from the older half, with its hits, so a used entry is not lapped."""
        if not rec.old:
            return False
        with self._lock:
            cur = self._find(key, h)
            if cur is None or cur[1] != rec.pos:
                return False  # replaced or gone meanwhile
            wi, p = cur
            q, cap = self._q, self.capacity
            a = self.arena + p % cap
            length = _U32.unpack_from(self._mm, a + 4)[0]
            raw = bytes(self._mm[a:a + length])
            hits = q[wi + 2]
            self._write(key, h, raw[:_H], raw[_H + len(key):], length, hits, refresh=True)
            return True

    def _write(self, key: bytes, h: int, head: bytes, body: bytes, n: int, hits: int, refresh: bool = False) -> None:
        q, mm, cap, f = self._q, self._mm, self.capacity, self._f
        q[f["dirty"]] = 1
        cur = self._find(key, h)                                    # 1. the key's current record
        if cur is not None:
            self._clear(cur[0], cur[1])
        w = q[self._wpos]                                          # 2. where it goes
        start = w if cap - w % cap >= n else w - w % cap + cap
        end = start + n
        self._advance_tail(end - cap)                              # 3. room
        q[self._wlimit] = end                                      # 4. reserve, then a Release fence
        fence()
        if start != w:                                             # 5. pad to the lap's end, then the bytes
            self._pad(w, start - w)
        a = self.arena + start % cap
        mm[a:a + _H] = head
        mm[a + _H:a + _H + len(key)] = key
        mm[a + _H + len(key):a + _H + len(key) + len(body)] = body
        pad = n - _H - len(key) - len(body)
        if pad:
            mm[a + n - pad:a + n] = bytes(pad)
        fence()
        q[self._wpos] = end                                        # 6. published
        b_off = self.index + (h & self._bmask) * (L.RESP_WAYS * L.RESP_WAY_SIZE)  # 7. indexed
        base = b_off >> 3
        way = None
        for w_ in range(L.RESP_WAYS):
            if q[base + 4 * w_] == 0:
                way = w_
                break
        if way is None:
            for w_ in range(L.RESP_WAYS):
                if q[base + 4 * w_ + 1] < end - cap:
                    way = w_
                    break
        if way is None:
            way = min(range(L.RESP_WAYS), key=lambda i: q[base + 4 * i + 1])
            self._clear(base + 4 * way, q[base + 4 * way + 1])
            q[f["evictions"]] += 1
        wi = base + 4 * way
        q[wi] = 0
        q[wi + 1] = start
        q[wi + 2] = hits
        q[wi] = h
        q[f["live_bytes"]] += n
        q[f["live_entries"]] += 1
        q[f["puts"]] += 1
        if refresh:
            q[f["refreshes"]] += 1
        q[f["dirty"]] = 0

    def _pad(self, pos: int, length: int) -> None:
        a = self.arena + pos % self.capacity
        self._mm[a:a + 8] = _U32.pack(L.RESP_PAD_MAGIC) + _U32.pack(length)

    def _clear(self, wi: int, pos: int) -> None:
        """Drop an indexed record's way and its share of the totals (the caller counts why)."""
        q = self._q
        length = _U32.unpack_from(self._mm, self.arena + pos % self.capacity + 4)[0]
        q[wi] = 0
        q[wi + 1] = 0
        q[self._f["live_bytes"]] -= min(length, q[self._f["live_bytes"]])
        if q[self._f["live_entries"]]:
            q[self._f["live_entries"]] -= 1

    def _find(self, key: bytes, h: int) -> tuple[int, int] | None:
        """(way index, pos) of key's indexed, valid record (the lock holder's R9 steps 2-4)."""
        q = self._q
        base = (self.index + (h & self._bmask) * (L.RESP_WAYS * L.RESP_WAY_SIZE)) >> 3
        for w in range(L.RESP_WAYS):
            wi = base + 4 * w
            if q[wi] != h:
                continue
            p = q[wi + 1]
            if self._valid(p) and self._key_at(p) == key:
                return wi, p
        return None

    def _valid(self, p: int) -> bool:
        q, cap = self._q, self.capacity
        wpos = q[self._wpos]
        if p & 7 or p + _H > wpos or p + cap < q[self._wlimit]:
            return False
        a = self.arena + p % cap
        magic, length, _kh, kl, bl = _HDR.unpack_from(self._mm, a)[:5]
        return (magic == L.RESP_MAGIC and not length & 7 and _H + kl + bl <= length <= self.max_record
                and p % cap + length <= cap and p + length <= wpos)

    def _key_at(self, p: int) -> bytes:
        a = self.arena + p % self.capacity
        kl = _U32.unpack_from(self._mm, a + 16)[0]
        return bytes(self._mm[a + _H:a + _H + kl])

    def _advance_tail(self, upto: int) -> None:
        """R8: walk the oldest records out of the way of a write reaching `upto + capacity`."""
        q, mm, cap, f = self._q, self._mm, self.capacity, self._f
        tail = q[f["tail"]]
        while tail < upto:
            o = tail % cap
            a = self.arena + o
            magic, length = _U32.unpack_from(mm, a)[0], _U32.unpack_from(mm, a + 4)[0]
            if magic == L.RESP_PAD_MAGIC and length and not length & 7 and o + length <= cap:
                tail += length
            elif magic == L.RESP_MAGIC and length and not length & 7 and o + length <= cap:
                h = _U64.unpack_from(mm, a + 8)[0]
                base = (self.index + (h & self._bmask) * (L.RESP_WAYS * L.RESP_WAY_SIZE)) >> 3
                for w in range(L.RESP_WAYS):
                    wi = base + 4 * w
                    if q[wi] == h and q[wi + 1] == tail:
                        self._clear(wi, tail)
                        q[f["evictions"]] += 1
                        break
                tail += length
            else:
                tail += cap - o
            q[f["tail"]] = tail

    # -- R12: removal ------------------------------------------------------------------------------------------
    def entries(self) -> list[dict[str, Any]]:
        """Every indexed, valid record, decoded (for GET /api/v1/cache); lock-free, best effort."""
        out = []
        if not self.buckets:
            return out
        q, mm, cap = self._q, self._mm, self.capacity
        now = self._clock()
        for slot in range(self.buckets * L.RESP_WAYS):
            wi = self._index_q + 4 * slot
            h = q[wi]
            if not h:
                continue
            p = q[wi + 1]
            if not self._valid(p):
                continue
            a = self.arena + p % cap
            (_m, length, _kh, kl, bl, created, expires, ttl_s, rows, _fl, _pid, etag) = _HDR.unpack_from(mm, a)
            key = bytes(mm[a + _H:a + _H + kl])
            if q[self._wlimit] > p + cap:
                continue
            fields = decode_key(key) or {}
            out.append({**fields, "bytes": length, "body_bytes": bl, "rows": rows,
                        "age_s": round(max(0, now - created) / 1e9, 3),
                        "ttl_left_s": round(max(0, expires - now) / 1e9, 3), "ttl_s": ttl_s,
                        "hits": q[wi + 2], "etag": f'"{etag.hex()}"', "_way": wi, "_pos": p, "_key": key})
        return out

    def remove(self, match=None) -> int:
        """R12: drop every indexed record whose decoded key satisfies `match(fields)` (all when None)."""
        if not self.buckets:
            return 0
        q, f = self._q, self._f
        n = 0
        with self._lock:
            q[f["dirty"]] = 1
            for e in self.entries():
                if match is None or match(e):
                    if q[e["_way"] + 1] == e["_pos"]:
                        self._clear(e["_way"], e["_pos"])
                        q[f["removals"]] += 1
                        n += 1
            q[f["dirty"]] = 0
        return n

    # -- R13: fills --------------------------------------------------------------------------------------------
    def claim(self, h: int, limit_s: float) -> tuple[int, int]:
        """R13: (token, 0) when this caller fills key h; (0, slot index) when another live caller does."""
        if not self.fill_slots:
            return 0, 0
        q = self._q
        i = (self.fills >> 3) + 4 * (h % self.fill_slots)
        now = self._clock()
        with self._lock:
            held_h, pid, _tok, until = q[i], q[i + 1], q[i + 2], q[i + 3]
            if held_h and until > now and _alive(pid):
                return (0, i) if held_h == h else (-1, 0)  # -1: the slot is another key's: fill without a claim
            token = next(_tokens)
            q[i] = h
            q[i + 1] = self._getpid()
            q[i + 2] = token
            q[i + 3] = now + int((limit_s + 1) * 1e9)
            return token, 0

    def filling(self, h: int, slot: int) -> bool:
        """Whether the claim a waiter saw in `slot` still stands (R13): same key, live pid, not past until_ns."""
        q = self._q
        return q[slot] == h and q[slot + 3] > self._clock() and _alive(q[slot + 1])

    def release(self, h: int, token: int) -> None:
        if token <= 0 or not self.fill_slots:
            return
        q = self._q
        i = (self.fills >> 3) + 4 * (h % self.fill_slots)
        with self._lock:
            if q[i] == h and q[i + 2] == token and q[i + 1] == self._getpid():
                q[i] = q[i + 1] = q[i + 2] = q[i + 3] = 0

    # -- R14: repair -------------------------------------------------------------------------------------------
    def repair(self) -> bool:
        """R14, by the lock holder after a takeover: pads over a killed writer's reservation, ways that no longer
        name a valid record cleared, the totals recounted."""
        if not self.buckets:
            return False
        q, f, cap = self._q, self._f, self.capacity
        if not q[f["dirty"]]:
            return False
        pos, limit = q[self._wpos], q[self._wlimit]
        while pos < limit:
            n = min(cap - pos % cap, limit - pos)
            self._pad(pos, n)
            pos += n
        fence()
        q[self._wpos] = limit
        live = count = 0
        for slot in range(self.buckets * L.RESP_WAYS):
            wi = self._index_q + 4 * slot
            if not q[wi]:
                continue
            p = q[wi + 1]
            if self._valid(p) and key_hash(self._key_at(p)) == q[wi]:
                live += _U32.unpack_from(self._mm, self.arena + p % cap + 4)[0]
                count += 1
            else:
                q[wi] = q[wi + 1] = 0
        q[f["live_bytes"]], q[f["live_entries"]] = live, count
        q[f["repairs"]] += 1
        q[f["dirty"]] = 0
        return True

    def stats(self) -> dict[str, int]:
        q = self._q
        out = {"capacity": self.capacity, "max_record": self.max_record, "index_slots": self.buckets * L.RESP_WAYS}
        if not self.buckets:
            return {**out, **{name: 0 for _off, name in L.RESP_STATS}, "wpos": 0}
        out.update({name: q[i] for name, i in self._f.items()})
        out["wpos"] = q[self._wpos]
        return out
