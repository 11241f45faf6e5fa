"""The recorder: the only consumer of the run rings and the only writer of runs.

It drains every ring into batches (by size and by time), writes each batch as one transaction or
insert that also records how far into each ring it got, and only then releases the rings' tails.
So a recorder killed at any instant restarts from the store's durable positions: nothing in the
rings is lost, and nothing already written is written again (exactly once). `Recorder` is the loop and
its protocol, step by step; `journal.py` the spill it keeps while the store is away (README.md here).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures

from shm.ring import RingError

from .journal import JournalFull

log = logging.getLogger("qag.recorder")

PRESSURE_MIN_S = 0.05  # a write in flight this long, with a ring half full, is spilled (Recorder._pressed)


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


class _InFlight:
    """The batch being committed on the writer thread (at most one: batches commit strictly in order)."""

    __slots__ = ("chunks", "future", "positions", "prepared", "runs", "since")

    def __init__(self, future, prepared, runs: int, chunks):
        self.future = future
        self.prepared = prepared
        self.positions = prepared.positions  # {slot: ring position after the batch's last run}
        self.runs = runs
        self.chunks = chunks
        self.since = time.monotonic()


class Recorder:
    """Drains `source`'s rings into `store` until `stop_event` is set, then flushes and returns (`run()`).

    The exactly-once protocol, in the order of this class's methods:

    1. **Start** (`_start`): read each ring from the store's durable position for this segment (`sid`), or
       from the journal's, whichever is further (`resume_positions`): what is before it is already written
       or journalled, and is released now if a crash came between the write and the release.
    2. **Batch** (`_read_rings`): runs are read from every ring in turn (no ring starves the others) into
       one open batch, by size (`batch_max`) and by time (`batch_ms`).
    3. **Flush** (`_flush`, the one place a batch leaves): into the store, or, while spilling, into the
       journal. Into the store: the batch is prepared (decoded) here and committed on the one writer
       thread (`_commit`), overlapping the reading of the next batch, one commit at a time, so event ids
       commit in order. The commit records how far into each ring the batch goes in the same transaction
       or insert.
    4. **Release** (`_finish`): only once that commit returned are the rings released up to it (LAYOUT.md
       R5). A commit that fails or hangs for `spill_after_s` (with a journal) `_detach`es its batch into
       the journal, and the recorder spills from then on; whether or not that commit lands, the drain
       sorts it out (step 6). Without a journal a failed write is retried until it succeeds; at stop it
       is abandoned and no later batch may commit (its positions would release the abandoned runs).
    5. **Spill** (`_spill`, `_pump`): a batch goes into the journal as one frame that also says how far
       into each ring the journal holds runs, then the rings are released up to it. A full journal holds
       the batch, in order, and no more is read from the rings, which then keep the rest.
    6. **Drain** (`_drain`, `_Drainer`): the journal goes into the store oldest frame first, committed under
       the journal's own source in the same transaction or insert as its runs, before any newer run;
       runs the store already holds under their ring's source are dropped by ring position. When the
       journal is (nearly) drained, new batches wait for the last drain (`CLOSE_S`), then go straight
       into the store again.

    `publish(state)` is called after each committed batch and about once a second when idle.
    """

    def __init__(self, source, store, stop_event: threading.Event, batch_max: int = 5000, batch_ms: int = 50,
                 publish=None, source_id: str | None = None, prune_every_s: float = 10.0,
                 prune_rows: int = 5000, idle_sleep_ms: float = 5.0, stop_grace_s: float = 5.0,
                 journal=None, spill_after_s: float = 1.0):
        self.store = store
        self.stop_event = stop_event
        self.batch_max = batch_max
        self.batch_ms = batch_ms
        self.publish = publish
        self.prune_every_s = prune_every_s
        self.prune_rows = prune_rows
        self.idle_sleep_ms = idle_sleep_ms
        self.stop_grace_s = stop_grace_s
        self.journal = journal
        self.spill_after_s = spill_after_s
        self.sid = source_id or source_identity(source)
        self.rings = [source.ring(i) for i in range(source.ring_count())]
        self.state = RecorderState(self.sid)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qag-recorder-writer")
        # reading
        self.cursor: dict[int, int] = {}   # ring slot -> position read up to
        self.start_ring = 0       # ring the next read starts from, rotated so no ring starves the others
        self.batch: list = []     # the open batch: [(slot, [(pos_after, payload), ...])], one chunk per ring read
        self.nbatch = 0
        self.batch_t0 = 0.0
        # writing
        self.pending: _InFlight | None = None
        self.abandoned = False    # a write given up at stop: nothing later may commit
        self.prune_fut = None
        self.next_prune = 0.0
        self.last_publish = 0.0
        self.idle = idle_sleep_ms / 1000.0
        self.stop_deadline: float | None = None
        # the journal side: spilling while the store cannot be written or the journal still holds runs
        self.spilling = False
        self.drainer: _Drainer | None = None
        self.drain_fut = None
        self.next_drain = 0.0
        self.drain_delay = 0.05
        self.closing = 0.0        # while spilling: until when new batches wait for the last drain (0: they don't)
        self.held: list = []      # [(chunks, positions, n, replay)] batches a full journal could not take yet, in order
        self.jpositions: dict[int, int] = {}  # ring slot -> how far the journal holds runs of this segment

    def run(self) -> RecorderState:
        self._start()
        try:
            while self._round():
                pass
            return self.state
        finally:
            self.writer.shutdown(wait=True)

    # -- 1. start ---------------------------------------------------------------------------------------
    def _start(self) -> None:
        state, store, journal, sid = self.state, self.store, self.journal, self.sid
        if journal is None:
            durable = store.positions(sid)
        else:
            # Not from this thread: a store that does not answer (a held lock, a frozen server) must not
            # keep the rings from being drained; whatever the answer is, the drainer runs after it. (A
            # lambda: the store is opened on first use, and that belongs on the writer thread too.)
            first = self.writer.submit(lambda: store.positions(sid))
            t_end = time.monotonic() + START_WAIT_S
            while not first.done() and time.monotonic() < t_end and not self.stop_event.is_set() \
                    and all(r.head - r.tail < r.capacity // 2 for r in self.rings):
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
            for slot, p in journal.ring_positions(sid).items():
                if p > durable.get(slot, -1):
                    durable[slot] = p
        self.cursor = resume_positions(self.rings, durable)
        state.positions = dict(self.cursor)
        self.next_prune = time.monotonic() + self.prune_every_s
        if journal is not None:
            self.spilling = not state.store_up or journal.pending_bytes > 0
            self.drainer = _Drainer(store, journal)
            self.jpositions = journal.ring_positions(sid)
            state.journal_bytes, state.journal_runs = journal.pending_bytes, journal.pending_runs
            if self.spilling and state.store_up:
                log.info("the journal holds %d runs (%d bytes): draining them before newer runs",
                         state.journal_runs, state.journal_bytes)

    # -- the loop -----------------------------------------------------------------------------------------
    def _round(self) -> bool:
        """One turn: read the rings, settle the write in flight, prune, drain the journal, flush a due batch,
        else sleep. False: the recorder is done (stopped, or a write abandoned at stop)."""
        stopping = self.stop_event.is_set()
        if stopping and self.stop_deadline is None:
            # On stop, drain what the rings hold (the arbiter stops producers first), but for at most
            # stop_grace_s, so producers that keep going cannot keep us alive.
            self.stop_deadline = time.monotonic() + self.stop_grace_s
        if self.held:
            self._pump()
        got, caught_up = 0, True  # caught up: every ring read returned all it held (not cut short by room)
        if not self.held and self.batch_max - self.nbatch > 0 and self.rings \
                and not (stopping and time.monotonic() > self.stop_deadline):
            read = self._read_rings()
            if read is None:
                return False
            got, caught_up = read
        now = time.monotonic()
        if self.pending is not None:
            if self.pending.future.done():
                if not self._settle():
                    return False
                if not self.spilling:
                    self._publish()
            elif self.journal is not None and (now - self.pending.since > self.spill_after_s or self._pressed(now)):
                # A write that neither commits nor fails (a store that stopped answering), or one the rings
                # cannot wait for any longer: spill.
                p, self.pending = self.pending, None
                self._detach(p, f"a write has not returned for {now - p.since:.1f} s"
                             + (" and the rings are half full" if self._pressed(now) else ""))
        self._prune(now, stopping)
        if self.drainer is not None:
            self._drain(now, stopping)
        full = self.nbatch >= self.batch_max
        due = self.batch and (full or stopping or (now - self.batch_t0) * 1000.0 >= self.batch_ms)
        if due and not self.held and not (self.spilling and self.closing):
            return self._flush()  # and the next turn at once
        if stopping and not got and self.spilling and (self.journal.pending_bytes or self.held or self.batch) \
                and time.monotonic() < self.stop_deadline:
            pass  # stopping: give the journal's drain (if the store is back) until the deadline
        elif stopping and not got:
            if self.pending is not None:
                self._settle()
            self._publish()
            return False
        if got and (stopping or not caught_up):
            return True  # a backlog: read on at once
        self._sleep(now, got)
        return True

    def _sleep(self, now: float, got: int) -> None:
        # Caught up, idle, or a partial batch waiting for its time: beat, then sleep. A recorder that woke
        # every 0.5 ms to pick up each run as it came woke several times per call, on the workers' cores;
        # polling every 5 ms still cost ~20 us per call at 500 calls/s (measured, bench/recorder.py --ab).
        # So: an open batch sleeps to its deadline (the rings hold seconds of runs), one wakeup per batch;
        # with no batch open, polls back off to batch_ms.
        if now - self.last_publish >= 1.0:
            self._publish()
        if got:
            self.idle = self.idle_sleep_ms / 1000.0
        if self.batch:
            wait = min(max(0.0, self.batch_ms / 1000.0 - (now - self.batch_t0)), 0.1)
        else:
            wait = self.idle
            self.idle = min(self.idle * 2, max(self.idle_sleep_ms, self.batch_ms) / 1000.0)
        if self.spilling:
            wait = min(wait, 0.02)  # drains and held frames are polled
        self.stop_event.wait(wait)

    # -- 2. batch -----------------------------------------------------------------------------------------
    def _read_rings(self) -> tuple[int, bool] | None:
        """Read every ring once, from the one after last turn's first, into the open batch, up to its room.
        Returns (runs read, caught up), or None when the recorder is done (a write abandoned at stop)."""
        rings, cursor, state, nrings = self.rings, self.cursor, self.state, len(self.rings)
        got = 0
        room = self.batch_max - self.nbatch
        caught_up = True
        for k in range(nrings):
            slot = (self.start_ring + k) % nrings
            try:
                recs = rings[slot].read_from(cursor[slot], room)
            except RingError as e:  # a record failing its checksum or length
                # Past a corrupt record nothing can be parsed, and stopping would stop every ring (the
                # arbiter would restart us into the same record): write what was read, then skip this
                # ring to its head, counted and logged, never silently.
                if self.batch and not self._flush():
                    return None
                if self.pending is not None:
                    self._settle()
                if self.abandoned:
                    return None
                if self.held:
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
                if not self.batch:
                    self.batch_t0 = time.monotonic()
                self.batch.append((slot, recs))
                cursor[slot] = recs[-1][0]
                got += len(recs)
                self.nbatch += len(recs)
                room -= len(recs)
                if room <= 0:
                    caught_up = False
                    break
        self.start_ring = (self.start_ring + 1) % nrings
        return got, caught_up

    # -- 3. flush -----------------------------------------------------------------------------------------
    def _flush(self) -> bool:
        """The open batch is due: into the store (its commit overlapping the reading of the next), or into
        the journal while spilling. False: the write before it was abandoned at stop (the recorder ends)."""
        chunks, n = self.batch, self.nbatch
        self.batch, self.nbatch = [], 0
        if self.spilling:
            positions = {slot: recs[-1][0] for slot, recs in chunks if recs}
            if self.pending is not None:  # never release past a batch still in flight: spill it first
                p, self.pending = self.pending, None
                self._detach(p, "spilling")
        else:
            prepared = self.store.prepare(self.sid, chunks)
            if self.pending is not None:
                if not self._settle():
                    return False
                self._publish()
            if not self.spilling:
                self.pending = _InFlight(self.writer.submit(self._commit, prepared), prepared, n, chunks)
                return True
            # settling the write before it found the store gone: this batch follows it into the journal
            # (never sent, so nothing to replay)
            positions = dict(prepared.positions)
        self._spill(chunks, positions, n)
        return True

    def _commit(self, prepared):
        """Writer thread: commit, retrying until it succeeds (with a journal: for spill_after_s, then
        StoreDown); a write whose outcome we could not see (connection lost at COMMIT) is checked
        against the durable positions first."""
        store, state = self.store, self.state
        delay = 0.05
        stop_seen = None
        t0 = time.monotonic()
        while True:
            try:
                return store.commit(prepared)
            except Exception as e:  # any store failure is retried, never dropped
                state.errors += 1
                state.last_error = f"{type(e).__name__}: {e}"[:500]
                if self.journal is not None and time.monotonic() - t0 >= self.spill_after_s:
                    raise StoreDown(state.last_error) from e
                if self.stop_event.is_set():
                    stop_seen = stop_seen or time.monotonic()
                    if time.monotonic() - stop_seen > self.stop_grace_s:
                        raise  # stopping: the runs stay in the rings (tails not released)
                if self.journal is None:
                    log.warning("run store write failed (retrying in %.2fs): %s", delay, state.last_error)
                time.sleep(delay)
                delay = min(delay * 2, 2.0 if self.journal is None else 0.25)
                try:
                    durable = store.positions(self.sid)
                    if prepared.positions and all(durable.get(s, -1) >= p for s, p in prepared.positions.items()):
                        return (0, 0, 0)  # it did commit
                except Exception:  # noqa: BLE001, S110 - still away: the commit is retried
                    pass

    # -- 4. release ---------------------------------------------------------------------------------------
    def _settle(self) -> bool:
        """Finish the write in flight (below). False: it was abandoned at stop."""
        p, self.pending = self.pending, None
        self._finish(p)
        return not self.abandoned

    def _finish(self, p: _InFlight) -> None:
        """Wait for a batch's commit, then release the rings up to it; or spill it (`_detach`)."""
        fut, state = p.future, self.state
        if self.journal is not None and not fut.done():
            # Wait for the write no longer than spill_after_s from its start: a store that does not answer
            # (a held lock, a frozen server) must not stop the draining of the rings.
            # In slices: the rings fill meanwhile, and they must not fill before the spill (_pressed).
            deadline = p.since + self.spill_after_s
            while not fut.done() and time.monotonic() < deadline and not self._pressed(time.monotonic(), p):
                wait_for_futures([fut], timeout=min(0.01, max(0.0, deadline - time.monotonic())))
            if not fut.done():
                self._detach(p, f"a write has not returned for {time.monotonic() - p.since:.1f} s")
                return
        try:
            _first, last, _written = fut.result()
        except StoreDown as e:
            self._detach(p, str(e))
            return
        except Exception:
            if self.journal is not None:
                self._detach(p, state.last_error or "write failed")
                return
            if not self.stop_event.is_set():
                raise
            # Gave up while stopping: the rings keep these runs for the next recorder, and no later batch
            # may commit (its positions would release these).
            log.exception("run store write abandoned at stop; the runs stay in the rings")
            self.abandoned = True
            return
        for slot, pos in p.positions.items():
            self.rings[slot].release(pos)
            state.positions[slot] = pos
        if last:
            state.last_event_id = last
        state.records += p.runs
        state.batches += 1
        state.bad_records = getattr(self.store, "bad_records", 0)

    def _pressed(self, now: float, p: _InFlight | None = None) -> bool:
        """A write has been in flight for PRESSURE_MIN_S and some ring is at least half full: the rings hold
        less than the spill delay at this rate, so waiting longer would fill them (and lose runs) before the
        journal takes the batch. Spill now rather than when spill_after_s is up."""
        p = p or self.pending
        if p is None or now - p.since < PRESSURE_MIN_S:
            return False
        for ring in self.rings:
            if ring.head - ring.tail >= ring.capacity // 2:
                return True
        return False

    def _detach(self, p: _InFlight, reason: str) -> None:
        """Spill the batch in flight: whether or not its commit lands, the drainer sorts it out (it runs
        after that commit on the one writer thread, and drops runs the store already has, or, on
        ClickHouse, sends the very same inserts again: their tokens make them land once)."""
        self._store_down(reason)
        self.spilling = True
        p.future.add_done_callback(_quiet)
        replay = getattr(self.store, "replay_data", lambda b: None)(p.prepared)
        self._spill(p.chunks, p.positions, p.runs, replay)

    # -- 5. spill -----------------------------------------------------------------------------------------
    def _spill(self, chunks, positions, n, replay=None) -> bool:
        """Main thread: put a batch in the journal, then release the rings up to it. False when the
        journal is full: the batch is held (in order, behind any held before it) and no more is read from
        the rings, which keep the rest."""
        self.held.append((chunks, positions, n, replay))
        return self._pump()

    def _pump(self) -> bool:
        journal, state = self.journal, self.state
        while self.held:
            chunks, positions, n, replay = self.held[0]
            new = dict(self.jpositions)
            for slot, pos in positions.items():
                if pos > new.get(slot, -1):
                    new[slot] = pos
            try:
                journal.append(self.sid, new, chunks, replay)
            except (JournalFull, OSError) as e:  # past the bound, or the disk refusing (ENOSPC, EIO): hold
                if not state.journal_full:
                    state.journal_full = True
                    log.error("run journal cannot take more runs (%s); the rings fill now, and runs are lost "
                              "(qag_runs_lost_total) once they are full", e)
                    self._publish()  # before the rings fill: a worker's loss log names this reason
                return False
            self.held.pop(0)
            if state.journal_full:
                state.journal_full = False
                log.info("run journal takes runs again")
            self.jpositions.update(new)
            for slot, pos in positions.items():
                if pos > self.rings[slot].tail:
                    self.rings[slot].release(pos)
                state.positions[slot] = max(state.positions.get(slot, 0), pos)
            state.spilled += n
            state.journal_bytes = journal.pending_bytes
            state.journal_runs += n
        return True

    def _store_down(self, reason: str) -> None:
        state = self.state
        if state.store_up:
            state.store_up = False
            state.store_down_since = time.monotonic()
            log.warning("run store unavailable (%s): spilling runs to the journal %s", reason, self.journal.dir)
        state.last_error = reason[:500]

    # -- 6. drain -----------------------------------------------------------------------------------------
    def _drain(self, now: float, stopping: bool) -> None:
        """While spilling: one drain of the journal into the store at a time (on the writer thread, between
        commits), backing off while the store is away; back to the store once the journal is in it."""
        journal, state = self.journal, self.state
        if self.drain_fut is not None and self.drain_fut.done():
            try:
                pos, n = self.drain_fut.result()
            except Exception as e:  # noqa: BLE001 - the store is still away: try again later
                self._store_down(f"{type(e).__name__}: {e}")
                self.next_drain = now + self.drain_delay
                self.drain_delay = min(self.drain_delay * 2, 0.5)
                self.closing = 0.0
            else:
                self._store_back()
                journal.mark_drained(pos)
                state.records += n
                state.drained += n
                state.last_event_id = max(state.last_event_id, self.drainer.last_event_id)
                state.batches += 1 if n else 0
                state.journal_runs = journal.pending_runs
                state.journal_bytes = journal.pending_bytes
                self.drain_delay = 0.05
                self.next_drain = now
                if n:
                    self._publish()
                if journal.pending_runs <= self.batch_max and not self.closing and not self.held:
                    # Nearly drained: hold new batches back for one more drain (at most CLOSE_S), or a store
                    # slower than the arrivals between two drains (each drain takes what came meanwhile)
                    # would keep every run in the journal.
                    self.closing = now + CLOSE_S
            self.drain_fut = None
        if self.closing and (now > self.closing or stopping):
            self.closing = 0.0  # the last drain is taking too long: spill the held batch after all
        if self.spilling and self.drain_fut is None and self.pending is None:
            if journal.pending_bytes > 0 or not state.store_up:
                if now >= self.next_drain:
                    # larger drains than batches: the journal is a backlog (one insert or transaction per
                    # drain has a fixed cost)
                    self.drain_fut = self.writer.submit(self.drainer.step, max(self.batch_max, DRAIN_MAX))
            elif not self.held:
                self.spilling = False  # the journal is in the store: newer runs go straight there
                self.closing = 0.0
                state.journal_runs = 0
                log.info("run journal drained; recording straight into the run store again")

    def _store_back(self) -> None:
        state, journal = self.state, self.journal
        if not state.store_up:
            state.store_up = True
            log.info("run store back after %.1f s; draining %d runs (%d bytes) from the journal",
                     time.monotonic() - state.store_down_since, journal.pending_runs, journal.pending_bytes)

    # -- housekeeping -------------------------------------------------------------------------------------
    def _prune(self, now: float, stopping: bool) -> None:
        if self.prune_fut is not None and self.prune_fut.done():
            try:
                deleted = self.prune_fut.result()
            except Exception as e:  # noqa: BLE001 - retention retries on the next round
                log.warning("run store retention failed: %s", e)
                deleted = 0
            # More expired rows: the next chunk soon, never one long delete.
            self.next_prune = now + (0.2 if deleted else self.prune_every_s)
            self.prune_fut = None
        if self.prune_fut is None and now >= self.next_prune and not stopping and not self.spilling:
            # One bounded chunk, queued on the writer between two commits: retention runs under sustained
            # load too, and delays a commit by one chunk at most.
            self.prune_fut = self.writer.submit(self.store.prune, self.prune_rows)
            self.next_prune = float("inf")

    def _publish(self) -> None:
        state = self.state
        state.heartbeat_ns = time.time_ns()
        for slot, r in enumerate(self.rings):
            state.lag_bytes[slot] = r.head - state.positions.get(slot, 0)
        if self.journal is not None:
            state.journal_bytes = self.journal.pending_bytes
        if self.publish is not None:
            try:
                self.publish(state)
            except Exception:  # a broken observer must not stop recording
                log.exception("recorder publish callback failed")
        self.last_publish = time.monotonic()


def run_recorder(source, store, stop_event: threading.Event, *args, **kwargs) -> RecorderState:
    """`Recorder(source, store, stop_event, ...).run()`: drain the rings into the store until `stop_event`
    is set, then flush and return the final state (the arguments are Recorder's)."""
    return Recorder(source, store, stop_event, *args, **kwargs).run()


def _quiet(fut):
    """A detached write's outcome: logged, never raised (its runs are in the journal)."""
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("detached run store write failed: %s", fut.exception())


__all__ = ["Recorder", "RecorderState", "StoreDown", "resume_positions", "run_recorder", "source_identity"]
