"""Changes made elsewhere reach this host's generations: another host on the same PostgreSQL store (through
`LISTEN qag_changes`, delivered at the other host's commit), or an edit that did not go through this host
(the CLI, a script): the store's change log is read as a fallback every half second (POLL_S).

Nothing can be lost between the two. Every change carries a sequence number that commits in order
(qag/store.py, migration 2), and the watcher remembers in the segment the last one it applied (its slot's
`heartbeat_value`, shm/LAYOUT.md [Slot metadata] W1). A watcher that starts, restarts or reconnects LISTENs
first, then applies every change after that number — or, when the segment cannot tell (a new segment, a
position the store does not have), bumps every generation — and only then says it is caught up.

Fail closed while it is not: workers trust cached entries only while the watcher's heartbeat is fresh
(`WatchedGenerations`), so they re-read the store on every call (503 `store_unavailable` if it is away), and
the arbiter bumps every generation while the watcher is dead or behind, so the data plane's published
entries stop matching and it forwards to Python. Every audited change maps to the generation it
invalidates; a bump this host already made costs at most one extra rebuild, never a wrong answer.
"""
from __future__ import annotations

import itertools
import logging
import select
import threading
import time

log = logging.getLogger("qag.changes")
_time_ns = time.time_ns

KIND = {"connection": "connection", "query": "query", "api_key": "key", "admin": "key"}
RESPONSE_CACHE = "response_cache"  # audit entity of an eviction (qag/http/cache.py): evicted here, no generation
POLL_S = 0.5     # the fallback read of the change log (one indexed SELECT), and the heartbeat's period
INDEX_MAX = 4096  # generation slots whose index a worker keeps (WatchedGenerations._index)
STALE_S = 3.0    # a heartbeat older than this: the watcher is not caught up (hung, or cannot read the store);
                 # six periods, so a loaded machine's late beat does not send the workers to the store
ROLE = "other"   # the watcher's slot role (shm/LAYOUT.md [Slot metadata] W1)
BATCH = 10_000
WATCHER_SLOT_FROM_TOP = 3  # below the recorder's and the data plane's slots (qag/server/arbiter.py)


def kind_of(entity: str, name: str) -> tuple[str, str]:
    if entity == "admin":
        return "key", "\x00admins"
    if entity == "role":
        return "key", "role:" + name   # a role's callers hold key-kind plans named role:<name> (qag/identity.py)
    return KIND.get(entity, entity), name


def watcher_slot(slots: int) -> int:
    """The change watcher's slot (shm/LAYOUT.md [Slot metadata] W1)."""
    return slots - WATCHER_SLOT_FROM_TOP


def watcher_current(seg, slot: int, now_ns: int | None = None, stale_s: float = STALE_S) -> bool:
    """W2: the watcher in `slot` is caught up: it published a position and beat within stale_s."""
    beat_ns, value = seg.heartbeat(slot)
    now_ns = time.time_ns() if now_ns is None else now_ns
    return value != 0 and now_ns - beat_ns < stale_s * 1e9


class WatchedGenerations:
    """The segment's generations as a worker's runtime sees them: the real ones while this host's change
    watcher is caught up (W2); otherwise a value no cached entry was built from, different at every read, so
    every lookup rebuilds from the store and nothing built meanwhile matches the segment (the plane never
    uses it). Everything else (bumps, gauges) goes to the segment."""

    __slots__ = ("_beat", "_index", "_never", "_q", "_stale_ns", "_value", "seg", "slot")

    def __init__(self, seg, slot: int, stale_s: float = STALE_S):
        self.seg = seg
        self.slot = slot
        self._stale_ns = int(stale_s * 1e9)
        self._beat, self._value = seg.heartbeat_indexes(slot)
        self._q = seg.words()  # the hot path reads the two heartbeat words itself: two loads, no calls (M2)
        self._index: dict[tuple[str, str], int] = {}  # (kind, ident) -> its u64 index in the segment
        self._never = itertools.count(1 << 62)  # real generations never get near 2^62

    def current(self) -> bool:
        q = self._q
        return q[self._value] != 0 and _time_ns() - q[self._beat] < self._stale_ns

    def gen(self, kind: str, ident: str) -> int:
        q = self._q
        if q[self._value] != 0 and _time_ns() - q[self._beat] < self._stale_ns:
            i = self._index.get((kind, ident))
            if i is None:
                i = self._index_of(kind, ident)
            return q[i]
        return next(self._never)

    def _index_of(self, kind: str, ident: str) -> int:
        """ident's generation slot in the segment (seg.gen_index: fixed for the segment's life), kept per name;
        bounded, since a caller may name queries that do not exist."""
        if len(self._index) >= INDEX_MAX:
            self._index.clear()
        i = self._index[(kind, ident)] = self.seg.gen_index(kind, ident)
        return i

    def global_gen(self) -> int:
        if self.current():
            return self.seg.global_gen()
        return next(self._never)

    def bump(self, kind: str, ident: str) -> int:
        return self.seg.bump(kind, ident)

    def gauge_cells(self, name, labels=()):
        return self.seg.gauge_cells(name, labels)

    def gauge_set(self, slot, name, labels=(), value=0):
        return self.seg.gauge_set(slot, name, labels, value)

    def __getattr__(self, name):
        return getattr(self.seg, name)


class ChangeWatcher:
    """The loop of `python -m qag.server.changes`: one per instance, in its own process and slot."""

    def __init__(self, store, segment, slot: int, stop: threading.Event, listen_name: str = "qag-changes"):
        self.store = store
        self.seg = segment
        self.slot = slot
        self.stop = stop
        self.listen_name = listen_name[:63]
        info = segment.slot_info(slot)
        prev = info["heartbeat_value"] if info["role"] == ROLE else 0
        # W1: the position a predecessor published (value = last applied sequence number + 1), if any
        self.position: int | None = prev - 1 if prev else None
        segment.set_slot(slot, ROLE)  # heartbeat_value 0: not caught up until catch_up() says so
        self.applied = 0
        self.full_bumps = 0

    def catch_up(self, check_position: bool = True) -> None:
        """Every change committed after the position into the generations, then publish the new position.
        check_position (on every (re)connection): also compare the position with the store's own (W3)."""
        top = self.store.change_position() if check_position or self.position is None else self.position
        if self.position is None or self.position > top:
            # W3: what this segment applied is unknown: every change up to `top` is in the store now, so
            # invalidating everything makes each cached entry re-read it; the ones after `top` follow.
            self.seg.bump_all()
            self.full_bumps += 1
            if self.position is None:
                log.debug("change watcher: no position in the segment (store at %d): every generation bumped", top)
            else:
                log.warning("change watcher: the segment is at change %d, the store at %d: every generation bumped",
                            self.position, top)
            self.position = top
        while True:
            rows = self.store.changes_since(self.position, BATCH)
            for seq, entity, name in rows:
                if entity == RESPONSE_CACHE:  # an administrator evicted cached answers on some host: here too
                    self.evict(name)
                else:
                    kind, ident = kind_of(entity, name)
                    self.seg.bump(kind, ident)
                self.position = seq
                self.applied += 1
            if len(rows) < BATCH:
                break
        self.seg.set_heartbeat(self.slot, self.position + 1)

    def evict(self, query: str) -> None:
        """`DELETE /api/v1/cache` made on any host (qag/http/cache.py): this host's answers of the query (`*`: all)
        leave its response cache (shm/LAYOUT.md [Response cache] R12)."""
        rc = self.seg.responses
        if rc.enabled:
            n = rc.remove(None if query == "*" else (lambda e: e.get("query") == query))
            log.debug("change watcher: %d cached answers of %s evicted", n, query)

    def not_current(self, why: str) -> None:
        """W2: say so at once (workers stop trusting their caches now, not STALE_S later)."""
        self.seg.set_heartbeat(self.slot, 0)
        log.warning("change watcher: not caught up: %s", why)

    def run(self) -> None:
        conn = None
        fresh = True  # a (re)connection: W3's full check
        while not self.stop.is_set():
            try:
                if self.store.is_pg and conn is None:
                    import psycopg2
                    conn = psycopg2.connect(self.store.url, application_name=self.listen_name, connect_timeout=3)
                    conn.autocommit = True
                    conn.cursor().execute("LISTEN qag_changes")
                    fresh = True
                # LISTEN is in effect before this read: a change committed later is notified or read next time
                self.catch_up(check_position=fresh)
                fresh = False
                if conn is not None:
                    ready, _, _ = select.select([conn], [], [], POLL_S)
                    if ready:
                        conn.poll()
                        conn.notifies.clear()
                else:
                    self.stop.wait(POLL_S)
            except Exception as exc:  # the store is away: keep trying; workers re-read it (or answer 503) meanwhile
                self.not_current(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
                fresh = True
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        pass
                conn = None
                self.stop.wait(POLL_S)
        self.seg.set_heartbeat(self.slot, 0)
        if conn is not None:
            conn.close()


def main(argv=None) -> int:
    """`python -m qag.server.changes --segment NAME --slot N`: the watcher as its own process (no store connection is
    ever inherited by a forked worker), supervised by the arbiter like the recorder."""
    import argparse
    import signal

    from qag import config
    from qag.store import Store
    ap = argparse.ArgumentParser(prog="python -m qag.server.changes")
    ap.add_argument("--segment", required=True)
    ap.add_argument("--slot", type=int, default=None, help="default: the arbiter's watcher slot")
    args = ap.parse_args(argv)
    try:
        from setproctitle import setproctitle
        setproctitle("qag: changes")
    except ImportError:
        pass
    import shm
    from qag import logs
    cfg = config.load()
    logs.setup("changes", cfg.log_format, "INFO", text_format="%(asctime)s qag: changes %(levelname)s %(message)s")
    seg = shm.Segment.attach(args.segment)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key)
    slot = watcher_slot(seg.slots) if args.slot is None else args.slot
    ChangeWatcher(store, seg, slot, stop, listen_name=f"qag-changes {args.segment}").run()
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
