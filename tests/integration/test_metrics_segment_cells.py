"""Observer.request on the shared segment writes each series' cells in place (qag/metrics.py, located once
through Segment.counter_cell / histogram_cell): what it leaves in the segment must be what counter_add and
histogram_observe leave for the same observations - every series, bucket, sum and count, in the slot's cells."""
from __future__ import annotations

import os
import uuid

import posix_ipc
import pytest

from qag.metrics import Observer
from shm import Segment

SIZE = 2 * 1024 * 1024

CALLS = [  # (route, status, code, rows, duration, query_seconds, plan_hit, recorded)
    ("/q/{name}", 200, None, 1, 0.0031, 0.0004, True, True),
    ("/q/{name}", 200, None, 0, 0.00009, 0.00002, False, True),
    ("/q/{name}", 404, "query_not_found", 0, 0.0002, None, None, True),
    ("/q/{name}", 200, None, 1000, 12.0, 11.5, True, False),
    ("/api/v1/queries", 201, None, 0, 0.02, None, None, None),
    ("/q/{name}", 200, None, 7, 0.001, 0.001, True, None),   # exactly on a bucket bound
    ("other", 500, "internal_error", 0, float("inf"), None, None, None),
]


@pytest.fixture()
def names():
    ns = [f"/qag-test-cells-{os.getpid()}-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    yield ns
    for n in ns:
        for unlink, arg in ((posix_ipc.unlink_shared_memory, n), (posix_ipc.unlink_semaphore, n + "-w"),
                            (posix_ipc.unlink_semaphore, n + "-r")):
            try:
                unlink(arg)
            except posix_ipc.ExistentialError:
                pass


def _by_counter_add(seg, slot, call):
    route, status, code, rows, duration, query_seconds, plan_hit, recorded = call
    seg.counter_add(slot, "qag_requests_total", (("route", route), ("status", str(status))), 1)
    if code:
        seg.counter_add(slot, "qag_errors_total", (("code", code),), 1)
    if rows:
        seg.counter_add(slot, "qag_rows_total", (), rows)
    seg.histogram_observe(slot, "qag_request_duration_seconds", (("route", route),), duration)
    if query_seconds is not None:
        seg.histogram_observe(slot, "qag_query_duration_seconds", (), query_seconds)
    if plan_hit is not None:
        seg.counter_add(slot, "qag_plan_cache_total", (("result", "hit" if plan_hit else "miss"),), 1)
    if recorded is not None:
        seg.counter_add(slot, "qag_runs_recorded_total" if recorded else "qag_runs_lost_total", (), 1)


def _series(seg):
    return sorted((i["name"], tuple(map(tuple, i["labels"])), repr(i.get("buckets")), i.get("sum"),
                   i.get("count"), i.get("value")) for i in seg.collect())


def test_observer_cells_hold_what_counter_add_would(names):
    fast, slow = (Segment.create(n, SIZE, slots=4) for n in names)
    try:
        obs = Observer(backend=fast, slot=2)
        for _ in range(3):
            for call in CALLS:
                obs.request(*call)
                _by_counter_add(slow, 2, call)
        assert _series(fast) == _series(slow)
        got = {(i["name"], tuple(map(tuple, i["labels"]))): i for i in fast.collect()}
        assert got[("qag_requests_total", (("route", "/q/{name}"), ("status", "200")))]["value"] == 12
        assert got[("qag_rows_total", ())]["value"] == 3 * 1008
        assert got[("qag_query_duration_seconds", ())]["count"] == 12
        # another slot's cells are untouched
        obs0 = Observer(backend=fast, slot=0)
        assert obs0._d is not None
    finally:
        for s in (fast, slow):
            s.close()
