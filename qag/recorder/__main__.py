"""`python -m qag.recorder --segment NAME --store URL`: the recorder process the arbiter starts."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NO_SEGMENT = 3
EXIT_STORE = 4
EXIT_JOURNAL = 5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qag.recorder", description=__doc__)
    ap.add_argument("--segment", required=True, help="shared-memory segment name")
    ap.add_argument("--store", default=None,
                    help="run store URL: a SQLite path, postgresql://, clickhouse:// or chdb:///dir "
                         "(default: QAG_RUN_STORE_URL)")
    ap.add_argument("--slot", type=int, default=None,
                    help="process slot whose heartbeat this recorder publishes in the segment")
    ap.add_argument("--batch-max", type=int, default=None,
                    help="most runs per batch (default: the store's hint: 5000 SQLite, 20000 PostgreSQL, "
                         "64000 ClickHouse)")
    ap.add_argument("--batch-ms", type=int, default=50)
    ap.add_argument("--attach-timeout", type=float, default=10.0,
                    help="seconds to wait for the segment to appear")
    ap.add_argument("--journal", default=None,
                    help="journal directory (default: QAG_JOURNAL_DIR, else QAG_HOME/journal/<segment>); 'off': none")
    args = ap.parse_args(argv)
    from .. import config

    cfg = config.load()  # the settings as declared in qag/config.py (QAG_RUN_STORE_URL, QAG_LOG_LEVEL, QAG_JOURNAL_*)
    if args.store is None:
        args.store = cfg.run_store_url
    if not args.store:
        ap.error("--store (or QAG_RUN_STORE_URL) is required")
    from .. import logs
    logs.setup("recorder", cfg.log_format, cfg.log_level,
               text_format="%(asctime)s qag: recorder %(levelname)s %(message)s")
    log = logging.getLogger("qag.recorder")
    # While the store is away every retry would log a driver warning: the recorder logs the outage
    # once itself (and when it ends), so the drivers' own retries stay quiet.
    for noisy in ("clickhouse_connect", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        from setproctitle import setproctitle

        setproctitle("qag: recorder")
    except ImportError:  # the title is cosmetic: never a reason not to record
        pass

    stop = threading.Event()
    # Signal handlers only enqueue (STYLE 5): the loop sees the event, flushes and returns.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    import shm

    seg = None
    deadline = time.monotonic() + args.attach_timeout
    while seg is None:
        try:
            seg = shm.Segment.attach(args.segment)
        except shm.LayoutError as e:
            if time.monotonic() >= deadline or stop.is_set():
                log.error("cannot attach segment %s: %s", args.segment, e)
                return EXIT_NO_SEGMENT
            time.sleep(0.1)

    from . import run_recorder
    from .journal import Journal, JournalError

    jcfg = journal_settings(cfg)
    journal = None
    jdir = args.journal or jcfg["dir"] or os.path.join(jcfg["home"], "journal", args.segment.strip("/"))
    if jdir != "off":
        try:
            journal = Journal(jdir, max_bytes=jcfg["max_bytes"], fsync=jcfg["fsync"])
        except JournalError as e:
            log.error("%s", e)
            return EXIT_JOURNAL
        if journal.pending_bytes:
            log.info("journal %s holds %d runs (%d bytes) not yet in the run store", jdir, journal.pending_runs,
                     journal.pending_bytes)

    store = LazyStore(args.store)
    if journal is None:
        try:
            store.open()
        except Exception as e:  # noqa: BLE001 - report and let the arbiter restart us with backoff
            log.error("run store %s unavailable: %s", _redact(args.store), e)
            return EXIT_STORE
    # With a journal the store is opened on first use, by the recorder's writer thread: a store away
    # or not answering at start never keeps the rings from being drained (into the journal).

    publish = None
    if args.slot is not None:
        seg.set_slot(args.slot, "recorder")

        counted = {"batches": 0, "spilled": 0}

        def publish(state, _seg=seg, _slot=args.slot):
            # Heartbeat value: the last committed event id (LAYOUT.md [Slots] M2). Ring positions need
            # no copy: each ring's tail is the recorder's durable position in that ring.
            _seg.set_heartbeat(_slot, state.last_event_id)
            if state.batches > counted["batches"]:
                _seg.counter_add(_slot, "qag_recorder_batches_total", (), state.batches - counted["batches"])
                counted["batches"] = state.batches
            if state.spilled > counted["spilled"]:
                _seg.counter_add(_slot, "qag_journal_spilled_runs_total", (), state.spilled - counted["spilled"])
                counted["spilled"] = state.spilled
            _seg.gauge_set(_slot, "qag_run_store_up", (), 1 if state.store_up else 0)
            _seg.gauge_set(_slot, "qag_journal_bytes", (), state.journal_bytes)
            _seg.gauge_set(_slot, "qag_journal_runs", (), state.journal_runs)
            _seg.gauge_set(_slot, "qag_journal_full", (), 1 if state.journal_full else 0)

        publish(_Initial(journal))

    log.info("recording segment %s into %s", args.segment, _redact(args.store))
    batch_max = args.batch_max or batch_max_hint(args.store)
    state = run_recorder(seg, store, stop, batch_max=batch_max, batch_ms=args.batch_ms, publish=publish,
                         journal=journal, spill_after_s=jcfg["spill_after_ms"] / 1000.0)
    log.info("stopped: %d runs in %d batches, last event id %d", state.records, state.batches, state.last_event_id)
    store.close()
    if journal is not None:
        journal.close(remove_if_empty=True)
    seg.close()
    return EXIT_OK


class _Initial:
    """What publish() shows before the first batch: the store assumed up, the journal as opened."""

    def __init__(self, journal):
        self.last_event_id = self.batches = self.spilled = 0
        self.store_up = True
        self.journal_bytes = journal.pending_bytes if journal is not None else 0
        self.journal_runs = journal.pending_runs if journal is not None else 0
        self.journal_full = False


def journal_settings(cfg) -> dict:
    """The journal's settings (declared in qag/config.py: QAG_JOURNAL_*), and QAG_HOME."""
    return {"home": cfg.home, "dir": cfg.journal_dir, "max_bytes": cfg.journal_max_bytes,
            "fsync": cfg.journal_fsync, "spill_after_ms": cfg.journal_spill_after_ms}


def batch_max_hint(url: str) -> int:
    """The store's batch size hint (declared by its class), known from its URL (the store may not be
    reachable yet)."""
    from ..runstore import CLICKHOUSE_SCHEMES

    if url.startswith(CLICKHOUSE_SCHEMES):
        from ..runstore.clickhouse import ClickHouseRunStore

        return ClickHouseRunStore.batch_max_hint
    from ..runstore.sql import SqlRunStore

    if url.startswith(("postgresql://", "postgres://")):
        return SqlRunStore.PG_BATCH_MAX_HINT
    return SqlRunStore.batch_max_hint


class LazyStore:
    """The run store, opened (and its schema ensured) on first use and again after a failed open, so
    a recorder starts, and records into its journal, while the store is away."""

    def __init__(self, url: str):
        import threading

        self.url = url
        self._store = None
        self._lock = threading.Lock()

    def open(self):
        with self._lock:
            return self._open()

    def _open(self):
        if self._store is None:
            from ..runstore import open_store

            st = open_store(self.url)
            try:
                st.ensure_schema()
            except BaseException:
                st.close()
                raise
            self._store = st
        return self._store

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.open(), name)

    def close(self):
        if self._store is not None:
            self._store.close()


def _redact(url: str) -> str:
    """A URL without its password, for logs."""
    if "://" in url and "@" in url.split("://", 1)[1]:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        user = cred.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


if __name__ == "__main__":
    sys.exit(main())
