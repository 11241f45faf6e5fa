"""The writers' lock: one named POSIX semaphore, with its owner in the segment so a dead owner's lock is taken over.

LAYOUT.md [Writer lock] is the contract. A writer killed while holding the semaphore cannot post
it, so waiters poll with a timeout and, when the recorded owner is gone, take the lock over
(ownership moves to them; the semaphore stays held). Takeovers are serialised by a second
semaphore so two waiters never both take over.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Self

import posix_ipc

from . import layout as L

POLL_S = 0.05  # how often a waiter looks at the owner; also bounds a takeover's delay
ORPHAN_S = 1.0  # lock held with no owner recorded and no progress this long: its taker died before claiming it


class LockTimeout(RuntimeError):
    """The writers' lock stayed held by a live process for the whole timeout."""


def proc_start(pid: int) -> int:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    return int(data.rsplit(b")", 1)[1].split()[19])


def owner_alive(pid: int, start: int) -> bool:
    """True while the process that took the lock still runs (same pid AND same start time: pids are reused)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start == 0 or proc_start(pid) == start


class WriterLock:
    """Context manager around the named semaphore; `on_takeover` repairs what a dead owner left half-written."""

    __slots__ = ("held", "on_takeover", "pid", "q", "recovery", "sem", "start")

    def __init__(self, sem: posix_ipc.Semaphore, recovery: posix_ipc.Semaphore, q: memoryview,
                 on_takeover: Callable[[], None]) -> None:
        self.sem = sem
        self.recovery = recovery
        self.q = q
        self.pid = 0
        self.start = 0
        self.on_takeover = on_takeover
        self.held = False

    def _claim(self) -> None:
        pid = os.getpid()
        if pid != self.pid:  # after fork
            self.pid, self.start = pid, proc_start(pid)
        q = self.q
        q[L.L_OWNER_PID // 8] = pid
        q[L.L_OWNER_START // 8] = self.start
        q[L.L_ACQUIRED_AT_NS // 8] = time.time_ns()
        q[L.L_SEQ // 8] = q[L.L_SEQ // 8] + 1
        self.held = True

    def acquire(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        orphan_seen: tuple[int, float] | None = None
        while True:
            try:
                self.sem.acquire(POLL_S)
                self._claim()
                return
            except posix_ipc.BusyError:
                pass
            except posix_ipc.SignalError:
                continue  # a signal handler ran (gunicorn workers get them): wait again
            q = self.q
            owner, start, seq = q[L.L_OWNER_PID // 8], q[L.L_OWNER_START // 8], q[L.L_SEQ // 8]
            if owner:
                orphan_seen = None
                if not owner_alive(owner, start) and self._take_over(owner, start, seq):
                    return
            else:
                # Held but no owner recorded: either a holder between sem_wait and _claim (microseconds)
                # or one that died there. Only a state unchanged for ORPHAN_S is treated as dead.
                now = time.monotonic()
                if orphan_seen is None or orphan_seen[0] != seq:
                    orphan_seen = (seq, now)
                elif now - orphan_seen[1] > ORPHAN_S and self._take_over(0, start, seq):
                    return  # (start may be non-zero: the holder died between the two stores of release())
            if time.monotonic() >= deadline:
                raise LockTimeout(f"shm writer lock held by pid {owner} for more than {timeout:.1f} s")

    def _take_over(self, owner: int, start: int, seq: int) -> bool:
        try:
            self.recovery.acquire(1.0)
        except posix_ipc.BusyError:
            return False  # another waiter is taking over right now (or died doing it: see LAYOUT.md)
        try:
            q = self.q
            if (q[L.L_OWNER_PID // 8], q[L.L_OWNER_START // 8], q[L.L_SEQ // 8]) != (owner, start, seq):
                return False  # someone else took it over, or the owner released it meanwhile
            if self.sem.value != 0:
                return False  # it was released after all: acquire it the normal way
            self._claim()
            q[L.L_RECOVERIES // 8] = q[L.L_RECOVERIES // 8] + 1
            self.on_takeover()
            return True
        finally:
            self.recovery.release()

    def release(self) -> None:
        q = self.q
        q[L.L_OWNER_PID // 8] = 0
        q[L.L_OWNER_START // 8] = 0
        self.held = False
        self.sem.release()

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
