"""Multi-process stress of the segment (LAYOUT.md [Memory ordering]): torn reads detected, SIGKILL mid-write
survived."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import struct
import time

import posix_ipc
import pytest

from shm import Segment
from tests.conftest import shm_name

FORK = mp.get_context("fork")
SIZE = 2 * 1024 * 1024  # ~400 cache slots: 1500 keys force evictions and slot reuse
KEYS = [f"plan:key{i}:q{i % 7}:1".encode() for i in range(1500)]
IDENTS = [f"k{i}" for i in range(8)]
DURATION = float(os.environ.get("QAG_SHM_STRESS_SECONDS", "5"))


@pytest.fixture()
def name():
    yield from shm_name("qag-test")


def make_value(key: bytes, writer: int, seq: int, rnd: random.Random, max_len: int) -> bytes:
    """key, writer, seq, a body of varying length and byte, and a digest over all of it: any tear shows."""
    body_len = rnd.randrange(16, max_len - len(key) - 64)
    head = struct.pack("<HIIH", writer, seq, body_len, len(key)) + key
    body = bytes([seq & 0xFF]) * body_len
    return head + body + hashlib.blake2b(head + body, digest_size=16).digest()


def verify(key: bytes, value: bytes) -> None:
    payload, digest = value[:-16], value[-16:]
    assert hashlib.blake2b(payload, digest_size=16).digest() == digest, "torn cache read"
    _writer_id, _seq, body_len, klen = struct.unpack_from("<HIIH", payload)
    assert payload[12:12 + klen] == key, "cache returned another key's value"
    assert len(payload) == 12 + klen + body_len


def _writer(name, writer, deadline, out):
    seg = Segment.attach(name)
    rnd = random.Random(writer)
    room = seg.cache_stats()["max_entry"] - 40
    puts = bumps = 0
    while time.time() < deadline:
        key = rnd.choice(KEYS)
        assert seg.cache_put(key, make_value(key, writer, puts, rnd, room))
        puts += 1
        if puts % 10 == 0:
            seg.bump("key", IDENTS[rnd.randrange(len(IDENTS))])
            bumps += 1
    out.put(("writer", puts, bumps))
    seg.close()


def _reader(name, deadline, out):
    seg = Segment.attach(name)
    rnd = random.Random(os.getpid())
    last = {i: 0 for i in IDENTS}
    last_global = 0
    reads = hits = 0
    while time.time() < deadline:
        key = rnd.choice(KEYS)
        value = seg.cache_get(key)
        reads += 1
        if value is not None:
            verify(key, value)
            hits += 1
        g = seg.global_gen()
        assert g >= last_global, "global generation went backwards"
        last_global = g
        ident = IDENTS[reads % len(IDENTS)]
        v = seg.gen("key", ident)
        assert v >= last[ident], "generation went backwards"
        last[ident] = v
    out.put(("reader", reads, hits, seg.cache_stats()["busy_misses"]))
    seg.close()


def test_stress_no_torn_reads(name):
    seg = Segment.create(name, SIZE, slots=4)
    try:
        deadline = time.time() + DURATION
        out = FORK.Queue()
        procs = [FORK.Process(target=_writer, args=(name, w, deadline, out)) for w in (1, 2)]
        procs += [FORK.Process(target=_reader, args=(name, deadline, out)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(DURATION + 30)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0], "a reader found a torn value or a writer failed"
        results = [out.get(timeout=5) for _ in procs]
        writers = [r for r in results if r[0] == "writer"]
        readers = [r for r in results if r[0] == "reader"]
        puts, bumps = sum(r[1] for r in writers), sum(r[2] for r in writers)
        hits = sum(r[2] for r in readers)
        assert puts > 1000 and hits > 1000, results
        assert sum(seg.gen("key", i) for i in IDENTS) == bumps == seg.global_gen()
        stats = seg.cache_stats()
        assert stats["puts"] == puts and stats["evictions"] > 0 and stats["repairs"] == 0
        for key in KEYS:  # the final state is whole too
            value = seg.cache_get(key)
            if value is not None:
                verify(key, value)
        print(f"stress: {puts} puts, {bumps} bumps, {sum(r[1] for r in readers)} reads, {hits} hits, "
              f"busy misses {sum(r[3] for r in readers)}")
    finally:
        seg.close()


def _put_forever(name, values):
    seg = Segment.attach(name)
    while True:
        for key, value in values:
            seg.cache_put(key, value)


def test_sigkill_mid_cache_write_leaves_segment_usable(name):
    seg = Segment.create(name, SIZE, slots=2)
    rnd = random.Random(7)
    room = seg.cache_stats()["max_entry"] - 40
    values = [(k, make_value(k, 9, i, rnd, room)) for i, k in enumerate(KEYS[:50])]
    try:
        kills = 0
        for _ in range(8):
            p = FORK.Process(target=_put_forever, args=(name, values))
            p.start()
            time.sleep(0.05 + rnd.random() * 0.1)
            os.kill(p.pid, signal.SIGKILL)  # anywhere: usually inside cache_put, often holding the lock
            p.join(5)
            kills += 1
            t0 = time.monotonic()
            assert seg.cache_put(b"after-kill", b"ok")  # no deadlock: a dead owner's lock is taken over (K3)
            assert time.monotonic() - t0 < 3
            for key, _value in values:
                got = seg.cache_get(key)
                if got is not None:
                    verify(key, got)  # never a half-written value (C3, K4)
            assert seg.stat()["lock"]["owner_pid"] == 0
        st = seg.stat()
        print(f"sigkill: {kills} kills, {st['lock']['takeovers']} lock takeovers, {st['cache']['repairs']} repairs")
        assert st["lock"]["dirty_cache_slot"] == 0
        assert st["cache"]["repairs"] <= st["lock"]["takeovers"]
        assert seg.cache_get(b"after-kill") == b"ok"
        present = sum(seg.cache_get(k) is not None for k, _v in values) + 1
        assert st["cache"]["used"] == present  # occupancy stays exact through repairs (K4)
    finally:
        seg.close()


PATTERNS = (0, 0xFFFFFFFFFFFFFFFF, 0x00000000FFFFFFFF, 0xFFFFFFFF00000000)


def _flip_words(shm_name, deadline):
    import mmap
    m = posix_ipc.SharedMemory(shm_name)
    mm = mmap.mmap(m.fd, 4096)
    m.close_fd()
    q, d = memoryview(mm).cast("Q"), memoryview(mm).cast("d")
    i = 0
    while time.time() < deadline:
        for _ in range(1000):
            q[8] = PATTERNS[i & 3]  # the same store shm uses for u64 fields
            d[16] = -1.5 if i & 1 else 3.0e300  # and for f64 counter cells
            i += 1


def test_memoryview_u64_f64_stores_are_single_copy_atomic(name):
    """[Memory ordering], Python: memoryview.cast('Q'/'d') item get/set never shows half of a store."""
    import mmap
    m = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096)
    mm = mmap.mmap(m.fd, 4096)
    m.close_fd()
    q, d = memoryview(mm).cast("Q"), memoryview(mm).cast("d")
    p = FORK.Process(target=_flip_words, args=(name, time.time() + 1.5))
    p.start()
    seen_q, seen_d, reads = set(), set(), 0
    while p.is_alive():
        for _ in range(1000):
            seen_q.add(q[8])
            seen_d.add(d[16])
            reads += 1
    p.join(5)
    q.release()
    d.release()
    mm.close()
    assert seen_q <= set(PATTERNS), f"torn u64: {sorted(seen_q - set(PATTERNS))[:4]}"
    assert seen_d <= {0.0, -1.5, 3.0e300}, f"torn f64: {sorted(seen_d)[:4]}"
    assert len(seen_q) == 4 and reads > 10000  # it really raced
