"""A worker's application: attach the segment, build the runtime and the app for this slot."""
from __future__ import annotations

import logging
import os
import threading
import time

from qag import entries
from qag.http.app import QagApp
from qag.metrics import Observer
from qag.runtime import Runtime
from qag.store import Store

log = logging.getLogger("qag.worker")


class RingRecorder:
    """Puts one run record into this worker's ring. A full ring never stalls the call: the run is
    counted lost (qag_runs_lost_total) at once, or after waiting QAG_RECORD_WAIT_MS outside the ring
    lock when that is set, and each episode of losses is logged once, with its reason. The recorder
    keeps the rings drained while it lives, into its journal when the run store is away, so a full
    ring means the recorder is stopped or stalled, or the journal is at QAG_JOURNAL_MAX_BYTES."""

    __slots__ = ("lock", "losing", "observer", "ring", "segment", "served_by", "wait_ms")

    def __init__(self, segment, slot: int, wait_ms: int, observer: Observer):
        self.segment = segment
        self.ring = segment.ring(slot)
        self.wait_ms = wait_ms
        self.served_by = f"worker:{slot}"
        self.observer = observer
        self.losing = 0  # runs lost in the current episode (0: none)
        # A ring has one producer: this worker's threads take turns (shm/LAYOUT.md, Rings).
        self.lock = threading.Lock()

    def __call__(self, run: dict) -> bool:
        payload = entries.pack_run_of(run, run.get("served_by") or self.served_by)
        with self.lock:
            ok = self.ring.push(payload, 0)
        if not ok and self.wait_ms:
            deadline = time.monotonic() + self.wait_ms / 1000.0
            while not ok and time.monotonic() < deadline:
                time.sleep(0.001)  # the lock is free meanwhile: other calls record or fail at once
                with self.lock:
                    ok = self.ring.push(payload, 0)
        if ok:
            if self.losing:
                log.warning("run ring %s takes runs again after %d were lost", self.served_by, self.losing)
                self.losing = 0
            return True
        self.losing += 1
        if self.losing == 1:
            log.error("run ring %s is full, runs are being lost (qag_runs_lost_total): %s", self.served_by,
                      loss_reason(self.segment))
        return False


def loss_reason(segment) -> str:
    """Why a ring is full, from what the recorder publishes (read once per episode of losses)."""
    try:
        st = segment.stat()
        now = time.time_ns()
        rec = [ps for ps in st["process_slots"] if ps.get("role") == "recorder"]
        if not rec or not rec[0].get("alive"):
            return "no recorder is running"
        age = (now - rec[0]["heartbeat_ns"]) / 1e9
        if age > 5:
            return f"the recorder has not drained for {age:.0f} s"
        full = sum(segment.gauge_cells("qag_journal_full"))
        if full:
            return "the recorder's run journal is full (QAG_JOURNAL_MAX_BYTES) while the run store is away"
        return "the recorder is behind"
    except Exception as e:  # noqa: BLE001 - the reason is for the log line only
        return f"reason unknown ({e})"


def segment_gauges(segment, runtime):
    """Gauges read at scrape time: ring occupancy and the recorder's lag for the whole instance; this
    worker's pools (each worker reports its own, labelled by slot)."""
    now = time.time_ns()
    st = segment.stat()
    for ps in st["process_slots"]:
        ring = ps.get("ring") or {}
        if ring.get("used") or ps.get("role") in ("worker", "plane"):  # every producer's ring, 0 included
            yield "qag_ring_occupancy_bytes", (str(ps["slot"]),), ring.get("used", 0)
        if ps.get("role") == "recorder" and ps.get("heartbeat_ns"):
            yield "qag_recorder_lag_seconds", (), max(0.0, (now - ps["heartbeat_ns"]) / 1e9)
    yield "qag_generation", (), segment.global_gen()
    rc = segment.responses
    if rc.enabled:  # the host's response cache (shm/LAYOUT.md [Response cache] R2), one region for every worker
        st = rc.stats()
        yield "qag_response_cache_bytes", (), st["live_bytes"]
        yield "qag_response_cache_capacity_bytes", (), st["capacity"]
        yield "qag_response_cache_entries", (), st["live_entries"]
        yield "qag_response_cache_evictions_total", ("room",), st["evictions"]
        yield "qag_response_cache_evictions_total", ("removed",), st["removals"]
    cs = segment.cache_stats()  # header counters (shm/LAYOUT.md C2): one writer at a time, under the lock
    yield "qag_segment_cache_entries", (), cs["used"]
    yield "qag_segment_cache_slots", (), cs["slots"]
    yield "qag_segment_cache_dropped_total", ("evicted",), cs["evictions"]
    yield "qag_segment_cache_dropped_total", ("rejected",), cs["rejects"]
    yield "qag_change_watcher_current", (), 1 if runtime.generations.current() else 0
    for name, (in_use, idle) in runtime.pool_stats().items():
        yield "qag_pool_connections", (name, "in_use", str(runtime.slot)), in_use
        yield "qag_pool_connections", (name, "idle", str(runtime.slot)), idle


def build_worker_app(cfg, *, slot: int, segment_name: str | None, plane_slot: int | None = None) -> QagApp:
    store = Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key)
    import shm
    segment = shm.Segment.attach(segment_name)
    segment.set_slot(slot, "worker", os.getpid())
    observer = Observer(backend=segment, slot=slot)
    store.observer = observer
    from qag.server.arbiter import watcher_slot
    from qag.server.changes import WatchedGenerations
    # cached entries are trusted only while this host's change watcher is caught up (qag/server/changes.py)
    runtime = Runtime(cfg, store, WatchedGenerations(segment, watcher_slot(segment.slots)), slot=slot)
    runtime.publisher = entries.Publisher(segment, cfg)
    recorder = RingRecorder(segment, slot, cfg.record_wait_ms, observer)
    observer.gauges.append(lambda: segment_gauges(segment, runtime))
    app = QagApp(cfg, runtime, observer=observer, recorder=recorder, segment=segment)
    from qag.server.arbiter import run_store_url
    app.run_store_url = run_store_url(cfg)
    return app
