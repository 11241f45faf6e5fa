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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qag.recorder", description=__doc__)
    ap.add_argument("--segment", required=True, help="shared-memory segment name")
    ap.add_argument("--store", default=os.environ.get("QAG_RUN_STORE_URL", ""),
                    help="run store URL: a SQLite path, postgresql://, clickhouse:// or chdb:///dir")
    ap.add_argument("--slot", type=int, default=None,
                    help="process slot whose heartbeat this recorder publishes in the segment")
    ap.add_argument("--batch-max", type=int, default=None,
                    help="most runs per batch (default: the store's hint: 5000 SQLite, 20000 PostgreSQL, 64000 ClickHouse)")
    ap.add_argument("--batch-ms", type=int, default=50)
    ap.add_argument("--attach-timeout", type=float, default=10.0,
                    help="seconds to wait for the segment to appear")
    args = ap.parse_args(argv)
    if not args.store:
        ap.error("--store (or QAG_RUN_STORE_URL) is required")
    logging.basicConfig(level=os.environ.get("QAG_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s qag: recorder %(levelname)s %(message)s")
    log = logging.getLogger("qag.recorder")
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

    from ..runstore import open_store
    from . import run_recorder

    try:
        store = open_store(args.store)
        store.ensure_schema()
    except Exception as e:  # noqa: BLE001 - report and let the arbiter restart us with backoff
        log.error("run store %s unavailable: %s", _redact(args.store), e)
        return EXIT_STORE

    publish = None
    if args.slot is not None:
        seg.set_slot(args.slot, "recorder")

        counted = [0]

        def publish(state, _seg=seg, _slot=args.slot):
            # Heartbeat value: the last committed event id (LAYOUT.md [Slots] M2). Ring positions need
            # no copy: each ring's tail is the recorder's durable position in that ring.
            _seg.set_heartbeat(_slot, state.last_event_id)
            if state.batches > counted[0]:
                _seg.counter_add(_slot, "qag_recorder_batches_total", (), state.batches - counted[0])
                counted[0] = state.batches

    log.info("recording segment %s into %s", args.segment, _redact(args.store))
    batch_max = args.batch_max or getattr(store, "batch_max_hint", 5000)
    state = run_recorder(seg, store, stop, batch_max=batch_max, batch_ms=args.batch_ms, publish=publish)
    log.info("stopped: %d runs in %d batches, last event id %d", state.records, state.batches, state.last_event_id)
    store.close()
    seg.close()
    return EXIT_OK


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
