"""The run record: one served call, as a worker or the data plane writes it into its ring.

A record is a msgpack array of the fields below, in this fixed order (format version 1). Readers
accept longer arrays (fields appended by a later minor version) and refuse another major `v`.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import msgpack

VERSION = 1

FIELDS = (
    "v", "at_us", "key_name", "query", "version", "connection", "status", "code", "rows",
    "duration_us", "bytes", "request_id", "served_by", "transport", "route",
)
NFIELDS = len(FIELDS)


class RunRecord(NamedTuple):
    v: int
    at_us: int            # call start, epoch microseconds UTC
    key_name: str | None
    query: str | None
    version: int | None
    connection: str | None
    status: int           # HTTP status sent
    code: str | None      # error code of the JSON error body, None on success
    rows: int
    duration_us: int
    bytes: int            # response body bytes
    request_id: str
    served_by: str        # "worker:N" or "plane"
    transport: str        # "http", "stream", ...
    route: str            # route template, e.g. "/q/{name}"


# One Packer per process: packb() builds a new Packer per call (~0.3 us more, measured).
_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_unpackb = msgpack.unpackb


def pack(at_us, key_name, query, version, connection, status, code, rows, duration_us,
         nbytes, request_id, served_by, transport, route) -> bytes:
    """Positional encoder for the hot path (no keyword dict built per call)."""
    return _pack((VERSION, at_us, key_name, query, version, connection, status, code, rows,
                  duration_us, nbytes, request_id, served_by, transport, route))


def encode(*, at_us=None, key_name=None, query=None, version=None, connection=None, status=200,
           code=None, rows=0, duration_us=0, bytes=0, request_id="", served_by="worker:0",
           transport="http", route="", v=VERSION) -> bytes:
    """Encode one run record; `at_us` defaults to now."""
    if at_us is None:
        at_us = time.time_ns() // 1000
    return _pack((v, at_us, key_name, query, version, connection, status, code, rows,
                  duration_us, bytes, request_id, served_by, transport, route))


class RecordError(ValueError):
    """A payload that is not a version-1 run record."""


def decode(payload: bytes) -> RunRecord:
    try:
        t = _unpackb(payload, use_list=False, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise RecordError(f"run record is not msgpack: {e}") from None
    if type(t) is not tuple or len(t) < NFIELDS or t[0] != VERSION:
        raise RecordError(f"run record is not a version-1 array of {NFIELDS} fields")
    if len(t) > NFIELDS:
        t = t[:NFIELDS]
    return RunRecord._make(t)
