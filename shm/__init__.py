"""qag's shared-memory segment: generations, a shared cache, per-slot rings and counters (layout: shm/LAYOUT.md).

Python-only, standalone (posix_ipc, mmap, struct, msgpack); the Rust data plane reads the same bytes.
"""
from .layout import DEFAULT_SIZE, HIST_BOUNDS, MAJOR, MINOR
from .lock import LockTimeout
from .ring import Ring, RingError
from .segment import LayoutError, Segment, SegmentFull, segment_name

__all__ = [
    "DEFAULT_SIZE",
    "HIST_BOUNDS",
    "MAJOR",
    "MINOR",
    "LayoutError",
    "LockTimeout",
    "Ring",
    "RingError",
    "Segment",
    "SegmentFull",
    "segment_name",
]
