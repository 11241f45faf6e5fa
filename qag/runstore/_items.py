"""Shared pieces of the run stores' read side: time arguments, cursors, and the API's run item."""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

from .. import config

UTC = _dt.UTC
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=UTC)

# Column order every store's read queries return, mapped to API.md's run fields by run_item().
READ_COLUMNS = ("event_id", "at_us", "query", "version", "key_name", "connection_name", "status",
                "code", "rows", "duration_us", "request_id", "served_by")
# History's reads (GET /api/v1/history: administrators only) add the database's text of a failed call
# (LAYOUT.md [Run record] RR5); the event stream, which keys read, uses READ_COLUMNS and never has it.
HISTORY_COLUMNS = READ_COLUMNS + ("error",)

PERIOD_SECONDS = {"minute": 60, "hour": 3600, "day": 86400}


# StoreSettings field -> the setting in qag/config.py that declares it (variable, type, default, doc):
# the run store reads its settings there, never the environment itself.
SETTING_OF = {
    "events_retention_hours": "events_retention_hours",
    "history_retention_days": "history_retention_days",
    "history_sample_rate": "history_sample_rate",
    "usage_retention_days": "usage_retention_days",
    "writer_id": "run_writer_id",
    "writers": "run_writers",
    "events_settle_ms": "events_settle_ms",
}
_D = {field: config.default(name) for field, name in SETTING_OF.items()}


@dataclass(frozen=True)
class StoreSettings:
    """The run store's settings; the defaults are config.py's."""

    events_retention_hours: int = _D["events_retention_hours"]
    history_retention_days: int = _D["history_retention_days"]
    history_sample_rate: float = _D["history_sample_rate"]
    usage_retention_days: int = _D["usage_retention_days"]
    # ClickHouse shared by several recorders (one per host): each its own writer number, and events
    # delivered only once older than the settle delay, since writers commit independently.
    writer_id: int = _D["writer_id"]
    writers: int = _D["writers"]
    events_settle_ms: int = _D["events_settle_ms"]

    @classmethod
    def from_env(cls, environ=None, **override) -> StoreSettings:
        """The settings from the QAG_* environment (parsed by qag/config.py), then `override`."""
        parsed = config.load_only(SETTING_OF.values(), environ)
        values = {field: parsed[name] for field, name in SETTING_OF.items()}
        values.update({k: v for k, v in override.items() if v is not None})
        if not 0.0 <= values["history_sample_rate"] <= 1.0:
            raise ValueError("history_sample_rate must be between 0 and 1")
        return cls(**values)


# Deterministic sampling by event id: a multiplicative permutation modulo a prime, so consecutive
# ids are spread evenly; the same expression is valid SQLite, PostgreSQL and ClickHouse SQL.
SAMPLE_PRIME = 1000003


def sample_threshold(rate: float) -> int:
    return round(rate * SAMPLE_PRIME)


def to_us(value) -> int | None:
    """None, epoch microseconds (int), a datetime or an RFC 3339 string -> epoch microseconds."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError("expected a timestamp")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            value = _dt.datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{value!r} is not an RFC 3339 timestamp such as 2026-11-30T06:59:53Z") from None
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        delta = value - _EPOCH
        return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
    raise ValueError("expected a timestamp")


_last_second = (None, "")


def fmt_us(at_us: int) -> str:
    """Epoch microseconds -> RFC 3339 UTC with milliseconds and Z (API.md). Runs come in time
    order, so the formatted second is reused from the previous call (4x cheaper per item); the
    cache is one tuple, replaced whole, so threads never see a second paired with another's text."""
    global _last_second
    sec, us = divmod(at_us, 1_000_000)
    cached = _last_second
    if cached[0] != sec:
        cached = (sec, (_EPOCH + _dt.timedelta(seconds=sec)).strftime("%Y-%m-%dT%H:%M:%S."))
        _last_second = cached
    return f"{cached[1]}{us // 1000:03d}Z"


def run_item(row) -> dict:
    """A READ_COLUMNS row -> the API's run object."""
    (event_id, at_us, query, version, key_name, connection, status, code, rows, duration_us,
     request_id, served_by) = row
    return {
        "event_id": int(event_id),
        "at": fmt_us(int(at_us)),
        "query": query,
        "version": version,
        "key_name": key_name,
        "connection_name": connection,
        "status": int(status),
        "code": code,
        "rows": int(rows),
        "duration_ms": int(duration_us) / 1000,
        "request_id": request_id,
        "served_by": served_by,
    }


def history_item(row) -> dict:
    """A HISTORY_COLUMNS row -> the API's run object with `error` (null unless the database said why it failed)."""
    item = run_item(row[:-1])
    item["error"] = row[-1]
    return item


def parse_cursor(cursor) -> int | None:
    if cursor is None or cursor == "":
        return None
    try:
        value = int(cursor)
    except (TypeError, ValueError):
        raise ValueError("cursor is not one this server gave") from None
    if value <= 0:
        raise ValueError("cursor is not one this server gave")
    return value


def parse_status(status):
    """status filter: an int (404), a class ("4xx"), "error" (>= 400) or "ok" (< 400) -> (lo, hi)."""
    if status is None or status == "":
        return None
    if isinstance(status, int) and not isinstance(status, bool):
        return (status, status)
    text = str(status).strip().lower()
    if text.isdigit():
        return (int(text), int(text))
    if len(text) == 3 and text[0] in "12345" and text[1:] == "xx":
        lo = int(text[0]) * 100
        return (lo, lo + 99)
    if text in ("error", "errors", "failed"):
        return (400, 999)
    if text == "ok":
        return (0, 399)
    raise ValueError("status must be a code such as 404, a class such as 5xx, 'ok' or 'error'")


def period_bounds(per: str):
    if per not in PERIOD_SECONDS:
        raise ValueError("per must be minute, hour or day")
    return PERIOD_SECONDS[per]
