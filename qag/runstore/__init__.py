"""Run stores: where the recorder writes every run, and where history, usage and events are read.

`open_store(url)` picks one: PostgreSQL (`postgresql://`), SQLite (`sqlite:///path` or a file path),
or ClickHouse (`clickhouse://`, `clickhouses://`, `http(s)://`, `chdb:///dir`). Every store has:

  ensure_schema(); positions(source) -> {slot: pos}; write_batch(source, [(slot, pos, payload)])
  -> (first_id, last_id, n); prune(max_rows) -> deleted; history(...) -> (items, next_cursor);
  usage(per, since, until, key, query) -> items; events_after(event_id, key_name, limit) -> items;
  last_event_id(); close().
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
