"""The recorder: the only consumer of the run rings and the only writer of runs.

It drains every ring into batches (by size and by time), writes each batch as one transaction or
insert that also records how far into each ring it got, and only then releases the rings' tails.
So a recorder killed at any instant restarts from the store's durable positions: nothing in the
rings is lost, and nothing already written is written again (exactly once).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("qag.recorder")


def source_identity(source) -> str:
    """Names the durable positions of one segment incarnation: its name and creation time, so a
    segment created afresh (positions restart at 0) never resumes from an older one's positions."""
    name = getattr(source, "name", None) or "default"
    created = None
    try:
        created = source.stat().get("created_at_ns")
    except Exception:
        created = getattr(source, "created_at_ns", None)
    return f"{name}@{created}" if created else str(name)


class RecorderState:
    """What the recorder publishes after each batch and at least once a second (its heartbeat)."""

    __slots__ = (
        "bad_records",
        "batches",
        "corrupt_skips",
        "errors",
        "heartbeat_ns",
        "lag_bytes",
        "last_error",
        "last_event_id",
        "positions",
        "records",
        "source_id",
        "started_ns",
    )

    def __init__(self, source_id: str):
        self.source_id = source_id
        self.started_ns = self.heartbeat_ns = time.time_ns()
        self.last_event_id = 0
        self.records = 0          # runs written since this process started
        self.batches = 0
        self.bad_records = 0      # payloads that were not run records (skipped, counted)
        self.corrupt_skips = 0    # rings skipped to their head past a record failing its checksum
        self.errors = 0           # failed writes (each retried until it succeeds)
        self.last_error = ""
        self.positions: dict[int, int] = {}   # ring slot -> durable position (== ring tail)
        self.lag_bytes: dict[int, int] = {}   # ring slot -> head - durable position

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def resume_positions(rings, durable: dict[int, int]) -> dict[int, int]:
    """Where to read each ring from: the store's durable position when it lies in [tail, head]
    (releasing up to it: those runs were written before a crash but not yet released), else the
    tail (a fresh ring, or positions that belong to another segment)."""
    cursor = {}
    for slot, r in enumerate(rings):
        tail, head = r.tail, r.head
        p = durable.get(slot)
        if p is not None and tail <= p <= head:
            if p > tail:
                r.release(p)
            cursor[slot] = p
        else:
            if p is not None and p != tail:
                log.warning("ring %d: stored position %d is outside [tail %d, head %d]; reading from the tail",
                            slot, p, tail, head)
            cursor[slot] = tail
    return cursor


def run_recorder(source, store, stop_event: threading.Event, batch_max: int = 5000, batch_ms: int = 50,
                 publish=None, source_id: str | None = None, prune_every_s: float = 10.0,
                 prune_rows: int = 5000, idle_sleep_ms: float = 5.0, stop_grace_s: float = 5.0) -> RecorderState:
    """Drain `source`'s rings into `store` until `stop_event` is set, then flush and return.

    `publish(state)` is called after each committed batch and about once a second when idle. The
    batch being written and the next one being read and formatted overlap (one writer thread), but
    batches commit strictly in order, so event ids are committed in order.
    """
    sid = source_id or source_identity(source)
    rings = [source.ring(i) for i in range(source.ring_count())]
    state = RecorderState(sid)
    cursor = resume_positions(rings, store.positions(sid))
    state.positions = dict(cursor)
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qag-recorder-writer")
    pending = None            # (future, {slot: pos}, n records) of the batch being committed
    batch: list = []          # [(slot, [(pos_after, payload), ...])], one chunk per ring read
    nbatch = 0
    batch_t0 = 0.0
    start = 0                 # ring the next read starts from, rotated so no ring starves the others
    idle = idle_sleep_ms / 1000.0
    next_prune = time.monotonic() + prune_every_s
    prune_fut = None
    last_publish = 0.0
    nrings = len(rings)

    def commit(prepared):
        """Writer thread: commit, retrying until it succeeds; a write whose outcome we could not
        see (connection lost at COMMIT) is checked against the durable positions first."""
        delay = 0.05
        stop_seen = None
        while True:
            try:
                return store.commit(prepared)
            except Exception as e:  # any store failure is retried, never dropped
                if stop_event.is_set():
                    stop_seen = stop_seen or time.monotonic()
                    if time.monotonic() - stop_seen > stop_grace_s:
                        raise  # stopping: the runs stay in the rings (tails not released)
                state.errors += 1
                state.last_error = f"{type(e).__name__}: {e}"[:500]
                log.warning("run store write failed (retrying in %.2fs): %s", delay, state.last_error)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                try:
                    durable = store.positions(sid)
                    if prepared.positions and all(durable.get(s, -1) >= p for s, p in prepared.positions.items()):
                        return (0, 0, 0)  # it did commit
                except Exception:
                    pass

    abandoned = []

    def finish(p):
        fut, positions, n = p
        try:
            _first, last, _written = fut.result()
        except Exception:
            if not stop_event.is_set():
                raise
            # Gave up while stopping: the rings keep these runs for the next recorder, and no later
            # batch may commit (its positions would release these).
            log.exception("run store write abandoned at stop; the runs stay in the rings")
            abandoned.append(True)
            return
        for slot, pos in positions.items():
            rings[slot].release(pos)
            state.positions[slot] = pos
        if last:
            state.last_event_id = last
        state.records += n
        state.batches += 1
        state.bad_records = getattr(store, "bad_records", 0)

    def do_publish():
        state.heartbeat_ns = time.time_ns()
        for slot, r in enumerate(rings):
            state.lag_bytes[slot] = r.head - state.positions.get(slot, 0)
        if publish is not None:
            try:
                publish(state)
            except Exception:  # a broken observer must not stop recording
                log.exception("recorder publish callback failed")

    try:
        stop_deadline = None
        while True:
            stopping = stop_event.is_set()
            if stopping and stop_deadline is None:
                # On stop, drain what the rings hold (the arbiter stops producers first), but for at
                # most stop_grace_s, so producers that keep going cannot keep us alive.
                stop_deadline = time.monotonic() + stop_grace_s
            got = 0
            room = batch_max - nbatch
            caught_up = True  # every ring read returned all it held (not cut short by the batch's room)
            if room > 0 and nrings and not (stopping and time.monotonic() > stop_deadline):
                for k in range(nrings):
                    slot = (start + k) % nrings
                    try:
                        recs = rings[slot].read_from(cursor[slot], room)
                    except Exception as e:  # shm.RingError: a record failing its checksum or length
                        if type(e).__name__ != "RingError":
                            raise
                        # Past a corrupt record nothing can be parsed, and stopping would stop every
                        # ring (the arbiter would restart us into the same record): write what was read,
                        # then skip this ring to its head, counted and logged, never silently.
                        if batch:
                            prepared = store.prepare(sid, batch)
                            if pending is not None:
                                finish(pending)
                                pending = None
                            if abandoned:
                                return state
                            pending = (writer.submit(commit, prepared), prepared.positions, nbatch)
                            batch, nbatch = [], 0
                        if pending is not None:
                            finish(pending)
                            pending = None
                        if abandoned:
                            return state
                        head = rings[slot].head
                        skipped = head - cursor[slot]
                        rings[slot].release(head)
                        cursor[slot] = state.positions[slot] = head
                        state.corrupt_skips += 1
                        state.last_error = f"ring {slot}: {e}; skipped {skipped} bytes"[:500]
                        log.error("ring %d: %s; skipped %d bytes of runs to its head", slot, e, skipped)
                        continue
                    if recs:
                        if not batch:
                            batch_t0 = time.monotonic()
                        batch.append((slot, recs))
                        cursor[slot] = recs[-1][0]
                        got += len(recs)
                        nbatch += len(recs)
                        room -= len(recs)
                        if room <= 0:
                            caught_up = False
                            break
                start = (start + 1) % nrings
            now = time.monotonic()
            if pending is not None and pending[0].done():
                finish(pending)
                pending = None
                do_publish()
                last_publish = now
            if prune_fut is not None and prune_fut.done():
                try:
                    deleted = prune_fut.result()
                except Exception as e:  # noqa: BLE001 - retention retries on the next round
                    log.warning("run store retention failed: %s", e)
                    deleted = 0
                # More expired rows: the next chunk soon, never one long delete.
                next_prune = now + (0.2 if deleted else prune_every_s)
                prune_fut = None
            if prune_fut is None and now >= next_prune and not stopping:
                # One bounded chunk, queued on the writer between two commits: retention runs under
                # sustained load too, and delays a commit by one chunk at most.
                prune_fut = writer.submit(store.prune, prune_rows)
                next_prune = float("inf")
            full = nbatch >= batch_max
            due = batch and (full or stopping or (now - batch_t0) * 1000.0 >= batch_ms)
            if due:
                prepared = store.prepare(sid, batch)
                if pending is not None:
                    finish(pending)
                    pending = None
                    if abandoned:
                        return state
                    do_publish()
                    last_publish = time.monotonic()
                pending = (writer.submit(commit, prepared), prepared.positions, nbatch)
                batch = []
                nbatch = 0
                continue
            if stopping and not got:
                if pending is not None:
                    finish(pending)
                    pending = None
                do_publish()
                return state
            if got and (stopping or not caught_up):
                continue  # a backlog: read on at once
            # Caught up, idle, or a partial batch waiting for its time: beat, then sleep. A recorder that
            # woke every 0.5 ms to pick up each run as it came woke several times per call, on the
            # workers' cores; polling every 5 ms still cost ~20 us per call at 500 calls/s (measured,
            # bench/recorder.py --ab). So: an open batch sleeps to its deadline (the rings hold seconds
            # of runs), one wakeup per batch; with no batch open, polls back off to batch_ms.
            if now - last_publish >= 1.0:
                do_publish()
                last_publish = now
            if got:
                idle = idle_sleep_ms / 1000.0
            if batch:
                wait = min(max(0.0, batch_ms / 1000.0 - (now - batch_t0)), 0.1)
            else:
                wait = idle
                idle = min(idle * 2, max(idle_sleep_ms, batch_ms) / 1000.0)
            stop_event.wait(wait)
    finally:
        writer.shutdown(wait=True)


__all__ = ["RecorderState", "resume_positions", "run_recorder", "source_identity"]
