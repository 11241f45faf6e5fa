"""Event ids: (milliseconds since 2025-01-01 UTC) << 11 | sequence, unique, increasing, < 2**53.

42 bits of milliseconds last until 2164; 11 bits allow 2,048 ids per millisecond before an id borrows
the next millisecond (ids stay increasing and at most a few ms ahead of the clock under bursts).
"""
from __future__ import annotations

import threading
import time

EPOCH_MS = 1735689600000  # 2025-01-01T00:00:00Z
SEQ_BITS = 11
MAX_ID = (1 << 53) - 1
MS_PER_DAY = 86_400_000


def id_floor(epoch_ms: int) -> int:
    """The smallest id that can be minted at `epoch_ms` (no id minted before it is >= this)."""
    return max(0, epoch_ms - EPOCH_MS) << SEQ_BITS


def id_ms(event_id: int) -> int:
    """Epoch milliseconds of the clock reading an id was minted from (or borrowed ahead of)."""
    return (event_id >> SEQ_BITS) + EPOCH_MS


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class IdClock:
    """Mints blocks of ids: first = max(last + stride, id_floor(now) + writer), so ids never repeat or
    go back even when the wall clock steps back (they then run ahead of it until it catches up).

    Several writers sharing one store without a common lock (ClickHouse recorders on several hosts)
    each take every `writers`-th id: writer w mints only ids equal to w modulo `writers` (a power of
    two up to 16), 2048 / writers ids per millisecond, as an arithmetic progression of step
    `writers` that runs straight across millisecond boundaries. One writer: stride 1."""

    __slots__ = ("_clock", "_lock", "last", "stride", "writer")

    def __init__(self, last: int = 0, clock=now_ms, writer: int = 0, writers: int = 1):
        if writers not in (1, 2, 4, 8, 16) or not 0 <= writer < writers:
            raise ValueError("writers must be 1, 2, 4, 8 or 16, and writer in 0..writers-1")
        self.stride = writers
        self.writer = writer
        # resume on this writer's own progression, above every id already stored
        self.last = last - (last - writer) % writers if last else 0
        self._lock = threading.Lock()
        self._clock = clock

    def take(self, n: int) -> int:
        """Reserve `n` ids: first, first + stride, ... first + stride * (n - 1). Returns the first."""
        with self._lock:
            first = id_floor(self._clock()) + self.writer
            if self.last and self.last + self.stride > first:
                first = self.last + self.stride
            last = first + self.stride * (n - 1)
            if last > MAX_ID:
                raise OverflowError("event ids exhausted (2**53)")
            self.last = last
            return first
