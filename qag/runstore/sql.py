"""The default run store: tables beside the metadata store, in SQLite (a file, WAL) or PostgreSQL.

One transaction per batch: mint the batch's event ids (a row lock on qag_event_clock, so concurrent
writers on a shared PostgreSQL commit in id order), COPY each run into one table, add the batch's
per-minute usage (summed by the recorder), and move the ring positions the batch consumed.

Each run is written once: into qag_history when history keeps it (every failure; successes by
QAG_HISTORY_SAMPLE_RATE, so every run at the default 1), else into qag_events. The event stream
is both tables within QAG_EVENTS_RETENTION_HOURS. Writing every run to both tables cost the
PostgreSQL server 1.5 CPU s per 100,000 runs; once, 0.9 (measured, bench/recorder.py).
"""
from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections import defaultdict

import msgpack

from ..entries import RUN_FIELDS, RUN_NFIELDS_1_0, RUN_TYPES
from ..entries import RUN_NFIELDS as NFIELDS
from ..entries import RUN_VERSION as VERSION
from . import _items
from ._items import HISTORY_COLUMNS, READ_COLUMNS, StoreSettings, fmt_us, history_item, run_item
from .eventid import EPOCH_MS, MAX_ID, id_floor, now_ms

# The run record's columns: every field of qag.entries.RunRecord after `v`, in its order (a field without a
# column here is a KeyError at import), as (column, type); "{name}" is a name column's type (collated in PostgreSQL).
_COLUMN = {"at_us": ("at_us", "BIGINT NOT NULL"), "key_name": ("key_name", "{name}"), "query": ("query", "{name}"),
           "version": ("version", "INTEGER"), "connection": ("connection_name", "TEXT"),
           "status": ("status", "INTEGER NOT NULL"), "code": ("code", "TEXT"), "rows": ('"rows"', "BIGINT NOT NULL"),
           "duration_us": ("duration_us", "BIGINT NOT NULL"), "bytes": ("bytes", "BIGINT NOT NULL"),
           "request_id": ("request_id", "TEXT NOT NULL"), "served_by": ("served_by", "TEXT NOT NULL"),
           "transport": ("transport", "TEXT NOT NULL"), "route": ("route", "TEXT NOT NULL"),
           # format 1.1 (LAYOUT.md [Run record] RR5); a store made before has it added by ensure_schema
           "error": ("error", "TEXT")}
_RUN_COLUMNS = tuple(_COLUMN[f] for f in RUN_FIELDS[1:])
_COLS = ("event_id",) + tuple(c for c, _ in _RUN_COLUMNS)
_COLLIST = ", ".join(_COLS)
# The batch loops below (_copy_lines, decode_chunks, usage_of) read the record by position, unrolled (one f-string
# per run: 3.7 against 6.1 us, measured); they are written for this order of the declaration.
if RUN_FIELDS[1:] != tuple(_COLUMN) or NFIELDS != 16:
    raise ImportError("qag.entries.RunRecord changed: update qag/runstore/sql.py's positional batch loops")
_READ = ", ".join('"rows"' if c == "rows" else c for c in READ_COLUMNS)
# History (administrators only) also reads `error`; the event stream, which a key reads too, never does.
_READ_HISTORY = ", ".join('"rows"' if c == "rows" else c for c in HISTORY_COLUMNS)
_PAD = (None,) * (NFIELDS - RUN_NFIELDS_1_0)

_unpackb = msgpack.unpackb

# A server that stops answering (frozen, a network partition) fails a write or a read within about
# 15 s instead of hanging the recorder's writer for ever: TCP keepalives and a send timeout (libpq).
_PG_CONNECT = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
               "keepalives_count": 3, "tcp_user_timeout": 15000}

# COPY text format escapes (PostgreSQL docs, "COPY ... Text Format").
_COPY_SPECIAL = re.compile(r"[\\\t\n\r]")
_COPY_ESC = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


class _CopyText(dict):
    """str/int/None -> COPY text field; a cache, since names, codes and routes repeat run after run."""

    def __missing__(self, value):
        if value is None:
            text = "\\N"
        elif type(value) is str:
            text = value.translate(_COPY_ESC) if _COPY_SPECIAL.search(value) else value
        elif type(value) is int:
            text = str(value)
        else:
            raise TypeError(f"unexpected {type(value).__name__} in a run record")
        if len(self) > 100_000:  # bounded: unique strings must not grow it forever
            self.clear()
        self[value] = text
        return text


def _copy_lines(rows) -> list[str]:
    """Records -> COPY text lines without the leading event id (minted at commit)."""
    E = _CopyText()
    sp, tr = _COPY_SPECIAL.search, _COPY_ESC
    out = []
    ap = out.append
    for t in rows:
        rid = t[11]  # unique per run: kept out of the cache
        if type(rid) is not str:
            rid = E[rid]
        elif sp(rid):
            rid = rid.translate(tr)
        # ints are formatted as they come: a non-int there fails COPY (DataError) and the batch
        # is retried through _valid(), so the fast path pays no per-field type checks.
        ap(f"{t[1]}\t{E[t[2]]}\t{E[t[3]]}\t{E[t[4]]}\t{E[t[5]]}\t{t[6]}\t{E[t[7]]}\t{t[8]}\t{t[9]}\t"
           f"{t[10]}\t{rid}\t{E[t[12]]}\t{E[t[13]]}\t{E[t[14]]}\t{E[t[15]]}\n")
    return out


# Each field's type, from the declaration (RUN_TYPES); `version` (int | None) is also an INTEGER (32 bits).
_INT_FIELDS = tuple(i for i in range(1, NFIELDS) if RUN_TYPES[i] == "int")  # (1, 6, 8, 9, 10)
_STR_FIELDS = tuple(i for i in range(1, NFIELDS) if RUN_TYPES[i] == "str")  # (11, 12, 13, 14)
_OPT_STR_FIELDS = tuple(i for i in range(1, NFIELDS) if RUN_TYPES[i] == "str | None")  # (2, 3, 5, 7)
_VERSION = RUN_FIELDS.index("version")


def _valid(t) -> bool:
    for i in _INT_FIELDS:
        if type(t[i]) is not int or not -(1 << 63) <= t[i] < (1 << 63):
            return False
    for i in _STR_FIELDS:
        if type(t[i]) is not str or "\x00" in t[i]:
            return False
    for i in _OPT_STR_FIELDS:
        if t[i] is not None and (type(t[i]) is not str or "\x00" in t[i]):
            return False
    v = t[_VERSION]
    return v is None or (type(v) is int and -(1 << 31) <= v < (1 << 31))


class PreparedBatch:
    __slots__ = ("bad", "lines", "positions", "rows", "source", "usage")

    def __init__(self, source, rows, lines, positions, bad, usage):
        self.source, self.rows, self.lines, self.positions, self.bad = source, rows, lines, positions, bad
        self.usage = usage


def chunks_of(records) -> list:
    """[(slot, pos_after, payload)] -> [(slot, [(pos_after, payload), ...])], the recorder's shape
    (one chunk per ring read, in ring order)."""
    chunks: list = []
    for slot, p, payload in records:
        if chunks and chunks[-1][0] == slot:
            chunks[-1][1].append((p, payload))
        else:
            chunks.append((slot, [(p, payload)]))
    return chunks


def decode_chunks(chunks, lines: list | None = None):
    """Decode every payload; with `lines`, also append its COPY line (one pass: this loop is the
    recorder's per-run Python cost). Returns (rows, bad, {slot: furthest pos})."""
    rows = []
    bad = 0
    positions: dict[int, int] = {}
    un = _unpackb
    ap = rows.append
    E = _CopyText() if lines is not None else None
    lap = lines.append if lines is not None else None
    sp, tr = _COPY_SPECIAL.search, _COPY_ESC
    # The fields that repeat run after run (key, query, version, connection, status, code; served_by,
    # transport, route) are formatted once per distinct tuple: 3.7 against 6.1 us per run (measured).
    mids: dict = {}
    tails: dict = {}
    for slot, recs in chunks:
        if not recs:
            continue
        last = recs[-1][0]
        if last > positions.get(slot, -1):
            positions[slot] = last
        for _p, payload in recs:
            try:
                t = un(payload, use_list=False, raw=False)
            except Exception:
                bad += 1
                continue
            if type(t) is not tuple or len(t) != NFIELDS:
                if type(t) is not tuple or len(t) < RUN_NFIELDS_1_0:
                    bad += 1
                    continue
                if len(t) < NFIELDS:  # RR2: a 1.0 record (a journal from before `error`): nil
                    t = t + _PAD[:NFIELDS - len(t)]
            if t[0] != VERSION:
                bad += 1
                continue
            ap(t)
            if lap is not None:
                rid = t[11]  # unique per run: kept out of the cache
                if type(rid) is not str:
                    rid = E[rid]
                elif sp(rid):
                    rid = rid.translate(tr)
                # ints are formatted as they come: a non-int there fails COPY (DataError) and the
                # batch is retried through _valid(), so the fast path pays no per-field type checks.
                k = t[2:8]
                mid = mids.get(k)
                if mid is None:
                    mid = mids[k] = f"{E[t[2]]}\t{E[t[3]]}\t{E[t[4]]}\t{E[t[5]]}\t{t[6]}\t{E[t[7]]}"
                k = t[12:16]  # served_by, transport, route, error (nil but for failures)
                tail = tails.get(k)
                if tail is None:
                    tail = tails[k] = f"{E[t[12]]}\t{E[t[13]]}\t{E[t[14]]}\t{E[t[15]]}\n"
                lap(f"{t[1]}\t{mid}\t{t[8]}\t{t[9]}\t{t[10]}\t{rid}\t{tail}")
    return rows, bad, positions


def usage_of(rows) -> list[tuple]:
    """The batch's per-minute rollup, [(minute, key, query, calls, errors, rows)], summed here rather
    than by a GROUP BY on the server: the server is the recorder's bottleneck (0.12 CPU s per
    100,000 runs there, measured; about a third of that here)."""
    acc: dict = {}
    get = acc.get
    for t in rows:
        k = (t[1] // 60_000_000, t[2], t[3])
        a = get(k)
        if a is None:
            acc[k] = [1, t[6] >= 400, t[8]]
        else:
            a[0] += 1
            a[1] += t[6] >= 400
            a[2] += t[8]
    out: dict = {}
    for (m, key, query), (calls, errors, nrows) in acc.items():
        # None and "" share a rollup row (the primary key columns are NOT NULL)
        k2 = (m * 60, key or "", query or "")
        o = out.get(k2)
        if o is None:
            out[k2] = [calls, int(errors), nrows]
        else:
            o[0] += calls
            o[1] += int(errors)
            o[2] += nrows
    return [k + tuple(v) for k, v in out.items()]


class SqlRunStore:
    """Run store in SQLite (`path`) or PostgreSQL (`dsn`). One instance per thread of use."""

    kind = "sql"
    batch_max_hint = 5000  # SQLite; PostgreSQL's is PG_BATCH_MAX_HINT (set in __init__)
    # Under a backlog, fewer and larger transactions: 46k against 37k runs/s here (measured; a batch
    # still closes after batch_ms, so at lower rates batches stay small).
    PG_BATCH_MAX_HINT = 20_000

    def __init__(self, url: str, settings: StoreSettings | None = None):
        self.url = url
        self.settings = settings or StoreSettings.from_env()
        self.pg = url.startswith(("postgresql://", "postgres://"))
        self._lock = threading.Lock()
        self.bad_records = 0
        if self.pg:
            import psycopg2

            self._psycopg2 = psycopg2
            self.conn = psycopg2.connect(url, **_PG_CONNECT)
            self.conn.autocommit = False
            self.batch_max_hint = self.PG_BATCH_MAX_HINT
        else:
            path = url.removeprefix("sqlite:///")
            if url.startswith("sqlite:///") and not path.startswith("/"):
                path = "/" + path
            self.path = path
            self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self.conn.execute("PRAGMA journal_mode=WAL")
            # WAL + NORMAL: a commit survives a process crash (the case the recorder must survive);
            # only an OS crash can lose the last commits, which the ring positions then replay.
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("PRAGMA busy_timeout=30000")

    # -- plumbing ---------------------------------------------------------------------------
    def _q(self, sql: str) -> str:
        return sql if self.pg else sql.replace("%s", "?")

    def _pg_alive(self):
        """Reconnect after the server dropped us (a restart, a failover): the recorder retries."""
        if self.conn.closed:
            self.conn = self._psycopg2.connect(self.url, **_PG_CONNECT)

    def _pg_failed(self, exc):
        if isinstance(exc, (self._psycopg2.OperationalError, self._psycopg2.InterfaceError)):
            try:
                self.conn.close()
            except Exception:
                pass

    def _read(self, sql, params=()):
        with self._lock:
            if self.pg:
                self._pg_alive()
                try:
                    with self.conn.cursor() as cur:
                        cur.execute(sql, params)
                        rows = cur.fetchall()
                    self.conn.rollback()  # end the read transaction: no snapshot held between calls
                except BaseException as e:
                    if not self.conn.closed:
                        try:
                            self.conn.rollback()
                        except Exception:
                            pass
                    self._pg_failed(e)
                    raise
                return rows
            return self.conn.execute(self._q(sql), params).fetchall()

    def close(self):
        try:
            self.conn.close()
        except Exception:
            pass

    # -- schema ------------------------------------------------------------------------------
    def ensure_schema(self):
        pk = "BIGINT PRIMARY KEY" if self.pg else "INTEGER PRIMARY KEY"
        name = 'TEXT COLLATE "C"' if self.pg else "TEXT"  # byte order: no locale cost in the btrees
        cols = ", ".join([f"event_id {pk}"] + [f"{c} {t.format(name=name)}" for c, t in _RUN_COLUMNS])
        stmts = [
            f"CREATE TABLE IF NOT EXISTS qag_events ({cols})",
            f"CREATE TABLE IF NOT EXISTS qag_history ({cols})",
            "CREATE INDEX IF NOT EXISTS qag_history_key ON qag_history (key_name, event_id)",
            "CREATE INDEX IF NOT EXISTS qag_history_query ON qag_history (query, event_id)",
            f"CREATE TABLE IF NOT EXISTS qag_usage_minute (minute BIGINT NOT NULL, key_name {name} NOT NULL, "
            f"query {name} NOT NULL, calls BIGINT NOT NULL, errors BIGINT NOT NULL, \"rows\" BIGINT NOT NULL, "
            "PRIMARY KEY (minute, key_name, query))",
            "CREATE TABLE IF NOT EXISTS qag_recorder_positions (source TEXT NOT NULL, slot INTEGER NOT NULL, "
            "position BIGINT NOT NULL, event_id BIGINT NOT NULL, updated_us BIGINT NOT NULL, "
            "PRIMARY KEY (source, slot))",
            "CREATE TABLE IF NOT EXISTS qag_event_clock (id INTEGER PRIMARY KEY CHECK (id = 1), "
            "last_event_id BIGINT NOT NULL)",
            "INSERT INTO qag_event_clock (id, last_event_id) VALUES (1, 0) ON CONFLICT DO NOTHING",
            "CREATE TABLE IF NOT EXISTS qag_runstore_layout (version INTEGER NOT NULL)",
        ]
        # Layout 1 wrote every run to qag_events and its history copy to qag_history; layout 2 writes
        # each run once (module docstring). Moving to 2 drops the copies the event stream now reads
        # from history, once, in the schema's transaction.
        migrate = ["DELETE FROM qag_events WHERE event_id IN (SELECT event_id FROM qag_history)",
                   "INSERT INTO qag_runstore_layout (version) VALUES (2)"]
        layout = "SELECT max(version) FROM qag_runstore_layout"
        with self._lock:
            if self.pg:
                with self.conn.cursor() as cur:
                    # Concurrent CREATE ... IF NOT EXISTS can still collide in pg_type: serialise.
                    cur.execute("SELECT pg_advisory_xact_lock(hashtext('qag_runstore_schema'))")
                    for s in stmts:
                        cur.execute(s)
                    cur.execute(layout)
                    if cur.fetchone()[0] is None:
                        for s in migrate:
                            cur.execute(s)
                    for s in self._added_columns(lambda table: _pg_columns(cur, table)):
                        cur.execute(s)
                self.conn.commit()
            else:
                self.conn.execute("BEGIN IMMEDIATE")
                try:
                    for s in stmts:
                        self.conn.execute(s)
                    if self.conn.execute(layout).fetchone()[0] is None:
                        for s in migrate:
                            self.conn.execute(s)
                    for s in self._added_columns(lambda table: {r[1] for r in self.conn.execute(
                            f"PRAGMA table_info({table})")}):
                        self.conn.execute(s)
                    self.conn.execute("COMMIT")
                except BaseException:
                    self.conn.execute("ROLLBACK")
                    raise

    @staticmethod
    def _added_columns(columns_of) -> list[str]:
        """A store made before a field was appended to the run record (RR2: format 1.1 appended `error`) gets
        its column, nullable, in both run tables, in ensure_schema's transaction: an ALTER that writes no row
        (SQLite and PostgreSQL add a nullable column without a default to the table's definition only), so the
        upgrade costs the same on a store of any size. The runs stored before read the field as null."""
        out = []
        for table in ("qag_events", "qag_history"):
            have = columns_of(table)
            for col, typ in _RUN_COLUMNS:
                if col.strip('"') not in have:
                    if "NOT NULL" in typ:
                        raise RuntimeError(f"{table} has no column {col}, and a NOT NULL column cannot be added "
                                           "to a store that holds runs")
                    out.append(f"ALTER TABLE {table} ADD COLUMN {col} {typ}")
        return out

    # -- write side (the recorder) -------------------------------------------------------------
    def positions(self, source: str) -> dict[int, int]:
        rows = self._read("SELECT slot, position FROM qag_recorder_positions WHERE source = %s", (source,))
        return {int(s): int(p) for s, p in rows}

    def last_event_id(self) -> int:
        rows = self._read("SELECT last_event_id FROM qag_event_clock WHERE id = 1")
        return int(rows[0][0]) if rows else 0

    def prepare(self, source: str, chunks) -> PreparedBatch:
        """CPU-only half of a write (decode, format), so the recorder can overlap it with the
        previous batch's commit. `chunks` is [(slot, [(pos_after, payload), ...])]."""
        if self.pg:
            lines: list | None = []
            try:
                rows, bad, positions = decode_chunks(chunks, lines)
                usage = usage_of(rows)
            except TypeError:  # a field of a type COPY text cannot carry: check every record
                rows, bad, positions = decode_chunks(chunks)
                good = [t for t in rows if _valid(t)]
                bad += len(rows) - len(good)
                rows, lines, usage = good, _copy_lines(good), usage_of(good)
        else:
            lines = None
            rows, bad, positions = decode_chunks(chunks)
            # SQLite's type affinity would store a wrong-typed field silently: check each record.
            good = [t for t in rows if _valid(t)]
            bad += len(rows) - len(good)
            rows = good
            usage = usage_of(rows)
        return PreparedBatch(source, rows, lines, positions, bad, usage)

    def write_batch(self, source: str, records) -> tuple[int, int, int]:
        """Write [(slot, pos_after, payload)] as one transaction and move `source`'s positions to
        the largest pos per slot. Returns (first_event_id, last_event_id, rows written); ids are
        0 when the batch held no valid record (positions still move past undecodable ones)."""
        return self.commit(self.prepare(source, chunks_of(records)))

    def commit(self, batch: PreparedBatch) -> tuple[int, int, int]:
        with self._lock:
            if self.pg:
                try:
                    out = self._write_pg(batch)
                except self._psycopg2.DataError:
                    # A record whose fields have the wrong types: drop those, keep the rest.
                    good = [t for t in batch.rows if _valid(t)]
                    batch.bad += len(batch.rows) - len(good)
                    batch.rows, batch.lines = good, _copy_lines(good)
                    batch.usage = usage_of(good)
                    out = self._write_pg(batch)
            else:
                out = self._write_sqlite(batch)
        self.bad_records += batch.bad
        return out

    def replay_data(self, batch) -> None:
        """None: a SQL batch commits whole or not at all, so the recorder's journal needs no replay of
        one whose outcome it could not see (it checks the durable ring positions instead)."""
        return None

    def _kept(self, rows, first: int) -> list[bool] | None:
        """Which runs of a batch whose ids start at `first` history keeps; None: every one (rate 1).
        Failures always; successes by a deterministic permutation of the id (the ClickHouse view's
        expression, _items.SAMPLE_PRIME), so the sample is spread evenly over time."""
        rate = self.settings.history_sample_rate
        if rate >= 1.0:
            return None
        thr = _items.sample_threshold(rate)
        P = _items.SAMPLE_PRIME
        return [t[6] >= 400 or t[7] is not None or ((first + i) % P) * 7919 % P < thr
                for i, t in enumerate(rows)]

    _USAGE = ("INSERT INTO qag_usage_minute (minute, key_name, query, calls, errors, \"rows\") VALUES {} "
              "ON CONFLICT (minute, key_name, query) DO UPDATE SET calls = qag_usage_minute.calls + excluded.calls, "
              "errors = qag_usage_minute.errors + excluded.errors, "
              "\"rows\" = qag_usage_minute.\"rows\" + excluded.\"rows\"")
    _POSITIONS = ("INSERT INTO qag_recorder_positions (source, slot, position, event_id, updated_us) VALUES {} "
                  "ON CONFLICT (source, slot) DO UPDATE SET position = excluded.position, "
                  "event_id = excluded.event_id, updated_us = excluded.updated_us")

    _CLOCK = ("UPDATE qag_event_clock SET last_event_id = "
              "CASE WHEN last_event_id + %s > %s THEN last_event_id + %s ELSE %s END "
              "WHERE id = 1 RETURNING last_event_id")

    def _clock_params(self, n):
        floor_last = id_floor(now_ms()) + n - 1
        return (n, floor_last, n, floor_last)

    def _write_pg(self, b):
        source, pos, n = b.source, b.positions, len(b.rows)
        self._pg_alive()
        cur = self.conn.cursor()
        try:
            first = last = 0
            if n:
                cur.execute(self._CLOCK, self._clock_params(n))
                last = cur.fetchone()[0]
                first = last - n + 1
                if last > MAX_ID:
                    raise OverflowError("event ids exhausted (2**53)")
                kept = self._kept(b.rows, first)
                lines = map("{}\t{}".format, range(first, last + 1), b.lines)
                if kept is None:
                    tables = (("qag_history", "".join(lines)),)
                else:
                    hist, ev = [], []
                    for line, k in zip(lines, kept):
                        (hist if k else ev).append(line)
                    tables = (("qag_history", "".join(hist)), ("qag_events", "".join(ev)))
                for table, text in tables:
                    if text:
                        cur.copy_expert(f"COPY {table} ({_COLLIST}) FROM STDIN", _StrReader(text))
                if b.usage:
                    m = cur.mogrify
                    cur.execute(self._USAGE.format(",".join(m("(%s,%s,%s,%s,%s,%s)", u).decode() for u in b.usage)))
            if pos:
                now_us = time.time_ns() // 1000
                vals = ",".join(cur.mogrify("(%s,%s,%s,%s,%s)", (source, slot, p, last, now_us)).decode()
                                for slot, p in pos.items())
                cur.execute(self._POSITIONS.format(vals))
            self.conn.commit()
            return first, last, n
        except BaseException as e:
            if not self.conn.closed:
                try:
                    self.conn.rollback()
                except Exception:
                    pass
            self._pg_failed(e)
            raise
        finally:
            cur.close()

    def _write_sqlite(self, b):
        source, rows, pos, n = b.source, b.rows, b.positions, len(b.rows)
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            first = last = 0
            if n:
                last = c.execute(self._q(self._CLOCK), self._clock_params(n)).fetchone()[0]
                first = last - n + 1
                if last > MAX_ID:
                    raise OverflowError("event ids exhausted (2**53)")
                kept = self._kept(rows, first)
                ins = f"INSERT INTO {{}} ({_COLLIST}) VALUES ({', '.join('?' * len(_COLS))})"
                vals = [(first + i,) + t[1:NFIELDS] for i, t in enumerate(rows)]
                if kept is None:
                    c.executemany(ins.format("qag_history"), vals)
                else:
                    c.executemany(ins.format("qag_history"), [v for v, k in zip(vals, kept) if k])
                    c.executemany(ins.format("qag_events"), [v for v, k in zip(vals, kept) if not k])
                c.executemany(self._USAGE.format("(?, ?, ?, ?, ?, ?)"), b.usage)
            now_us = time.time_ns() // 1000
            c.executemany(self._POSITIONS.format("(?, ?, ?, ?, ?)"),
                          [(source, slot, p, last, now_us) for slot, p in pos.items()])
            c.execute("COMMIT")
            return first, last, n
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def prune(self, max_rows: int = 5000, now_ms_: int | None = None) -> int:
        """Delete at most `max_rows` expired rows per table (bounded so ingestion never stalls
        behind a long delete). Returns rows deleted; call again while it returns > 0."""
        t = now_ms() if now_ms_ is None else now_ms_
        s = self.settings
        ev_cut = id_floor(t - s.events_retention_hours * 3_600_000)
        hi_cut = id_floor(t - s.history_retention_days * 86_400_000)
        us_cut = (t - s.usage_retention_days * 86_400_000) // 1000
        total = 0
        stmts = [
            ("DELETE FROM qag_events WHERE event_id IN (SELECT event_id FROM qag_events "
             "WHERE event_id < %s ORDER BY event_id LIMIT %s)", (ev_cut, max_rows)),
            ("DELETE FROM qag_history WHERE event_id IN (SELECT event_id FROM qag_history "
             "WHERE event_id < %s ORDER BY event_id LIMIT %s)", (hi_cut, max_rows)),
            ("DELETE FROM qag_usage_minute WHERE (minute, key_name, query) IN (SELECT minute, key_name, query "
             "FROM qag_usage_minute WHERE minute < %s ORDER BY minute LIMIT %s)", (us_cut, max_rows)),
            # Positions of segments gone quiet for that long (each segment incarnation has its own
            # source): nothing of theirs is unreleased any more, the rings' tails are right.
            ("DELETE FROM qag_recorder_positions WHERE updated_us < %s",
             ((t - s.events_retention_hours * 3_600_000) * 1000,)),
        ]
        with self._lock:
            for i, (sql, params) in enumerate(stmts):
                if self.pg:
                    self._pg_alive()
                    try:
                        with self.conn.cursor() as cur:
                            cur.execute(sql, params)
                            n = cur.rowcount
                        self.conn.commit()
                    except BaseException as e:
                        if not self.conn.closed:
                            self.conn.rollback()
                        self._pg_failed(e)
                        raise
                else:
                    n = self.conn.execute(self._q(sql), params).rowcount
                if i < 3:  # runs, not bookkeeping: what the caller loops on
                    total += n
        return total

    # -- read side (the HTTP routes) -------------------------------------------------------------
    def history(self, query=None, key=None, status=None, since=None, until=None, limit=100, cursor=None):
        """Newest first. Returns (items, next_cursor); next_cursor is None on the last page."""
        limit = max(1, min(int(limit), 1000))
        where, params = [], []
        before = _items.parse_cursor(cursor)
        if before is not None:
            where.append("event_id < %s")
            params.append(before)
        if query:
            where.append("query = %s")
            params.append(query)
        if key:
            where.append("key_name = %s")
            params.append(key)
        st = _items.parse_status(status)
        if st:
            where.append("status BETWEEN %s AND %s")
            params += list(st)
        since_us, until_us = _items.to_us(since), _items.to_us(until)
        if since_us is not None:
            # A run is recorded after it starts, so its id is >= the id floor of its start (1 s of
            # slack for clocks): this bound lets the primary key narrow the scan.
            where += ["at_us >= %s", "event_id >= %s"]
            params += [since_us, id_floor(since_us // 1000 - 1000)]
        if until_us is not None:
            where.append("at_us < %s")
            params.append(until_us)
        sql = f"SELECT {_READ_HISTORY} FROM qag_history"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY event_id DESC LIMIT %s"
        params.append(limit + 1)
        rows = self._read(sql, tuple(params))
        items = [history_item(r) for r in rows[:limit]]
        nxt = str(items[-1]["event_id"]) if len(rows) > limit else None
        return items, nxt

    def _event_window(self) -> int:
        """The smallest id the event stream still serves from history (runs history keeps are the
        stream's too, for QAG_EVENTS_RETENTION_HOURS; the rest are in qag_events, pruned at that age)."""
        return id_floor(now_ms() - self.settings.events_retention_hours * 3_600_000)

    def events_after(self, event_id: int = 0, key_name: str | None = None, limit: int = 1000):
        """Events with id > event_id, oldest first, from both tables in one statement (one snapshot).
        Every one returned is committed, and ids are minted under the clock row lock in commit order,
        so none with a smaller id can appear later."""
        limit = max(1, min(int(limit), 100_000))
        key = " AND key_name = %s" if key_name is not None else ""
        kp = (key_name,) if key_name is not None else ()
        # each arm ordered and limited on its own primary key, then merged: never a scan of either table
        sql = (f"SELECT * FROM (SELECT {_READ} FROM qag_events WHERE event_id > %s{key} ORDER BY event_id LIMIT %s) e "
               f"UNION ALL SELECT * FROM (SELECT {_READ} FROM qag_history WHERE event_id > %s AND event_id >= %s{key} "
               "ORDER BY event_id LIMIT %s) h ORDER BY event_id LIMIT %s")
        params = (int(event_id), *kp, limit, int(event_id), self._event_window(), *kp, limit, limit)
        return [run_item(r) for r in self._read(self._q(sql), params)]

    def usage(self, per="hour", since=None, until=None, key=None, query=None):
        """Calls, errors and rows per period, oldest first: whole minutes from the rollup, partial
        minutes at the edges from the event table (exact while the events are kept)."""
        step = _items.period_bounds(per)
        since_us, until_us = _items.to_us(since), _items.to_us(until)
        where, params = [], []
        if key:
            where.append("key_name = %s")
            params.append(key)
        if query:
            where.append("query = %s")
            params.append(query)
        buckets: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])

        def add(rows):
            for p, calls, errors, nrows in rows:
                b = buckets[int(p)]
                b[0] += int(calls)
                b[1] += int(errors or 0)
                b[2] += int(nrows or 0)

        # whole minutes: [ceil(since), floor(until))
        m_lo = None if since_us is None else -(-since_us // 60_000_000) * 60
        m_hi = None if until_us is None else (until_us // 60_000_000) * 60
        w, p = list(where), list(params)
        if m_lo is not None:
            w.append("minute >= %s")
            p.append(m_lo)
        if m_hi is not None:
            w.append("minute < %s")
            p.append(m_hi)
        sql = (f"SELECT (minute / {step}) * {step}, sum(calls), sum(errors), sum(\"rows\") FROM qag_usage_minute"
               + (" WHERE " + " AND ".join(w) if w else "") + " GROUP BY 1")
        add(self._read(sql, tuple(p)))
        # edges, from events
        edges = []
        if since_us is not None and m_lo * 1_000_000 > since_us:
            edges.append((since_us, min(m_lo * 1_000_000, until_us if until_us is not None else 1 << 62)))
        if until_us is not None and m_hi * 1_000_000 < until_us:
            lo = m_hi * 1_000_000
            if since_us is not None:
                lo = max(lo, since_us)
            if not edges or edges[0] != (lo, until_us):
                edges.append((lo, until_us))
        for lo, hi in edges:
            if lo >= hi:
                continue
            # every run is in exactly one of the two tables; a run's id is minted after it starts
            # (1 s of slack for clocks), so the primary keys bound the scan
            w = list(where) + ["at_us >= %s", "at_us < %s", "event_id >= %s"]
            p = tuple(params) + (lo, hi, id_floor(lo // 1000 - 1000))
            arm = 'SELECT at_us, status, "rows" FROM {} WHERE ' + " AND ".join(w)
            sql = (f"SELECT (at_us / {step * 1_000_000}) * {step}, count(*), "
                   "sum(CASE WHEN status >= 400 THEN 1 ELSE 0 END), sum(\"rows\") FROM ("
                   + arm.format("qag_events") + " UNION ALL " + arm.format("qag_history") + ") u GROUP BY 1")
            add(self._read(sql, p + p))
        return [{"period": fmt_us(k * 1_000_000), "calls": v[0], "errors": v[1], "rows": v[2]}
                for k, v in sorted(buckets.items())]

    # -- introspection ---------------------------------------------------------------------------
    def counts(self) -> dict:
        """Runs the event stream serves (both tables, see _event_window), history holds, usage counts."""
        out = {}
        out["qag_events"] = int(self._read("SELECT count(*) FROM qag_events")[0][0]) + int(self._read(
            "SELECT count(*) FROM qag_history WHERE event_id >= %s", (self._event_window(),))[0][0])
        out["qag_history"] = int(self._read("SELECT count(*) FROM qag_history")[0][0])
        out["usage_calls"] = int(self._read("SELECT COALESCE(sum(calls), 0) FROM qag_usage_minute")[0][0])
        return out


def _pg_columns(cur, table: str) -> set[str]:
    cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
                "AND table_name = %s", (table,))
    return {r[0] for r in cur.fetchall()}


class _StrReader:
    """File-like over one str for copy_expert, encoded in 1 MiB slices (no second full copy)."""

    __slots__ = ("_i", "_s")

    def __init__(self, s: str):
        self._s = s
        self._i = 0

    def read(self, size=-1):
        if size is None or size < 0:
            size = len(self._s)
        size = max(size, 1 << 20)
        chunk = self._s[self._i:self._i + size]
        self._i += len(chunk)
        return chunk.encode()

    readline = read


__all__ = ["EPOCH_MS", "SqlRunStore", "StoreSettings"]
