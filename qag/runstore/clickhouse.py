"""The ClickHouse run store: one insert per batch into `qag_events`; materialised views fill history,
per-minute usage and the recorder's positions from it. Exactly once without transactions:

- every insert carries `insert_deduplication_token = "<source>:<first event id>"`, and every table
  keeps a deduplication window, with `deduplicate_blocks_in_dependent_materialized_views = 1`;
- so a write retried after an error, or the last batch replayed from `qag_events` after a crash
  (`recover()`: it may be in events while a view missed it), lands in each table exactly once;
- the positions a batch consumed travel in its rows (src, slot, pos = the furthest position the
  insert covers in that slot): they are durable exactly when the runs are, and no positions table
  is needed (see positions()).

Event ids are minted here, by the single recorder, and a batch never spans two days (one insert =
one partition = one part), so a batch is in `qag_events` whole or not at all.
"""
from __future__ import annotations

import logging
import re
import struct
import urllib.parse
from collections import defaultdict

import msgpack

from ..entries import RUN_FIELDS, RUN_NFIELDS_1_0
from ..entries import RUN_NFIELDS as NFIELDS
from ..entries import RUN_VERSION as VERSION
from . import _items
from ._items import StoreSettings, fmt_us, history_item, run_item
from .eventid import EPOCH_MS, MS_PER_DAY, SEQ_BITS, IdClock, id_floor, now_ms

log = logging.getLogger("qag.runstore.clickhouse")

# The run record's columns: every field of qag.entries.RunRecord, in its order (a field without a column here is a
# KeyError at import), as (column, type in the history table; qag_events drops the LowCardinality).
_COLUMN = {"v": ("v", "UInt8"), "at_us": ("at", "DateTime64(6, 'UTC')"),
           "key_name": ("key_name", "LowCardinality(Nullable(String))"),
           "query": ("query", "LowCardinality(Nullable(String))"), "version": ("version", "Nullable(Int32)"),
           "connection": ("connection_name", "LowCardinality(Nullable(String))"), "status": ("status", "UInt16"),
           "code": ("code", "LowCardinality(Nullable(String))"), "rows": ("rows", "Int64"),
           "duration_us": ("duration_us", "Int64"), "bytes": ("bytes", "Int64"), "request_id": ("request_id", "String"),
           "served_by": ("served_by", "LowCardinality(String)"), "transport": ("transport", "LowCardinality(String)"),
           "route": ("route", "LowCardinality(String)"),
           # format 1.1 (LAYOUT.md [Run record] RR5); tables made before have it added by ensure_schema
           "error": ("error", "Nullable(String)")}
_RECORD_COLUMNS = tuple(_COLUMN[f] for f in RUN_FIELDS)
# Insert column order: the constant columns first, then what the recorder adds per row, then the record's
# fields exactly as the ring holds them (the MsgPack row is the record's array body).
INSERT_COLUMNS = ["batch", "src", "event_id", "slot", "pos"] + [c for c, _ in _RECORD_COLUMNS]
_TS = f"fromUnixTimestamp64Milli(toInt64(bitShiftRight(event_id, {SEQ_BITS})) + {EPOCH_MS}, 'UTC')"
# The history table's run columns (all but v), and the view that fills it selects them in this order.
_RUN_COLS = ", ".join(["event_id"] + [c for c, _ in _RECORD_COLUMNS[1:]])
_RUN_COL_TYPES = ", ".join(f"{c} {t}" for c, t in _RECORD_COLUMNS[1:])
_READ = ("event_id, toUnixTimestamp64Micro(at), query, version, key_name, connection_name, status, code, "
         "rows, duration_us, request_id, served_by")
# History (administrators only) also reads `error`; the event stream, which keys read, never does.
_READ_HISTORY = _READ + ", error"
# Every insert: views deduplicate by the insert's token (exactly once on retry and replay); views
# run in parallel; no merge-on-insert (reads sum/argMax anyway; halves the insert time, measured).
_DEDUP = {"deduplicate_blocks_in_dependent_materialized_views": 1, "parallel_view_processing": 1,
          "optimize_on_insert": 0}
_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack
# Most rows in one insert: one block (an insert is parsed in blocks of max_block_size, 65,505 rows),
# so one deduplication token, which recover()'s replay (one block too, see its settings) must match.
# Without both, replaying the last batch wrote it twice whenever it held over ~10,000 runs (seen on
# chDB 26.9); a larger batch goes as several inserts, as one spanning midnight does.
_MAX_INSERT_ROWS = 64_000
# LAYOUT.md [Run record] RR4: the array's head (array16 of 16: dc 00 10), then v = 1; a row of the insert body is
# the record without its array head.
_ARRAY_HEAD = msgpack.packb((None,) * NFIELDS)[:-NFIELDS]
_RECORD_HEAD = _ARRAY_HEAD + bytes([VERSION])
_PAD = (None,) * (NFIELDS - RUN_NFIELDS_1_0)


def _client(url: str):
    import clickhouse_connect

    if url.startswith("chdb:"):
        return clickhouse_connect.get_client(dsn=url)
    if url.startswith(("clickhouse://", "clickhouses://")):
        return clickhouse_connect.get_client(dsn=url)
    u = urllib.parse.urlsplit(url)
    db = u.path.strip("/") or None
    return clickhouse_connect.get_client(
        host=u.hostname, port=u.port or (8443 if u.scheme == "https" else 8123),
        username=urllib.parse.unquote(u.username or "default"), password=urllib.parse.unquote(u.password or ""),
        database=db, secure=u.scheme == "https", interface=u.scheme)


def _q(value) -> str:
    """A ClickHouse string literal (for the few values built into SQL text)."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


class CHBatch:
    __slots__ = ("bad", "first", "inserts", "last", "n", "positions", "source")

    def __init__(self, source, inserts, positions, bad, first, last, n):
        self.source, self.inserts, self.positions, self.bad = source, inserts, positions, bad
        self.first, self.last, self.n = first, last, n


class ClickHouseRunStore:
    kind = "clickhouse"
    # Each insert pays a fixed cost per part it writes (the events part and one per view): under a
    # backlog the recorder fills batches up to this many runs, the most one insert takes (one block):
    # 99-104k against 63-90k runs/s with 50,000 (measured, load 4.5).
    batch_max_hint = _MAX_INSERT_ROWS

    def __init__(self, url: str, settings: StoreSettings | None = None):
        self.url = url
        self.settings = settings or StoreSettings.from_env()
        self.client = _client(url)
        self.bad_records = 0
        self.clock: IdClock | None = None

    def close(self):
        try:
            self.client.close()
        except Exception:
            pass

    # -- schema ------------------------------------------------------------------------------
    def schema_sql(self) -> list[str]:
        s = self.settings
        thr = _items.sample_threshold(s.history_sample_rate)
        run_cols = _RUN_COL_TYPES
        # Events take plain strings: the MsgPack parser fills LowCardinality columns row by row,
        # 3x slower per insert (28 against 96 ms per 5,000 runs, measured); events are kept a day and
        # their repeated names compress anyway. History, kept for weeks, gets LowCardinality
        # from the view, converted column-wise.
        ev_cols = re.sub(r"LowCardinality\((.*?\)?)\)", r"\1", run_cols)
        dedup = "non_replicated_deduplication_window = 1000"
        return [
            f"CREATE TABLE IF NOT EXISTS qag_events (event_id UInt64, batch UInt64, src String, "
            f"slot UInt16, pos UInt64, v UInt8, {ev_cols}, ts DateTime64(3, 'UTC') MATERIALIZED {_TS}, "
            "INDEX key_idx key_name TYPE bloom_filter GRANULARITY 4) "
            "ENGINE = MergeTree PARTITION BY toYYYYMMDD(ts) ORDER BY event_id "
            f"TTL toDateTime(ts) + INTERVAL {int(s.events_retention_hours)} HOUR "
            f"SETTINGS {dedup}, ttl_only_drop_parts = 1",
            f"CREATE TABLE IF NOT EXISTS qag_history (event_id UInt64, {run_cols}, ts DateTime64(3, 'UTC'), "
            "INDEX key_idx key_name TYPE bloom_filter GRANULARITY 4, "
            "INDEX query_idx query TYPE bloom_filter GRANULARITY 4) "
            "ENGINE = MergeTree PARTITION BY toYYYYMMDD(ts) ORDER BY event_id "
            f"TTL toDateTime(ts) + INTERVAL {int(s.history_retention_days)} DAY "
            f"SETTINGS {dedup}, ttl_only_drop_parts = 1",
            "CREATE TABLE IF NOT EXISTS qag_usage_minute (minute DateTime('UTC'), key_name LowCardinality(String), "
            "query LowCardinality(String), calls UInt64, errors UInt64, rows Int64) "
            "ENGINE = SummingMergeTree PARTITION BY toYYYYMM(minute) ORDER BY (minute, key_name, query) "
            f"TTL minute + INTERVAL {int(s.usage_retention_days)} DAY SETTINGS {dedup}",
            # Failures are always kept; successes by a deterministic permutation of the event id.
            "CREATE MATERIALIZED VIEW IF NOT EXISTS qag_history_mv TO qag_history AS "
            f"SELECT {_RUN_COLS}, {_TS} AS ts FROM qag_events WHERE status >= 400 OR code IS NOT NULL "
            f"OR ((event_id % {_items.SAMPLE_PRIME}) * 7919) % {_items.SAMPLE_PRIME} < {thr}",
            "CREATE MATERIALIZED VIEW IF NOT EXISTS qag_usage_minute_mv TO qag_usage_minute AS "
            "SELECT toDateTime(toStartOfMinute(at), 'UTC') AS minute, ifNull(key_name, '') AS key_name, "
            "ifNull(query, '') AS query, count() AS calls, countIf(status >= 400) AS errors, sum(rows) AS rows "
            "FROM qag_events GROUP BY minute, key_name, query",
        ]

    def init_text(self, user: str = "qag_writer", password: str = "", reader: str | None = "qag_reader",
                  reader_password: str = "") -> str:
        """For `qag clickhouse init`: create the schema here, and return the users and grants for an
        operator to apply with an administrator account (they cannot be applied through chDB)."""
        self.ensure_schema()
        db = self.client.query("SELECT currentDatabase()").result_rows[0][0]
        return writer_user_sql(db, user, password, reader, reader_password)

    def ensure_schema(self):
        thr = _items.sample_threshold(self.settings.history_sample_rate)
        # positions used to be a view of their own; they ride in the events rows now
        self.client.command("DROP VIEW IF EXISTS qag_recorder_positions_mv")
        rows = self.client.query(
            "SELECT create_table_query FROM system.tables WHERE database = currentDatabase() "
            "AND name = 'qag_history_mv'").result_rows
        if rows and (f"< {thr}" not in rows[0][0] or not all(
                re.search(rf"\b{c}\b", rows[0][0]) for c, _ in _RECORD_COLUMNS[1:])):
            # The sample rate changed, or the view was made before a field was appended to the run record: the
            # view is recreated by the recorder, the only writer, before it writes, so no insert runs in between.
            self.client.command("DROP VIEW IF EXISTS qag_history_mv")
        stmts = self.schema_sql()
        views = [stmt for stmt in stmts if stmt.startswith("CREATE MATERIALIZED VIEW")]
        for stmt in stmts:
            if stmt not in views:
                self.client.command(stmt)
        for stmt in self._added_columns():  # before the views, which select them
            self.client.command(stmt)
        for stmt in views:
            self.client.command(stmt)
        # Retention settings may have changed since the tables were made.
        s = self.settings
        self.client.command(f"ALTER TABLE qag_events MODIFY TTL toDateTime(ts) + INTERVAL "
                            f"{int(s.events_retention_hours)} HOUR")
        self.client.command(f"ALTER TABLE qag_history MODIFY TTL toDateTime(ts) + INTERVAL "
                            f"{int(s.history_retention_days)} DAY")

    def _added_columns(self) -> list[str]:
        """Tables made before a field was appended to the run record (RR2: format 1.1 appended `error`) get its
        column, nullable, after the field before it: ADD COLUMN changes the table's metadata only (the parts
        already written read it as its default, null), so the upgrade costs the same on a store of any size."""
        have: dict[str, set] = defaultdict(set)
        for table, name in self.client.query(
                "SELECT table, name FROM system.columns WHERE database = currentDatabase() "
                "AND table IN ('qag_events', 'qag_history')").result_rows:
            have[table].add(name)
        out = []
        for table in ("qag_events", "qag_history"):
            for i, (col, typ) in enumerate(_RECORD_COLUMNS[1:], start=1):
                if col not in have[table]:
                    if not typ.startswith(("Nullable", "LowCardinality(Nullable")):
                        raise RuntimeError(f"{table} has no column {col}, and only a nullable one can be added")
                    if table == "qag_events":  # as schema_sql: events take plain strings
                        typ = re.sub(r"LowCardinality\((.*?\)?)\)", r"\1", typ)
                    out.append(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {col} {typ} "
                               f"AFTER {_RECORD_COLUMNS[i - 1][0]}")
        return out

    # -- write side ----------------------------------------------------------------------------
    def positions(self, source: str) -> dict[int, int]:
        """Durable ring positions of `source`, read from its last insert's rows. Enough because the
        recorder commits batch N+1 only after releasing batch N's rings: only the last batch can be
        written but not released, and a slot absent from it is released up to what was written
        (so the ring's tail is right for it). No positions table: one part fewer per insert, which
        halved the insert time here (measured 40k -> 80k runs/s per 50,000-run insert on chDB)."""
        batch = self.recover(source)
        if batch is None:
            return {}
        rows = self.client.query(
            f"SELECT slot, max(pos) FROM qag_events WHERE src = %(s)s AND batch = {int(batch)} GROUP BY slot",
            parameters={"s": source}).result_rows
        return {int(a): int(b) for a, b in rows}

    def last_event_id(self) -> int:
        rows = self.client.query("SELECT event_id FROM qag_events ORDER BY event_id DESC LIMIT 1").result_rows
        return int(rows[0][0]) if rows else 0

    def recover(self, source: str) -> int | None:
        """Replay this source's last insert from qag_events with its own token: where it is whole in
        every table this writes nothing; where a view missed it (a crash between the event part and
        a view's part), the view gets it now. Returns that insert's batch id (None: no runs yet)."""
        rows = self.client.query(
            "SELECT batch FROM qag_events WHERE src = %(s)s ORDER BY event_id DESC LIMIT 1",
            parameters={"s": source}).result_rows
        if rows:
            batch = int(rows[0][0])
            cols = ", ".join(INSERT_COLUMNS)
            self.client.command(
                f"INSERT INTO qag_events ({cols}) SELECT {cols} FROM qag_events "
                f"WHERE src = {_q(source)} AND batch = {batch} ORDER BY event_id",
                settings={**_DEDUP, "insert_deduplication_token": f"{source}:{batch}",
                          "max_threads": 1, "max_insert_threads": 1,
                          # one block, as the insert it replays was, or the token does not match
                          "max_block_size": _MAX_INSERT_ROWS, "preferred_block_size_bytes": 1 << 40,
                          "min_insert_block_size_rows": _MAX_INSERT_ROWS, "min_insert_block_size_bytes": 1 << 40})
        if self.clock is None:
            self.clock = self._new_clock()
        return int(rows[0][0]) if rows else None

    def _new_clock(self) -> IdClock:
        s = self.settings
        return IdClock(self.last_event_id(), writer=s.writer_id, writers=s.writers)

    def prepare(self, source: str, chunks) -> CHBatch:
        """`chunks` is [(slot, [(pos_after, payload), ...])]; mints the batch's ids and builds the
        MsgPack body (a row is a fixed head plus the record's own array body: no per-field work)."""
        if self.clock is None:
            self.clock = self._new_clock()
        good, bad = [], 0
        positions: dict[int, int] = {}
        head = _RECORD_HEAD
        for slot, recs in chunks:
            if not recs:
                continue
            if recs[-1][0] > positions.get(slot, -1):
                positions[slot] = recs[-1][0]
            for p, payload in recs:
                if payload[:2] == head:
                    good.append((slot, p, payload))
                else:
                    fixed = _normalise(payload)
                    if fixed is None:
                        bad += 1
                    else:
                        good.append((slot, p, fixed))
        n = len(good)
        if not n:
            return CHBatch(source, [], positions, bad, 0, 0, 0)
        stride = self.clock.stride
        first = self.clock.take(n)
        last = first + stride * (n - 1)
        inserts = []
        # A batch never spans two days: one partition per insert, so each insert is one part.
        day_first = (first >> SEQ_BITS) // MS_PER_DAY
        split = n
        if (last >> SEQ_BITS) // MS_PER_DAY != day_first:
            split = -(-((((day_first + 1) * MS_PER_DAY) << SEQ_BITS) - first) // stride)
        bounds = sorted({0, split, n} | set(range(_MAX_INSERT_ROWS, n, _MAX_INSERT_ROWS)))
        for lo, hi in zip(bounds, bounds[1:]):
            if lo >= hi:
                continue
            bfirst = first + lo * stride
            # Every row of a slot carries the furthest position its insert covers; the batch's last
            # insert covers the batch's furthest, so skipped records after the last good one count too.
            upto = positions if hi == n else None
            inserts.append((bfirst, self._body(source, bfirst, good[lo:hi], upto, stride)))
        return CHBatch(source, inserts, positions, bad, first, last, n)

    @staticmethod
    def _body(source, bfirst, recs, upto, stride=1) -> bytes:
        if upto is None:
            upto = {}
            for slot, p, _pl in recs:
                upto[slot] = p
        const = _packb(bfirst) + _packb(source)
        # one struct per row: the insert's constant columns, then event_id, slot, pos
        rh = struct.Struct(f">{len(const)}sBQBHBQ").pack
        eid = bfirst
        skip = len(_ARRAY_HEAD)
        parts = []
        ap = parts.append
        for slot, _pos, payload in recs:
            ap(rh(const, 0xCF, eid, 0xCD, slot, 0xCF, upto[slot]))
            ap(payload[skip:])
            eid += stride
        return b"".join(parts)

    def commit(self, batch: CHBatch) -> tuple[int, int, int]:
        for bfirst, body in batch.inserts:
            self._insert(batch, bfirst, body)
        self.bad_records += batch.bad
        return batch.first, batch.last, batch.n

    def replay_data(self, batch: CHBatch):
        """What replays this batch exactly as it was sent (the same ids, rows and deduplication tokens),
        for the recorder's journal when its outcome is unknown: replaying lands it once in every table,
        also where a crash left it in a view but not in qag_events (or the other way round)."""
        return [[bfirst, body] for bfirst, body in batch.inserts] if batch.inserts else None

    def replay(self, source: str, data) -> None:
        batch = CHBatch(source, [(int(b), bytes(body)) for b, body in data], {}, 0, 0, 0, 0)
        for bfirst, body in batch.inserts:
            self._insert(batch, bfirst, body)

    def _insert(self, batch, bfirst, body):
        settings = {**_DEDUP, "insert_deduplication_token": f"{batch.source}:{bfirst}"}
        try:
            self.client.raw_insert("qag_events", INSERT_COLUMNS, insert_block=body, fmt="MsgPack",
                                   settings=settings)
        except Exception as e:
            if "MsgPack" not in str(e) and "CANNOT_PARSE" not in str(e) and "Cannot parse" not in str(e):
                raise
            # A record with a field of the wrong type fails the whole parse (nothing written): drop
            # what does not validate, keep the rest under the same ids and token.
            kept, dropped = _validate_body(body)
            if not dropped:
                raise
            batch.bad += dropped
            self.client.raw_insert("qag_events", INSERT_COLUMNS, insert_block=kept, fmt="MsgPack",
                                   settings=settings)

    def write_batch(self, source: str, records):
        """[(slot, pos_after, payload)] in one insert (two across midnight)."""
        from .sql import chunks_of

        return self.commit(self.prepare(source, chunks_of(records)))

    def prune(self, max_rows: int = 5000, now_ms_: int | None = None) -> int:
        """Drop at most one whole expired partition per call (the TTL removes rows inside
        partitions that are partly expired). Returns 1 when it dropped one, else 0."""
        t = now_ms() if now_ms_ is None else now_ms_
        s = self.settings
        cut = {"qag_events": t - s.events_retention_hours * 3_600_000,
               "qag_history": t - s.history_retention_days * MS_PER_DAY}
        parts = self.client.query(
            "SELECT table, partition FROM system.parts WHERE database = currentDatabase() AND active "
            "AND table IN ('qag_events', 'qag_history', 'qag_usage_minute') GROUP BY table, partition "
            "ORDER BY partition").result_rows
        for table, partition in parts:
            p = str(partition)
            if table == "qag_usage_minute":
                # YYYYMM: the month's end must be older than the usage retention
                y, m = int(p[:4]), int(p[4:6])
                end = _month_end_ms(y, m)
                if end <= t - s.usage_retention_days * MS_PER_DAY:
                    self.client.command(f"ALTER TABLE qag_usage_minute DROP PARTITION {p}")
                    return 1
                continue
            day_end = _day_start_ms(int(p)) + MS_PER_DAY
            if day_end <= cut[table]:
                self.client.command(f"ALTER TABLE {table} DROP PARTITION {p}")
                return 1
        return 0

    # -- read side -------------------------------------------------------------------------------
    def _rows(self, sql, params=None):
        return self.client.query(sql, parameters=params or {}).result_rows

    def history(self, query=None, key=None, status=None, since=None, until=None, limit=100, cursor=None):
        limit = max(1, min(int(limit), 1000))
        where, params = [], {}
        before = _items.parse_cursor(cursor)
        if before is not None:
            where.append("event_id < %(before)s")
            params["before"] = before
        if query:
            where.append("query = %(query)s")
            params["query"] = query
        if key:
            where.append("key_name = %(key)s")
            params["key"] = key
        st = _items.parse_status(status)
        if st:
            where.append("status BETWEEN %(slo)s AND %(shi)s")
            params["slo"], params["shi"] = st
        since_us, until_us = _items.to_us(since), _items.to_us(until)
        if since_us is not None:
            where += ["at >= fromUnixTimestamp64Micro(%(since)s, 'UTC')", "event_id >= %(since_id)s"]
            params["since"], params["since_id"] = since_us, id_floor(since_us // 1000 - 1000)
        if until_us is not None:
            where.append("at < fromUnixTimestamp64Micro(%(until)s, 'UTC')")
            params["until"] = until_us
        sql = f"SELECT {_READ_HISTORY} FROM qag_history"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY event_id DESC LIMIT {limit + 1}"
        rows = self._rows(sql, params)
        items = [history_item(r) for r in rows[:limit]]
        return items, (str(items[-1]["event_id"]) if len(rows) > limit else None)

    def events_after(self, event_id: int = 0, key_name: str | None = None, limit: int = 1000):
        """Events with id > event_id, oldest first. One writer inserts batches one after another,
        each visible whole once its insert returns, in id order: none with a smaller id appears later.
        With several writers (QAG_RUN_WRITERS > 1) set QAG_EVENTS_SETTLE_MS (e.g. 1000) above the
        longest insert: events are then delivered once that old."""
        limit = max(1, min(int(limit), 100_000))
        params = {"after": int(event_id)}
        where = "event_id > %(after)s"
        if self.settings.events_settle_ms > 0:
            # Several writers commit independently: an id is delivered once no writer can still
            # commit a smaller one, i.e. once it is older than the settle delay.
            where += f" AND event_id < {id_floor(now_ms() - self.settings.events_settle_ms)}"
        if key_name is not None:
            where += " AND key_name = %(key)s"
            params["key"] = key_name
        rows = self._rows(f"SELECT {_READ} FROM qag_events WHERE {where} ORDER BY event_id LIMIT {limit}", params)
        return [run_item(r) for r in rows]

    def usage(self, per="hour", since=None, until=None, key=None, query=None):
        step = _items.period_bounds(per)
        since_us, until_us = _items.to_us(since), _items.to_us(until)
        where, params = [], {}
        if key:
            where.append("key_name = %(key)s")
            params["key"] = key
        if query:
            where.append("query = %(query)s")
            params["query"] = query
        buckets: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])

        def add(rows):
            for p, calls, errors, nrows in rows:
                b = buckets[int(p)]
                b[0] += int(calls)
                b[1] += int(errors)
                b[2] += int(nrows)

        m_lo = None if since_us is None else -(-since_us // 60_000_000) * 60
        m_hi = None if until_us is None else (until_us // 60_000_000) * 60
        w = list(where)
        if m_lo is not None:
            w.append(f"minute >= toDateTime({m_lo}, 'UTC')")
        if m_hi is not None:
            w.append(f"minute < toDateTime({m_hi}, 'UTC')")
        add(self._rows(f"SELECT intDiv(toUnixTimestamp(minute), {step}) * {step} AS p, sum(calls), sum(errors), "
                       f"sum(rows) FROM qag_usage_minute {'WHERE ' + ' AND '.join(w) if w else ''} GROUP BY p",
                       params))
        edges = []
        if since_us is not None and m_lo * 1_000_000 > since_us:
            edges.append((since_us, min(m_lo * 1_000_000, until_us if until_us is not None else 1 << 62)))
        if until_us is not None and m_hi * 1_000_000 < until_us:
            lo = m_hi * 1_000_000 if since_us is None else max(m_hi * 1_000_000, since_us)
            if not edges or edges[0] != (lo, until_us):
                edges.append((lo, until_us))
        for lo, hi in edges:
            if lo >= hi:
                continue
            w = list(where) + [f"at >= fromUnixTimestamp64Micro({lo}, 'UTC')",
                               f"at < fromUnixTimestamp64Micro({hi}, 'UTC')",
                               f"event_id >= {id_floor(lo // 1000 - 1000)}"]
            add(self._rows(f"SELECT intDiv(toUnixTimestamp(at), {step}) * {step} AS p, count(), "
                           f"countIf(status >= 400), sum(rows) FROM qag_events WHERE {' AND '.join(w)} GROUP BY p",
                           params))
        return [{"period": fmt_us(k * 1_000_000), "calls": v[0], "errors": v[1], "rows": v[2]}
                for k, v in sorted(buckets.items())]

    def counts(self) -> dict:
        c = self.client
        return {
            "qag_events": int(c.query("SELECT count() FROM qag_events").result_rows[0][0]),
            "qag_history": int(c.query("SELECT count() FROM qag_history").result_rows[0][0]),
            "usage_calls": int(c.query("SELECT sum(calls) FROM qag_usage_minute").result_rows[0][0] or 0),
        }


def _normalise(payload: bytes) -> bytes | None:
    """A record that is not the plain 16-field array (a later minor version's extra fields, or a
    non-canonical encoding): re-encoded as one, or None when it is not a run record at all."""
    try:
        t = msgpack.unpackb(payload, use_list=False, raw=False)
    except Exception:
        return None
    if type(t) is not tuple or len(t) < RUN_NFIELDS_1_0 or t[0] != VERSION:
        return None
    from .sql import _valid

    # RR2: a later minor version's extra fields dropped; a 1.0 record (no `error`) read with them nil
    t = t[:NFIELDS] if len(t) >= NFIELDS else t + _PAD[:NFIELDS - len(t)]
    if not _valid(t):
        return None
    return _packb(t)


def _validate_body(body: bytes) -> tuple[bytes, int]:
    """Re-walk a MsgPack insert body row by row, keeping rows whose record fields are well typed."""
    from .sql import _valid

    up = msgpack.Unpacker(raw=False)
    up.feed(body)
    ncols = len(INSERT_COLUMNS)
    kept, dropped = [], 0
    try:
        while True:
            row = [up.unpack() for _ in range(ncols)]
            rec = tuple(row[5:])
            if _valid(rec) and type(row[2]) is int:
                kept.append(b"".join(_packb(x) for x in row))
            else:
                dropped += 1
    except msgpack.OutOfData:
        pass
    return b"".join(kept), dropped


def _day_start_ms(yyyymmdd: int) -> int:
    import calendar

    y, m, d = yyyymmdd // 10000, yyyymmdd // 100 % 100, yyyymmdd % 100
    return calendar.timegm((y, m, d, 0, 0, 0)) * 1000


def _month_end_ms(y: int, m: int) -> int:
    import calendar

    y2, m2 = (y + 1, 1) if m == 12 else (y, m + 1)
    return calendar.timegm((y2, m2, 1, 0, 0, 0)) * 1000


def writer_user_sql(database: str = "default", user: str = "qag_writer", password: str = "",
                    reader: str | None = "qag_reader", reader_password: str = "") -> str:
    """The users and grants `qag clickhouse init` prints for an operator to apply. chDB has no users
    (CREATE USER fails with ACCESS_DENIED there), so this is tested as text only.

    The writer can add runs to qag_events and read it (to resume: its last insert and the ids); it
    can't alter, delete, drop or truncate anything, nor write history or usage except through the
    views, which run with their definer's rights (ClickHouse 24.2+: SQL SECURITY DEFINER, the
    default for materialised views)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", database) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", user):
        raise ValueError("database and user names must be plain identifiers")
    db = f"`{database}`"
    lines = [
        f"CREATE USER IF NOT EXISTS {user} IDENTIFIED WITH sha256_password BY {_q(password)};",
        f"GRANT INSERT, SELECT ON {db}.qag_events TO {user};",
    ]
    if reader:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", reader):
            raise ValueError("reader must be a plain identifier")
        lines += [
            f"CREATE USER IF NOT EXISTS {reader} IDENTIFIED WITH sha256_password BY {_q(reader_password)};",
            f"GRANT SELECT ON {db}.qag_events TO {reader};",
            f"GRANT SELECT ON {db}.qag_history TO {reader};",
            f"GRANT SELECT ON {db}.qag_usage_minute TO {reader};",
        ]
    return "\n".join(lines) + "\n"


__all__ = ["INSERT_COLUMNS", "ClickHouseRunStore", "writer_user_sql"]
