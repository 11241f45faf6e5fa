"""A worker's application: attach the segment, build the runtime and the app for this slot."""
from __future__ import annotations

import logging
import os
import threading

from qag import runrecord
from qag.app import QagApp
from qag.metrics import Observer
from qag.runtime import Runtime
from qag.store import Store

log = logging.getLogger("qag.worker")


class RingRecorder:
    """Puts one run record into this worker's ring; a ring still full after QAG_RECORD_WAIT_MS counts the
    run as lost (qag_runs_lost_total) instead of blocking the call for ever."""

    __slots__ = ("ring", "wait_ms", "served_by", "observer", "lock")

    def __init__(self, segment, slot: int, wait_ms: int, observer: Observer):
        self.ring = segment.ring(slot)
        self.wait_ms = wait_ms
        self.served_by = f"worker:{slot}"
        self.observer = observer
        # A ring has one producer: this worker's threads take turns (shm/LAYOUT.md, Rings).
        self.lock = threading.Lock()

    def __call__(self, run: dict) -> None:
        payload = runrecord.pack(run["at_us"], run["key_name"], run["query"], run["version"], run["connection"],
                                 run["status"], run["code"], run["rows"], run["duration_us"], run["bytes"],
                                 run["request_id"], self.served_by, run["transport"], run["route"])
        with self.lock:
            return self.ring.push(payload, self.wait_ms)


def segment_gauges(segment, runtime):
    """Gauges read at scrape time: ring occupancy and the recorder's lag for the whole instance; this
    worker's pools (each worker reports its own, labelled by slot)."""
    import time
    now = time.time_ns()
    st = segment.stat()
    for ps in st["process_slots"]:
        ring = ps.get("ring") or {}
        if ring.get("used") or ps.get("role") in ("worker", "plane"):  # every producer's ring, 0 included
            yield "qag_ring_occupancy_bytes", (str(ps["slot"]),), ring.get("used", 0)
        if ps.get("role") == "recorder" and ps.get("heartbeat_ns"):
            yield "qag_recorder_lag_seconds", (), max(0.0, (now - ps["heartbeat_ns"]) / 1e9)
    yield "qag_generation", (), segment.global_gen()
    yield "qag_change_watcher_current", (), 1 if runtime.gens.current() else 0
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
    from qag.arbiter import watcher_slot
    from qag.changes import WatchedGenerations
    # cached entries are trusted only while this host's change watcher is caught up (qag/changes.py)
    runtime = Runtime(cfg, store, WatchedGenerations(segment, watcher_slot(segment.slots)), slot=slot)
    from qag.publish import Publisher
    runtime.publisher = Publisher(segment, cfg)
    recorder = RingRecorder(segment, slot, cfg.record_wait_ms, observer)
    observer.gauges.append(lambda: segment_gauges(segment, runtime))
    app = QagApp(cfg, runtime, observer=observer, recorder=recorder, segment=segment)
    from qag.arbiter import run_store_url
    app.run_store_url = run_store_url(cfg)
    return app
