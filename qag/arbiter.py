"""What the arbiter does around gunicorn: the shared segment's life and the recorder's supervision.

Signal handlers only enqueue; gunicorn's arbiter loop does the work.
"""
from __future__ import annotations

import hashlib
import logging
import os

log = logging.getLogger("qag.arbiter")


def instance_name(cfg) -> str:
    """Two `qag serve` on one host never share a segment: the name derives from QAG_HOME and the bind."""
    try:
        import shm
        return shm.segment_name(f"{cfg.home}|{cfg.bind}")
    except (ImportError, AttributeError):
        return "/qag-" + hashlib.sha256(f"{cfg.home}|{cfg.bind}".encode()).hexdigest()[:16]


class ArbiterHooks:
    def __init__(self, cfg):
        self.cfg = cfg
        self.segment = None
        self.segment_name: str | None = None
        self.recorder = None

    def start(self) -> str | None:
        try:
            import shm
        except ImportError:
            log.warning("the shm package is missing: workers share no cache (every call reads the store)")
            return None
        self.segment_name = instance_name(self.cfg)
        self.segment = shm.Segment.create(self.segment_name, self.cfg.shm_size)
        return self.segment_name

    def ready(self, server) -> None:
        pass

    def worker_exited(self, slot, pid) -> None:
        pass

    def stop(self) -> None:
        seg, self.segment = self.segment, None
        if seg is not None and os.getpid() == getattr(self, "_pid", os.getpid()):
            try:
                seg.unlink()
                seg.close()
            except Exception:
                pass
