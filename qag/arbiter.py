"""What the arbiter does around gunicorn: the shared segment's life and the recorder's supervision.

The segment is created before the first fork (so every worker attaches the same one) and unlinked on
a clean stop. The recorder is a child process, restarted with backoff whenever it dies; it resumes
from the positions it made durable in the run store, so a crash loses no run.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
import time

log = logging.getLogger("qag.arbiter")

# Slots: workers take 0..N-1; the recorder and the data plane take fixed slots at the top.
RECORDER_SLOT_FROM_TOP = 1
PLANE_SLOT_FROM_TOP = 2


def instance_name(cfg) -> str:
    """Two `qag serve` on one host never share a segment: the name derives from QAG_HOME and the bind."""
    try:
        import shm
        return shm.segment_name(f"{cfg.home}|{cfg.bind}")
    except (ImportError, AttributeError):
        return "/qag-" + hashlib.sha256(f"{cfg.home}|{cfg.bind}".encode()).hexdigest()[:16]


def run_store_url(cfg) -> str:
    """ClickHouse when QAG_RUN_STORE_URL is set; else the metadata store's PostgreSQL; else runs.db in
    QAG_HOME (a separate SQLite file, so batches never hold the metadata store's write lock)."""
    if cfg.run_store_url:
        return cfg.run_store_url
    if cfg.database_url:
        return cfg.database_url
    return os.path.join(cfg.home, "runs.db")


def slot_count(workers: int) -> int:
    return max(8, workers + 4)


class ArbiterHooks:
    def __init__(self, cfg, workers: int = 1):
        self.cfg = cfg
        self.workers = workers
        self.segment = None
        self.segment_name: str | None = None
        self.recorder: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.recorder_restarts = 0

    def start(self) -> str | None:
        import shm
        self.segment_name = instance_name(self.cfg)
        slots = slot_count(self.workers)
        self.segment = shm.Segment.create(self.segment_name, self.cfg.shm_size, slots=slots)
        self.recorder_slot = slots - RECORDER_SLOT_FROM_TOP
        self.plane_slot = slots - PLANE_SLOT_FROM_TOP
        # The store's schema exists before any worker serves (history reads must not race its creation).
        from qag.runstore import open_store
        st = open_store(run_store_url(self.cfg))
        st.ensure_schema()
        st.close()
        self._spawn_recorder()
        self._thread = threading.Thread(target=self._supervise, name="qag-supervisor", daemon=True)
        self._thread.start()
        return self.segment_name

    def _spawn_recorder(self) -> None:
        cmd = [sys.executable, "-m", "qag.recorder", "--segment", self.segment_name, "--store",
               run_store_url(self.cfg), "--slot", str(self.recorder_slot)]
        self.recorder = subprocess.Popen(cmd, env=dict(os.environ), stdin=subprocess.DEVNULL)
        self.recorder_started = time.monotonic()

    def _supervise(self) -> None:
        """Restart the recorder with backoff (0.2 s doubling to 10 s; reset after 30 s alive)."""
        backoff = 0.2
        while not self._stop.wait(0.2):
            proc = self.recorder
            if proc is None or proc.poll() is None:
                continue
            if self._stop.is_set():
                return
            alive_for = time.monotonic() - self.recorder_started
            if alive_for > 30:
                backoff = 0.2
            log.warning("the recorder exited (code %s); restarting in %.1f s", proc.returncode, backoff)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 10.0)
            self.recorder_restarts += 1
            self._spawn_recorder()

    def ready(self, server) -> None:
        pass

    def worker_exited(self, slot, pid) -> None:
        pass

    def stop(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked worker inherits this object; only the arbiter stops things
        self._stop.set()
        proc, self.recorder = self.recorder, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # the recorder drains the rings and commits before it exits
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        seg, self.segment = self.segment, None
        if seg is not None:
            try:
                seg.unlink()
                seg.close()
            except Exception:
                pass
