"""End to end: a client that reconnects to `/events` at random points over 1,000,000 events misses none and
repeats none (issue 5). The run store (runs.db in QAG_HOME, as `qag serve` keeps it on SQLite) is filled
through the recorder's own write path before the server starts; the client reads the stream in pieces of
random size, resuming with Last-Event-ID from the last id it got, or now and then from an earlier one (a
client that lost the tail of what it read)."""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

import requests

from qag import entries
from qag.runstore import StoreSettings, open_store
from tests.conftest import start_server

N = 1_000_000


def test_reconnecting_over_a_million_events_misses_none_and_repeats_none():
    home = tempfile.mkdtemp(prefix="qag-e2e-million-")
    store = open_store(os.path.join(home, "runs.db"), StoreSettings())
    store.ensure_schema()
    now_us = time.time_ns() // 1000
    batch = 20_000
    for j in range(0, N, batch):
        store.write_batch("prefill", [
            (0, i + 1, entries.encode_run(at_us=now_us - (N - i) * 10, key_name=f"key{i % 5}", query="q", version=1,
                                 connection="c", status=200, code=None, rows=1, duration_us=100, bytes=10,
                                 request_id=f"r{i}", served_by="worker:0", transport="http", route="/q/{name}"))
            for i in range(j, j + batch)])
    first, last_id = store.events_after(0, limit=1)[0]["event_id"], store.last_event_id()
    store.close()

    srv = start_server({"QAG_HOME": home}, args=("--workers", "1"))
    rnd = random.Random(11)
    seen: list[int] = []
    last, reconnects, rewinds = 0, 0, 0
    t0 = time.time()
    while not seen or seen[-1] < last_id:
        # the stream follows for ever once it has sent what exists: ask at most for what is left
        piece = min(rnd.choice((1, 7, 500, 20_000, 60_000, 150_000)), N - len(seen))
        headers = {**srv.admin, "Last-Event-ID": str(last)}
        r = requests.get(srv.base + f"/events?limit={piece}", headers=headers, timeout=300)
        assert r.status_code == 200, r.text[:300]
        got = [int(line[4:]) for line in r.text.splitlines() if line.startswith("id: ")]
        assert got, "the stream stalled"
        assert got[0] > last and got == sorted(set(got)), "an event repeated or out of order within a piece"
        seen += got
        reconnects += 1
        if rnd.random() < 0.15 and len(seen) > 1:
            # resume from an earlier id this client holds: everything after it must come again, once
            back = rnd.randrange(max(0, len(seen) - 50_000), len(seen))
            last = seen[back]
            del seen[back + 1:]
            rewinds += 1
        else:
            last = got[-1]
        assert time.time() - t0 < 900, f"too slow: {len(seen)} events after {reconnects} reconnects"
    assert len(seen) == N, (len(seen), reconnects, rewinds)
    assert seen[0] == first and seen[-1] == last_id
    assert all(b > a for a, b in zip(seen, seen[1:])), "an event repeated or came out of order"
    assert reconnects > 10 and rewinds > 0
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)
