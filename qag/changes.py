"""Changes made elsewhere reach this host's generations: another host on the same PostgreSQL store (through
`LISTEN qag_changes`, delivered at the other host's commit), or an edit that did not go through this host
(the CLI, a script): the audit log is polled as a fallback every QAG_CHANGE_POLL_S seconds.

Every audited change maps to the generation it invalidates; a bump this host already made costs at most
one extra rebuild, never a wrong answer.
"""
from __future__ import annotations

import logging
import select
import threading
import time

log = logging.getLogger("qag.changes")

KIND = {"connection": "connection", "query": "query", "api_key": "key", "admin": "key"}
POLL_S = 1.0
LOOKBACK = 256  # PostgreSQL assigns ids at insert, so a smaller id may commit later: look back and skip seen ids


def kind_of(entity: str, name: str) -> tuple[str, str]:
    if entity == "admin":
        return "key", "\x00admins"
    return KIND.get(entity, entity), name


class ChangeWatcher(threading.Thread):
    def __init__(self, store, segment, stop: threading.Event):
        super().__init__(name="qag-changes", daemon=True)
        self.store = store
        self.seg = segment
        self.stop = stop
        rows = store.changes_since(0, 1_000_000_000)
        self.last = rows[-1][0] if rows else 0
        # what was committed before this watcher started is already in every generation it could affect
        now = time.monotonic()
        self.seen: dict[int, float] = {r[0]: now for r in rows[-LOOKBACK:]}
        self.applied = 0

    def apply(self) -> None:
        rows = self.store.changes_since(max(0, self.last - LOOKBACK), 10_000)
        now = time.monotonic()
        for cid, entity, name in rows:
            if cid in self.seen or (cid <= self.last - LOOKBACK):
                continue
            self.seen[cid] = now
            if cid > self.last:
                self.last = cid
            kind, ident = kind_of(entity, name)
            self.seg.bump(kind, ident)
            self.applied += 1
        if len(self.seen) > 4 * LOOKBACK:
            floor = self.last - LOOKBACK
            self.seen = {k: v for k, v in self.seen.items() if k > floor}

    def run(self) -> None:
        conn = None
        while not self.stop.is_set():
            try:
                if self.store.is_pg and conn is None:
                    import psycopg2
                    conn = psycopg2.connect(self.store.url, application_name="qag-changes")
                    conn.autocommit = True
                    conn.cursor().execute("LISTEN qag_changes")
                    self.apply()  # anything committed before LISTEN took effect
                if conn is not None:
                    ready, _, _ = select.select([conn], [], [], POLL_S)
                    if ready:
                        conn.poll()
                        conn.notifies.clear()
                else:
                    self.stop.wait(POLL_S)
                self.apply()
            except Exception as exc:  # the store is away: keep trying, workers answer 503 meanwhile
                log.warning("change watcher: %s", exc)
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        pass
                conn = None
                self.stop.wait(POLL_S)
        if conn is not None:
            conn.close()


def main(argv=None) -> int:
    """`python -m qag.changes --segment NAME`: the watcher as its own process (no store connection is ever
    inherited by a forked worker), supervised by the arbiter like the recorder."""
    import argparse
    import signal

    from qag import config
    from qag.store import Store
    ap = argparse.ArgumentParser(prog="python -m qag.changes")
    ap.add_argument("--segment", required=True)
    args = ap.parse_args(argv)
    try:
        from setproctitle import setproctitle
        setproctitle("qag: changes")
    except ImportError:
        pass
    logging.basicConfig(level="INFO", format="%(asctime)s qag: changes %(levelname)s %(message)s")
    import shm
    cfg = config.load()
    seg = shm.Segment.attach(args.segment)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key)
    while not stop.is_set():
        try:
            w = ChangeWatcher(store, seg, stop)
            break
        except Exception as exc:
            log.warning("store unavailable: %s", exc)
            stop.wait(POLL_S)
    else:
        return 0
    w.run()
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
