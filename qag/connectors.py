"""Connectors to the data databases, with per-worker pools.

Read-only mode and the statement time limit are set once per pooled session, when it is opened
(PostgreSQL through the startup packet's `options`, MySQL/MariaDB with one SET after connecting,
SQLite with `mode=ro` and a progress-handler deadline), so a read is one round trip. Writes use
separate read-write sessions.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from typing import Any, Iterator

from qag import formats
from qag.errors import ApiError

try:
    import psycopg2
    import psycopg2.extensions
    import psycopg2.errorcodes
except ImportError:  # pragma: no cover
    psycopg2 = None  # type: ignore[assignment]

try:
    import mysql.connector as mysql_connector
    import mysql.connector.errors as mysql_errors
except ImportError:  # pragma: no cover
    mysql_connector = None  # type: ignore[assignment]

DIALECTS = {"postgres": "postgres", "mysql": "mysql", "sqlite": "sqlite", "clickhouse": "clickhouse"}


class QueryFailed(Exception):
    """The database rejected the statement; `db_text` is shown to administrators only."""

    def __init__(self, db_text: str):
        super().__init__(db_text)
        self.db_text = db_text


def connection_failed(name: str, detail: str = "") -> ApiError:
    msg = f"Could not reach the database of connection '{name}'"
    if detail:
        msg += f" ({detail})"
    return ApiError(502, "connection_failed", msg + "; check that it is running and reachable, then retry.")


def query_timeout(seconds: float) -> ApiError:
    return ApiError(504, "query_timeout",
                    f"The statement ran longer than its time limit of {seconds:g} s and was cancelled.",
                    {"timeout": seconds})


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
        self._idle: dict[bool, list[Any]] = {False: [], True: []}
        self._lock = threading.Lock()
        self.in_use = 0
        self.opened = 0
        self.closed = False

    # -- pool ----------------------------------------------------------------------------
    def acquire(self, write: bool):
        with self._lock:
            idle = self._idle[write]
            conn = idle.pop() if idle else None
            self.in_use += 1
        if conn is not None:
            return conn, True
        try:
            conn = self._open(write)
        except BaseException:
            with self._lock:
                self.in_use -= 1
            raise
        self.opened += 1
        return conn, False

    def release(self, conn, write: bool, broken: bool = False) -> None:
        with self._lock:
            self.in_use -= 1
            if not broken and not self.closed and len(self._idle[write]) < self.pool_size:
                self._idle[write].append(conn)
                return
        self._close(conn)

    def idle_count(self) -> int:
        return len(self._idle[False]) + len(self._idle[True])

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns = self._idle[False] + self._idle[True]
            self._idle = {False: [], True: []}
        for c in conns:
            self._close(c)

    def _close(self, conn) -> None:
        try:
            conn.close()
        except Exception:
            pass

    # -- what subclasses provide -------------------------------------------------------------
    def _open(self, write: bool):
        raise NotImplementedError

    def default_schema(self) -> str:
        raise NotImplementedError

    def run(self, sql: str, args: tuple, *, write: bool, timeout: float | None, max_rows: int | None
            ) -> tuple[list[str], list[tuple], int]:
        """Execute one statement; (columns, rows, rowcount). Retries a read once on a stale pooled session."""
        for attempt in (0, 1):
            conn, reused = self.acquire(write)
            broken = False
            try:
                return self._run(conn, sql, args, write=write, timeout=timeout, max_rows=max_rows)
            except _Stale:
                broken = True
                if attempt == 0 and reused and not write:
                    continue
                raise connection_failed(self.name, "the connection was lost") from None
            except BaseException:
                broken = True
                raise
            finally:
                self.release(conn, write, broken)
        raise connection_failed(self.name)

    def stream(self, sql: str, args: tuple, *, timeout: float | None, batch: int = 500
               ) -> tuple[list[str], Iterator[list[tuple]]]:
        raise NotImplementedError

    def introspect(self) -> dict[tuple[str, str], list[str]]:
        raise NotImplementedError

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


class _Stale(Exception):
    pass


# ---------------------------------------------------------------------------------------------
class PostgresConnector(Connector):
    dialect = "postgres"

    def default_schema(self) -> str:
        opts = self.row.get("options") or {}
        sp = opts.get("schema") or opts.get("search_path")
        if sp:
            return str(sp).split(",")[0].strip().strip('"')
        return "public"

    def _open(self, write: bool):
        if psycopg2 is None:
            raise ApiError(500, "driver_missing", "psycopg2 is not installed: pip install 'qag[postgres]'")
        opts = self.row.get("options") or {}
        ms = int(self.timeout * 1000)
        pg_opts = [f"-c statement_timeout={ms}"]
        if not write:
            pg_opts.append("-c default_transaction_read_only=on")
        sp = opts.get("schema") or opts.get("search_path")
        if sp:
            pg_opts.append("-c search_path=" + str(sp).replace(" ", "").replace("\\", ""))
        kw = dict(host=self.row.get("host") or "127.0.0.1", port=self.row.get("port") or 5432,
                  user=self.row.get("user") or None, password=self.password or None,
                  dbname=self.row.get("database") or None, connect_timeout=max(1, int(round(self.connect_timeout))),
                  options=" ".join(pg_opts), application_name="qag")
        if opts.get("sslmode"):
            kw["sslmode"] = opts["sslmode"]
        try:
            conn = psycopg2.connect(**{k: v for k, v in kw.items() if v is not None})
        except psycopg2.OperationalError as exc:
            raise connection_failed(self.name, _first_line(exc, self.password)) from None
        conn.autocommit = not write  # a read is one message and one answer; a write is its own transaction
        return conn

    def _run(self, conn, sql, args, *, write, timeout, max_rows):
        cur = conn.cursor()
        try:
            if timeout is not None and timeout < self.timeout:
                cur.execute("SET statement_timeout = %s", (int(timeout * 1000),))
            try:
                cur.execute(sql, args)
                if cur.description is None:
                    cols, rows = [], []
                else:
                    cols = formats.pg_columns(cur.description)
                    rows = cur.fetchall() if max_rows is None else cur.fetchmany(max_rows)
                count = cur.rowcount
                if write:
                    conn.commit()
            except psycopg2.errors.QueryCanceled:
                _rollback(conn)
                raise query_timeout(timeout if timeout is not None and timeout < self.timeout else self.timeout) \
                    from None
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
                if conn.closed:
                    raise _Stale() from None
                raise connection_failed(self.name, _first_line(exc, self.password)) from None
            except psycopg2.Error as exc:
                _rollback(conn)
                raise QueryFailed(_first_line(exc, self.password)) from None
            finally:
                if timeout is not None and timeout < self.timeout and not conn.closed:
                    try:
                        _rollback(conn)
                        cur.execute("SET statement_timeout = %s", (int(self.timeout * 1000),))
                    except Exception:
                        pass
            return cols, rows, count
        finally:
            try:
                cur.close()
            except Exception:
                pass

    def stream(self, sql, args, *, timeout, batch=500):
        conn, _ = self.acquire(False)
        conn.autocommit = False  # a named (server-side) cursor lives in a transaction
        cur = conn.cursor(name="qag_stream")
        cur.itersize = batch
        try:
            cur.execute(sql, args)
            first = cur.fetchmany(batch)
            cols = formats.pg_columns(cur.description) if cur.description else []
        except BaseException as exc:
            _rollback(conn)
            conn.autocommit = True
            self.release(conn, False, broken=bool(conn.closed))
            self._translate(exc)
            raise

        def gen():
            broken = False
            try:
                yield from _batches(cur, first, batch)
            except BaseException:
                broken = True
                raise
            finally:
                try:
                    cur.close()
                    _rollback(conn)
                    conn.autocommit = True
                except Exception:
                    broken = True
                self.release(conn, False, broken or bool(conn.closed))
        return cols, gen()

    def _translate(self, exc):
        if isinstance(exc, psycopg2.errors.QueryCanceled):
            raise query_timeout(self.timeout) from None
        if isinstance(exc, (psycopg2.OperationalError, psycopg2.InterfaceError)):
            raise connection_failed(self.name, _first_line(exc, self.password)) from None
        if isinstance(exc, psycopg2.Error):
            raise QueryFailed(_first_line(exc, self.password)) from None

    def introspect(self):
        cols, rows, _ = self.run(
            "SELECT table_schema, table_name, column_name FROM information_schema.columns "
            "WHERE table_schema NOT IN ('pg_toast') ORDER BY table_schema, table_name, ordinal_position",
            (), write=False, timeout=None, max_rows=None)
        out: dict[tuple[str, str], list[str]] = {}
        for s, t, c in rows:
            out.setdefault((s, t), []).append(c)
        return out

    def user_functions(self):
        # Every function outside the catalog schemas, extensions' included (their SQL bodies can read tables).
        _, rows, _ = self.run(
            "SELECT DISTINCT n.nspname, p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND left(n.nspname, 8) <> 'pg_toast'",
            (), write=False, timeout=None, max_rows=None)
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
class MySQLConnector(Connector):
    dialect = "mysql"

    def default_schema(self) -> str:
        return self.row.get("database") or ""

    def _open(self, write: bool):
        if mysql_connector is None:
            raise ApiError(500, "driver_missing", "mysql-connector-python is not installed: pip install 'qag[mysql]'")
        try:
            conn = mysql_connector.connect(
                host=self.row.get("host") or "127.0.0.1", port=int(self.row.get("port") or 3306),
                user=self.row.get("user") or "root", password=self.password or "",
                database=self.row.get("database") or None, connection_timeout=max(1, int(round(self.connect_timeout))),
                autocommit=not write, charset="utf8mb4", use_unicode=True)
        except mysql_errors.Error as exc:
            raise connection_failed(self.name, _first_line(exc, self.password)) from None
        version = conn.get_server_info() or ""
        self.mariadb = "mariadb" in version.lower()
        cur = conn.cursor()
        # One SET per pooled session: read-only and the time limit (MariaDB: max_statement_time in s;
        # MySQL: max_execution_time in ms, SELECT only).
        parts = []
        if self.mariadb:
            parts.append(f"max_statement_time = {self.timeout:.3f}")
        else:
            parts.append(f"max_execution_time = {int(self.timeout * 1000)}")
        cur.execute("SET SESSION " + ", ".join(parts))
        if not write:
            cur.execute("SET SESSION TRANSACTION READ ONLY")
        cur.close()
        return conn

    def _run(self, conn, sql, args, *, write, timeout, max_rows):
        cur = conn.cursor()
        custom = timeout is not None and timeout < self.timeout
        try:
            if custom:
                cur.execute(f"SET SESSION max_statement_time = {timeout:.3f}" if self.mariadb
                            else f"SET SESSION max_execution_time = {int(timeout * 1000)}")
            try:
                cur.execute(sql, args or None)
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
            except mysql_errors.Error as exc:
                errno = getattr(exc, "errno", None)
                if errno in (1969, 3024, 1317):  # MariaDB max_statement_time, MySQL max_execution_time, interrupted
                    raise query_timeout(timeout if custom else self.timeout) from None
                if errno in (2006, 2013, 2055) or isinstance(exc, mysql_errors.OperationalError) and errno and errno >= 2000:
                    raise _Stale() from None
                try:
                    conn.rollback()
                except Exception:
                    pass
                raise QueryFailed(_first_line(exc, self.password)) from None
            finally:
                if custom:
                    try:
                        cur.execute(f"SET SESSION max_statement_time = {self.timeout:.3f}" if self.mariadb
                                    else f"SET SESSION max_execution_time = {int(self.timeout * 1000)}")
                    except Exception:
                        pass
            return cols, rows, count
        finally:
            try:
                cur.close()
            except Exception:
                pass

    def stream(self, sql, args, *, timeout, batch=500):
        conn, _ = self.acquire(False)
        cur = conn.cursor(buffered=False)
        try:
            cur.execute(sql, args or None)
            cols = formats.mysql_columns(cur.description) if cur.description else []
            first = cur.fetchmany(batch)
        except BaseException as exc:
            self.release(conn, False, broken=True)
            if isinstance(exc, mysql_errors.Error):
                if getattr(exc, "errno", None) in (1969, 3024):
                    raise query_timeout(self.timeout) from None
                raise QueryFailed(_first_line(exc, self.password)) from None
            raise

        def gen():
            broken = False
            try:
                yield from _batches(cur, first, batch)
            except BaseException:
                broken = True
                raise
            finally:
                try:
                    cur.close()
                except Exception:
                    broken = True
                self.release(conn, False, broken)
        return cols, gen()

    def introspect(self):
        cols, rows, _ = self.run(
            "SELECT table_schema, table_name, column_name FROM information_schema.columns "
            "WHERE table_schema NOT IN ('performance_schema', 'sys') ORDER BY table_schema, table_name, ordinal_position",
            (), write=False, timeout=None, max_rows=None)
        out: dict[tuple[str, str], list[str]] = {}
        for s, t, c in rows:
            out.setdefault((s, t), []).append(c)
        return out

    def user_functions(self):
        # Stored functions (information_schema lists those this account may see) and loadable UDFs (native
        # code, in mysql.func when the account may read it).
        _, rows, _ = self.run("SELECT ROUTINE_SCHEMA, ROUTINE_NAME FROM information_schema.ROUTINES "
                              "WHERE ROUTINE_TYPE = 'FUNCTION'", (), write=False, timeout=None, max_rows=None)
        out = {(s, n) for s, n in rows}
        try:
            _, rows, _ = self.run("SELECT name FROM mysql.func", (), write=False, timeout=None, max_rows=None)
            out |= {("", n) for (n,) in rows}
        except (QueryFailed, ApiError):
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

    def _open(self, write: bool):
        path = self._path()
        if not path or not os.path.exists(path):
            raise connection_failed(self.name, "the database file does not exist")
        mode = "rw" if write else "ro"
        try:
            conn = sqlite3.connect(f"file:{path}?mode={mode}", uri=True, check_same_thread=False,
                                   isolation_level=None, timeout=self.connect_timeout)
        except sqlite3.Error as exc:
            raise connection_failed(self.name, str(exc)) from None
        return conn

    def _run(self, conn, sql, args, *, write, timeout, max_rows):
        limit = timeout if timeout is not None and timeout < self.timeout else self.timeout
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
                raise query_timeout(limit) from None
            raise QueryFailed(str(exc)) from None
        except sqlite3.Error as exc:
            if write:
                _sqlite_rollback(cur)
            raise QueryFailed(str(exc)) from None
        finally:
            conn.set_progress_handler(None, 0)
            cur.close()

    def stream(self, sql, args, *, timeout, batch=500):
        conn, _ = self.acquire(False)
        deadline = time.monotonic() + self.timeout
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 2000)
        cur = conn.cursor()
        try:
            cur.execute(sql, args)
            cols = [d[0] for d in cur.description] if cur.description else []
            first = cur.fetchmany(batch)
        except sqlite3.Error as exc:
            conn.set_progress_handler(None, 0)
            self.release(conn, False)
            if "interrupted" in str(exc):
                raise query_timeout(self.timeout) from None
            raise QueryFailed(str(exc)) from None

        def gen():
            try:
                yield from _batches(cur, first, batch)
            finally:
                cur.close()
                conn.set_progress_handler(None, 0)
                self.release(conn, False)
        return cols, gen()

    def introspect(self):
        _, tables, _ = self.run("SELECT name FROM sqlite_master WHERE type IN ('table', 'view') ORDER BY name", (),
                                write=False, timeout=None, max_rows=None)
        out: dict[tuple[str, str], list[str]] = {}
        for (t,) in tables:
            _, cols, _ = self.run("SELECT name FROM pragma_table_info(?) ORDER BY cid", (t,), write=False,
                                  timeout=None, max_rows=None)
            out[("main", t.lower())] = [c[0] for c in cols]
        return out

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

    def _open(self, write: bool):
        try:
            import clickhouse_connect
        except ImportError:
            raise ApiError(500, "driver_missing", "clickhouse-connect is not installed: pip install 'qag[clickhouse]'") \
                from None
        host = self.row.get("host") or "127.0.0.1"
        settings = {"max_execution_time": int(max(1, self.timeout))}
        if not write:
            settings["readonly"] = 2
        try:
            if host.startswith("chdb:"):
                return clickhouse_connect.get_client(dsn="chdb://" + host[5:], database=self.default_schema())
            return clickhouse_connect.get_client(host=host, port=int(self.row.get("port") or 8123),
                                                 username=self.row.get("user") or "default",
                                                 password=self.password or "", database=self.default_schema(),
                                                 connect_timeout=self.connect_timeout, settings=settings)
        except Exception as exc:
            raise connection_failed(self.name, _first_line(exc, self.password)) from None

    def _run(self, conn, sql, args, *, write, timeout, max_rows):
        try:
            if args:
                sql = sql % tuple(_ch_literal(a) for a in args)
            else:
                sql = sql.replace("%%", "%")
            res = conn.query(sql)
            cols = list(res.column_names)
            rows = [tuple(r) for r in res.result_rows]
            if max_rows is not None:
                rows = rows[:max_rows]
            return cols, rows, len(rows)
        except ApiError:
            raise
        except Exception as exc:
            text = _first_line(exc, self.password)
            if "TIMEOUT_EXCEEDED" in text or "Code: 159" in text:
                raise query_timeout(self.timeout) from None
            raise QueryFailed(text) from None

    def stream(self, sql, args, *, timeout, batch=500):
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


def _batches(cur, first: list, batch: int):
    """A streamed result in batches: the one fetched before the response started, then the rest."""
    yield first
    while True:
        chunk = cur.fetchmany(batch)
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
