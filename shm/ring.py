"""One single-producer/single-consumer byte ring per process slot (LAYOUT.md [Rings]).

Positions are monotonically increasing u64 byte counts; offset = position & (capacity - 1). A record
is an 8-byte word (length | crc32 << 32) and the payload padded to 8 bytes; the word is stored after
the payload and `head` after the word, so a consumer that loaded `head` sees whole records only.
"""
from __future__ import annotations

import time
import zlib
from typing import Any, Protocol

from . import layout as L
from .fence import fence

_MASK32 = 0xFFFFFFFF
_PAD_WORD = L.PAD_LENGTH  # crc 0


class RingError(RuntimeError):
    """A position outside [tail, head] or a record that fails its checksum (a layout violation)."""


class SegmentView(Protocol):
    """What a ring reads of the segment it lives in: shm/segment.py's Segment, which makes the rings (so the
    ring does not import it back)."""

    slots: int
    geometry: L.Geometry
    _mm: Any
    _q: memoryview


class Ring:
    """A view of ring `slot`; cheap to make, holds no state of its own beyond offsets."""

    __slots__ = ("_base", "_cap", "_data", "_head_i", "_mask", "_max_record", "_mm", "_q", "_tail_i", "slot")

    def __init__(self, seg: SegmentView, slot: int) -> None:
        if not 0 <= slot < seg.slots:
            raise IndexError(f"ring slot {slot} out of range 0..{seg.slots - 1}")
        g = seg.geometry
        self.slot = slot
        self._mm = seg._mm
        self._q = seg._q
        self._base = g.region("rings")[0] + slot * g.ring_stride
        self._data = self._base + L.RING_HEADER_SIZE
        self._head_i = (self._base + L.R_HEAD) // 8
        self._tail_i = (self._base + L.R_TAIL) // 8
        self._cap = g.ring_capacity
        self._mask = g.ring_capacity - 1
        self._max_record = g.ring_capacity // 2 - L.RECORD_HEADER

    @property
    def head(self) -> int:
        return self._q[self._head_i]

    @property
    def tail(self) -> int:
        return self._q[self._tail_i]

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def max_record(self) -> int:
        return self._max_record

    def push(self, record: bytes, wait_ms: int = 0) -> bool:
        """Producer only. False when the ring stayed full for wait_ms (the caller counts the record lost)."""
        n = len(record)
        if not 0 < n <= self._max_record:
            raise ValueError(f"ring record must be 1..{self._max_record} bytes, got {n}")
        q = self._q
        rl = L.RECORD_HEADER + ((n + 7) & ~7)
        head = q[self._head_i]
        off = head & self._mask
        contiguous = self._cap - off
        need = rl if rl <= contiguous else contiguous + rl
        if need > self._cap - (head - q[self._tail_i]) and not self._wait(head, need, wait_ms):
            return False
        mm = self._mm
        if rl > contiguous:  # no record straddles the end: a pad word sends the consumer to offset 0
            q[(self._data + off) // 8] = _PAD_WORD
            head += contiguous
            off = 0
        start = self._data + off
        mm[start + 8:start + 8 + n] = record
        fence()  # payload before its length word (LAYOUT.md [Rings] R2)
        q[start // 8] = n | zlib.crc32(record) << 32
        fence()  # length word before head (R3)
        q[self._head_i] = head + rl
        return True

    def _wait(self, head: int, need: int, wait_ms: int) -> bool:
        if wait_ms <= 0:
            return False
        deadline = time.monotonic() + wait_ms / 1000.0
        pause = 0.0001
        while True:
            if need <= self._cap - (head - self._q[self._tail_i]):
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.002)

    def read(self, max_records: int) -> list[tuple[int, bytes]]:
        """Consumer: up to max_records committed records from tail, not consumed; (position after it, payload)."""
        return self.read_from(self._q[self._tail_i], max_records)

    def read_from(self, pos: int, max_records: int) -> list[tuple[int, bytes]]:
        q = self._q
        head = q[self._head_i]
        fence()  # head before the records it covers (R4)
        tail = q[self._tail_i]
        if not tail <= pos <= head:
            raise RingError(f"ring {self.slot}: position {pos} outside [tail {tail}, head {head}]")
        mm = self._mm
        mask = self._mask
        out: list[tuple[int, bytes]] = []
        while pos < head and len(out) < max_records:
            off = pos & mask
            word = q[(self._data + off) // 8]
            n = word & _MASK32
            if n == L.PAD_LENGTH:
                pos += self._cap - off
                continue
            if not 0 < n <= self._max_record:
                raise RingError(f"ring {self.slot}: bad record length {n} at position {pos}")
            start = self._data + off + 8
            payload = mm[start:start + n]
            if zlib.crc32(payload) != word >> 32:
                raise RingError(f"ring {self.slot}: record at position {pos} fails its crc32")
            pos += 8 + ((n + 7) & ~7)
            out.append((pos, payload))
        return out

    def release(self, pos: int) -> None:
        """Consumer only: everything before pos is consumed and may be overwritten."""
        q = self._q
        tail, head = q[self._tail_i], q[self._head_i]
        if not tail <= pos <= head:
            raise RingError(f"ring {self.slot}: release({pos}) outside [tail {tail}, head {head}]")
        fence()  # our reads of the records before the store that lets the producer reuse them (R5)
        q[self._tail_i] = pos

    def stat(self) -> dict:
        head, tail = self.head, self.tail
        return {"slot": self.slot, "head": head, "tail": tail, "used": head - tail, "capacity": self._cap}
