"""Memory fences for Python writers and readers of the segment (LAYOUT.md [Memory ordering]).

x86-64 (TSO) keeps store->store and load->load order in hardware, and every Python-level access is
an opaque C call the compiler cannot reorder across, so `fence()` is a no-op there. Elsewhere
(aarch64) the stdlib has no fence primitive; POSIX 4.12 lists sem_post/sem_wait among the
functions that "synchronize memory", so a post+wait pair on a private semaphore is the fence
(about 1 us, paid only by writers and by seqlock readers on those hosts).
"""
from __future__ import annotations

import os
import platform

import posix_ipc

_MACHINE = platform.machine().lower()
MODE = os.environ.get("QAG_SHM_FENCE") or ("none" if _MACHINE in ("x86_64", "amd64", "i686", "i386") else "sem")

_sem: posix_ipc.Semaphore | None = None
_sem_pid = 0


def _noop() -> None:
    return None


def _sem_fence() -> None:
    global _sem, _sem_pid
    pid = os.getpid()
    if _sem is None or _sem_pid != pid:  # one private semaphore per process (re-made after fork)
        sem = posix_ipc.Semaphore(f"/qag-fence-{pid}-{id(object())}", posix_ipc.O_CREX, initial_value=0)
        sem.unlink()  # nameless from here on: nothing to clean up if the process dies
        _sem, _sem_pid = sem, pid
    _sem.release()  # sem_post: release, and an RMW that is ordered with the wait below (RCsc on aarch64)
    _sem.acquire()  # sem_wait: acquire; never blocks (value was just raised to 1)


fence = _noop if MODE == "none" else _sem_fence
