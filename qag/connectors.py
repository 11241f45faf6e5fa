"""Connectors to the data databases: per-worker pools of sessions, and the rules every session keeps.

The data plane (rustplane) opens the same sessions and keeps the same rules; what it mirrors is numbered.

S1 Opening a session. PostgreSQL: startup options `-c statement_timeout=<limit ms>` and, for reads,
   `-c default_transaction_read_only=on` (plus `-c search_path=` from the connection's options),
   `application_name=qag`, libpq `keepalives=1 keepalives_idle=10 keepalives_interval=5
   keepalives_count=3 tcp_user_timeout=10000`; reads and writes in autocommit. MySQL/MariaDB: one
   `SET SESSION max_statement_time = <s>` (MySQL: `max_execution_time = <ms>`) and, for reads,
   `SET SESSION TRANSACTION READ ONLY`; the TCP socket gets SO_KEEPALIVE, TCP_KEEPIDLE 10, TCP_KEEPINTVL 5,
   TCP_KEEPCNT 3, TCP_USER_TIMEOUT 10000 ms. The session-level settings are the second layer; S2 is the first.
S2 A read is one message and one answer, in a transaction that cannot become read-write.
   PostgreSQL: `SET TRANSACTION READ ONLY; [SET LOCAL statement_timeout = <ms>; ]<statement>` as one
   simple-query message (psycopg2 binds client-side): the server runs the pieces in one implicit
   transaction, read-only before the statement's first snapshot (so `set_config('transaction_read_only',
   'off', true)` inside it fails), and the answer kept is the statement's, the last. The SET LOCAL is
   sent only when the call's limit differs from the session's. MariaDB: `SET STATEMENT tx_read_only=1,
   max_statement_time=<s.mmm> FOR <statement>` (one statement, no multi-statement flag). MySQL (not
   MariaDB, no SET STATEMENT): the session-level settings of S1, and a `SET SESSION max_execution_time`
   around a call with its own limit. mysql-connector's `cursor()` pings the server (a second round trip);
   cursors are built directly (`MySQLCursor(conn)`), so a read is one COM_QUERY.
   A PostgreSQL write is one message and one answer too: `SET LOCAL statement_timeout = <ms>; <statement>` in
   autocommit, which the server runs as one implicit transaction committed at its end (a deferred constraint
   or a serialization failure at that commit is the message's error, and nothing is kept), the count kept being
   the statement's. The SET LOCAL is always sent: a lone statement would run outside any transaction block,
   where `VACUUM`, `CREATE INDEX CONCURRENTLY` and the like run, which psycopg2's `BEGIN`, the plane's and this
   message all refuse. psycopg2's own transaction was three round trips (`BEGIN`, the statement, `COMMIT`).
S3 Time limits. A call's limit is min(QAG_QUERY_TIMEOUT, max(0.01, asked)) seconds (`?timeout=` must be a
   positive number, else 400 invalid_timeout), rounded UP to whole milliseconds (PostgreSQL
   `statement_timeout` in ms, MariaDB `max_statement_time` in seconds with 3 decimals, MySQL
   `max_execution_time` in ms): never 0, which both servers read as "no limit". See `limit_ms()`.
S4 A hung database. Every call is watched: at its limit + DEADLINE_MARGIN (1.0 s) without an answer (a
   frozen server or a cut network, when the server cannot cancel it itself), the session's socket is shut
   down in both directions, the call answers 504 query_timeout and the session is discarded. Opening a
   session is bounded by QAG_CONNECT_TIMEOUT (libpq `connect_timeout`, mysql-connector
   `connection_timeout`).
S5 No state from one caller to the next. A statement is *state-free* when `state_free()` proves it (one
   SELECT, no INTO, no locking clause, no user-variable assignment, every function on the short list of
   built-ins below that read nothing but their arguments) and it reads no view and no table with row-level
   security (a view's definition and a policy's expression may call anything; plan.py checks the connection's
   catalogue, read once per generation); the plan carries the verdict (`Plan.state_free`, plan
   entry field `state_free`). After a call whose statement is not proven state-free, the session is reset
   before it goes back to the pool: PostgreSQL `DISCARD ALL` (settings back to the startup packet's, advisory
   locks, prepared statements, temp tables, LISTEN, cursors gone), sent without waiting for its answer
   (`_LibPQ`: the server runs it at once; the answer is read when the session is next taken, and anything but
   one COMMAND_OK, or bytes from a server that ended the idle session, discards it before use); MariaDB/MySQL
   COM_RESET_CONNECTION then one `SET NAMES 'utf8mb4' COLLATE <the session's>, autocommit = <1 read, 0 write>,
   sql_mode = <the session's>, <S1's settings>` (two round trips). Writes are always reset. After every call,
   whatever the verdict, a session that is not idle (PostgreSQL PQtransactionStatus != IDLE; MySQL in a
   transaction) is rolled back and reset, and a PostgreSQL session whose reported
   `default_transaction_read_only` or `session_authorization` (ParameterStatus) differs from what it opened
   with is discarded. A reset that fails discards.
S6 Stale sessions. A pooled session that fails with a connectivity error (PostgreSQL: the connection is
   closed after the error; MySQL: client errors 2006, 2013, 2055 and server errors 1053, 1927) is
   dropped, and so is every idle session of its pool opened before the failure (after a restart they are
   all dead); a read is then retried once on a fresh session, so the caller sees nothing. 502
   connection_failed only when a fresh session fails too. Writes are not retried (at most once).
S7 Errors. A statement the database rejects, the session still usable, is 500 query_failed, whatever its
   SQLSTATE class (`could not stat file` is a statement error); an unreachable or lost database is 502
   connection_failed; over the limit is 504 query_timeout. Scoped keys get a fixed sentence that depends
   on nothing the database said nor on the password; the database's own first line (`db_text`, with the
   password replaced by `********`) is for administrators only.
S8 Privileged roles. `privileges()` reads whether the connection's role is a superuser or may read server
   files or run programs (PostgreSQL rolsuper, pg_read_server_files, pg_write_server_files,
   pg_execute_server_program; MariaDB/MySQL global SUPER or FILE); a key with an allow-list or masking
   rules is refused such a connection (403 connection_privileged) unless the connection's
   `options.allow_superuser` is true. Decided once per connection generation.
SQLite uses `mode=ro` and a progress-handler deadline; ClickHouse `readonly=2` and `max_execution_time`.
"""
from __future__ import annotations

import json
import math
import os
import re
import select
import socket
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator

from qag import formats
from qag.errors import ConnectorError, DriverMissing, QueryFailed, Timeout, Unreachable

try:
    import psycopg2
    import psycopg2.errorcodes
    import psycopg2.extensions
except ImportError:  # pragma: no cover
    psycopg2 = None  # type: ignore[assignment]

try:
    import mysql.connector as mysql_connector
    import mysql.connector.errors as mysql_errors
    from mysql.connector.constants import ServerCmd
    from mysql.connector.cursor import MySQLCursor
except ImportError:  # pragma: no cover
    mysql_connector = None  # type: ignore[assignment]

DIALECTS = {"postgres": "postgres", "mysql": "mysql", "sqlite": "sqlite", "clickhouse": "clickhouse"}

MIN_TIMEOUT = 0.01       # S3: the shortest limit a caller may ask for, in seconds
DEADLINE_MARGIN = 1.0    # S4: seconds past a call's limit before its socket is shut down
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
             "tcp_user_timeout": 10000}  # S1 (PostgreSQL libpq names; the same values on MySQL sockets)

# S7's errors are domain errors (qag/errors.py), answered by qag/http/errors.py: QueryFailed (the database
# rejected the statement), Unreachable (connection_failed: a sentence fixed by the connection's name; what went
# wrong is `db_text`, for administrators), Timeout (query_timeout), DriverMissing.
def limit_ms(asked: float | None, server: float) -> int:
    """S3: a call's limit in whole milliseconds: the server's when none is asked, never below 10 ms, never above
    the server's, rounded up (a limit of 0 means none to PostgreSQL and MariaDB)."""
    server_ms = max(int(MIN_TIMEOUT * 1000), math.ceil(server * 1000 - 1e-9))
    if asked is None:
        return server_ms
    # clamped before scaling: a finite but huge value (7e307 s) would overflow to infinity in milliseconds
    ms = math.ceil(min(max(asked, MIN_TIMEOUT), server) * 1000 - 1e-9)
    return max(int(MIN_TIMEOUT * 1000), min(ms, server_ms))


def _generated_from_rows(rows) -> dict:
    """(schema, table, column, source column or None) rows -> generated_columns()'s form; a column with no
    source row (or a None one) may derive from any column of its table."""
    out: dict = {}
    for s, t, c, dep in rows:
        cols = out.setdefault((s, t), {})
        if dep is None:
            cols[c] = None
        elif c not in cols or cols[c] is not None:
            cols[c] = tuple(dict.fromkeys((*(cols.get(c) or ()), dep)))
    return out


_WORD = re.compile(r"[A-Za-z_\u0080-\uffff][A-Za-z0-9_$\u0080-\uffff]*")


def _generated_from_text(rows, columns: dict) -> dict:
    """(schema, table, column, expression text) rows -> generated_columns()'s form: the table's columns the
    expression's words name (compared without case), which over-counts (a word in a string) and never misses
    a column; a table whose columns are unknown: any."""
    out: dict = {}
    for s, t, c, expr in rows:
        known = columns.get((s, t))
        if known is None or expr is None:
            out.setdefault((s, t), {})[c] = None
            continue
        words = {w.lower() for w in _WORD.findall(str(expr))}
        out.setdefault((s, t), {})[c] = tuple(k for k in known if k.lower() in words and k != c)
    return out


# -- S5: which statements are proven to leave no state behind ---------------------------------------
# Built-ins that compute from their arguments (and the statement's snapshot) only. Anything else — a
# user-defined function, set_config, advisory locks, nextval, dblink... — makes the session reset after the call.
_PURE_COMMON = frozenset("""
abs avg bit_and bit_or bool_and bool_or ceil ceiling char_length character_length coalesce concat concat_ws count
cume_dist date_trunc dense_rank every exp first_value floor greatest lag last_value lead least left length ln log
lower lpad ltrim max md5 min mod nth_value ntile nullif octet_length percent_rank position power rank replace
reverse right round row_number rpad rtrim sign sqrt stddev stddev_pop stddev_samp substr substring sum trim trunc
upper var_pop var_samp variance
""".split())
PURE_FUNCTIONS = {
    "postgres": _PURE_COMMON | frozenset("""
age array_agg array_length array_position array_to_string btrim cardinality date_part extract format
generate_series initcap json_agg json_build_array json_build_object jsonb_agg jsonb_build_array jsonb_build_object
json_extract_path json_extract_path_text jsonb_extract_path jsonb_extract_path_text make_date make_interval
make_time make_timestamp now overlay percentile_cont percentile_disc regexp_replace regexp_match split_part
statement_timestamp string_agg string_to_array strpos timezone to_char to_date to_json to_jsonb to_number
to_timestamp transaction_timestamp translate unnest row_to_json
""".split()),
    "mysql": _PURE_COMMON | frozenset("""
adddate addtime char concat curdate current_date current_time current_timestamp curtime date date_add
date_format date_sub datediff day dayname dayofmonth dayofweek dayofyear from_unixtime group_concat hour
if ifnull instr json_arrayagg json_extract json_object json_objectagg json_unquote last_day lcase locate
minute month monthname now quarter second str_to_date strcmp subdate substring_index time time_format
timediff timestampadd timestampdiff to_days truncate ucase unix_timestamp week weekday year
""".split()),
}


def state_free(sql: str, dialect: str) -> bool:
    """S5: True only when the statement (markers neutralised) provably leaves no session state behind; False
    when in doubt, which costs a reset after the call, never a wrong answer."""
    try:
        if dialect == "postgres":
            return _pg_state_free(sql)
        if dialect == "mysql":
            return _mysql_state_free(sql)
    except Exception:
        return False
    return dialect in ("sqlite", "clickhouse")  # no pooled session state qag does not set on every call


def _pg_state_free(sql: str) -> bool:
    from pglast.parser import parse_sql_json
    stmts = json.loads(parse_sql_json(sql)).get("stmts") or []
    if len(stmts) != 1 or "SelectStmt" not in stmts[0].get("stmt", {}):
        return False
    pure = PURE_FUNCTIONS["postgres"]
    stack: list = [stmts[0]["stmt"]]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("intoClause", "lockingClause"):
                    return False
                if k == "FuncCall":
                    names = [n.get("String", {}).get("sval", "") for n in v.get("funcname", [])]
                    if not names or len(names) > 2 or len(names) == 2 and names[0] != "pg_catalog" \
                            or names[-1] not in pure:
                        return False
                stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)
    return True


def _mysql_state_free(sql: str) -> bool:
    import sqlglot
    from sqlglot import exp
    trees = [t for t in sqlglot.parse(sql, read="mysql") if t is not None]
    if len(trees) != 1 or not isinstance(trees[0], exp.Query):
        return False
    pure = PURE_FUNCTIONS["mysql"]
    for node in trees[0].walk():
        if isinstance(node, (exp.PropertyEQ, exp.Into, exp.Lock, exp.Parameter, exp.SessionParameter)):
            return False
        if isinstance(node, exp.Select) and (node.args.get("into") or node.args.get("locks")):
            return False
        if isinstance(node, exp.Func) and not isinstance(node, (exp.Cast, exp.TryCast, exp.Case, exp.If)):
            name = node.name if isinstance(node, exp.Anonymous) else node.sql_name()
            if name.lower() not in pure:
                return False
    return True


# -- S4: the watchdog -------------------------------------------------------------------------------
class _Watchdog:
    """One thread per process: a call still waiting at its deadline gets its session's socket shut down, so the
    blocked read returns and the call answers 504. Arming and disarming are one dict store each (atomic under the
    GIL; a cut that races a disarm leaves a session that fails as stale on its next use, S6). The thread sleeps
    until the earliest deadline it knows of (about the statement limit away), so a busy worker pays no wake-ups;
    an arm with an earlier deadline than that wakes it."""

    def __init__(self):
        self._after_fork()

    def _after_fork(self) -> None:
        self._calls: dict[_Session, float] = {}
        self._running = False
        self._wake = 0.0  # when the thread next looks; 0 while it is looking
        self._cond = threading.Condition()

    def arm(self, sess: _Session, seconds: float) -> None:
        if not self._running:
            self._start()
        d = time.monotonic() + seconds
        self._calls[sess] = d
        if d < self._wake or not self._wake:
            with self._cond:
                self._cond.notify()

    def disarm(self, sess: _Session) -> None:
        self._calls.pop(sess, None)

    def _start(self) -> None:
        with self._cond:
            if not self._running:
                threading.Thread(target=self._loop, name="qag-db-watchdog", daemon=True).start()
                self._running = True

    def _loop(self) -> None:
        with self._cond:
            while True:
                self._wake = 0.0
                now = time.monotonic()
                for s, d in list(self._calls.items()):
                    if d <= now and self._calls.pop(s, None) is not None:
                        s.fired = True
                        s.cut()
                nxt = min(self._calls.values(), default=now + 60.0)
                self._wake = nxt
                self._cond.wait(max(0.005, nxt - now))


WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=WATCHDOG._after_fork)


class _Session:
    """One pooled database session: the driver's connection, when it was opened (S6), and what S4/S5 need."""

    __slots__ = ("auth", "conn", "fired", "opened_at", "own_sock", "pending", "sock", "write")

    def __init__(self, conn, write: bool, sock=None, own_sock: bool = False):
        self.conn = conn
        self.write = write
        self.opened_at = time.monotonic()
        self.sock = sock          # a socket object on the session's connection, for cut()
        self.fired = False        # the watchdog cut this session
        self.own_sock = own_sock  # sock is a dup of the driver's descriptor, closed with the session
        self.auth = None          # S5: PostgreSQL session_authorization at open; MySQL (reset SET, sql_mode)
        self.pending = False      # S5: a reset sent and its answer not read yet (read before the next use)

    def cut(self) -> None:
        try:
            if self.sock is not None:
                self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass
        if self.own_sock:
            try:
                self.sock.close()
            except OSError:
                pass


class _Stale(Exception):
    """The session's connection is gone (S6); `text` is the driver's first line."""

    def __init__(self, text: str = ""):
        super().__init__(text)
        self.text = text
        self.at = time.monotonic()


def _keepalive(sock) -> None:
    """S1's keepalives on a TCP socket (MySQL; libpq sets PostgreSQL's itself)."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE["keepalives_idle"])
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE["keepalives_interval"])
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE["keepalives_count"])
        sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", 18), KEEPALIVE["tcp_user_timeout"])
    except OSError:
        pass


class Connector:
    dialect = ""

    def __init__(self, row: dict, password: str | None, *, timeout: float, connect_timeout: float, pool_size: int,
                 home: str = ""):
        self.row = row
        self.name = row["name"]
        self.password = password
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.pool_size = pool_size
        self.home = home
        self._idle: dict[bool, list[_Session]] = {False: [], True: []}
        self._lock = threading.Lock()
        self.in_use = 0
        self.opened = 0
        self.resets = 0         # sessions reset after a call not proven state-free (S5)
        self.stale_dropped = 0  # sessions dropped as stale, idle ones opened before a failure included (S6)
        self.closed = False
        self.session_ms = limit_ms(None, timeout)  # S3: the sessions' own limit
        self._session_limit = self.session_ms / 1000

    # -- pool ----------------------------------------------------------------------------
    def acquire(self, write: bool) -> tuple[_Session, bool]:
        while True:
            with self._lock:
                idle = self._idle[write]
                # the most recently released first (its server process and pages are the warmest: measured
                # against the longest idle first, which gives a reset sent ahead more time, at 32 callers)
                sess = idle.pop() if idle else None
                self.in_use += 1
            if sess is None:
                break
            if not sess.pending or self._settle(sess):
                return sess, True
            # S5: its reset failed (or the session died idle): never used again; nothing ran on it yet
            with self._lock:
                self.in_use -= 1
            sess.close()
        try:
            sess = self._open(write)
        except BaseException:
            with self._lock:
                self.in_use -= 1
            raise
        self.opened += 1
        return sess, False

    def release(self, sess: _Session, write: bool, broken: bool = False) -> None:
        with self._lock:
            self.in_use -= 1
            if not broken and not self.closed and len(self._idle[write]) < self.pool_size:
                self._idle[write].append(sess)
                return
        sess.close()

    def _drop_idle_before(self, t: float) -> None:
        """S6: after a stale session, every idle one opened before the failure goes too."""
        with self._lock:
            old = [s for w in (False, True) for s in self._idle[w] if s.opened_at <= t]
            for w in (False, True):
                self._idle[w] = [s for s in self._idle[w] if s.opened_at > t]
            self.stale_dropped += len(old)
        for s in old:
            s.close()

    def idle_count(self) -> int:
        return len(self._idle[False]) + len(self._idle[True])

    def close(self) -> None:
        with self._lock:
            self.closed = True
            sessions = self._idle[False] + self._idle[True]
            self._idle = {False: [], True: []}
        for s in sessions:
            s.close()

    def limit(self, asked: float | None) -> float:
        """S3: the call's limit in seconds (whole milliseconds)."""
        return self._session_limit if asked is None else limit_ms(asked, self.timeout) / 1000

    # -- what subclasses provide -------------------------------------------------------------
    def _open(self, write: bool) -> _Session:
        raise NotImplementedError

    def _run(self, sess: _Session, sql: str, args: tuple, *, write: bool, limit: float, max_rows: int | None):
        raise NotImplementedError

    def _reset(self, sess: _Session, clean: bool) -> bool:
        """S5: bring the session back to how it was opened; False when it must be discarded instead."""
        return True

    def _settle(self, sess: _Session) -> bool:
        """S5: the answer of a reset sent after the session's last call (sess.pending); False: discard it."""
        return False

    def default_schema(self) -> str:
        raise NotImplementedError

    def run(self, sql: str, args: tuple, *, write: bool, timeout: float | None, max_rows: int | None,
            state_free: bool = False) -> tuple[list[str], list[tuple], int]:
        """Execute one statement; (columns, rows, rowcount). `state_free` is the plan's S5 verdict. A read on a
        stale pooled session is retried on a fresh one (S6)."""
        limit = self.limit(timeout)
        for attempt in (0, 1):
            sess, reused = self.acquire(write)
            ok = False
            try:
                WATCHDOG.arm(sess, limit + DEADLINE_MARGIN)
                try:
                    out = self._run(sess, sql, args, write=write, limit=limit, max_rows=max_rows)
                finally:
                    WATCHDOG.disarm(sess)
                ok = self._reset(sess, state_free)
                return out
            except _Stale as st:
                if sess.fired:
                    raise Timeout(limit) from None
                self.stale_dropped += 1
                self._drop_idle_before(st.at)
                if attempt == 0 and reused and not write:
                    continue
                raise Unreachable(self.name, st.text) from None
            except QueryFailed:
                ok = not sess.fired and self._reset(sess, state_free)
                raise
            except (Timeout, Unreachable, DriverMissing) as err:
                ok = isinstance(err, Timeout) and not sess.fired and self._reset(sess, state_free)
                raise
            finally:
                self.release(sess, write, broken=not ok)
        raise Unreachable(self.name)  # pragma: no cover (the loop returns or raises)

    def stream(self, sql: str, args: tuple, *, timeout: float | None, batch: int = 500, state_free: bool = False
               ) -> tuple[list[str], Iterator[list[tuple]]]:
        raise NotImplementedError

    def introspect(self) -> dict[tuple[str, str], list[str]]:
        raise NotImplementedError

    def generated_columns(self) -> dict[tuple[str, str], dict[str, tuple[str, ...] | None]]:
        """{(schema, table): {column: the columns of that table its value is computed from (None: unknown, any)}}
        for generated, ALIAS and MATERIALIZED columns: governance masks them as derived from those columns."""
        return {}

    def privileges(self) -> dict:
        """S8: {"superuser": bool, "server_files": bool, "privileged": bool, "detail": [...]} of the role this
        connection logs in as, read from the database (the runtime keeps it per connection generation)."""
        return self._read_privileges()

    def _read_privileges(self) -> dict:
        return {"superuser": False, "server_files": False, "privileged": False, "detail": []}

    def user_functions(self) -> set[tuple[str, str]]:
        """(schema, name) of the functions defined in the database rather than built in: their bodies may read
        any table, so governance refuses them to keys with an allow-list or masking rules. SQLite (no
        functions but qag's) and ClickHouse have none to report."""
        return set()

    def views(self) -> dict[tuple[str, str], str | None]:
        """{(schema, view): its definition} (issue 12, class 5): governance expands a view a key with an
        allow-list or masking rules reads into what it reads; None or "" (a definition this account may not
        see) is refused."""
        return {}

    def ancestors(self) -> dict[tuple[str, str], tuple[tuple[str, str], ...]]:
        """{(schema, table): its ancestors} for tables whose rows are also another table's rows (PostgreSQL
        partitions and INHERITS children): a masking rule on a table covers them too."""
        return {}

    def row_secured(self) -> set[tuple[str, str]]:
        """{(schema, table)} of tables with row-level security on (PostgreSQL): reading one runs its policies'
        expressions, which may call any function, so such a read is never proven state-free (S5)."""
        return set()


# ---------------------------------------------------------------------------------------------
_PG_IDLE = psycopg2.extensions.TRANSACTION_STATUS_IDLE if psycopg2 is not None else 0


class _LibPQ:
    """S5's reset without waiting for its answer. psycopg2 sends a statement and sleeps until the answer comes
    (PQexec); a `DISCARD ALL` after every write cost a worker a second sleep and wake-up per write
    (bench/results/2026-12-06-s24/notes.md). The libpq psycopg2 is linked with (its symbols looked up through
    psycopg2's own module: one library, one PGconn) sends it (PQsendQuery, all written in blocking mode) and
    the pool reads its answer when the session is next taken (PQgetResult). psycopg2's own next PQexec would
    also discard an unread result, silently; _settle reads it first so a failed reset discards the session.
    Where the library cannot be bound, `send` is False and the reset waits for its answer as before."""

    PGRES_COMMAND_OK = 1
    CONNECTION_OK = 0

    def __init__(self):
        self.lib = None
        self.tried = False
        self.lock = threading.Lock()

    def _bind(self):
        with self.lock:
            if self.tried:
                return self.lib
            self.tried = True
            try:
                import ctypes

                from psycopg2 import _psycopg
                # dlsym through psycopg2's own module finds the libpq that module was linked with (its
                # dependencies are searched), not another one some other package may have loaded
                lib = ctypes.CDLL(_psycopg.__file__)
                vp = ctypes.c_void_p
                lib.PQsendQuery.argtypes, lib.PQsendQuery.restype = [vp, ctypes.c_char_p], ctypes.c_int
                lib.PQgetResult.argtypes, lib.PQgetResult.restype = [vp], vp
                lib.PQresultStatus.argtypes, lib.PQresultStatus.restype = [vp], ctypes.c_int
                lib.PQclear.argtypes, lib.PQclear.restype = [vp], None
                lib.PQisnonblocking.argtypes, lib.PQisnonblocking.restype = [vp], ctypes.c_int
                lib.PQstatus.argtypes, lib.PQstatus.restype = [vp], ctypes.c_int
                self.lib = lib
            except Exception:  # noqa: BLE001 - no library to bind: the reset waits for its answer
                self.lib = None
            return self.lib

    def send(self, conn, sql: bytes) -> bool:
        lib = self.lib if self.tried else self._bind()
        if lib is None:
            return False
        ptr = conn.pgconn_ptr
        if not ptr or lib.PQisnonblocking(ptr):
            return False
        return lib.PQsendQuery(ptr, sql) == 1

    def settle(self, conn) -> bool:
        """Read the one answer of what send() sent (up to its ReadyForQuery): True when it was COMMAND_OK and
        nothing else came."""
        lib = self.lib
        ptr = conn.pgconn_ptr
        if lib is None or not ptr:
            return False
        ok, n = False, 0
        while True:
            res = lib.PQgetResult(ptr)
            if not res:
                break
            n += 1
            ok = lib.PQresultStatus(res) == self.PGRES_COMMAND_OK
            lib.PQclear(res)
        return ok and n == 1 and lib.PQstatus(ptr) == self.CONNECTION_OK


_LIBPQ = _LibPQ()


class PostgresConnector(Connector):
    dialect = "postgres"

    def default_schema(self) -> str:
        opts = self.row.get("options") or {}
        sp = opts.get("schema") or opts.get("search_path")
        if sp:
            return str(sp).split(",")[0].strip().strip('"')
        return "public"

    # Without a schema/search_path option, the search_path the server gives a new session (the server's default,
    # or one set with ALTER ROLE ... SET / ALTER DATABASE ... SET) is read from the first session this connector
    # opens, and every later session (and the plane's, through the published connection entry) is opened with
    # that same value: the sessions run bare names with the path governance resolved them with, whatever
    # ALTER ROLE/DATABASE does later (a new connector, made when the connection changes, reads it again).
    _server_path: str | None = None
    _server_user: str | None = None

    def pinned_search_path(self) -> str | None:
        """The search_path text every session of this connector runs with, reading it from the server (one
        session opened) when the connection's options do not set one; None when they set it."""
        opts = self.row.get("options") or {}
        if opts.get("schema") or opts.get("search_path"):
            return None
        if self._server_path is None:
            self.run("SELECT 1", (), write=False, timeout=None, max_rows=None)   # a first session reads it
        if self._server_path is None:
            raise Unreachable(self.name, "the server's search_path could not be read")
        return self._server_path

    def search_path(self) -> list[str]:
        """The schemas a bare name is looked up in, in order, as the session's search_path lists them ("$user"
        is the connection's user); governance resolves a bare name to the first one holding it, as PostgreSQL
        does. Without an option, the path the server gives the connection's sessions (pinned_search_path)."""
        opts = self.row.get("options") or {}
        sp = opts.get("schema") or opts.get("search_path")
        user = self.row.get("user")
        if not sp:
            sp = self.pinned_search_path()
            user = self._server_user or user
        out = []
        for part in str(sp).replace(" ", "").replace("\\", "").split(","):
            name = part[1:-1].replace('""', '"') if len(part) > 1 and part[0] == part[-1] == '"' else part.lower()
            if name == "$user":
                name = str(user or "")
            if name and name not in out:
                out.append(name)
        return out or ["public"]

    def _open(self, write: bool) -> _Session:
        if psycopg2 is None:
            raise DriverMissing("psycopg2 is not installed: pip install 'qag[postgres]'")
        opts = self.row.get("options") or {}
        pg_opts = [f"-c statement_timeout={limit_ms(None, self.timeout)}"]
        if not write:
            pg_opts.append("-c default_transaction_read_only=on")
        sp = opts.get("schema") or opts.get("search_path") or self._server_path
        if sp:
            pg_opts.append("-c search_path=" + str(sp).replace(" ", "").replace("\\", ""))
        kw = dict(host=self.row.get("host") or "127.0.0.1", port=self.row.get("port") or 5432,
                  user=self.row.get("user") or None, password=self.password or None,
                  dbname=self.row.get("database") or None, connect_timeout=max(1, int(round(self.connect_timeout))),
                  options=" ".join(pg_opts), application_name="qag")
        if opts.get("sslmode"):
            kw["sslmode"] = opts["sslmode"]
        if not str(kw["host"]).startswith("/"):
            kw.update(KEEPALIVE)
        try:
            conn = psycopg2.connect(**{k: v for k, v in kw.items() if v is not None})
        except psycopg2.OperationalError as exc:
            raise Unreachable(self.name, _first_line(exc, self.password)) from None
        conn.autocommit = True  # a read is one message and one answer (S2), and so is a write (its own transaction)
        if not sp and not self._pin_search_path(conn):
            conn.close()          # another session pinned another path first (ALTER ROLE in between): reopen with it
            return self._open(write)
        sess = _Session(conn, write, socket.socket(fileno=os.dup(conn.fileno())), own_sock=True)
        sess.auth = conn.get_parameter_status("session_authorization")
        return sess

    def _pin_search_path(self, conn) -> bool:
        """The first session without a search_path option reads the one the server gave it (role's, database's
        or server's default); later sessions are opened with it (_open)."""
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_catalog.current_setting('search_path'), current_user")
                path, user = cur.fetchone()
            if not conn.autocommit:
                conn.rollback()
        except psycopg2.Error as exc:
            conn.close()
            raise Unreachable(self.name, "the server's search_path could not be read: "
                              + _first_line(exc, self.password)) from None
        if self._server_path is None:
            self._server_user = user
            self._server_path = path
        return self._server_path == path

    def _run(self, sess, sql, args, *, write, limit, max_rows):
        conn = sess.conn
        ms = round(limit * 1000)
        if write:  # one implicit transaction, committed at the message's end (S2)
            text = f"SET LOCAL statement_timeout = {ms}; {sql}"
        elif ms == self.session_ms:
            text = "SET TRANSACTION READ ONLY; " + sql
        else:
            text = f"SET TRANSACTION READ ONLY; SET LOCAL statement_timeout = {ms}; {sql}"
        cur = conn.cursor()
        try:
            cur.execute(text, args)
            if cur.description is None:
                cols, rows = [], []
            else:
                cols = formats.pg_columns(cur.description)
                rows = cur.fetchall() if max_rows is None else cur.fetchmany(max_rows)
            return cols, rows, cur.rowcount
        except psycopg2.Error as exc:
            self._translate(sess, exc, limit)
            raise
        finally:
            try:
                cur.close()
            except Exception:
                pass

    def _translate(self, sess, exc, limit):
        """S7: what a driver error means; raises."""
        conn = sess.conn
        if sess.fired or conn.closed:
            raise _Stale(_first_line(exc, self.password)) from None
        _rollback(conn)
        if isinstance(exc, psycopg2.errors.QueryCanceled):
            raise Timeout(limit) from None
        raise QueryFailed(_first_line(exc, self.password)) from None

    def _reset(self, sess, clean):
        conn = sess.conn
        if conn.closed:
            return False
        try:
            if conn.get_transaction_status() != _PG_IDLE:
                conn.rollback()
                clean = False
            if not sess.write and conn.get_parameter_status("default_transaction_read_only") != "on" \
                    or conn.get_parameter_status("session_authorization") != sess.auth:
                return False
            if conn.notifies:
                del conn.notifies[:]
                clean = False
            if not clean:
                self.resets += 1
                if conn.autocommit and _LIBPQ.send(conn, b"DISCARD ALL"):
                    sess.pending = True   # its answer is read when the session is next taken (_settle)
                    return True
                ac = conn.autocommit
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute("DISCARD ALL")
                conn.autocommit = ac
            return True
        except Exception:
            return False

    def _settle(self, sess):
        """The DISCARD ALL that _reset sent: the server ran it at once (so nothing of the last call outlived it,
        locks included); its answer, read here, says whether it worked (PQgetResult: normally already in the
        socket's buffer, so the thread does not sleep on it; a database that does not answer is cut by S4's
        watchdog). Anything but one COMMAND_OK: the session is discarded, before anything runs on it."""
        WATCHDOG.arm(sess, self._session_limit + DEADLINE_MARGIN)
        try:
            ok = _LIBPQ.settle(sess.conn)
        finally:
            WATCHDOG.disarm(sess)
        sess.pending = False
        if not ok or sess.fired or sess.conn.closed:
            return False
        # The answer read up to its ReadyForQuery, an idle session has nothing more to say: bytes waiting now are
        # a server that ended it (its FATAL, then EOF) while it sat in the pool. It goes before use (a write is
        # never retried, S6), at the price of one poll.
        try:
            return not select.select((sess.sock,), (), (), 0)[0]
        except (OSError, ValueError):
            return False

    def stream(self, sql, args, *, timeout, batch=500, state_free=False):
        limit = self.limit(timeout)
        sess, _ = self.acquire(False)
        conn = sess.conn
        conn.autocommit = False  # a named (server-side) cursor lives in a transaction: BEGIN READ ONLY (S2)
        conn.readonly = True
        cur = conn.cursor(name="qag_stream")
        cur.itersize = batch
        try:
            WATCHDOG.arm(sess, limit + DEADLINE_MARGIN)
            try:
                cur.execute(sql, args)
                first = cur.fetchmany(batch)
            finally:
                WATCHDOG.disarm(sess)
            cols = formats.pg_columns(cur.description) if cur.description else []
        except BaseException as exc:
            err: BaseException = exc
            broken = True
            if isinstance(exc, psycopg2.Error):
                try:
                    self._translate(sess, exc, limit)
                except _Stale as st:
                    err = Timeout(limit) if sess.fired else Unreachable(self.name, st.text)
                except ConnectorError as e:
                    err = e
                    broken = not self._stream_done(sess, state_free)
            self.release(sess, False, broken=broken)
            if err is exc:
                raise
            raise err from None

        def gen():
            ok = False
            try:
                yield from _batches(cur, first, batch, sess, limit)
                ok = True
            finally:
                try:
                    cur.close()
                except Exception:
                    ok = False
                self.release(sess, False, broken=not (ok and self._stream_done(sess, state_free)))
        return cols, gen()

    def _stream_done(self, sess, state_free) -> bool:
        conn = sess.conn
        try:
            _rollback(conn)
            conn.readonly = None
            conn.autocommit = True
        except Exception:
            return False
        return self._reset(sess, state_free)

    def _read_privileges(self):
        _, rows, _ = self.run(
            "SELECT r.rolsuper, pg_has_role(current_user, 'pg_read_server_files', 'MEMBER'), "
            "pg_has_role(current_user, 'pg_write_server_files', 'MEMBER'), "
            "pg_has_role(current_user, 'pg_execute_server_program', 'MEMBER') "
            "FROM pg_roles r WHERE r.rolname = current_user", (), write=False, timeout=None, max_rows=None)
        sup, rd, wr, ex = rows[0] if rows else (False, False, False, False)
        detail = [n for n, v in (("rolsuper", sup), ("pg_read_server_files", rd), ("pg_write_server_files", wr),
                                 ("pg_execute_server_program", ex)) if v]
        return {"superuser": bool(sup), "server_files": bool(rd or wr or ex), "privileged": bool(detail),
                "detail": detail}

    def introspect(self):
        cols, rows, _ = self.run(
            "SELECT table_schema, table_name, column_name FROM information_schema.columns "
            "WHERE table_schema NOT IN ('pg_toast') ORDER BY table_schema, table_name, ordinal_position",
            (), write=False, timeout=None, max_rows=None)
        out: dict[tuple[str, str], list[str]] = {}
        for s, t, c in rows:
            out.setdefault((s, t), []).append(c)
        return out

    def generated_columns(self):
        # GENERATED ALWAYS AS (...) STORED columns and the columns their expression reads (pg_depend)
        _, rows, _ = self.run(
            "SELECT n.nspname, c.relname, a.attname, d.attname FROM pg_attribute a "
            "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
            "LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum "
            "LEFT JOIN pg_depend dep ON dep.classid = 'pg_attrdef'::regclass AND dep.objid = ad.oid "
            "AND dep.refclassid = 'pg_class'::regclass AND dep.refobjid = a.attrelid AND dep.refobjsubid > 0 "
            "LEFT JOIN pg_attribute d ON d.attrelid = a.attrelid AND d.attnum = dep.refobjsubid "
            "WHERE a.attgenerated <> '' AND NOT a.attisdropped", (), write=False, timeout=None, max_rows=None)
        return _generated_from_rows(rows)

    def user_functions(self):
        # Every function outside the catalog schemas, extensions' included (their SQL bodies can read tables).
        _, rows, _ = self.run(
            "SELECT DISTINCT n.nspname, p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND left(n.nspname, 8) <> 'pg_toast'",
            (), write=False, timeout=None, max_rows=None)
        return {(s, n) for s, n in rows}

    def ancestors(self):
        # Partitions and INHERITS children, with every ancestor (a partition of a partition has two)
        _, rows, _ = self.run(
            "WITH RECURSIVE anc(child, parent) AS (SELECT inhrelid, inhparent FROM pg_inherits UNION "
            "SELECT a.child, i.inhparent FROM anc a JOIN pg_inherits i ON i.inhrelid = a.parent) "
            "SELECT cn.nspname, c.relname, pn.nspname, p.relname FROM anc JOIN pg_class c ON c.oid = anc.child "
            "JOIN pg_namespace cn ON cn.oid = c.relnamespace JOIN pg_class p ON p.oid = anc.parent "
            "JOIN pg_namespace pn ON pn.oid = p.relnamespace", (), write=False, timeout=None, max_rows=None)
        out: dict = {}
        for cs, cn, ps, pn in rows:
            out.setdefault((cs, cn), []).append((ps, pn))
        return {k: tuple(v) for k, v in out.items()}

    def row_secured(self):
        # ENABLE ROW LEVEL SECURITY, forced or not: whether the policies apply to the connection's role (not to a
        # superuser, nor to the owner unless forced) is not looked at; a reset costs a round trip, never an answer
        _, rows, _ = self.run(
            "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relrowsecurity", (), write=False, timeout=None, max_rows=None)
        return {(s, n) for s, n in rows}

    def views(self):
        # Views and materialized views outside the catalogs; each definition is deparsed with search_path set
        # to pg_catalog for that statement only (set_config(..., true)), so every other name in it is qualified.
        _, rows, _ = self.run(
            "SELECT n.nspname, c.relname, (SELECT pg_get_viewdef(c.oid) FROM "
            "(SELECT set_config('search_path', 'pg_catalog', true)) s) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('v', 'm') "
            "AND n.nspname NOT IN ('pg_catalog', 'information_schema')", (), write=False, timeout=None, max_rows=None)
        return {(s, n): d for s, n, d in rows}


# ---------------------------------------------------------------------------------------------
_MY_TIMEOUT = (1969, 3024, 1317)              # MariaDB max_statement_time, MySQL max_execution_time, interrupted
_MY_LOST = (2006, 2013, 2055, 1053, 1927)     # gone away, lost, lost at..., server shutdown, connection killed


def _my_closed(conn) -> bool:
    """mysql-connector drops its socket when it closes a connection (after a lost connection or a timeout)."""
    return getattr(conn, "_socket", None) is None or getattr(conn._socket, "sock", None) is None



def mysql_parse_column(packet: bytes, encoding: str = "utf-8"):
    """mysql-connector's column-definition parser (MySQLProtocol.parse_column) that keeps what it drops: a
    DECIMAL's precision and scale go into the description's precision and scale fields (DB-API's; the driver
    leaves them None), so Parquet can declare decimal128(p, s) before any row is seen (qag/formats.py). The
    packet (Protocol::ColumnDefinition41): six length-coded strings, then 0x0c, charset (2), column length (4),
    type (1), flags (2), decimals (1), filler (2). A DECIMAL's column length is its precision, plus one for the
    point when the scale is > 0, plus one for the sign unless UNSIGNED."""
    from mysql.connector import utils
    from mysql.connector.constants import FieldFlag
    packet, _ = utils.read_lc_string(packet[4:])  # catalog
    for _ in range(3):  # db, table, org_table
        packet, _ = utils.read_lc_string(packet)
    packet, name = utils.read_lc_string(packet)
    packet, _ = utils.read_lc_string(packet)  # org_name
    try:
        charset, length, column_type, flags, decimals = struct.unpack("<xHIBHBxx", packet)
    except struct.error:
        raise mysql_errors.InterfaceError("Failed parsing column information") from None
    precision = scale = None
    if column_type in (0, 246):  # DECIMAL, NEWDECIMAL
        scale = decimals
        precision = length - (1 if decimals else 0) - (0 if flags & FieldFlag.UNSIGNED else 1)
    return (name.decode(encoding), column_type, None, None, precision, scale, ~flags & FieldFlag.NOT_NULL, flags,
            charset)


class MySQLConnector(Connector):
    dialect = "mysql"
    mariadb = True

    def default_schema(self) -> str:
        return self.row.get("database") or ""

    def _session_vars(self, write: bool) -> str:
        """S1: the session settings of one SET, sent when the session opens and again after a reset (S5)."""
        ms = limit_ms(None, self.timeout)
        if self.mariadb:
            return f"max_statement_time = {ms / 1000:.3f}" + ("" if write else ", tx_read_only = 1")
        return f"max_execution_time = {ms}" + ("" if write else ", transaction_read_only = 1")

    def _session_sql(self, write: bool) -> str:
        return "SET SESSION " + self._session_vars(write)

    def _open(self, write: bool) -> _Session:
        if mysql_connector is None:
            raise DriverMissing("mysql-connector-python is not installed: pip install 'qag[mysql]'")
        try:
            conn = mysql_connector.connect(
                host=self.row.get("host") or "127.0.0.1", port=int(self.row.get("port") or 3306),
                user=self.row.get("user") or "root", password=self.password or "",
                database=self.row.get("database") or None, connection_timeout=max(1, int(round(self.connect_timeout))),
                autocommit=not write, charset="utf8mb4", use_unicode=True)
            self.mariadb = "mariadb" in (conn.server_info or "").lower()
            if getattr(conn, "_protocol", None) is not None:
                conn._protocol.parse_column = mysql_parse_column  # DECIMAL's precision and scale kept
            conn._init_command = self._session_sql(write)  # what cmd_reset_connection's _post_connection re-sends
            sock = getattr(conn._socket, "sock", None)
            _keepalive(sock)
            sess = _Session(conn, write, sock)
            cur = MySQLCursor(conn)
            cur.execute(conn._init_command)
            # mysql-connector reads sql_mode lazily, through cursor() (a ping and a query) at the first call with
            # parameters: read it here, once per session
            cur.execute("SELECT @@session.sql_mode, @@collation_connection")
            conn._sql_mode, collation = cur.fetchall()[0]
            cur.close()
            # S5's reset: COM_RESET_CONNECTION, then this one SET (mysql-connector's own reset re-sends five)
            if re.fullmatch(r"[A-Za-z0-9_]+", collation or ""):
                sess.auth = (f"SET NAMES 'utf8mb4' COLLATE '{collation}', autocommit = {0 if write else 1}, "
                             f"sql_mode = %s, {self._session_vars(write)}", conn._sql_mode)
        except mysql_errors.Error as exc:
            raise Unreachable(self.name, _first_line(exc, self.password)) from None
        return sess

    def _run(self, sess, sql, args, *, write, limit, max_rows):
        conn = sess.conn
        ms = round(limit * 1000)
        own = ms != self.session_ms
        if self.mariadb:  # S2: the statement's own read-only transaction and limit, in the statement
            text = (f"SET STATEMENT max_statement_time={ms / 1000:.3f} FOR {sql}" if write else
                    f"SET STATEMENT tx_read_only=1, max_statement_time={ms / 1000:.3f} FOR {sql}")
        else:
            text = sql
        cur = MySQLCursor(conn)  # not conn.cursor(): that pings the server first
        try:
            try:
                if own and not self.mariadb:
                    cur.execute(f"SET SESSION max_execution_time = {ms}")
                cur.execute(text, args or None)
                if cur.description is None:
                    cols, rows = [], []
                else:
                    cols = formats.mysql_columns(cur.description)
                    rows = cur.fetchall()
                    if max_rows is not None:
                        rows = rows[:max_rows]
                count = cur.rowcount
                if write:
                    conn.commit()
                return cols, rows, count
            finally:
                if own and not self.mariadb and not sess.fired:
                    try:
                        cur.execute(f"SET SESSION max_execution_time = {limit_ms(None, self.timeout)}")
                    except Exception:
                        pass
        except mysql_errors.Error as exc:
            self._translate(sess, exc, limit)
            raise
        finally:
            try:
                cur.close()
            except Exception:
                pass

    def _translate(self, sess, exc, limit):
        errno = getattr(exc, "errno", None)
        cause = exc.__cause__
        if isinstance(cause, mysql_errors.Error) and not isinstance(cause, mysql_errors.ProgrammingError):
            errno = getattr(cause, "errno", None)
            exc = cause
        if sess.fired or _my_closed(sess.conn) or errno in _MY_LOST or errno and errno >= 2000 \
                or errno is None and isinstance(exc, (mysql_errors.InterfaceError, mysql_errors.OperationalError)):
            raise _Stale(_first_line(exc, self.password)) from None
        if errno in _MY_TIMEOUT:
            raise Timeout(limit) from None
        try:
            if sess.conn.in_transaction:
                sess.conn.rollback()
        except Exception:
            pass
        raise QueryFailed(_first_line(exc, self.password)) from None

    def _reset(self, sess, clean):
        conn = sess.conn
        try:
            if _my_closed(conn) or conn.unread_result:
                return False
            if conn.in_transaction:
                conn.rollback()
                clean = False
            if not clean:
                if sess.auth is None:
                    if not conn.cmd_reset_connection():  # S5: COM_RESET_CONNECTION, then S1's SET (init_command)
                        return False
                else:
                    conn._handle_ok(conn._send_cmd(ServerCmd.RESET_CONNECTION))
                    cur = MySQLCursor(conn)
                    cur.execute(sess.auth[0], (sess.auth[1],))
                    cur.close()
                self.resets += 1
            return True
        except Exception:
            return False

    def stream(self, sql, args, *, timeout, batch=500, state_free=False):
        limit = self.limit(timeout)
        sess, _ = self.acquire(False)
        conn = sess.conn
        cur = MySQLCursor(conn)  # unbuffered
        ms = round(limit * 1000)
        text = f"SET STATEMENT tx_read_only=1, max_statement_time={ms / 1000:.3f} FOR {sql}" if self.mariadb else sql
        try:
            WATCHDOG.arm(sess, limit + DEADLINE_MARGIN)
            try:
                cur.execute(text, args or None)
                cols = formats.mysql_columns(cur.description) if cur.description else []
                first = cur.fetchmany(batch)
            finally:
                WATCHDOG.disarm(sess)
        except BaseException as exc:
            self.release(sess, False, broken=True)
            if isinstance(exc, mysql_errors.Error):
                try:
                    self._translate(sess, exc, limit)
                except _Stale as st:
                    raise (Timeout(limit) if sess.fired else Unreachable(self.name, st.text)) from None
            raise

        def gen():
            ok = False
            try:
                yield from _batches(cur, first, batch, sess, limit)
                ok = True
            finally:
                try:
                    cur.close()
                except Exception:
                    ok = False
                self.release(sess, False, broken=not (ok and self._reset(sess, state_free)))
        return cols, gen()

    def _read_privileges(self):
        _, rows, _ = self.run(
            "SELECT PRIVILEGE_TYPE FROM information_schema.USER_PRIVILEGES WHERE GRANTEE = CONCAT('''', "
            "SUBSTRING_INDEX(CURRENT_USER(), '@', 1), '''@''', SUBSTRING_INDEX(CURRENT_USER(), '@', -1), '''')",
            (), write=False, timeout=None, max_rows=None)
        privs = {str(p).upper() for (p,) in rows}
        detail = sorted(privs & {"SUPER", "FILE"})
        return {"superuser": "SUPER" in privs, "server_files": "FILE" in privs, "privileged": bool(detail),
                "detail": detail}

    def introspect(self):
        cols, rows, _ = self.run(
            "SELECT table_schema, table_name, column_name FROM information_schema.columns "
            "WHERE table_schema NOT IN ('performance_schema', 'sys') "
            "ORDER BY table_schema, table_name, ordinal_position",
            (), write=False, timeout=None, max_rows=None)
        out: dict[tuple[str, str], list[str]] = {}
        for s, t, c in rows:
            out.setdefault((s, t), []).append(c)
        return out

    def generated_columns(self):
        # VIRTUAL / STORED generated columns: the table's columns named in the expression
        _, rows, _ = self.run(
            "SELECT TABLE_SCHEMA, TABLE_NAME, COLUMN_NAME, GENERATION_EXPRESSION FROM information_schema.COLUMNS "
            "WHERE IS_GENERATED = 'ALWAYS' AND TABLE_SCHEMA NOT IN ('performance_schema', 'sys')",
            (), write=False, timeout=None, max_rows=None)
        return _generated_from_text(rows, self.introspect() if rows else {})

    def user_functions(self):
        # Stored functions (information_schema lists those this account may see) and loadable UDFs (native
        # code, in mysql.func when the account may read it).
        _, rows, _ = self.run("SELECT ROUTINE_SCHEMA, ROUTINE_NAME FROM information_schema.ROUTINES "
                              "WHERE ROUTINE_TYPE = 'FUNCTION'", (), write=False, timeout=None, max_rows=None)
        out = {(s, n) for s, n in rows}
        try:
            _, rows, _ = self.run("SELECT name FROM mysql.func", (), write=False, timeout=None, max_rows=None)
            out |= {("", n) for (n,) in rows}
        except ConnectorError:
            pass
        return out

    def views(self):
        # VIEW_DEFINITION names every table with its database; it is empty when this account may not see it.
        _, rows, _ = self.run(
            "SELECT TABLE_SCHEMA, TABLE_NAME, VIEW_DEFINITION FROM information_schema.VIEWS "
            "WHERE TABLE_SCHEMA NOT IN ('information_schema', 'mysql', 'performance_schema', 'sys')",
            (), write=False, timeout=None, max_rows=None)
        return {(s, n): d for s, n, d in rows}


# ---------------------------------------------------------------------------------------------
class SQLiteConnector(Connector):
    dialect = "sqlite"

    def default_schema(self) -> str:
        return "main"

    def _path(self) -> str:
        path = self.row.get("database") or ""
        if path and not os.path.isabs(path) and self.home:
            path = os.path.join(self.home, path)
        return path

    def _open(self, write: bool) -> _Session:
        path = self._path()
        if not path or not os.path.exists(path):
            raise Unreachable(self.name, "the database file does not exist")
        mode = "rw" if write else "ro"
        try:
            conn = sqlite3.connect(f"file:{path}?mode={mode}", uri=True, check_same_thread=False,
                                   isolation_level=None, timeout=self.connect_timeout)
        except sqlite3.Error as exc:
            raise Unreachable(self.name, str(exc)) from None
        return _Session(conn, write)

    def _run(self, sess, sql, args, *, write, limit, max_rows):
        conn = sess.conn
        deadline = time.monotonic() + limit
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 2000)
        cur = conn.cursor()
        try:
            if write:
                cur.execute("BEGIN IMMEDIATE")
            cur.execute(sql, args)
            if cur.description is None:
                cols, rows = [], []
            else:
                cols = [d[0] for d in cur.description]
                rows = cur.fetchall() if max_rows is None else cur.fetchmany(max_rows)
            count = cur.rowcount
            if write:
                cur.execute("COMMIT")
            return cols, rows, count
        except sqlite3.OperationalError as exc:
            if write:
                _sqlite_rollback(cur)
            if "interrupted" in str(exc):
                raise Timeout(limit) from None
            raise QueryFailed(str(exc)) from None
        except sqlite3.Error as exc:
            if write:
                _sqlite_rollback(cur)
            raise QueryFailed(str(exc)) from None
        finally:
            conn.set_progress_handler(None, 0)
            cur.close()

    def stream(self, sql, args, *, timeout, batch=500, state_free=False):
        limit = self.limit(timeout)
        sess, _ = self.acquire(False)
        conn = sess.conn
        deadline = time.monotonic() + limit
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 2000)
        cur = conn.cursor()
        try:
            cur.execute(sql, args)
            cols = [d[0] for d in cur.description] if cur.description else []
            first = cur.fetchmany(batch)
        except sqlite3.Error as exc:
            conn.set_progress_handler(None, 0)
            self.release(sess, False)
            if "interrupted" in str(exc):
                raise Timeout(limit) from None
            raise QueryFailed(str(exc)) from None

        def gen():
            try:
                yield from _batches(cur, first, batch)
            finally:
                cur.close()
                conn.set_progress_handler(None, 0)
                self.release(sess, False)
        return cols, gen()

    def introspect(self):
        _, tables, _ = self.run("SELECT name FROM sqlite_master WHERE type IN ('table', 'view') ORDER BY name", (),
                                write=False, timeout=None, max_rows=None)
        out: dict[tuple[str, str], list[str]] = {}
        for (t,) in tables:
            # table_xinfo: generated columns too (hidden 2, 3), which SELECT * returns; not a virtual table's hidden
            _, cols, _ = self.run("SELECT name FROM pragma_table_xinfo(?) WHERE hidden <> 1 ORDER BY cid", (t,),
                                  write=False, timeout=None, max_rows=None)
            out[("main", t.lower())] = [c[0] for c in cols]
        return out

    def generated_columns(self):
        # GENERATED ALWAYS AS columns (hidden 2, 3 in table_xinfo): computed from the row, any column of it
        _, rows, _ = self.run("SELECT m.name, x.name FROM sqlite_master m, pragma_table_xinfo(m.name) x "
                              "WHERE m.type = 'table' AND x.hidden IN (2, 3)", (), write=False, timeout=None,
                              max_rows=None)
        return _generated_from_rows([("main", t.lower(), c, None) for t, c in rows])

    def views(self):
        # sqlite_master keeps each view's CREATE VIEW statement as written
        _, rows, _ = self.run("SELECT name, sql FROM sqlite_master WHERE type = 'view'", (), write=False,
                              timeout=None, max_rows=None)
        return {("main", n): d for n, d in rows}


# ---------------------------------------------------------------------------------------------
class ClickHouseConnector(Connector):
    """ClickHouse through clickhouse-connect (HTTP), or in-process chDB when the host is `chdb:<dir>`."""
    dialect = "clickhouse"

    def default_schema(self) -> str:
        return self.row.get("database") or "default"

    def _open(self, write: bool) -> _Session:
        try:
            import clickhouse_connect
        except ImportError:
            raise DriverMissing("clickhouse-connect is not installed: pip install 'qag[clickhouse]'") \
                from None
        host = self.row.get("host") or "127.0.0.1"
        settings = {"max_execution_time": int(max(1, self.timeout))}
        if not write:
            settings["readonly"] = 2
        try:
            if host.startswith("chdb:"):
                return _Session(clickhouse_connect.get_client(dsn="chdb://" + host[5:], database=self.default_schema()),
                                write)
            return _Session(clickhouse_connect.get_client(host=host, port=int(self.row.get("port") or 8123),
                                                          username=self.row.get("user") or "default",
                                                          password=self.password or "", database=self.default_schema(),
                                                          connect_timeout=self.connect_timeout, settings=settings),
                            write)
        except Exception as exc:
            raise Unreachable(self.name, _first_line(exc, self.password)) from None

    def _run(self, sess, sql, args, *, write, limit, max_rows):
        try:
            if args:
                sql = sql % tuple(_ch_literal(a) for a in args)
            else:
                sql = sql.replace("%%", "%")
            res = sess.conn.query(sql)
            cols = list(res.column_names)
            rows = [tuple(r) for r in res.result_rows]
            if max_rows is not None:
                rows = rows[:max_rows]
            return cols, rows, len(rows)
        except ConnectorError:
            raise
        except Exception as exc:
            text = _first_line(exc, self.password)
            if "TIMEOUT_EXCEEDED" in text or "Code: 159" in text:
                raise Timeout(self.timeout) from None
            raise QueryFailed(text) from None

    def stream(self, sql, args, *, timeout, batch=500, state_free=False):
        cols, rows, _ = self.run(sql, args, write=False, timeout=timeout, max_rows=None)

        def gen():
            for i in range(0, len(rows), batch):
                yield rows[i:i + batch]
        return cols, gen()

    def introspect(self):
        _, rows, _ = self.run("SELECT database, table, name FROM system.columns ORDER BY database, table, position",
                              (), write=False, timeout=None, max_rows=None)
        out: dict[tuple[str, str], list[str]] = {}
        for s, t, c in rows:
            out.setdefault((s, t), []).append(c)
        return out

    def generated_columns(self):
        # ALIAS, MATERIALIZED and DEFAULT columns: computed from the row's other columns
        _, rows, _ = self.run(
            "SELECT database, table, name, default_expression FROM system.columns "
            "WHERE default_kind IN ('ALIAS', 'MATERIALIZED', 'DEFAULT') AND default_expression <> ''",
            (), write=False, timeout=None, max_rows=None)
        return _generated_from_text(rows, self.introspect() if rows else {})

    def views(self):
        # as_select names every table with its database; materialized views' too (their rows came from it)
        _, rows, _ = self.run(
            "SELECT database, name, as_select FROM system.tables WHERE engine IN ('View', 'MaterializedView') "
            "AND database NOT IN ('system', 'INFORMATION_SCHEMA', 'information_schema')",
            (), write=False, timeout=None, max_rows=None)
        return {(s, n): d for s, n, d in rows}


def _ch_literal(v) -> str:
    """clickhouse-connect's own quoting (its client-side binding), used only for driver-validated typed values."""
    from clickhouse_connect.driver.binding import format_query_value
    return format_query_value(v)


CONNECTORS = {"postgres": PostgresConnector, "mysql": MySQLConnector, "sqlite": SQLiteConnector,
              "clickhouse": ClickHouseConnector}


def make(row: dict, password: str | None, cfg) -> Connector:
    cls = CONNECTORS[row["db"]]
    return cls(row, password, timeout=cfg.query_timeout, connect_timeout=cfg.connect_timeout,
               pool_size=cfg.pool_size, home=cfg.home)


def _batches(cur, first: list, batch: int, sess: _Session | None = None, limit: float = 0.0):
    """A streamed result in batches: the one fetched before the response started, then the rest (each fetch
    watched, S4)."""
    yield first
    while True:
        if sess is not None:
            WATCHDOG.arm(sess, limit + DEADLINE_MARGIN)
        try:
            chunk = cur.fetchmany(batch)
        finally:
            if sess is not None:
                WATCHDOG.disarm(sess)
        if not chunk:
            return
        yield chunk


def _first_line(exc: BaseException, password: str | None) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if password:
        text = text.replace(password, "********")
    return text


def _rollback(conn) -> None:
    try:
        if not conn.closed and not conn.autocommit:
            conn.rollback()
    except Exception:
        pass


def _sqlite_rollback(cur) -> None:
    try:
        cur.execute("ROLLBACK")
    except Exception:
        pass
