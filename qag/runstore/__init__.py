"""Run stores: where the recorder writes every run, and where history, usage and events are read.

`open_store(url)` picks one: PostgreSQL (`postgresql://`), SQLite (`sqlite:///path` or a file path),
or ClickHouse (`clickhouse://`, `clickhouses://`, `http(s)://`, `chdb:///dir`). Every store has:

  write side (the recorder only)
    ensure_schema()                      idempotent; tables are prefixed qag_
    positions(source) -> {slot: pos}     durable ring positions (ClickHouse: after replaying its last insert)
    prepare(source, chunks) -> batch     CPU only; chunks = [(slot, [(pos_after, payload), ...])]
    commit(batch) -> (first_id, last_id, n)   one transaction (SQL) / one insert (ClickHouse)
    write_batch(source, [(slot, pos_after, payload)]) = commit(prepare(...))
    prune(max_rows) -> deleted           one bounded chunk of retention; call again while > 0
  read side (the HTTP routes)
    history(query, key, status, since, until, limit, cursor) -> (items, next_cursor)   newest first
    usage(per="minute"|"hour"|"day", since, until, key, query) -> [{period, calls, errors, rows}]
    events_after(event_id, key_name=None, limit=1000) -> items, oldest first (for /events)
    last_event_id(); close()

SQL stores write each run once: into qag_history when history keeps it (every failure; successes by
QAG_HISTORY_SAMPLE_RATE), else into qag_events; the event stream reads both within the events
retention, and the recorder sums the per-minute usage itself (see sql.py). ClickHouse writes
qag_events only; its views fill history and usage.

Items are API.md's run objects: event_id, at (RFC 3339 UTC, ms, Z), query, version, key_name,
connection_name, status, code, rows, duration_ms, request_id, served_by; history's items also `error` (the
database's words of a failed call, for administrators: shm/LAYOUT.md [Run record] RR5), which the event stream,
read by keys, never has. `since`/`until` take an
RFC 3339 string, a datetime or epoch microseconds; `status` an int, "4xx"/"5xx", "ok" or "error";
`cursor` is the opaque string a previous page returned.

Why a reader asking for `event_id > last` never misses a run and never sees one twice:
ids are minted at commit time, in commit order (SQL: under the row lock of qag_event_clock, held
until COMMIT, so even several recorders sharing one PostgreSQL commit in id order; ClickHouse: by
the one recorder, inserting batches one after another). A batch becomes visible whole, at its
commit, after every batch with smaller ids. So once a reader has seen id X, every run with an id
below X is already visible to it, and any run committed later has an id above X.
Several recorders on one ClickHouse (one per host) commit independently: each takes every W-th id
(QAG_RUN_WRITERS = W, QAG_RUN_WRITER_ID = w, so none collide) and events are delivered only once
older than QAG_EVENTS_SETTLE_MS, set above the longest insert.

Settings (declared in qag/config.py, read by StoreSettings.from_env): QAG_EVENTS_RETENTION_HOURS,
QAG_HISTORY_RETENTION_DAYS, QAG_HISTORY_SAMPLE_RATE (failures always kept), QAG_USAGE_RETENTION_DAYS,
QAG_RUN_WRITERS, QAG_RUN_WRITER_ID, QAG_EVENTS_SETTLE_MS.
"""
from __future__ import annotations

from ._items import StoreSettings
from .eventid import IdClock, id_floor, id_ms

CLICKHOUSE_SCHEMES = ("clickhouse://", "clickhouses://", "http://", "https://", "chdb://")


def open_store(url: str, settings: StoreSettings | None = None, **overrides):
    """The run store for `url`; settings default to the QAG_* environment."""
    if settings is None:
        settings = StoreSettings.from_env(**overrides)
    if url.startswith(CLICKHOUSE_SCHEMES):
        from .clickhouse import ClickHouseRunStore

        return ClickHouseRunStore(url, settings)
    from .sql import SqlRunStore

    return SqlRunStore(url, settings)


__all__ = ["IdClock", "StoreSettings", "id_floor", "id_ms", "open_store"]
