"""capacity.CallerCalls, a caller's max_concurrent, over one segment formatted in memory (Segment.in_buffer): two
instances on two slots stand for two workers of a host; claiming a slot (set_slot, LAYOUT.md M1) frees what a dead
process held there."""
from __future__ import annotations

import pytest

from qag.capacity import CallerCalls
from qag.errors import ApiError
from shm.segment import Segment


def _segment() -> Segment:
    return Segment.in_buffer(bytearray(4 * 1024 * 1024), 4)


def test_the_limit_is_the_hosts_not_one_workers():
    seg = _segment()
    w0, w1 = CallerCalls(seg, 0), CallerCalls(seg, 1)
    w0.acquire("k", 3)
    w1.acquire("k", 3)
    w1.acquire("k", 3)
    with pytest.raises(ApiError) as exc:
        w0.acquire("k", 3)   # this worker holds one, the host three
    e = exc.value
    assert (e.status, e.code, e.extra["max_concurrent"], e.extra["retry_after"]) == (429, "too_many_concurrent", 3, 1)
    assert e.headers == {"Retry-After": "1"}
    assert seg.gauge_cells(CallerCalls.NAME, (("key", "k"),))[:2] == [1, 2], "a refusal takes nothing"
    w0.acquire("other", 1)   # another caller counts apart
    w1.release("k")
    w0.acquire("k", 3)
    assert (w0.held("k"), w1.held("k")) == (2, 1)


def test_releases_give_back_to_zero():
    seg = _segment()
    w = CallerCalls(seg, 2)
    for _ in range(2):
        w.acquire("k", 2)
    for _ in range(2):
        w.release("k")
    assert sum(seg.gauge_cells(CallerCalls.NAME, (("key", "k"),))) == 0 and w.held("k") == 0


def test_a_dead_workers_calls_are_freed_when_its_slot_is_claimed():
    seg = _segment()
    dead, live = CallerCalls(seg, 1), CallerCalls(seg, 0)
    dead.acquire("k", 2)
    dead.acquire("k", 2)
    with pytest.raises(ApiError):
        live.acquire("k", 2)
    seg.set_slot(1, "worker", 4343)   # the arbiter's replacement claims the slot (M1): its gauges restart at 0
    replacement = CallerCalls(seg, 1)
    live.acquire("k", 2)
    replacement.acquire("k", 2)
    assert sum(seg.gauge_cells(CallerCalls.NAME, (("key", "k"),))) == 2


def test_without_a_segment_a_worker_counts_its_own():
    w = CallerCalls(None)
    w.acquire("k", 1)
    with pytest.raises(ApiError):
        w.acquire("k", 1)
    w.release("k")
    w.acquire("k", 1)
