"""The recorder process on a real segment: producers in other processes push runs into their rings
while `python -m qag.recorder` drains them; it is killed with SIGKILL mid-burst and restarted. Every run
must end up in the store exactly once (events, history, usage), on SQLite, PostgreSQL and chDB."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from qag.runstore import StoreSettings, open_store
from shm import Segment
from tests.conftest import unlink_segment

from .test_runstore import pg_fresh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PER_PRODUCER = 25_000
PRODUCER = textwrap.dedent("""
    import sys, time
    import shm
    from qag import entries
    seg = shm.Segment.attach(sys.argv[1]); slot = int(sys.argv[2]); n = int(sys.argv[3])
    ring = seg.ring(slot)
    lost = 0
    for i in range(n):
        if not ring.push(entries.encode_run(key_name=f"k{slot}", query="q", status=500 if i % 10 == 0 else 200,
                                   rows=1, request_id=f"p{slot}-{i}", served_by=f"worker:{slot}"), 10_000):
            lost += 1
        if i % 500 == 499:
            time.sleep(0.01)  # ~50,000 runs/s per producer: the burst outlasts the recorder's kills
    print(lost)
""")


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def journal_dir(name) -> str:
    """The recorders of one test share a journal (as an instance's do), out of the user's QAG_HOME."""
    return os.path.join(tempfile.gettempdir(), "qag-rectest-journal" + name.replace("/", "-"))


def start_recorder(name, url, slot):
    return subprocess.Popen([sys.executable, "-m", "qag.recorder", "--segment", name, "--store", url,
                             "--slot", str(slot), "--batch-max", "2000", "--batch-ms", "20",
                             "--journal", journal_dir(name)],
                            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _cmdline(pid) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


@pytest.fixture()
def segment():
    name = f"/qag-rectest-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    seg = Segment.create(name, slots=3)  # rings 0 and 1 for the producers, slot 2 for the recorder
    yield name, seg
    shutil.rmtree(journal_dir(name), ignore_errors=True)
    seg.close()
    unlink_segment(name)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "clickhouse"])
def test_sigkill_mid_burst_loses_nothing_and_duplicates_nothing(kind, segment):
    name, seg = segment
    tmp = tempfile.mkdtemp(prefix="qag-rec-kill-")
    url = {"sqlite": lambda: os.path.join(tmp, "runs.db"), "postgresql": lambda: pg_fresh("qag_rec_test_kill"),
           "clickhouse": lambda: f"chdb://{tmp}/ch"}[kind]()
    rnd = random.Random(kind)
    rec = start_recorder(name, url, 2)
    producers = [subprocess.Popen([sys.executable, "-c", PRODUCER, name, str(s), str(PER_PRODUCER)], cwd=ROOT,
                                  env=env(), stdout=subprocess.PIPE) for s in (0, 1)]
    rings = [seg.ring(0), seg.ring(1)]
    deadline = time.monotonic() + 30
    while _cmdline(rec.pid) != "qag: recorder" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _cmdline(rec.pid) == "qag: recorder"  # what ps shows (DESIGN.md, Processes)
    kills = 0
    try:
        for frac in (0.15, 0.45):
            # wait until the recorder has committed past `frac` of what will be pushed, then kill it
            # a random few ms later, most likely with a batch in flight
            deadline = time.monotonic() + 60
            while rings[0].tail < frac * PER_PRODUCER * 40 and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rnd.uniform(0, 0.02))
            rec.send_signal(signal.SIGKILL)
            rec.wait(10)
            kills += 1
            rec = start_recorder(name, url, 2)
        for p in producers:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0 and out.strip() == b"0", out  # no run was refused by a full ring
        deadline = time.monotonic() + 120
        while any(r.tail != r.head for r in rings) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(r.tail == r.head for r in rings), [r.stat() for r in rings]
        # introspection as the oracle (STYLE 12): the recorder's slot says who it is, its last event id,
        # and how many batches it committed since its slot was last claimed
        info = seg.stat()["process_slots"][2]
        assert info["role"] == "recorder" and info["heartbeat_value"] > 0
        assert info["counters"].get("qag_recorder_batches_total", 0) >= 1
        rec.send_signal(signal.SIGTERM)
        out, _ = rec.communicate(timeout=60)
        assert rec.returncode == 0, out.decode()[-2000:]
    finally:
        for p in producers + [rec]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert kills == 2
    store = open_store(url, StoreSettings())
    try:
        total = 2 * PER_PRODUCER
        ids, last = [], 0
        while True:
            got = store.events_after(last, limit=20_000)
            if not got:
                break
            ids += [g["request_id"] for g in got]
            last = got[-1]["event_id"]
        assert len(ids) == total, f"{len(ids)} events for {total} runs"
        assert set(ids) == {f"p{s}-{i}" for s in (0, 1) for i in range(PER_PRODUCER)}
        c = store.counts()
        assert c == {"qag_events": total, "qag_history": total, "usage_calls": total}
        errors = sum(u["errors"] for u in store.usage(per="day"))
        assert errors == 2 * len(range(0, PER_PRODUCER, 10))
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)
