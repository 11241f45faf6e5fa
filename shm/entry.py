"""The cache entry convention (LAYOUT.md [Cache entries]): msgpack [1, [[kind, ident, gen], ...], payload].

The segment stores opaque bytes; callers that follow this convention get generation checks for free.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    from .segment import Segment

ENTRY_FORMAT = 1


def pack_entry(payload: Any, gens: Iterable[tuple[str, str, int]]) -> bytes:
    """Encode payload with the generations (kind, ident, value) it was built from."""
    return msgpack.packb([ENTRY_FORMAT, [[k, i, g] for k, i, g in gens], payload], use_bin_type=True)


def unpack_entry(data: bytes) -> tuple[Any, list[tuple[str, str, int]]]:
    fmt, gens, payload = msgpack.unpackb(data, raw=False)
    if fmt != ENTRY_FORMAT:
        raise ValueError(f"cache entry format {fmt}, expected {ENTRY_FORMAT}")
    return payload, [(k, i, g) for k, i, g in gens]


def entry_current(seg: Segment, gens: Iterable[tuple[str, str, int]]) -> bool:
    """True when every generation the entry was built from is still the segment's (one 8-byte read each)."""
    return all(seg.gen(k, i) == g for k, i, g in gens)
