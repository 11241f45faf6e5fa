"""RFC 3339 UTC timestamps, the only time format of the API."""
from __future__ import annotations

import datetime as _dt
import re

UTC = _dt.UTC


def now() -> _dt.datetime:
    return _dt.datetime.now(UTC)


def fmt(value: _dt.datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    value = value.astimezone(UTC)
    # four-digit years always (strftime's %Y writes year 231 as "231", which is not RFC 3339)
    return (f"{value.year:04d}-{value.month:02d}-{value.day:02d}T{value.hour:02d}:{value.minute:02d}:"
            f"{value.second:02d}.{value.microsecond // 1000:03d}Z")


def now_text() -> str:
    return fmt(now())  # type: ignore[return-value]


def parse(text: str) -> _dt.datetime:
    """Parse RFC 3339 (a trailing Z or an offset; a date alone means midnight UTC)."""
    if not isinstance(text, str) or not text:
        raise ValueError("expected an RFC 3339 timestamp such as 2026-11-30T06:59:53Z")
    t = text.strip()
    if t.endswith(("Z", "z")):
        t = t[:-1] + "+00:00"
    try:
        value = _dt.datetime.fromisoformat(t)
    except ValueError:
        raise ValueError(f"{text!r} is not an RFC 3339 timestamp such as 2026-11-30T06:59:53Z") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


# RFC 3339 section 5.6: a full-date, or a date-time with its offset (Z or +hh:mm); the separator T, t or a space
# (the RFC's note), seconds' fraction of any length. ASCII digits only.
_RFC3339 = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
                      r"(?:[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:[Zz]|[+-][0-9]{2}:[0-9]{2}))?")


def parse_input(text) -> _dt.datetime:
    """A timestamp a caller gave (a key's expires_at, history's since/until): RFC 3339 exactly, as the API writes
    them (`2026-11-30T06:59:53Z`, an offset such as +02:00, or a date alone for midnight UTC). A time without an
    offset is refused: it would be read in some zone the caller did not say. ValueError says what to send."""
    if not isinstance(text, str) or not _RFC3339.fullmatch(text):
        raise ValueError(f"{str(text)[:60]!r} is not an RFC 3339 timestamp with its offset, such as "
                         "2026-11-30T06:59:53Z")
    return parse(text)
