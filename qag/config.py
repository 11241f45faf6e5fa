"""Settings, declared once: name, environment variable, type, default and one line of documentation.

The README's configuration reference is generated from `SETTINGS` (`python -m qag.config`), and a unit
test fails when the two disagree.
"""
from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class SettingError(ValueError):
    """A malformed setting: startup stops with a message naming it."""


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _pos_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be zero or a positive integer")
    return value


def _run_writers(text: str) -> int:
    value = int(text)
    if value not in (1, 2, 4, 8, 16):
        raise ValueError("must be 1, 2, 4, 8 or 16 (each writer takes every QAG_RUN_WRITERS-th event id)")
    return value


def _run_writer_id(text: str) -> int:
    """A number, or a StatefulSet pod's name ending in its ordinal (`qag-3` is 3: what the Helm chart passes, from
    the pod's own name, so no two pods of one StatefulSet share an id)."""
    t = text.strip()
    m = re.fullmatch(r"(?:.*[^-]-)?([0-9]{1,9})", t)
    if m is None:
        raise ValueError("must be a number, or a StatefulSet pod's name ending in its ordinal (qag-3)")
    return int(m.group(1))


def _pos_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be a positive number")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be between 0 and 1")
    return value


def _workers(text: str) -> str | int:
    if text.strip().lower() == "auto":
        return "auto"
    return _pos_int(text)


def _auto_or_nonneg(text: str) -> str | int:
    if text.strip().lower() == "auto":
        return "auto"
    return _nonneg_int(text)


def _bind(text: str) -> str:
    if text.startswith("unix:"):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected HOST:PORT (e.g. 127.0.0.1:8080) or unix:PATH")
    return text


def _url(text: str) -> str:
    if text and not (text.startswith("postgresql://") or text.startswith("postgres://")):
        raise ValueError("expected a postgresql:// URL")
    return text


def _runstore_url(text: str) -> str:
    if text and text.split("://", 1)[0] not in ("clickhouse", "clickhouses", "chdb", "http", "https", "postgresql",
                                                 "postgres"):
        raise ValueError("expected clickhouse://, https://, http://, chdb:// or postgresql:// URL")
    return text


def _fsync(text: str) -> str:
    v = text.strip().lower()
    if v not in ("batch", "off"):
        raise ValueError("must be batch or off")
    return v


def _http_worker(text: str) -> str:
    v = text.strip().lower()
    if v not in ("qag", "gthread"):
        raise ValueError("must be qag or gthread")
    return v


def _redis_url(text: str) -> str:
    """redis://[user:password@]host[:port][/db], rediss://… or unix:///path[?db=N]; checked here, so a typo stops
    startup with the setting's name instead of putting every host in fallback."""
    if not text:
        return text
    url = urllib.parse.urlsplit(text)
    if url.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("expected a redis://, rediss:// or unix:// URL")
    try:
        port = url.port  # ValueError: not a number, or outside 0-65535
    except ValueError:
        raise ValueError("its port must be a number between 1 and 65535") from None
    if url.scheme == "unix":
        if not url.path:
            raise ValueError("a unix:// URL names the socket's path, as unix:///run/redis.sock")
    else:
        if port == 0:
            raise ValueError("its port must be a number between 1 and 65535")
        db = url.path.strip("/")
        if db and not (db.isascii() and db.isdigit()):
            raise ValueError(f"its path is the database number (as /0), not {url.path!r}")
    for name, values in urllib.parse.parse_qs(url.query).items():
        if name == "db" and not all(v.isascii() and v.isdigit() for v in values):
            raise ValueError("its db= is a database number")
    return text


def _origins(text: str) -> tuple[str, ...]:
    out = []
    for o in (x.strip().rstrip("/") for x in text.split(",")):
        if not o:
            continue
        if o != "*" and not (o.startswith("http://") or o.startswith("https://")):
            raise ValueError(f"{o!r} is not an origin (scheme://host[:port]) or *")
        out.append(o)
    return tuple(out)


def _log_format(text: str) -> str:
    v = text.strip().lower()
    if v not in ("text", "json"):
        raise ValueError("must be text or json")
    return v


def _log_level(text: str) -> str:
    v = text.strip().lower()
    if v not in ("debug", "info", "warning", "error", "critical"):
        raise ValueError("must be debug, info, warning, error or critical")
    return v


def _str(text: str) -> str:
    return text


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    parse: Callable[[str], Any]
    default: str
    doc: str
    type_name: str


SETTINGS: tuple[Setting, ...] = (
    Setting("home", "QAG_HOME", _str, "~/.qag", "Directory for the embedded SQLite store, the mask key and demo data.", "path"),
    Setting("admin_key", "QAG_ADMIN_KEY", _str, "", "Break-glass administrator key (X-API-Key). Empty: only named administrator tokens.", "str"),
    Setting("database_url", "QAG_DATABASE_URL", _url, "", "PostgreSQL URL of the metadata store; empty means SQLite in QAG_HOME.", "url"),
    Setting("bind", "QAG_BIND", _bind, "127.0.0.1:8080", "Address qag serve listens on (HOST:PORT or unix:PATH).", "host:port"),
    Setting("workers", "QAG_WORKERS", _workers, "auto", "Worker processes: auto = one per physical core of the allowed CPUs.", "auto|int"),
    Setting("threads", "QAG_THREADS", _pos_int, "8", "Threads per worker; they wait on databases, they add no CPU.", "int"),
    Setting("http_worker", "QAG_HTTP_WORKER", _http_worker, "qag", "gunicorn worker class: qag (gthread's HTTP handling, one-shot epoll hand-off) or gthread.", "qag|gthread"),
    Setting("pin", "QAG_PIN", _bool, "1", "Pin each worker to one logical CPU of its physical core.", "bool"),
    Setting("allow_writes", "QAG_ALLOW_WRITES", _bool, "0", "Allow saved queries that write (each key must also allow writes).", "bool"),
    Setting("max_page_size", "QAG_MAX_PAGE_SIZE", _pos_int, "1000", "Largest page_size a caller may ask for.", "int"),
    Setting("default_page_size", "QAG_DEFAULT_PAGE_SIZE", _pos_int, "10", "page_size when the caller gives none.", "int"),
    Setting("query_timeout", "QAG_QUERY_TIMEOUT", _pos_float, "30", "Statement time limit in seconds; a caller may ask for less with ?timeout=.", "seconds"),
    Setting("connect_timeout", "QAG_CONNECT_TIMEOUT", _pos_float, "3", "Seconds to wait for a data database connection before 502 connection_failed.", "seconds"),
    Setting("pool_size", "QAG_POOL_SIZE", _pos_int, "8", "Idle connections kept per data connection in each worker.", "int"),
    Setting("secret_key", "QAG_SECRET_KEY", _str, "", "Fernet key encrypting connection passwords at rest (empty: stored as given).", "str"),
    Setting("mask_key", "QAG_MASK_KEY", _str, "", "HMAC key for hash masking; empty: a key generated once and kept in the store.", "str"),
    Setting("max_body_bytes", "QAG_MAX_BODY_BYTES", _pos_int, "1048576", "Largest request body accepted (413 above it).", "bytes"),
    Setting("max_param_bytes", "QAG_MAX_PARAM_BYTES", _pos_int, "65536", "Largest single parameter value accepted.", "bytes"),
    Setting("metrics_token", "QAG_METRICS_TOKEN", _str, "", "Bearer token required by /metrics (empty: public); an administrator's X-API-Key opens it too.", "str"),
    Setting("shm_size", "QAG_SHM_SIZE", _pos_int, "67108864", "Size in bytes of the shared-memory segment.", "bytes"),
    Setting("response_cache_redis", "QAG_RESPONSE_CACHE_REDIS", _bool, "1", "With QAG_REDIS_URL: cached answers are shared across hosts through Redis too (a second tier behind each host's segment); 0: each host's own only.", "bool"),
    Setting("response_cache_mb", "QAG_RESPONSE_CACHE_MB", _auto_or_nonneg, "auto", "MiB of the shared-memory segment that hold saved queries' cached answers (cache_ttl), shared by the host's workers and the plane; at most half of what the segment's fixed tables leave (about 31 with the default QAG_SHM_SIZE), and a value past that stops the start; auto: 16, or what fits when QAG_SHM_SIZE is smaller; 0: answers are not cached.", "auto|MiB"),
    Setting("record_wait_ms", "QAG_RECORD_WAIT_MS", _nonneg_int, "0", "How long a call may wait on a full run ring (outside the ring lock) before its run is counted lost; 0: never waits.", "ms"),
    Setting("run_store_url", "QAG_RUN_STORE_URL", _runstore_url, "", "ClickHouse (or PostgreSQL) URL for runs; empty: the metadata store's own tables.", "url"),
    Setting("journal_dir", "QAG_JOURNAL_DIR", _str, "", "Directory of the recorder's run journal; empty: QAG_HOME/journal/<segment>; off: no journal.", "path"),
    Setting("journal_max_bytes", "QAG_JOURNAL_MAX_BYTES", _pos_int, "1073741824", "Most bytes of runs the journal holds while the run store is away; past it the rings fill and runs are lost.", "bytes"),
    Setting("journal_fsync", "QAG_JOURNAL_FSYNC", _fsync, "batch", "batch: fdatasync each journal frame before its ring is released; off: leave it to the OS (survives a process crash, not a power loss).", "batch|off"),
    Setting("journal_spill_after_ms", "QAG_JOURNAL_SPILL_AFTER_MS", _pos_int, "1000", "How long a run store write may fail or hang before the recorder spills runs to the journal.", "ms"),
    Setting("events_retention_hours", "QAG_EVENTS_RETENTION_HOURS", _pos_int, "24", "Hours the event table keeps every run.", "hours"),
    Setting("history_retention_days", "QAG_HISTORY_RETENTION_DAYS", _pos_int, "30", "Days history keeps runs.", "days"),
    Setting("history_sample_rate", "QAG_HISTORY_SAMPLE_RATE", _rate, "1", "Share of successful runs kept in history (failures always kept).", "0..1"),
    Setting("usage_retention_days", "QAG_USAGE_RETENTION_DAYS", _pos_int, "400", "Days the per-minute usage rollups are kept.", "days"),
    Setting("run_writers", "QAG_RUN_WRITERS", _run_writers, "1", "Recorders writing one shared run store (several hosts on one ClickHouse): 1, 2, 4, 8 or 16.", "int"),
    Setting("run_writer_id", "QAG_RUN_WRITER_ID", _run_writer_id, "0", "This host's recorder number, 0..QAG_RUN_WRITERS-1 (keeps event ids apart), or a StatefulSet pod's name ending in it (qag-3).", "int|name-N"),
    Setting("events_settle_ms", "QAG_EVENTS_SETTLE_MS", _nonneg_int, "0", "With several writers: events are delivered once older than this, so none arrives out of order.", "ms"),
    Setting("max_connections", "QAG_MAX_CONNECTIONS", _pos_int, "1000", "Client connections one worker keeps open; at the limit it closes its longest-idle kept-alive one to take a new one.", "int"),
    Setting("keepalive", "QAG_KEEPALIVE", _pos_int, "5", "Seconds an idle kept-alive connection stays open.", "seconds"),
    Setting("header_timeout", "QAG_HEADER_TIMEOUT", _pos_float, "10", "Seconds a client has, from its first byte, to send a request's headers and body (buffered without a thread); then the connection is closed.", "seconds"),
    Setting("send_timeout", "QAG_SEND_TIMEOUT", _pos_float, "30", "Seconds a send to a client that does not read may block; then the answer is dropped (a stream's database session is released).", "seconds"),
    Setting("reserve_threads", "QAG_RESERVE_THREADS", _pos_int, "2", "Threads per worker, beside QAG_THREADS, that serve only the Management API and operations routes; /health and /metrics have one more of their own.", "int"),
    Setting("key_calls", "QAG_KEY_CALLS", _nonneg_int, "0", "Data calls of one key in flight in one worker; 0: QAG_THREADS - 1 (at least 1). More wait for a thread without holding one.", "int"),
    Setting("key_queue", "QAG_KEY_QUEUE", _nonneg_int, "1000", "Data calls of one key waiting for a thread in one worker (they hold no thread); more get 429 too_many_calls.", "int"),
    Setting("connection_calls", "QAG_CONNECTION_CALLS", _nonneg_int, "0", "Calls in flight on one data connection in one worker; more get 503 busy (0: no bound but the threads).", "int"),
    Setting("max_streams", "QAG_MAX_STREAMS", _nonneg_int, "16", "Open ?stream=true answers on the instance; more get 503 too_many_streams.", "int"),
    Setting("key_streams", "QAG_KEY_STREAMS", _nonneg_int, "2", "Open ?stream=true answers of one key on the instance.", "int"),
    Setting("max_subscribers", "QAG_MAX_SUBSCRIBERS", _nonneg_int, "64", "Open /events subscriptions on the instance; more get 503 too_many_streams.", "int"),
    Setting("key_subscribers", "QAG_KEY_SUBSCRIBERS", _nonneg_int, "4", "Open /events subscriptions of one key on the instance.", "int"),
    Setting("cors_origins", "QAG_CORS_ORIGINS", _origins, "", "Comma-separated origins (https://app.example.com) allowed to call from a browser; empty: CORS off.", "list"),
    Setting("log_level", "QAG_LOG_LEVEL", _log_level, "info", "Log level of the arbiter and workers.", "str"),
    Setting("log_format", "QAG_LOG_FORMAT", _log_format, "text", "Log lines of every process (arbiter, workers, recorder, change watcher, plane): text, or json (one object per line).", "text|json"),
    Setting("access_log", "QAG_ACCESS_LOG", _bool, "0", "Write a gunicorn access log line per request (runs are the access log).", "bool"),
    Setting("redis_url", "QAG_REDIS_URL", _redis_url, "", "Redis shared by every host for rate limits and quotas (empty: counted per host).", "url"),
    Setting("jwt_secret", "QAG_JWT_SECRET", _str, "", "Shared secret for HS256 tokens of signed-in callers (empty: HS256 refused).", "str"),
    Setting("jwt_jwks_url", "QAG_JWT_JWKS_URL", _str, "", "JWKS URL of the identity provider for RS256/ES256 tokens (empty: refused).", "url"),
    Setting("jwt_issuer", "QAG_JWT_ISSUER", _str, "", "Required iss of tokens (empty: not checked).", "str"),
    Setting("jwt_audience", "QAG_JWT_AUDIENCE", _str, "", "Required aud of tokens (empty: a token that names an audience is refused).", "str"),
    Setting("jwt_role_claim", "QAG_JWT_ROLE_CLAIM", _str, "role", "The claim naming a signed-in caller's role.", "str"),
    Setting("jwt_leeway_seconds", "QAG_JWT_LEEWAY_SECONDS", _nonneg_int, "30", "Clock skew allowed on exp and nbf.", "seconds"),
    Setting("log_params", "QAG_LOG_PARAMS", _bool, "0", "Log the database's words as they are, parameter values included (default: each value replaced by [value]).", "bool"),
    Setting("slow_ms", "QAG_SLOW_MS", _nonneg_int, "0", "Log every data call slower than this many milliseconds (0: none).", "ms"),
    Setting("console_session_seconds", "QAG_CONSOLE_SESSION_SECONDS", _pos_int, "28800", "Lifetime of a Console sign-in (the session cookie and its row in the store).", "seconds"),
)

_BY_NAME = {s.name: s for s in SETTINGS}


# Not settings (no variable, not in the reference): values `qag serve` derives at start, declared here so
# that every attribute a Config carries is declared in this module. Absent until derived.
DERIVED: dict[str, str] = {
    "public_bind": "`qag serve --plane`: the address callers use (QAG_BIND, where the plane listens); `bind` is "
                   "then the workers' unix socket behind the plane",
}


class Config:
    """Parsed settings; attribute per setting name (and the DERIVED ones, once derived)."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)

    def behind_plane(self, upstream: str) -> None:
        """The plane takes QAG_BIND (kept as `public_bind`: the segment's name and the Console use it) and
        the workers listen on `upstream` instead."""
        self.__dict__["public_bind"] = self.bind
        self.__dict__["bind"] = upstream

    def __repr__(self) -> str:  # never print secrets
        shown = {k: ("***" if k in ("admin_key", "secret_key", "mask_key", "metrics_token") and v else v)
                 for k, v in self.__dict__.items()}
        return f"Config({shown})"


def _parse(s: Setting, env) -> Any:
    raw = env.get(s.env)
    text = s.default if raw is None else raw
    try:
        return s.parse(text)
    except ValueError as exc:
        shown = re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", raw) if s.type_name == "url" and raw else raw
        raise SettingError(f"{s.env}={shown!r} is malformed: {exc}") from None


def default(name: str) -> Any:
    """A setting's declared default, parsed (what it is when its variable is not set)."""
    s = _BY_NAME[name]
    return s.parse(s.default)


def load_only(names: Iterable[str], environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Parse just the named settings from the environment (a component that needs a few, such as the run
    store, reads them here too: one declaration, one parser); SettingError names a malformed one."""
    env = os.environ if environ is None else environ
    return {name: _parse(_BY_NAME[name], env) for name in names}


def load(environ: dict[str, str] | None = None, **overrides: Any) -> Config:
    """Parse every setting from the environment; raise SettingError naming the first malformed one."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {s.name: _parse(s, env) for s in SETTINGS}
    for name, value in overrides.items():
        if name not in _BY_NAME:
            raise SettingError(f"unknown setting {name}")
        if value is not None:
            values[name] = value
    if values["run_writer_id"] >= values["run_writers"]:
        raise SettingError(f"QAG_RUN_WRITER_ID={values['run_writer_id']} is malformed: must be below "
                           f"QAG_RUN_WRITERS={values['run_writers']}")
    values["home"] = os.path.abspath(os.path.expanduser(values["home"]))
    return Config(values)


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """QAG_* variables that name no setting: most often a misspelt one, which would otherwise be ignored."""
    env = os.environ if environ is None else environ
    known = {s.env for s in SETTINGS} | {"QAG_MASK_KEY_FILE", "QAG_SHM_FENCE"}
    # the plane's own knobs (rustplane/README.md) and the tests' and bench's
    prefixes = ("QAG_PLANE_", "QAG_TEST_", "QAG_FUZZ_", "QAG_BURST_", "QAG_SHM_STRESS_")
    return sorted(k for k in env if k.startswith("QAG_") and k not in known and not k.startswith(prefixes))


def reference_markdown() -> str:
    """The configuration reference table for the README."""
    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = s.default if s.default != "" else "(empty)"
        cells = [f"`{s.env}`", s.type_name.replace("|", "\\|"), f"`{default}`", s.doc.replace("|", "\\|")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
