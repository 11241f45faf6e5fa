"""One log format for every process of an instance: QAG_LOG_FORMAT=text (each process's lines as they have
always read) or json (one JSON object per line, on standard error, from the arbiter, the workers, the recorder,
the change watcher and the plane alike):

    {"ts": "2026-12-02T01:02:03.456Z", "level": "warning", "process": "worker:0", "pid": 4242,
     "logger": "qag.calls", "msg": "GET /q/orders: 403 table_not_allowed (...)", "request_id": "...", ...}

`ts`, `level`, `process`, `pid`, `logger` and `msg` are on every line; an event that carries fields of its own
(a refusal: request_id, key, query, version, status, code) adds them, so a log pipeline need not parse `msg`.
`exc` holds a traceback when there is one. Never a secret and never a parameter value: the events that log
decide what they carry (qag/http/data.py).
"""
from __future__ import annotations

import json
import logging
import sys
import time

FORMATS = ("text", "json")
PROCESS = "qag"  # this process's name in json lines: arbiter, worker:N, recorder, changes (set by setup)
_FMT = "text"


def rfc3339(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created * 1000) % 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """A record as one JSON object (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": rfc3339(record.created), "level": record.levelname.lower(), "process": PROCESS,
               "pid": record.process, "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "qag", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                out.setdefault(k, v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def is_json() -> bool:
    return _FMT == "json"


def setup(process: str, fmt: str = "text", level: str | int | None = None, text_format: str | None = None) -> None:
    """Name this process and install its format. json: the root logger writes JsonFormatter lines to standard
    error (every qag.* logger propagates there). text: `text_format` (the process's own line) when given, else
    the lines stay as Python writes them."""
    global PROCESS, _FMT
    PROCESS, _FMT = process, fmt if fmt in FORMATS else "text"
    root = logging.getLogger()
    if _FMT == "json":
        for h in list(root.handlers):
            root.removeHandler(h)
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(JsonFormatter())
        root.addHandler(h)
        if level is not None:
            root.setLevel(level.upper() if isinstance(level, str) else level)
    elif text_format:
        logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=text_format)
    elif level is not None:
        root.setLevel(level.upper() if isinstance(level, str) else level)


def rename(process: str) -> None:
    """A forked worker takes its own name (its lines keep the format the arbiter set up)."""
    global PROCESS
    PROCESS = process


def gunicorn_logger_class():
    """gunicorn's Logger whose error and access lines are JSON objects too when QAG_LOG_FORMAT=json."""
    from gunicorn.glogging import Logger

    class QagGunicornLogger(Logger):
        def _set_handler(self, log, output, fmt, stream=None):
            super()._set_handler(log, output, JsonFormatter() if is_json() else fmt, stream)

    return QagGunicornLogger
