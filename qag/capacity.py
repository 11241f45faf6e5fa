"""Capacity: bounds on what a few callers may hold open: streams and event subscriptions per key and per instance, calls
in flight per data connection (issue 13, "a few clients must not take the instance down").

Each worker counts its own opens under a lock and publishes them in its slot's gauge cells of the shared
segment (one writer per cell, shm/LAYOUT.md N1), so a limit "per instance" sums every worker's cells. Two
workers deciding in the same microsecond may let one more through, never a whole worker's share.
"""
from __future__ import annotations

import threading

from qag.errors import ApiError
from shm.fence import fence

RETRY_AFTER_S = 1


class OpenCount:
    """Open things of one kind (`stream`, `subscriber`): at most `per_key` of one key and `total` on the instance
    (0: unbounded). `acquire` raises 503 `too_many_streams` with Retry-After; every acquire is paired with one
    `release`."""

    def __init__(self, kind: str, per_key: int, total: int, segment=None, slot: int = 0):
        self.kind = kind
        self.per_key = per_key
        self.total = total
        self.segment = segment if segment is not None and hasattr(segment, "gauge_cells") else None
        self.slot = slot
        self.lock = threading.Lock()
        self.mine: dict[str, int] = {}
        self.mine_total = 0
        self._name = "qag_open_" + kind + "s"
        self._all = (("scope", "instance"),)

    def _others(self, labels: tuple, mine: int) -> float:
        """What the other workers hold: the sum over slots, less this worker's own cell (a key's: none known when
        the segment has no room for its series, caller_cells)."""
        if self.segment is None:
            return 0
        cells = caller_cells(self.segment, self._name, labels) if labels is not self._all \
            else self.segment.gauge_cells(self._name, labels)
        return sum(cells) - cells[self.slot] if cells else 0

    def _publish(self, key: str) -> None:
        if self.segment is not None:
            labels = (("key", key),)
            if caller_cells(self.segment, self._name, labels) is not None:
                self.segment.gauge_set(self.slot, self._name, labels, self.mine.get(key, 0))
            self.segment.gauge_set(self.slot, self._name, self._all, self.mine_total)

    def acquire(self, key: str) -> None:
        with self.lock:
            mine = self.mine.get(key, 0)
            if self.per_key and mine + self._others((("key", key),), mine) >= self.per_key:
                raise self._refuse(f"This key has {self.per_key} open {self.kind}s, its limit")
            if self.total and self.mine_total + self._others(self._all, self.mine_total) >= self.total:
                raise self._refuse(f"This server has {self.total} open {self.kind}s, its limit")
            self.mine[key] = mine + 1
            self.mine_total += 1
            self._publish(key)

    def release(self, key: str) -> None:
        with self.lock:
            n = self.mine.get(key, 0) - 1
            if n > 0:
                self.mine[key] = n
            else:
                self.mine.pop(key, None)
            self.mine_total = max(0, self.mine_total - 1)
            self._publish(key)

    def open(self, key: str | None = None) -> int:
        with self.lock:
            return self.mine.get(key, 0) if key is not None else self.mine_total

    def _refuse(self, why: str) -> ApiError:
        return ApiError(503, "too_many_streams", f"{why}; close one or retry in {RETRY_AFTER_S} s.",
                        {"retry_after": RETRY_AFTER_S}, {"Retry-After": str(RETRY_AFTER_S)})


class InFlight:
    """Calls in flight per data connection in this worker (QAG_CONNECTION_CALLS; 0: unbounded): one slow
    database cannot take every thread from the others. More get 503 `busy` with Retry-After."""

    def __init__(self, bound: int):
        self.bound = bound
        self.lock = threading.Lock()
        self.calls: dict[str, int] = {}

    def acquire(self, name: str) -> None:
        if not self.bound:
            return
        with self.lock:
            n = self.calls.get(name, 0)
            if n >= self.bound:
                raise ApiError(503, "busy", f"The connection '{name}' has {self.bound} calls in flight in this "
                               f"worker, its limit; retry in {RETRY_AFTER_S} s.",
                               {"retry_after": RETRY_AFTER_S}, {"Retry-After": str(RETRY_AFTER_S)})
            self.calls[name] = n + 1

    def release(self, name: str) -> None:
        if not self.bound:
            return
        with self.lock:
            n = self.calls.get(name, 0) - 1
            if n > 0:
                self.calls[name] = n
            else:
                self.calls.pop(name, None)


class CallerCalls:
    """A caller's `max_concurrent` (a key's or a role's grant): its calls in flight at once across every worker of
    the host, from authentication until the answer's last byte (a stream holds its place while it streams).

    Each worker publishes its own count per caller in its slot's gauge cell `qag_caller_calls_in_flight` (one
    writer per cell, shm/LAYOUT.md N1); the host's count is the sum over slots. A worker that dies holding calls
    frees them when the arbiter restarts a worker into its slot: claiming a slot zeroes its gauges (M1).
    A call is admitted by publishing first and summing after, so two workers deciding at once may both refuse
    one, but the sum never passes the limit. Over it: 429 `too_many_concurrent` with Retry-After."""

    NAME = "qag_caller_calls_in_flight"

    def __init__(self, segment=None, slot: int = 0):
        self.segment = segment if segment is not None and hasattr(segment, "gauge_cells") else None
        self.slot = slot
        self.lock = threading.Lock()
        self.mine: dict[str, int] = {}

    def acquire(self, caller: str, limit: int) -> None:
        with self.lock:
            n = self.mine.get(caller, 0) + 1
            seg = self.segment
            if seg is None:
                total = n
            else:
                labels = (("key", caller),)
                if caller_cells(seg, self.NAME, labels) is None:
                    seg = None  # no room for this caller's series: counted in this worker only
                    total = n
                else:
                    seg.gauge_set(self.slot, self.NAME, labels, n)
                    _store_load_barrier()
                    total = sum(seg.gauge_cells(self.NAME, labels))
            if total > limit:
                if seg is not None:
                    seg.gauge_set(self.slot, self.NAME, labels, n - 1)
                raise ApiError(429, "too_many_concurrent", f"This caller already has {limit} calls in flight, its "
                               f"max_concurrent; retry when one finishes, in {RETRY_AFTER_S} s.",
                               {"retry_after": RETRY_AFTER_S, "max_concurrent": limit},
                               {"Retry-After": str(RETRY_AFTER_S)})
            self.mine[caller] = n

    def release(self, caller: str) -> None:
        with self.lock:
            n = self.mine.get(caller, 0) - 1
            if n > 0:
                self.mine[caller] = n
            else:
                self.mine.pop(caller, None)
                n = 0
            if self.segment is not None and caller_cells(self.segment, self.NAME, (("key", caller),)) is not None:
                self.segment.gauge_set(self.slot, self.NAME, (("key", caller),), n)

    def held(self, caller: str) -> int:
        with self.lock:
            return self.mine.get(caller, 0)


def caller_cells(seg, name: str, labels: tuple):
    """The segment's cells of a series named by a caller (a key or a signed-in subject: there is no bound on how
    many), or None when the segment keeps its remaining room for the instance's own series
    (shm Segment.gauge_cells_bounded). Then the caller's count is this worker's alone: a per-host bound becomes a
    per-worker one for the callers past the room, and no call fails for a full series table (each new limited
    caller or stream was a 500 once about a thousand callers had been seen)."""
    bounded = getattr(seg, "gauge_cells_bounded", None)
    if bounded is None:
        return seg.gauge_cells(name, labels)
    cells = bounded(name, labels)
    if cells is None:
        _warn_once()
    return cells


_warned = []


def _warn_once() -> None:
    if not _warned:
        _warned.append(True)
        import logging
        logging.getLogger("qag.capacity").warning(
            "the shared segment has no more room for per-caller counts (QAG_SHM_SIZE): the limits, streams and "
            "max_concurrent of callers seen from now on are counted per worker")


_BARRIER = threading.Lock()


def _store_load_barrier() -> None:
    """Our cell's store must be visible before the other slots' cells are loaded: the one reordering x86-64 (TSO)
    allows, so shm.fence (store->store, load->load) is not enough. A lock's acquire is a locked read-modify-write,
    a full barrier on x86-64 (Intel SDM 8.2.2); elsewhere shm.fence's semaphore post/wait is one (POSIX 4.12)."""
    _BARRIER.acquire()
    _BARRIER.release()
    fence()
