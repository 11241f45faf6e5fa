"""Plans: everything a call needs beyond its parameter values, built once per (key, query, version).

A plan holds the driver-ready statement, the parameter specs, the connection, the governance outcome
(tables checked; a masking transform per output column) and the generations it was built from. It is
never used when those generations differ from the current ones.
"""
from __future__ import annotations

from typing import Any

from qag import connectors
from qag import params as P
from qag.errors import ApiError

try:
    import sqlglot
    from sqlglot import exp
except ImportError:  # pragma: no cover
    sqlglot = None  # type: ignore[assignment]

SQLGLOT_DIALECT = {"postgres": "postgres", "mysql": "mysql", "sqlite": "sqlite", "clickhouse": "clickhouse"}


class Plan:
    __slots__ = ("query", "version", "connection", "dialect", "sql", "arg_names", "specs", "is_write", "write_ops",
                 "transforms", "names", "tables", "page_mode", "gens", "cache_ttl", "key_name", "unknown",
                 "state_free", "claims", "response_prefix", "shared_prefix", "write_grant")

    def bind_args(self, values: dict[str, Any]) -> tuple:
        return tuple(values[n] for n in self.arg_names)

    def paged_sql(self, page: int, page_size: int) -> str:
        """The statement limited to one page (+1 row to know whether there is more)."""
        if self.page_mode == "append":
            return f"{self.sql}\nLIMIT {page_size + 1} OFFSET {(page - 1) * page_size}"
        if self.page_mode == "wrap":
            return (f"SELECT * FROM (\n{self.sql}\n) AS qag_page LIMIT {page_size + 1} "
                    f"OFFSET {(page - 1) * page_size}")
        return self.sql


def strip_sql(sql: str) -> str:
    """Drop trailing semicolons and whitespace (a single statement may end with one)."""
    s = sql.strip()
    while s.endswith(";"):
        s = s[:-1].rstrip()
    return s


def _governance():
    try:
        from qag import governance
    except ImportError:
        return None
    return governance if hasattr(governance, "plan_governance") else None


def check_statement(sql: str, dialect: str) -> None:
    """Refuse at save time what can never run: unparseable text or several statements (400)."""
    neutral = P.neutralize(sql, dialect)
    governance = _governance()
    if governance is not None:
        try:
            governance.analyze(neutral, dialect)
        except governance.GovernanceError as exc:
            if exc.code in ("multiple_statements", "invalid_sql"):
                raise ApiError(exc.status, exc.code, exc.message, exc.extra) from None
        return
    if sqlglot is None:
        return
    try:
        stmts = [s for s in sqlglot.parse(neutral, read=SQLGLOT_DIALECT[dialect]) if s is not None]
    except Exception as exc:
        raise ApiError(400, "invalid_sql", f"The SQL does not parse: {str(exc).splitlines()[0]}") from None
    if len(stmts) != 1:
        raise ApiError(400, "multiple_statements", "Save exactly one SQL statement per query.")


def page_mode(sql: str, dialect: str) -> str:
    """'append' when the statement is a SELECT without its own LIMIT/OFFSET, 'wrap' when it has one,
    'none' for anything else (writes, SHOW, EXPLAIN...)."""
    if sqlglot is None:
        return "none"
    try:
        tree = sqlglot.parse_one(P.neutralize(sql, dialect), read=SQLGLOT_DIALECT[dialect])
    except Exception:
        return "none"
    if isinstance(tree, (exp.Select, exp.Union, exp.Intersect, exp.Except)):
        if tree.args.get("limit") is not None or tree.args.get("offset") is not None or tree.args.get("locks"):
            return "wrap" if not tree.args.get("locks") else "none"
        if tree.args.get("into") is not None:
            return "none"
        return "append"
    return "none"


def build(*, key: dict | None, query: dict, version: dict, connection: dict, connector, cfg, gens: tuple,
          columns_of, functions_of=None, views_of=None) -> Plan:
    """Build a plan; raise ApiError for anything governance refuses (decided here, once)."""
    dialect = connection["db"]
    sql = strip_sql(version["sql"])
    driver_sql, arg_names = P.compile_sql(sql, dialect)
    plan = Plan()
    plan.query = query["name"]
    plan.version = version["version"]
    plan.connection = connection["name"]
    plan.dialect = dialect
    plan.sql = driver_sql
    plan.arg_names = arg_names
    plan.specs = P.build_specs(version["parameters"])
    plan.cache_ttl = query.get("cache_ttl")
    plan.response_prefix = None  # its cached answers' key prefix (shm/LAYOUT.md [Response cache] R5), made on use
    plan.shared_prefix = None  # the same in Redis, store-stable (qag/response_tier.py), made on use
    plan.key_name = key["name"] if key else None
    from qag.identity import claim_params
    plan.claims = claim_params(version.get("parameters"))  # (parameter, claim) bound from a signed-in caller
    plan.gens = gens
    grants = key["grants"] if key else {}
    # the write decisions governance takes below, as the plan entry carries them for the plane (LAYOUT.md
    # [Plan entry] 1.2): the server's QAG_ALLOW_WRITES, the key's allow_writes, its allowed_write_ops (None: any)
    plan.write_grant = (bool(cfg.allow_writes), bool(grants.get("allow_writes")) if key else True,
                        grants.get("allowed_write_ops") if key else None)
    neutral = P.neutralize(sql, dialect)
    mask_rules = list(grants.get("mask") or []) + list(version.get("mask") or [])
    governance = _governance()
    if governance is None:
        plan.is_write, plan.write_ops, plan.transforms, plan.tables = _basic_guard(neutral, dialect, cfg, key), \
            frozenset(), None, frozenset()
        plan.names = None
        plan.unknown = ()
    else:
        try:
            gp = governance.plan_governance(
                sql=neutral, dialect=dialect, default_schema=connector.default_schema(),
                allowed_tables=grants.get("allowed_tables") if key else None,
                mask_rules=mask_rules,
                server_allows_writes=cfg.allow_writes,
                key_allows_writes=bool(grants.get("allow_writes")) if key else True,
                allowed_write_ops=grants.get("allowed_write_ops") if key else None,
                allow_unsafe=bool(version.get("allow_unsafe")),
                columns_of=columns_of, functions_of=functions_of, views_of=views_of,
                search_path=getattr(connector, "search_path", lambda: None)(),
                trusted_functions=tuple((connection.get("options") or {}).get("trusted_functions") or ()))
        except governance.GovernanceError as exc:
            raise ApiError(exc.status, exc.code, exc.message, exc.extra) from None
        plan.is_write = gp.is_write
        plan.write_ops = gp.write_ops
        plan.transforms = gp.transforms
        plan.names = getattr(gp, "output_names", None)
        plan.tables = gp.tables
        plan.unknown = getattr(gp, "unknown", ())
    plan.page_mode = "none" if plan.is_write else page_mode(sql, dialect)
    # connectors S5: a statement not proven to leave no session state gets its session reset after each call
    # (a view's definition, and a row security policy's expression, may call any function the statement does
    # not name)
    plan.state_free = not plan.is_write and connectors.state_free(neutral, dialect) \
        and not _reads_code(plan.tables, views_of, dialect)
    return plan


def _reads_code(tables, views_of, dialect: str) -> bool:
    """Whether the statement reads a relation whose reading runs code it does not name: a view (PostgreSQL,
    MySQL/MariaDB) or a table with row-level security (PostgreSQL); True when that cannot be read."""
    if dialect not in ("postgres", "mysql") or not tables:
        return False
    if views_of is None:
        return True
    try:
        opaque = {f"{s}.{n}".lower() for s, n in views_of()}
        if dialect == "postgres":
            secured = getattr(views_of, "secured", None)
            if secured is None:
                return True
            opaque |= secured()
    except Exception:  # the catalogue unreadable: not proven
        return True
    return bool(opaque & {t.lower() for t in tables})


_WRITE_KINDS = ("Insert", "Update", "Delete", "Merge", "Create", "Drop", "Alter", "TruncateTable", "Command")


def _basic_guard(neutral: str, dialect: str, cfg, key) -> bool:
    """Read/write classification used only if the governance package is missing."""
    if sqlglot is None:
        raise ApiError(500, "governance_missing", "sqlglot is not installed; no statement can be checked.")
    try:
        tree = sqlglot.parse_one(neutral, read=SQLGLOT_DIALECT[dialect])
    except Exception:
        raise ApiError(400, "invalid_sql", "The saved SQL does not parse; it is refused.") from None
    is_write = any(type(n).__name__ in _WRITE_KINDS for n in tree.walk())
    if is_write:
        if not cfg.allow_writes:
            raise ApiError(403, "read_only", "The server forbids writes (QAG_ALLOW_WRITES is off).")
        if key is not None and not key["grants"].get("allow_writes"):
            raise ApiError(403, "read_only", f"The key '{key['name']}' does not allow writes (allow_writes is false).")
    return is_write
