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
from concurrent.futures import wait as wait_for_futures

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
        "drained",
        "errors",
        "heartbeat_ns",
        "journal_bytes",
        "journal_full",
        "journal_runs",
        "lag_bytes",
        "last_error",
        "last_event_id",
        "positions",
        "records",
        "source_id",
        "spilled",
        "started_ns",
        "store_down_since",
        "store_up",
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
        self.store_up = True      # the last write (or drain) reached the store
        self.store_down_since = 0.0
        self.spilled = 0          # runs put in the journal since this process started
        self.drained = 0          # runs written from the journal into the store
        self.journal_bytes = 0    # journal bytes not yet in the store
        self.journal_runs = 0     # journal runs not yet in the store
        self.journal_full = False  # the journal is at QAG_JOURNAL_MAX_BYTES: the rings fill

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


# Most the recorder waits at start for the store's first answer (opening it: chDB in-process takes ~6 s
# here) before it drains the rings into the journal instead; it stops waiting sooner if a ring is half
# full. The rings hold ~30 s by default.
START_WAIT_S = 30.0
DRAIN_MAX = 20_000
CLOSE_S = 1.0  # most a new batch waits, leaving the journal, for the drain that empties it


class StoreDown(RuntimeError):
    """The run store refused or did not answer a write for longer than the recorder waits before it
    spills to its journal (the batch's outcome is then unknown: it may have committed)."""


class _Drainer:
    """Writes the journal into the store, oldest frame first, on the recorder's writer thread.

    Exactly once: every drained batch is committed under the journal's own source (slot 0, position =
    the journal position after its last frame), in the same transaction or insert as its runs, so the
    store says how far the journal is in it. Runs of a frame that may already be in the store under
    their ring's source (the batch that was in flight when the store went away, or runs re-read from a
    ring after a restart without the store) are dropped by their ring position against that source's
    durable positions."""

    def __init__(self, store, journal):
        self.store = store
        self.journal = journal
        self.pos = journal.drained
        self.synced = False
        self.inflight = None      # (prepared batch, journal position after it, runs) whose commit failed
        self.src_pos: dict = {}
        self.last_event_id = 0

    def step(self, max_runs: int) -> tuple[int, int]:
        """Commit the next frames (whole ones, up to max_runs runs). Returns (journal position, runs)."""
        t0 = time.monotonic()
        try:
            pos, n = self._step(max_runs)
        except BaseException as e:
            self.synced = False
            log.debug("journal drain failed after %.2f s: %s", time.monotonic() - t0, e)
            raise
        log.debug("journal drain: %d runs, up to position %d, in %.2f s", n, pos, time.monotonic() - t0)
        return pos, n

    def _step(self, max_runs):
        store, journal = self.store, self.journal
        if self.inflight is not None:  # retry the very same batch (ClickHouse: the same token)
            batch, end, n = self.inflight
            if store.positions(journal.source).get(0, -1) >= end:
                self.inflight = None      # it did commit
                self.pos = end
                return end, n
            store.commit(batch)
            self.inflight = None
            self.pos = end
            return end, n
        if not self.synced:
            durable = store.positions(journal.source).get(0)
            if durable is not None:
                if durable > journal.end:
                    journal.restart_at(durable)
                    if durable > journal.end:
                        log.error("the store holds journal %s up to %d, past its end %d; draining all of it",
                                  journal.source, durable, journal.end)
                        durable = journal.drained
                self.pos = max(self.pos, durable)
            self.pos = max(self.pos, journal.drained)
            self.src_pos = {}
            self.synced = True
        frames = journal.read(self.pos, max_runs)
        if not frames:
            return self.pos, 0
        if frames[0][3] is not None:
            # A batch whose outcome was unknown, journalled with the store's own inserts (ClickHouse):
            # sent again exactly as before, it lands once in each table whatever the first try left.
            end, source, fchunks, replay = frames[0]
            store.replay(source, replay)
            self.src_pos.pop(source, None)
            self.pos = end
            return end, sum(len(rr) for _slot, rr in fchunks)
        frames = frames[:next((i for i, f in enumerate(frames) if f[3] is not None), len(frames))]
        chunks = []
        n = 0
        for end, source, fchunks, _replay in frames:
            durable = self.src_pos.get(source)
            if durable is None:
                durable = self.src_pos[source] = store.positions(source)
            recs = []
            for slot, rr in fchunks:
                if not rr:
                    continue
                d = durable.get(slot, -1)
                if rr[-1][0] <= d:
                    continue  # already in the store under the ring's source
                if rr[0][0] > d:
                    recs.extend(payload for _p, payload in rr)
                else:
                    recs.extend(payload for p, payload in rr if p > d)
            if recs:
                chunks.append((0, [(end, payload) for payload in recs]))
                n += len(recs)
        end = frames[-1][0]
        if not chunks:
            self.pos = end
            return end, 0
        batch = store.prepare(journal.source, chunks)
        self.inflight = (batch, end, n)
        _first, last, _n = store.commit(batch)
        self.last_event_id = max(self.last_event_id, last or 0)
        self.inflight = None
        self.pos = end
        return end, n


def run_recorder(source, store, stop_event: threading.Event, batch_max: int = 5000, batch_ms: int = 50,
                 publish=None, source_id: str | None = None, prune_every_s: float = 10.0,
                 prune_rows: int = 5000, idle_sleep_ms: float = 5.0, stop_grace_s: float = 5.0,
                 journal=None, spill_after_s: float = 1.0) -> RecorderState:
    """Drain `source`'s rings into `store` until `stop_event` is set, then flush and return.

    `publish(state)` is called after each committed batch and about once a second when idle. The
    batch being written and the next one being read and formatted overlap (one writer thread), but
    batches commit strictly in order, so event ids are committed in order.

    With a `journal` (qag.recorder.journal.Journal), a store that fails or hangs a write for
    `spill_after_s` does not stop the draining: batches go to the journal (the rings are released once
    the journal holds them), and the journal drains into the store, in order and before any newer run,
    when it is back. Without one, a failed write is retried until it succeeds (the rings hold the runs).
    """
    sid = source_id or source_identity(source)
    rings = [source.ring(i) for i in range(source.ring_count())]
    state = RecorderState(sid)
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qag-recorder-writer")
    if journal is None:
        durable = store.positions(sid)
    else:
        # Not from this thread: a store that does not answer (a held lock, a frozen server) must not
        # keep the rings from being drained; whatever the answer is, the drainer runs after it.
        first = writer.submit(lambda: store.positions(sid))
        t_end = time.monotonic() + START_WAIT_S
        while not first.done() and time.monotonic() < t_end and not stop_event.is_set() \
                and all(r.head - r.tail < r.capacity // 2 for r in rings):
            wait_for_futures([first], timeout=0.05)
        if first.done() and first.exception() is None:
            durable = first.result()
        else:
            durable = {}
            state.store_up = False
            state.store_down_since = time.monotonic()
            e = first.exception() if first.done() else None
            state.last_error = (f"{type(e).__name__}: {e}" if e else "no answer at start")[:500]
            if not first.done():
                first.add_done_callback(_quiet)
            log.info("run store unavailable at start (%s); spilling runs to the journal %s", state.last_error,
                     journal.dir)
    if journal is not None:
        for slot, p in journal.ring_positions(sid).items():
            if p > durable.get(slot, -1):
                durable[slot] = p
    cursor = resume_positions(rings, durable)
    state.positions = dict(cursor)
    pending = None            # (future, {slot: pos}, n, chunks, submitted at, prepared) of the batch being committed
    batch: list = []          # [(slot, [(pos_after, payload), ...])], one chunk per ring read
    nbatch = 0
    batch_t0 = 0.0
    start = 0                 # ring the next read starts from, rotated so no ring starves the others
    idle = idle_sleep_ms / 1000.0
    next_prune = time.monotonic() + prune_every_s
    prune_fut = None
    last_publish = 0.0
    nrings = len(rings)
    # The journal side: spilling while the store cannot be written or the journal still holds runs.
    spilling = journal is not None and (not state.store_up or journal.pending_bytes > 0)
    drainer = _Drainer(store, journal) if journal is not None else None
    drain_fut = None
    next_drain = 0.0
    drain_delay = 0.05
    closing = 0.0             # while spilling: until when new batches wait for the last drain (0: they don't)
    held: list = []           # [(chunks, positions, n)] batches a full journal could not take yet, in order
    jpositions = journal.ring_positions(sid) if journal is not None else {}
    if journal is not None:
        state.journal_bytes, state.journal_runs = journal.pending_bytes, journal.pending_runs
        if spilling and state.store_up:
            log.info("the journal holds %d runs (%d bytes): draining them before newer runs",
                     state.journal_runs, state.journal_bytes)

    def commit(prepared):
        """Writer thread: commit, retrying until it succeeds (with a journal: for spill_after_s, then
        StoreDown); a write whose outcome we could not see (connection lost at COMMIT) is checked
        against the durable positions first."""
        delay = 0.05
        stop_seen = None
        t0 = time.monotonic()
        while True:
            try:
                return store.commit(prepared)
            except Exception as e:  # any store failure is retried, never dropped
                state.errors += 1
                state.last_error = f"{type(e).__name__}: {e}"[:500]
                if journal is not None and time.monotonic() - t0 >= spill_after_s:
                    raise StoreDown(state.last_error) from e
                if stop_event.is_set():
                    stop_seen = stop_seen or time.monotonic()
                    if time.monotonic() - stop_seen > stop_grace_s:
                        raise  # stopping: the runs stay in the rings (tails not released)
                if journal is None:
                    log.warning("run store write failed (retrying in %.2fs): %s", delay, state.last_error)
                time.sleep(delay)
                delay = min(delay * 2, 2.0 if journal is None else 0.25)
                try:
                    durable = store.positions(sid)
                    if prepared.positions and all(durable.get(s, -1) >= p for s, p in prepared.positions.items()):
                        return (0, 0, 0)  # it did commit
                except Exception:
                    pass

    abandoned = []

    def store_down(reason: str):
        if state.store_up:
            state.store_up = False
            state.store_down_since = time.monotonic()
            log.warning("run store unavailable (%s): spilling runs to the journal %s", reason, journal.dir)
        state.last_error = reason[:500]

    def store_back():
        if not state.store_up:
            state.store_up = True
            log.info("run store back after %.1f s; draining %d runs (%d bytes) from the journal",
                     time.monotonic() - state.store_down_since, journal.pending_runs, journal.pending_bytes)

    def spill(chunks, positions, n, replay=None) -> bool:
        """Main thread: put a batch in the journal, then release the rings up to it. False when the
        journal is full: the batch is held (in order, behind any held before it) and the caller reads
        no more from the rings, which keep the rest."""
        held.append((chunks, positions, n, replay))
        return pump()

    def pump() -> bool:
        while held:
            chunks, positions, n, replay = held[0]
            new = dict(jpositions)
            for slot, pos in positions.items():
                if pos > new.get(slot, -1):
                    new[slot] = pos
            try:
                journal.append(sid, new, chunks, replay)
            except Exception as e:  # JournalFull, or the disk refusing (ENOSPC, EIO): hold, retry later
                if not state.journal_full:
                    state.journal_full = True
                    log.error("run journal cannot take more runs (%s); the rings fill now, and runs are lost "
                              "(qag_runs_lost_total) once they are full", e)
                    do_publish()  # before the rings fill: a worker's loss log names this reason
                return False
            held.pop(0)
            if state.journal_full:
                state.journal_full = False
                log.info("run journal takes runs again")
            jpositions.update(new)
            for slot, pos in positions.items():
                if pos > rings[slot].tail:
                    rings[slot].release(pos)
                state.positions[slot] = max(state.positions.get(slot, 0), pos)
            state.spilled += n
            state.journal_bytes = journal.pending_bytes
            state.journal_runs += n
        return True

    def detach(p, reason: str):
        """Spill the batch in flight: whether or not its commit lands, the drainer sorts it out (it
        runs after that commit on the one writer thread, and drops runs the store already has, or, on
        ClickHouse, sends the very same inserts again: their tokens make them land once)."""
        nonlocal spilling
        fut, positions, n, chunks, _t, prepared = p
        store_down(reason)
        spilling = True
        fut.add_done_callback(_quiet)
        replay = getattr(store, "replay_data", lambda b: None)(prepared)
        spill(chunks, positions, n, replay)

    def finish(p):
        nonlocal spilling
        fut, positions, n, _chunks, t_sub, _prepared = p
        if journal is not None and not fut.done():
            # Wait for the write no longer than spill_after_s from its start: a store that does not
            # answer (a held lock, a frozen server) must not stop the draining of the rings.
            wait_for_futures([fut], timeout=max(0.0, t_sub + spill_after_s - time.monotonic()))
            if not fut.done():
                detach(p, f"a write has not returned for {time.monotonic() - t_sub:.1f} s")
                return
        try:
            _first, last, _written = fut.result()
        except StoreDown as e:
            detach(p, str(e))
            return
        except Exception:
            if journal is not None:
                detach(p, state.last_error or "write failed")
                return
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

    def flush(chunks, n):
        """A batch is due: into the store (overlapping the previous commit), or into the journal."""
        nonlocal pending
        if spilling:
            positions = {}
            for slot, recs in chunks:
                if recs:
                    positions[slot] = recs[-1][0]
            if pending is not None:  # never release past a batch still in flight: spill it first
                detach(pending, "spilling")
                pending = None
            spill(chunks, positions, n)
            return True
        prepared = store.prepare(sid, chunks)
        if pending is not None:
            finish(pending)
            pending = None
            if abandoned:
                return False
            do_publish()
        if spilling:  # finish() found the store gone: this batch follows it into the journal
            spill(chunks, dict(prepared.positions), n)
            return True
        pending = (writer.submit(commit, prepared), prepared.positions, n, chunks, time.monotonic(), prepared)
        return True

    def do_publish():
        nonlocal last_publish
        state.heartbeat_ns = time.time_ns()
        for slot, r in enumerate(rings):
            state.lag_bytes[slot] = r.head - state.positions.get(slot, 0)
        if journal is not None:
            state.journal_bytes = journal.pending_bytes
        if publish is not None:
            try:
                publish(state)
            except Exception:  # a broken observer must not stop recording
                log.exception("recorder publish callback failed")
        last_publish = time.monotonic()

    try:
        stop_deadline = None
        while True:
            stopping = stop_event.is_set()
            if stopping and stop_deadline is None:
                # On stop, drain what the rings hold (the arbiter stops producers first), but for at
                # most stop_grace_s, so producers that keep going cannot keep us alive.
                stop_deadline = time.monotonic() + stop_grace_s
            if held:
                pump()
            got = 0
            room = batch_max - nbatch
            caught_up = True  # every ring read returned all it held (not cut short by the batch's room)
            if not held and room > 0 and nrings and not (stopping and time.monotonic() > stop_deadline):
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
                            if not flush(batch, nbatch):
                                return state
                            batch, nbatch = [], 0
                        if pending is not None:
                            finish(pending)
                            pending = None
                        if abandoned:
                            return state
                        if held:
                            break  # the journal is full: skip the ring once it has room
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
            if pending is not None:
                if pending[0].done():
                    finish(pending)
                    pending = None
                    if abandoned:
                        return state
                    if not spilling:
                        do_publish()
                elif journal is not None and now - pending[4] > spill_after_s:
                    # A write that neither commits nor fails (a store that stopped answering): spill.
                    p, pending = pending, None
                    detach(p, f"a write has not returned for {now - p[4]:.1f} s")
            if prune_fut is not None and prune_fut.done():
                try:
                    deleted = prune_fut.result()
                except Exception as e:  # noqa: BLE001 - retention retries on the next round
                    log.warning("run store retention failed: %s", e)
                    deleted = 0
                # More expired rows: the next chunk soon, never one long delete.
                next_prune = now + (0.2 if deleted else prune_every_s)
                prune_fut = None
            if prune_fut is None and now >= next_prune and not stopping and not spilling:
                # One bounded chunk, queued on the writer between two commits: retention runs under
                # sustained load too, and delays a commit by one chunk at most.
                prune_fut = writer.submit(store.prune, prune_rows)
                next_prune = float("inf")
            if drainer is not None:
                if drain_fut is not None and drain_fut.done():
                    try:
                        pos, n = drain_fut.result()
                    except Exception as e:  # noqa: BLE001 - the store is still away: try again later
                        store_down(f"{type(e).__name__}: {e}")
                        next_drain = now + drain_delay
                        drain_delay = min(drain_delay * 2, 0.5)
                        closing = 0.0
                    else:
                        store_back()
                        journal.mark_drained(pos)
                        state.records += n
                        state.drained += n
                        state.last_event_id = max(state.last_event_id, drainer.last_event_id)
                        state.batches += 1 if n else 0
                        state.journal_runs = journal.pending_runs
                        state.journal_bytes = journal.pending_bytes
                        drain_delay = 0.05
                        next_drain = now
                        if n:
                            do_publish()
                        if journal.pending_runs <= batch_max and not closing and not held:
                            # Nearly drained: hold new batches back for one more drain (at most
                            # CLOSE_S), or a store slower than the arrivals between two drains (each
                            # drain takes what came meanwhile) would keep every run in the journal.
                            closing = now + CLOSE_S
                    drain_fut = None
                if closing and (now > closing or stopping):
                    closing = 0.0  # the last drain is taking too long: spill the held batch after all
                if spilling and drain_fut is None and pending is None:
                    if journal.pending_bytes > 0 or not state.store_up:
                        if now >= next_drain:
                            # larger drains than batches: the journal is a backlog (one insert or
                            # transaction per drain has a fixed cost)
                            drain_fut = writer.submit(drainer.step, max(batch_max, DRAIN_MAX))
                    elif not held:
                        spilling = False  # the journal is in the store: newer runs go straight there
                        closing = 0.0
                        state.journal_runs = 0
                        log.info("run journal drained; recording straight into the run store again")
            full = nbatch >= batch_max
            due = batch and (full or stopping or (now - batch_t0) * 1000.0 >= batch_ms)
            if due and not held and not (spilling and closing):
                if not flush(batch, nbatch):
                    return state
                batch = []
                nbatch = 0
                continue
            if stopping and not got and spilling and (journal.pending_bytes or held or batch) \
                    and time.monotonic() < stop_deadline:
                pass  # stopping: give the journal's drain (if the store is back) until the deadline
            elif stopping and not got:
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
            if got:
                idle = idle_sleep_ms / 1000.0
            if batch:
                wait = min(max(0.0, batch_ms / 1000.0 - (now - batch_t0)), 0.1)
            else:
                wait = idle
                idle = min(idle * 2, max(idle_sleep_ms, batch_ms) / 1000.0)
            if spilling:
                wait = min(wait, 0.02)  # drains and held frames are polled
            stop_event.wait(wait)
    finally:
        writer.shutdown(wait=True)


def _quiet(fut):
    """A detached write's outcome: logged, never raised (its runs are in the journal)."""
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("detached run store write failed: %s", fut.exception())


__all__ = ["RecorderState", "StoreDown", "resume_positions", "run_recorder", "source_identity"]
