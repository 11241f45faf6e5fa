"""Rings across real processes (LAYOUT.md [Rings]): nothing lost, nothing torn, back-pressure, resumable reads."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import struct
import time
import uuid

import posix_ipc
import pytest

from shm import RingError, Segment

FORK = mp.get_context("fork")
SIZE = 1024 * 1024  # small rings (128 KiB at 2 slots, 64 KiB at 4): many wraps per test


@pytest.fixture()
def seg():
    n = f"/qag-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    s = Segment.create(n, SIZE, slots=4)
    yield s
    s.close()
    s.unlink()


def record(slot: int, i: int) -> bytes:
    """A run-like record of varying size whose last 8 bytes check the rest (torn records would fail)."""
    body = struct.pack("<II", slot, i) + bytes([i % 251]) * (i * 37 % 700)
    return body + hashlib.blake2b(body, digest_size=8).digest()


def check(rec: bytes) -> tuple[int, int]:
    body, digest = rec[:-8], rec[-8:]
    assert hashlib.blake2b(body, digest_size=8).digest() == digest, "torn ring record"
    return struct.unpack_from("<II", body)


def _produce(name, slot, n, lost_q):
    seg = Segment.attach(name)
    r = seg.ring(slot)
    lost = 0
    for i in range(n):
        if not r.push(record(slot, i), wait_ms=2000):
            lost += 1
    lost_q.put(lost)
    seg.close()


def test_ring_across_processes_nothing_lost_or_torn(seg):
    n = 20000
    lost_q = FORK.Queue()
    procs = [FORK.Process(target=_produce, args=(seg.name, s, n, lost_q)) for s in (0, 1, 2)]
    for p in procs:
        p.start()
    expect = {0: 0, 1: 0, 2: 0}
    rings = {s: seg.ring(s) for s in expect}
    while any(p.is_alive() for p in procs) or any(r.head != r.tail for r in rings.values()):
        for s, r in rings.items():
            recs = r.read(500)
            for _pos, payload in recs:
                slot, i = check(payload)
                assert (slot, i) == (s, expect[s]), "lost, duplicated or reordered record"
                expect[s] += 1
            if recs:
                r.release(recs[-1][0])
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    assert [lost_q.get(timeout=5) for _ in procs] == [0, 0, 0]
    assert expect == {0: n, 1: n, 2: n}
    st = seg.stat()["process_slots"][0]["ring"]
    assert st["head"] == st["tail"] > 5 * st["capacity"]  # wrapped many times


def test_full_ring_is_back_pressure_not_silent_loss(seg):
    r = seg.ring(3)
    rec = b"x" * 1000
    pushed = 0
    while r.push(rec):
        pushed += 1
    assert r.head - r.tail <= r.capacity and pushed == r.capacity // 1008
    assert r.push(rec, wait_ms=30) is False  # still full after waiting: the caller counts it lost
    got = r.read(3)
    r.release(got[-1][0])
    assert r.push(rec) and r.push(rec) and r.push(rec)
    assert not r.push(rec)
    with pytest.raises(ValueError):
        r.push(b"")
    with pytest.raises(ValueError):
        r.push(b"y" * r.capacity)


def test_read_is_non_destructive_and_resumable(seg):
    r = seg.ring(0)
    for i in range(10):
        assert r.push(b"run-%d" % i)
    first = r.read(4)
    assert [p for _, p in first] == [b"run-0", b"run-1", b"run-2", b"run-3"]
    assert r.read(4) == first  # nothing consumed until release
    rest = r.read_from(first[-1][0], 100)  # the recorder resumes from its own durable position
    assert [p for _, p in rest] == [b"run-%d" % i for i in range(4, 10)]
    r.release(first[1][0])
    assert r.tail == first[1][0] and [p for _, p in r.read(1)] == [b"run-2"]
    with pytest.raises(RingError):
        r.read_from(0, 1)  # before tail
    with pytest.raises(RingError):
        r.release(r.head + 8)  # beyond head
    r.release(r.head)
    assert r.read(10) == [] and r.head == r.tail


def _produce_and_die(name, slot, ready):
    seg = Segment.attach(name)
    r = seg.ring(slot)
    i = 0
    while True:
        if r.push(record(slot, i)):
            i += 1
            if i == 20:
                ready.set()


def test_producer_killed_mid_push_leaves_only_whole_records(seg):
    ready = FORK.Event()
    p = FORK.Process(target=_produce_and_die, args=(seg.name, 1, ready))
    p.start()
    r = seg.ring(1)
    got = 0
    try:
        assert ready.wait(20)
        deadline = time.monotonic() + 20
        while got < 3000 and time.monotonic() < deadline:  # drain while it runs, then kill it inside push
            recs = r.read(200)
            for _pos, payload in recs:
                assert check(payload) == (1, got)
                got += 1
            if recs:
                r.release(recs[-1][0])
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
    for _pos, payload in r.read(10**6):
        assert check(payload) == (1, got)
        got += 1
    assert got >= 3000  # it kept producing while we drained


def test_attach_sees_same_positions():
    n = f"/qag-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    a = Segment.create(n, SIZE, slots=2)
    try:
        assert a.ring(1).push(b"hello")
        b = Segment.attach(n)
        assert (b.ring(1).head, b.ring(1).tail, b.ring(1).capacity) == (a.ring(1).head, 0, a.ring(1).capacity)
        assert b.ring(1).read(1)[0][1] == b"hello"
        with pytest.raises(IndexError):
            b.ring(2)
        b.close()
    finally:
        a.close()
        try:
            a.unlink()
        except posix_ipc.ExistentialError:
            pass
