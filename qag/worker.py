"""A worker's application: attach the segment, build the runtime and the app for this slot."""
from __future__ import annotations

import logging

from qag.app import QagApp
from qag.metrics import Observer
from qag.runtime import Runtime
from qag.store import Store

log = logging.getLogger("qag.worker")


def build_worker_app(cfg, *, slot: int, segment_name: str | None) -> QagApp:
    store = Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key)
    segment = None
    gens = None
    observer = Observer(slot=slot)
    if segment_name:
        import shm
        segment = shm.Segment.attach(segment_name)
        gens = segment
        observer = Observer(backend=segment, slot=slot)
    runtime = Runtime(cfg, store, gens, slot=slot)
    return QagApp(cfg, runtime, observer=observer, segment=segment)
