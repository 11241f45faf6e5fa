"""The response cache region (shm/LAYOUT.md [Response cache]) shared by processes: writers and readers at once in a
small region that laps many times (no torn or foreign read, the byte bound held, eviction), a writer SIGKILLed in
the middle of a put (repaired on takeover, R14), and a filler killed holding its claim (R13)."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import struct
import time

import pytest

from shm import Segment
from shm import responses as R
from tests.conftest import shm_name

FORK = mp.get_context("fork")
SIZE = 2 * 1024 * 1024
RESPONSES = 256 * 1024  # a 240 KiB arena: the stress laps it many times
KEYS = [R.prefix(f"q{i % 5}", 1, "main", 1, 1, bytes(16)) + R.suffix("json", 1, 10, (i, f"v{i}")) for i in range(600)]
DURATION = float(os.environ.get("QAG_SHM_STRESS_SECONDS", "4"))


@pytest.fixture()
def name():
    yield from shm_name("qag-test-resp")


def body_for(key: bytes, writer: int, seq: int, n: int) -> bytes:
    """The key's digest, who wrote it and a filler of varying length, then a digest of all of it: a tear or
    another key's body shows."""
    head = hashlib.sha256(key).digest() + struct.pack("<II", writer, seq)
    payload = head + bytes([seq & 0xFF]) * n
    return payload + hashlib.blake2b(payload, digest_size=16).digest()


def check(key: bytes, body: bytes) -> None:
    payload, digest = body[:-16], body[-16:]
    assert hashlib.blake2b(payload, digest_size=16).digest() == digest, "torn response read"
    assert payload[:32] == hashlib.sha256(key).digest(), "another key's answer"


def _writer(name, writer, deadline, out):
    seg = Segment.attach(name)
    rc = seg.responses
    rnd = random.Random(writer)
    puts = 0
    while time.time() < deadline:
        key = rnd.choice(KEYS)
        h = R.key_hash(key)
        body = body_for(key, writer, puts, rnd.randrange(0, 3000))
        rc.put(key, h, body, rows=1, has_more=False, ttl_s=60, etag=bytes(16))
        puts += 1
        if puts % 7 == 0:
            rec = rc.get(key, h)
            if rec is not None:
                rc.refresh(key, h, rec)
    out.put(("w", puts))


def _reader(name, deadline, out):
    seg = Segment.attach(name)
    rc = seg.responses
    rnd = random.Random(os.getpid())
    found = reads = 0
    seen: list[tuple[bytes, int]] = []
    while time.time() < deadline:
        key = rnd.choice(KEYS)
        rec = rc.get(key, R.key_hash(key))
        reads += 1
        if rec is not None:
            check(key, rec.body)
            rc.hit(rec)
            found += 1
            seen.append((key, rec.pos))
        if len(seen) > 50:  # positions read a while ago, being lapped by the writers now: R9 must refuse each
            old_key, old_pos = seen.pop(0)   # one whose bytes changed, whatever the index says
            again = rc.read_at(old_pos, old_key)
            if again is not None:
                check(old_key, again.body)
    out.put(("r", reads, found))


def test_writers_and_readers_at_once_no_torn_read_and_the_bound_held(name):
    seg = Segment.create(name, SIZE, slots=4, responses_size=RESPONSES)
    try:
        out = FORK.Queue()
        deadline = time.time() + DURATION
        procs = [FORK.Process(target=_writer, args=(name, w, deadline, out)) for w in range(2)]
        procs += [FORK.Process(target=_reader, args=(name, deadline, out)) for _ in range(2)]
        for p in procs:
            p.start()
        results = [out.get(timeout=DURATION + 60) for _ in procs]
        for p in procs:
            p.join(10)
            assert p.exitcode == 0, "a reader saw a torn or foreign answer (its assertion failed)"
        rc = seg.responses
        st = rc.stats()
        puts = sum(r[1] for r in results if r[0] == "w")
        found = sum(r[2] for r in results if r[0] == "r")
        assert st["wpos"] > 3 * rc.capacity, f"the arena lapped {st['wpos'] / rc.capacity:.1f} times only"
        assert st["puts"] >= puts and st["evictions"] > 0 and found > 0
        assert st["live_bytes"] <= rc.capacity and st["dirty"] == 0
        entries = rc.entries()
        assert sum(e["bytes"] for e in entries) == st["live_bytes"] and len(entries) == st["live_entries"]
        for e in entries:
            check(e["_key"], rc.get(e["_key"], R.key_hash(e["_key"])).body)
    finally:
        seg.close()


def _killed_mid_put(name, ready):
    """Take the writers' lock and start a put as R7 does, then die with the reservation made and half the
    bytes written (never reaching wpos or the index)."""
    seg = Segment.attach(name)
    rc = seg.responses
    seg._lock.acquire()
    q = seg.words()
    q[(rc.offset + 200) // 8] = 1  # dirty
    w = q[(rc.offset + 64) // 8]
    q[(rc.offset + 128) // 8] = w + 8192  # wlimit: reserved
    a = rc.arena + w % rc.capacity
    seg._mm[a:a + 4096] = b"\xde\xad\xbe\xef" * 1024
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_killed_mid_put_is_repaired_on_takeover(name):
    seg = Segment.create(name, SIZE, slots=4, responses_size=RESPONSES)
    try:
        rc = seg.responses
        keep = KEYS[0]
        assert rc.put(keep, R.key_hash(keep), body_for(keep, 0, 0, 100), rows=1, has_more=False, ttl_s=60,
                      etag=bytes(16))
        ready = FORK.Event()
        p = FORK.Process(target=_killed_mid_put, args=(name, ready))
        p.start()
        p.join(10)
        assert p.exitcode == -signal.SIGKILL and ready.is_set()
        check(keep, rc.get(keep, R.key_hash(keep)).body)  # readers are not affected by the dead writer
        t = time.monotonic()
        nxt = KEYS[1]
        assert rc.put(nxt, R.key_hash(nxt), body_for(nxt, 0, 1, 100), rows=1, has_more=False, ttl_s=60,
                      etag=bytes(16))  # K3: the dead owner's lock taken over, then R14
        assert time.monotonic() - t < 3
        st = rc.stats()
        assert st["repairs"] == 1 and st["dirty"] == 0 and st["wpos"] > 8192
        assert seg.stat()["lock"]["takeovers"] == 1
        for i in range(400):  # the tail walks over the pads: later laps are sound
            k = KEYS[i % len(KEYS)]
            assert rc.put(k, R.key_hash(k), body_for(k, 1, i, 1500), rows=1, has_more=False, ttl_s=60,
                          etag=bytes(16))
        for e in rc.entries():
            check(e["_key"], rc.get(e["_key"], R.key_hash(e["_key"])).body)
        assert rc.stats()["live_bytes"] == sum(e["bytes"] for e in rc.entries())
    finally:
        seg.close()


def _claim_and_die(name, h, ready):
    seg = Segment.attach(name)
    token, _ = seg.responses.claim(h, 30.0)
    assert token > 0
    ready.set()
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_filler_that_dies_does_not_hold_the_others(name):
    """R13: another process's live claim makes this one wait; once it is killed the wait ends at once (not after
    its 31 s claim) and the key can be claimed."""
    seg = Segment.create(name, SIZE, slots=4, responses_size=RESPONSES)
    try:
        rc = seg.responses
        h = R.key_hash(KEYS[3])
        ready = FORK.Event()
        p = FORK.Process(target=_claim_and_die, args=(name, h, ready))
        p.start()
        assert ready.wait(10)
        token, slot = rc.claim(h, 30.0)
        assert token == 0 and rc.filling(h, slot), "a live filler's claim is honoured"
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        assert not rc.filling(h, slot), "a dead filler still holds the key"
        token, _ = rc.claim(h, 30.0)
        assert token > 0
        rc.release(h, token)
    finally:
        seg.close()
