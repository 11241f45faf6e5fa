"""Statement analysis: parse one statement with sqlglot and find its writes, tables and file/server-reaching parts.

Everything here is decided from the parsed tree, never from guesses about text; what sqlglot cannot parse
is refused (400 invalid_sql). Results are cached per (sql, dialect) because plans are rebuilt often.
"""

from __future__ import annotations

import functools
import logging
import re

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

from . import lexers, pgparse
from .errors import GovernanceError
from .tables import ASCII_LOWER, default_schema_for, resolve

# sqlglot logs a warning whenever it falls back to exp.Command; we handle that case ourselves.
logging.getLogger("sqlglot").setLevel(logging.ERROR)
_log = logging.getLogger("qag.governance")

DIALECTS = {
    "postgres": "postgres", "postgresql": "postgres", "pg": "postgres",
    "mysql": "mysql", "mariadb": "mysql",
    "sqlite": "sqlite", "sqlite3": "sqlite",
    "clickhouse": "clickhouse",
}

# Roots that only read. Anything else is a write (a known class) or refused as not analysable.
_READ_ROOTS = (exp.Select, exp.SetOperation, exp.Values, exp.Subquery)

# Statement classes that change state, with the write-op name an operator grants in allowed_write_ops.
_WRITE_CLASSES: tuple[tuple[type, str], ...] = tuple(
    (cls, op) for cls, op in (
        (getattr(exp, "Insert", None), "insert"),
        (getattr(exp, "Update", None), "update"),
        (getattr(exp, "Delete", None), "delete"),
        (getattr(exp, "Merge", None), "merge"),
        (getattr(exp, "Create", None), "create"),
        (getattr(exp, "Drop", None), "drop"),
        (getattr(exp, "Alter", None), "alter"),
        (getattr(exp, "TruncateTable", None), "truncate"),
        (getattr(exp, "Grant", None), "grant"),
        (getattr(exp, "Revoke", None), "revoke"),
        (getattr(exp, "Copy", None), "copy"),
        (getattr(exp, "Set", None), "set"),
        (getattr(exp, "Transaction", None), "transaction"),
        (getattr(exp, "Commit", None), "transaction"),
        (getattr(exp, "Rollback", None), "transaction"),
        (getattr(exp, "Pragma", None), "pragma"),
        (getattr(exp, "Attach", None), "attach"),
        (getattr(exp, "Detach", None), "detach"),
        (getattr(exp, "Use", None), "use"),
        (getattr(exp, "Analyze", None), "analyze"),
        (getattr(exp, "Cache", None), "cache"),
        (getattr(exp, "Uncache", None), "cache"),
        (getattr(exp, "LoadData", None), "load"),
        (getattr(exp, "Refresh", None), "refresh"),
        (getattr(exp, "Comment", None), "comment"),
        (getattr(exp, "Kill", None), "kill"),
        (getattr(exp, "Declare", None), "set"),
    ) if cls is not None
)
_WRITE_CLASS_TUPLE = tuple(cls for cls, _ in _WRITE_CLASSES)

def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Functions that read or write server files, reach other servers, run SQL given as text (so escape the
# allow-list) or act on other sessions/the server. Names are compared lowercased, schema stripped.
_UNSAFE_FUNCS = {
    "postgres": _names("""
        pg_read_file pg_read_binary_file pg_ls_dir pg_stat_file pg_ls_logdir pg_ls_waldir pg_ls_tmpdir
        pg_ls_archive_statusdir pg_ls_logicalsnapdir pg_ls_logicalmapdir pg_ls_replslotdir
        lo_import lo_export lo_get lo_put lo_from_bytea lo_create lo_creat lo_unlink lo_open lo_truncate
        lowrite loread lo_close lo_lseek lo_tell
        pg_file_write pg_file_rename pg_file_unlink pg_file_sync pg_logdir_ls pg_logfile_rotate
        pg_rotate_logfile pg_reload_conf pg_terminate_backend pg_cancel_backend pg_promote pg_switch_wal
        pg_create_restore_point pg_create_physical_replication_slot pg_create_logical_replication_slot
        pg_drop_replication_slot pg_logical_slot_get_changes pg_logical_slot_peek_changes
        pg_logical_slot_get_binary_changes pg_logical_slot_peek_binary_changes pg_logical_emit_message
        pg_copy_physical_replication_slot pg_copy_logical_replication_slot pg_replication_slot_advance
        query_to_xml query_to_xmlschema query_to_xml_and_xmlschema table_to_xml table_to_xmlschema
        table_to_xml_and_xmlschema cursor_to_xml cursor_to_xmlschema schema_to_xml schema_to_xmlschema
        schema_to_xml_and_xmlschema database_to_xml database_to_xmlschema database_to_xml_and_xmlschema
        get_raw_page heap_page_items heap_page_item_attrs tuple_data_split bt_page_items bt_metap
        bt_page_stats brin_page_items gist_page_items hash_page_items gin_leafpage_items pg_stat_statements
        pg_get_wal_records_info pg_get_wal_block_info pg_get_wal_stats
        ts_stat pg_import_system_collations pg_stat_reset pg_stat_reset_shared pg_stat_reset_single_table_counters
        pg_stat_reset_single_function_counters pg_stat_reset_slru pg_stat_reset_replication_slot
        pg_stat_reset_subscription_stats pg_stat_reset_backend_stats
        pg_backup_start pg_backup_stop pg_start_backup pg_stop_backup pg_log_backend_memory_contexts
        pg_wal_replay_pause pg_wal_replay_resume pg_log_standby_snapshot pg_sync_replication_slots
        pg_current_logfile
    """),
    "mysql": _names("load_file sys_exec sys_eval sys_get sys_set sys_bineval"),
    "sqlite": _names("load_extension readfile writefile edit fts3_tokenizer zipfile fsdir sqlar_uncompress"),
    "clickhouse": _names("""
        file url urlcluster s3 s3cluster gcs oss cosn hdfs hdfscluster remote remotesecure cluster
        clusterallreplicas mysql postgresql sqlite mongodb redis jdbc odbc azureblobstorage
        azureblobstoragecluster iceberg icebergs3 icebergazure iceberghdfs icebergcluster deltalake
        deltalakecluster hudi hudicluster executable input merge loop filecluster dictionary
        fuzzjson fuzzquery timeseriesdata timeseriesmetrics timeseriestags mergetreeindex mergetreeprojection
        arrowflight arrowflightcluster ytsaurus paimon
    """),
}
_UNSAFE_PREFIXES = {"postgres": ("dblink", "binary_upgrade_", "pg_replication_origin_"), "mysql": (),
                    "sqlite": (), "clickhouse": ()}

# ClickHouse table functions that only compute values (anything else in FROM is refused as unsafe:
# most of them reach files, URLs or other servers, and merge()/loop() read tables chosen by a pattern).
_CLICKHOUSE_SAFE_TABLE_FUNCS = _names(
    "numbers numbers_mt zeros zeros_mt generaterandom values view null generate_series generateseries format")

# Set-returning functions known to compute rows from their arguments only. Any other function in FROM
# (a user-defined one may read any table) makes the statement's tables and lineage unknowable.
_SAFE_FROM_FUNCS = {
    "postgres": _names("""
        generate_series exploding_generate_series unnest json_each json_each_text jsonb_each jsonb_each_text
        json_array_elements json_array_elements_text jsonb_array_elements jsonb_array_elements_text
        json_to_record json_to_recordset jsonb_to_record jsonb_to_recordset json_populate_record
        json_populate_recordset jsonb_populate_record jsonb_populate_recordset json_object_keys
        jsonb_object_keys jsonb_path_query regexp_matches regexp_split_to_table string_to_table
        generate_subscripts pg_options_to_table json_table j_s_o_n_table xmltable x_m_l_table
    """),
    "mysql": _names("json_table j_s_o_n_table"),   # sqlglot names its JSONTable node j_s_o_n_table
    "sqlite": _names("json_each json_tree generate_series"),
    "clickhouse": frozenset(),   # ClickHouse table functions are judged by _CLICKHOUSE_SAFE_TABLE_FUNCS
}

# Functions that change state even inside a SELECT; value = write op.
_WRITE_FUNCS = {
    "postgres": {"nextval": "sequence", "setval": "sequence", "set_config": "set", "pg_notify": "notify",
                 "pg_advisory_lock": "lock", "pg_advisory_lock_shared": "lock", "pg_advisory_xact_lock": "lock",
                 "pg_advisory_xact_lock_shared": "lock", "pg_try_advisory_lock": "lock",
                 "pg_try_advisory_lock_shared": "lock", "pg_try_advisory_xact_lock": "lock",
                 "pg_try_advisory_xact_lock_shared": "lock", "pg_advisory_unlock": "lock",
                 "pg_advisory_unlock_shared": "lock", "pg_advisory_unlock_all": "lock"},
    "mysql": {"get_lock": "lock", "release_lock": "lock", "release_all_locks": "lock",
              "setval": "sequence", "nextval": "sequence", "lastval": "sequence"},
    "sqlite": {},
    "clickhouse": {},
}

# exp.Command keywords (statements sqlglot does not model) that reach files or servers.
_UNSAFE_COMMANDS = frozenset({"load", "backup", "restore", "install", "attach", "detach", "handler", "source"})
_EXPLAIN_OPTIONS = re.compile(r"^\s*(?:\((?:[^()]|\([^()]*\))*\)|analy[sz]e\b|verbose\b|query\s+plan\b|"
                              r"extended\b|partitions\b|format\s*=\s*\w+|pipeline\b|plan\b|syntax\b|ast\b|"
                              r"estimate\b|indexes\s*=\s*\d)\s*", re.IGNORECASE)
# MySQL/MariaDB run the text of /*! ... */ and /*M! ... */ comments; sqlglot drops comments.
_MYSQL_EXEC_COMMENT = re.compile(r"/\*M?!", re.IGNORECASE)
_MYSQL_UNPARSED_UNSAFE = re.compile(r"\binto\s+(?:outfile|dumpfile)\b|\bload\s+(?:data|xml)\b|\bload_file\s*\(",
                                    re.IGNORECASE)
_CH_UNPARSED_UNSAFE = re.compile(r"\binto\s+outfile\b", re.IGNORECASE)
_CH_IN_FUNCS = frozenset(f"{g}{n}in{i}".lower() for g in ("", "global") for n in ("", "not", "null", "notnull")
                         for i in ("", "ignoreset"))
_CH_GUARDED_SETTINGS = frozenset({"readonly", "log_queries", "log_comment", "send_timeout", "receive_timeout",
                                  "workload", "priority", "enable_http_compression"})
_CH_HARMLESS_SETTINGS = frozenset({"max_threads", "max_block_size", "max_final_threads", "max_insert_threads"})
# MySQL optimizer hints that override session limits the gateway set (statement time limit, variables).
_FILE_WORDS = re.compile(r"\b(?:program|outfile|dumpfile|infile)\b", re.IGNORECASE)
_MYSQL_SONAME = re.compile(r"\bsoname\b", re.IGNORECASE)
_MYSQL_SESSION_HINT = re.compile(r"/\*\+[^*]*\b(?:max_execution_time|set_var)\b", re.IGNORECASE)


def canonical_dialect(dialect: str) -> str:
    try:
        return DIALECTS[dialect.lower()]
    except (KeyError, AttributeError):
        raise GovernanceError(400, "invalid_sql", f"unknown SQL dialect {dialect!r}; "
                              "use postgres, mysql, sqlite or clickhouse") from None


def normalize_identifier(ident, dialect: str) -> str:
    """Name comparison rules: PostgreSQL folds unquoted names to lower case (ASCII letters only, as it does
    in UTF-8 databases); MySQL/MariaDB and SQLite are compared case-insensitively (as the contract asks for
    database.table); ClickHouse is case-sensitive."""
    if isinstance(ident, exp.Identifier):
        text, quoted = ident.this, ident.quoted
    else:
        text, quoted = str(ident), False
    if dialect == "clickhouse":
        return text
    if dialect == "postgres":
        return text if quoted else text.translate(ASCII_LOWER)
    return text.lower()


def func_name(node: exp.Func) -> str:
    if isinstance(node, exp.Anonymous):
        this = node.this
        return (this.this if isinstance(this, exp.Identifier) else str(this)).lower()
    return node.sql_name().lower()


class Analysis:
    """What one statement is, from its parsed tree. Shared through the cache: treat as read-only."""

    __slots__ = (
        "dialect",
        "explain",
        "from_funcs",
        "has_output",
        "is_write",
        "opaque",
        "reading",
        "sql",
        "table_refs",
        "tree",
        "unsafe",
        "write_ops",
    )

    def __init__(self, sql, dialect, tree, is_write, write_ops, unsafe, table_refs, opaque, explain, has_output,
                 from_funcs=()):
        self.sql = sql
        self.dialect = dialect
        self.tree = tree                      # sqlglot tree of the statement (for EXPLAIN: the explained one)
        self.is_write = is_write
        self.write_ops = write_ops            # frozenset[str]
        self.unsafe = unsafe                  # tuple[str, ...]: names of file/server-reaching parts
        self.table_refs = table_refs          # tuple[(db | None, name)], normalized, CTE names excluded
        self.opaque = opaque                  # str | None: why the tables read cannot be known
        self.explain = explain                # output is a plan, not data
        self.has_output = has_output          # whether rows of data come back (SELECT, RETURNING, ...)
        self.from_funcs = from_funcs          # functions in FROM not known to be pure (UDFs may read anything)
        self.reading = None                   # PostgreSQL: pgparse.Reading, what PostgreSQL's parser read

    def __repr__(self) -> str:
        return (f"Analysis(is_write={self.is_write}, write_ops={sorted(self.write_ops)}, unsafe={self.unsafe}, "
                f"tables={self.table_refs}, opaque={self.opaque!r})")


def analyze(sql: str, dialect: str) -> Analysis:
    """Parse exactly one statement and classify it; raises GovernanceError (400 multiple_statements,
    400 invalid_sql, 403 unsafe_function for file-reaching forms sqlglot cannot parse)."""
    d = canonical_dialect(dialect)
    try:
        return _analyze_cached(sql, d)
    except GovernanceError:
        raise
    except RecursionError:
        raise GovernanceError(400, "invalid_sql", "the statement is nested too deeply to analyse") from None
    except Exception as exc:  # failing closed is a refusal naming the reason, never a 500
        if hasattr(exc, "status"):
            raise
        _log.exception("analysis of a %s statement failed", d)
        raise GovernanceError(400, "invalid_sql", f"qag could not analyse this statement ({type(exc).__name__}: "
                                                  f"{str(exc)[:120]}); it is refused rather than run unchecked") \
            from None


@functools.lru_cache(maxsize=2048)
def _analyze_cached(sql: str, dialect: str) -> Analysis:
    if not isinstance(sql, str):
        raise GovernanceError(400, "invalid_sql", "the statement must be text")
    if dialect == "mysql" and _MYSQL_EXEC_COMMENT.search(sql):
        raise GovernanceError(400, "invalid_sql",
                              "MySQL executable comments (/*! ... */) are refused: the server runs their "
                              "text but it cannot be analysed; write the SQL without them")
    if dialect == "postgres":
        # PostgreSQL's parser is the authority: one statement, names as the server decodes them; sqlglot reads
        # the statement re-spelled from PostgreSQL's tokens and must agree with it (pgparse.cross_check).
        reading = pgparse.read(sql)
        tree = _parse_one(reading.text, dialect)
        a = _classify(reading.text, dialect, tree)
        a.sql = sql
        if not isinstance(a.tree, exp.Command):
            _pg_search_cycle_check(reading.stmt, tree)
            pgparse.cross_check(reading, a.tree if a.explain else tree, _pg_norm)
            pgparse.check_outputs(reading.stmt, a.tree, _pg_norm)
        a.reading = reading
        _pg_function_checks(a, reading)
        return a
    alt = _mysql_ansi_reading(sql) if dialect == "mysql" else None
    tree = _parse_one(sql, dialect)
    if dialect == "sqlite":
        _sqlite_string_names(tree)
    if dialect == "clickhouse":
        if tree.find(exp.Aliases) is not None:
            raise GovernanceError(400, "invalid_sql", "ClickHouse reads this statement differently from qag's parser "
                                                      "(a call such as in(x, t) taken for a name with aliases); "
                                                      "write x IN (SELECT ...)")
        for node in tree.find_all(exp.Placeholder):
            text = node.sql(dialect="clickhouse").replace(": ", ":") if node.this is not None else "?"
            raise GovernanceError(400, "invalid_sql",
                                  f"ClickHouse binds {text} itself (a query parameter, "
                                  "which can stand for a table or column name qag cannot see); name parameters "
                                  "as :name")
    a = _classify(sql, dialect, tree)
    if alt is not None:
        _merge_ansi_reading(a, alt)
    if dialect == "mysql" and _MYSQL_SESSION_HINT.search(sql):
        a.is_write, a.write_ops = True, a.write_ops | {"set"}
    if dialect == "mysql" and _MYSQL_SONAME.search(sql):
        a.unsafe = a.unsafe + ("SONAME",)   # CREATE FUNCTION ... SONAME / INSTALL PLUGIN load a shared library
    return a


@functools.lru_cache(maxsize=2048)
def _mysql_ansi_reading(sql: str) -> str | None:
    """MySQL/MariaDB by the server's own token rules (lexers.mysql_read: refused when the statement reads
    differently with NO_BACKSLASH_ESCAPES, holds an executable comment, a nested comment or a ? placeholder;
    two statements by the server's reading are two). Returns the statement as a server with ANSI_QUOTES in
    its sql_mode reads it ("x" a name, re-spelled `x`) when it has double-quoted text, else None."""
    try:
        tokens = lexers.mysql_read(sql)
    except lexers.LexError as exc:
        raise GovernanceError(400, "invalid_sql", "qag cannot read this MySQL/MariaDB statement exactly as the "
                                                  f"server would: {exc.why}") from None
    code = [t for t in tokens if t[0] != "comment"]
    for k, (kind, a, b) in enumerate(code):
        if kind == "op" and sql[a:b] == ";" and any(sql[x:y] != ";" for _, x, y in code[k + 1:]):
            raise GovernanceError(400, "multiple_statements", "the SQL holds more than one statement (as MySQL "
                                                              "reads it); a query must be exactly one statement")
    if not any(kind == "dq" for kind, _, _ in tokens):
        return None
    out, pos = [], 0
    for kind, a, b in tokens:
        if kind == "dq":
            name = sql[a + 1:b - 1].replace('""', '"')
            out += [sql[pos:a], "`", name.replace("`", "``"), "`"]
            pos = b
    out.append(sql[pos:])
    return "".join(out)


def _pg_search_cycle_check(stmt, tree: exp.Expression) -> None:
    """SEARCH/CYCLE clauses add columns to a recursive CTE (lineage.bind_ctes); sqlglot keeps one per WITH:
    refused when PostgreSQL's parser reads a different number of them."""
    from pglast.visitors import Visitor

    class _Count(Visitor):
        n = 0

        def visit_CommonTableExpr(self, ancestors, node):
            if node.search_clause is not None or node.cycle_clause is not None:
                self.n += 1

    counter = _Count()
    counter(stmt)
    ours = sum(1 for w in tree.find_all(exp.With) if w.args.get("search") is not None or
               w.args.get("cycle") is not None)
    if counter.n != ours:
        raise GovernanceError(400, "invalid_sql", "qag reads the SEARCH and CYCLE clauses of this statement "
                                                  "differently from PostgreSQL; write one per WITH, on its last CTE")


def _sqlite_string_names(tree: exp.Expression) -> None:
    """SQLite reads a '...' string beside a dot as a name ('customers'.card, c.'card', 'main'.'t'.'c': its
    grammar's nm is an identifier or a STRING); sqlglot keeps it a literal, so the column would go untraced.
    Refused: write the name unquoted or in double quotes."""
    for node in tree.walk():
        if isinstance(node, exp.Literal) and node.is_string and isinstance(node.parent, (exp.Dot, exp.Column)) \
                and node.arg_key in ("this", "expression", "table", "db", "catalog"):
            raise GovernanceError(400, "invalid_sql",
                                  f"SQLite reads the string {node.sql(dialect='sqlite')} beside a dot as a name; "
                                  "write names unquoted or in double quotes")


def _merge_ansi_reading(a: Analysis, alt_sql: str) -> None:
    """Govern both readings of "x" (text, or with ANSI_QUOTES a name): tables, unsafe parts and writes of
    either, and lineage of either per output column (lineage.Lineage.outputs reads tree.meta["qag_alt"])."""
    try:
        b = _classify(alt_sql, a.dialect, _parse_one(alt_sql, a.dialect))
    except GovernanceError:
        return      # not SQL when "x" is a name: a server with ANSI_QUOTES refuses it
    a.table_refs = tuple(dict.fromkeys(a.table_refs + b.table_refs))
    a.unsafe = tuple(dict.fromkeys(a.unsafe + b.unsafe))
    a.from_funcs = tuple(dict.fromkeys(a.from_funcs + b.from_funcs))
    if b.write_ops - a.write_ops:
        a.write_ops = a.write_ops | b.write_ops
    a.is_write = a.is_write or b.is_write
    a.opaque = a.opaque or b.opaque
    if isinstance(a.tree, exp.Expression) and isinstance(b.tree, exp.Expression):
        a.tree.meta["qag_alt"] = b.tree


def _pg_norm(ident) -> str:
    return normalize_identifier(ident, "postgres")


def _pg_function_checks(a: Analysis, reading) -> None:
    """File/server-reaching and state-changing functions judged on the names PostgreSQL's parser read."""
    unsafe = list(a.unsafe)
    ops = set(a.write_ops)
    for _, name in reading.functions:
        low = name.lower()
        if low in _UNSAFE_FUNCS["postgres"] or low.startswith(_UNSAFE_PREFIXES["postgres"]):
            unsafe.append(name)
        op = _WRITE_FUNCS["postgres"].get(low)
        if op:
            ops.add(op)
    a.unsafe = tuple(dict.fromkeys(unsafe))
    if ops != set(a.write_ops):
        a.write_ops = frozenset(ops)
        a.is_write = True


def attribute_calls(sql: str, dialect: str, columns_of, default_schema) -> tuple[tuple[None, str], ...]:
    """PostgreSQL attribute notation: (None, f) for each `x.f` / `(x).f` where x is a FROM item and f is not one
    of its columns (columns_of(schema, table) -> list | None; unknown columns count as calls): the call f(x).
    Empty for other dialects."""
    if canonical_dialect(dialect) != "postgres":
        return ()
    full = called_functions(sql, dialect, columns_of=columns_of, default_schema=default_schema)
    base = set(_called_cached(sql, "postgres"))
    return tuple(c for c in full if c not in base)


def called_functions(sql: str, dialect: str, columns_of=None,
                     default_schema=None) -> tuple[tuple[str | None, str], ...]:
    """EVERY function the statement calls: (schema or None, name).

    PostgreSQL: as PostgreSQL's parser reads them (Unicode escapes decoded, unquoted names folded, quoted
    ones kept exactly); with columns_of(schema, table) -> list | None also attribute notation: `x.f` /
    `(x).f` where x is a FROM item and f is not one of its columns (or its columns are unknown) is the call
    f(x). Without columns_of those are left out (see attribute_calls).
    Other dialects: the calls sqlglot keeps by name (exp.Anonymous), lowercased (their function names are
    case-insensitive); the built-ins sqlglot models as nodes of their own are named by plan.statement_calls
    the way the dialect writes them."""
    dialect = canonical_dialect(dialect)
    base = _called_cached(sql, dialect)
    if dialect != "postgres":
        return base
    reading = analyze(sql, dialect).reading
    schema = default_schema_for(dialect, default_schema)
    if columns_of is None:
        return base     # without the catalogue x.name cannot be told from a column: see attribute_calls
    attrs = pgparse.attribute_calls(reading, columns_of, lambda ref: next(iter(resolve([ref], dialect, schema))))
    return tuple(dict.fromkeys(base + tuple((None, n) for n in attrs)))


@functools.lru_cache(maxsize=2048)
def _called_cached(sql: str, dialect: str) -> tuple[tuple[str | None, str], ...]:
    if dialect == "postgres":
        return analyze(sql, dialect).reading.functions
    trees = [_parse_one(sql, dialect)]
    alt = _mysql_ansi_reading(sql) if dialect == "mysql" else None
    if alt is not None:
        try:
            trees.append(_parse_one(alt, dialect))
        except GovernanceError:
            pass
    out = []
    for node in (n for t in trees for n in t.find_all(exp.Anonymous)):
        qualifier = None
        parent = node.parent
        if isinstance(parent, exp.Dot) and parent.expression is node:
            q = parent.this
            qualifier = (q.this if isinstance(q, exp.Identifier) else q.sql(dialect)).lower() \
                if isinstance(q, exp.Expression) else str(q).lower()
        out.append((qualifier, func_name(node)))
    return tuple(dict.fromkeys(out))


def _parse_one(sql: str, dialect: str) -> exp.Expression:
    try:
        statements = [s for s in sqlglot.parse(sql, read=dialect) if s is not None]
    except (SqlglotError, RecursionError, ValueError) as e:
        pattern = {"mysql": _MYSQL_UNPARSED_UNSAFE, "clickhouse": _CH_UNPARSED_UNSAFE}.get(dialect)
        if pattern is not None and pattern.search(sql):
            raise GovernanceError(403, "unsafe_function",
                                  "the statement reads or writes server files (INTO OUTFILE/DUMPFILE, LOAD DATA "
                                  "or LOAD_FILE) and is refused") from None
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise GovernanceError(400, "invalid_sql",
                              f"the SQL could not be parsed as {dialect} ({first}); fix the statement") from None
    if not statements:
        raise GovernanceError(400, "invalid_sql", "the SQL is empty: write exactly one statement")
    if len(statements) > 1:
        raise GovernanceError(400, "multiple_statements",
                              f"the SQL holds {len(statements)} statements; a query must be exactly one statement")
    return statements[0]


def _classify(sql: str, dialect: str, tree: exp.Expression, depth: int = 0) -> Analysis:
    if isinstance(tree, exp.Command):
        return _classify_command(sql, dialect, tree, depth)
    if isinstance(tree, exp.Describe):
        inner = tree.this
        if isinstance(inner, exp.Expression) and not isinstance(inner, exp.Table):
            sub = _classify(sql, dialect, inner, depth + 1)
            return Analysis(sql, dialect, sub.tree, sub.is_write, sub.write_ops, sub.unsafe, sub.table_refs,
                            sub.opaque, True, False, sub.from_funcs)
        walker = _Walker(dialect)
        walker.walk(tree, frozenset())
        return walker.result(sql, tree, is_write=False, explain=True, has_output=False)
    if isinstance(tree, exp.Show):
        return Analysis(sql, dialect, tree, False, frozenset(), (), (), "SHOW statements", False, True)
    if not isinstance(tree, _READ_ROOTS + _WRITE_CLASS_TUPLE):
        raise GovernanceError(400, "invalid_sql",
                              f"qag cannot analyse a {type(tree).__name__} statement for {dialect}; "
                              "only statements it understands are run")
    walker = _Walker(dialect)
    try:
        walker.walk(tree, frozenset())
    except RecursionError:
        raise GovernanceError(400, "invalid_sql", "the statement is nested too deeply to analyse") from None
    has_output = isinstance(tree, _READ_ROOTS) or bool(tree.args.get("returning"))
    return walker.result(sql, tree, is_write=bool(walker.ops), explain=False, has_output=has_output)


def _classify_command(sql: str, dialect: str, tree: exp.Command, depth: int) -> Analysis:
    keyword = str(tree.this or "").strip().lower()
    rest = tree.expression.name if isinstance(tree.expression, exp.Literal) else str(tree.expression or "")
    first = keyword.split()[0] if keyword else "command"
    if first in ("explain", "describe", "desc") and depth < 3:
        body = rest
        while True:
            m = _EXPLAIN_OPTIONS.match(body)
            if not m or not m.group(0):
                break
            body = body[m.end():]
        if not body.strip():
            raise GovernanceError(400, "invalid_sql", "EXPLAIN without a statement")
        sub = _classify(sql, dialect, _parse_one(body, dialect), depth + 1)
        return Analysis(sql, dialect, sub.tree, sub.is_write, sub.write_ops, sub.unsafe, sub.table_refs,
                        sub.opaque, True, False, sub.from_funcs)
    if first == "show":
        return Analysis(sql, dialect, tree, False, frozenset(), (), (), "SHOW statements", False, True)
    if first == "replace" and dialect in ("mysql", "sqlite"):
        # REPLACE is an INSERT that first deletes a clashing row: analyse it as that INSERT.
        try:
            ins = sqlglot.parse_one("INSERT " + rest, read=dialect)
        except SqlglotError:
            ins = None
        if isinstance(ins, exp.Insert):
            sub = _classify(sql, dialect, ins, depth + 1)
            ops = (sub.write_ops - {"insert"}) | {"replace"}
            return Analysis(sql, dialect, ins, True, frozenset(ops), sub.unsafe, sub.table_refs, sub.opaque,
                            False, sub.has_output, sub.from_funcs)
    unsafe = ()
    if first in _UNSAFE_COMMANDS or (first == "vacuum" and re.search(r"\binto\b", rest, re.IGNORECASE)) or \
            re.search(r"\bsoname\b|\bplugin\b", rest, re.IGNORECASE) or \
            (first in ("copy", "select") and _FILE_WORDS.search(rest)):
        unsafe = (keyword.upper(),)
    return Analysis(sql, dialect, tree, True, frozenset({first}), unsafe, (),
                    f"{keyword.upper()} statements", False, True)


class _Walker:
    """One pass over the tree collecting table references (CTE-aware), write ops and unsafe parts."""

    __slots__ = ("dialect", "from_funcs", "opaque", "ops", "refs", "unsafe")

    def __init__(self, dialect: str):
        self.dialect = dialect
        self.from_funcs: list[str] = []
        self.refs: list[tuple[str | None, str]] = []
        self.ops: set[str] = set()
        self.unsafe: list[str] = []
        self.opaque: str | None = None

    def result(self, sql, tree, *, is_write, explain, has_output) -> Analysis:
        refs = tuple(dict.fromkeys(self.refs))
        unsafe = tuple(dict.fromkeys(self.unsafe))
        return Analysis(sql, self.dialect, tree, is_write, frozenset(self.ops), unsafe, refs, self.opaque,
                        explain, has_output, tuple(dict.fromkeys(self.from_funcs)))

    def walk(self, node, visible: frozenset) -> None:
        if not isinstance(node, exp.Expression):
            return
        args = node.args
        with_ = args.get("with_") if "with_" in args else args.get("with")
        if isinstance(with_, exp.With):
            ctes = with_.expressions
            names = [normalize_identifier(cte.args["alias"].this, self.dialect)
                     if isinstance(cte.args.get("alias"), exp.TableAlias) and cte.args["alias"].this is not None
                     else None for cte in ctes]
            names = [n for n in names if n is not None]
            recursive = bool(with_.args.get("recursive"))
            for i, cte in enumerate(ctes):
                # A non-recursive CTE does not see itself or later siblings: a same-named real table is read.
                vis = visible | frozenset(names if recursive else names[:i])
                self.walk(cte.this, vis)
            visible = visible | frozenset(names)

        self._visit(node, visible)

        for key, value in args.items():
            if key in ("with_", "with") and isinstance(value, exp.With):
                continue
            if key == "settings" and isinstance(value, list) and self.dialect == "clickhouse":
                self._ch_settings(value)
            if key == "tables" and isinstance(node, exp.Delete) and isinstance(value, list):
                # MySQL DELETE t1 FROM t1 JOIN t2: the leading names are aliases of the FROM tables.
                value = [v for v in value if not self._is_delete_alias(node, v)]
            if isinstance(node, exp.Table) and key in ("this", "db", "catalog") and isinstance(value, exp.Identifier):
                continue
            if isinstance(node, exp.Table) and key == "indexed":
                continue    # SQLite INDEXED BY <index>: an index of this table, not a table
            if isinstance(value, list):
                for v in value:
                    self.walk(v, visible)
            else:
                self.walk(value, visible)

    def _visit(self, node: exp.Expression, visible: frozenset) -> None:
        d = self.dialect
        if isinstance(node, exp.Table):
            this = node.this
            if isinstance(this, exp.Identifier):
                db = node.args.get("db")
                name = normalize_identifier(this, d)
                if db is None:
                    if name in visible:
                        return  # a CTE, not a table
                    if d == "mysql" and name == "dual":
                        return
                    self.refs.append((None, name))
                else:
                    self.refs.append((normalize_identifier(db, d) if isinstance(db, exp.Identifier)
                                      else str(db).lower(), name))
            elif isinstance(this, exp.Func) and d == "clickhouse":
                fname = func_name(this)
                if fname not in _CLICKHOUSE_SAFE_TABLE_FUNCS:
                    self.unsafe.append(fname)
            elif isinstance(this, exp.Func) and d == "sqlite" and func_name(this).startswith("pragma_"):
                # SQLite's table-valued pragmas are eponymous virtual tables: govern them by name.
                self.refs.append((None, func_name(this)))
            elif isinstance(this, exp.Func):
                self._from_func(this)
            return
        if isinstance(node, exp.Lateral) and isinstance(node.this, exp.Func):
            self._from_func(node.this)
        if d in ("clickhouse", "sqlite"):
            # ClickHouse and SQLite read a name on the right of IN (x IN secrets, x IN main.secrets, ClickHouse's
            # notIn(x, db.secrets), globalInIgnoreSet ...) as a table: a membership test over its rows
            target = None
            if isinstance(node, exp.In):
                target = node.args.get("field")
            elif d == "clickhouse" and isinstance(node, exp.Anonymous) and func_name(node) in _CH_IN_FUNCS and \
                    len(node.expressions) > 1:
                target = node.expressions[1]
            if d == "sqlite" and isinstance(target, exp.Func):
                # x IN json_each(...) / IN pragma_table_info('t'): a table-valued function, as in FROM
                if func_name(target).startswith("pragma_"):
                    self.refs.append((None, func_name(target)))
                else:
                    self._from_func(target)
            if isinstance(target, exp.Column) and isinstance(target.this, exp.Identifier):
                db = target.args.get("table")
                name = normalize_identifier(target.this, d)
                if db is None and name not in visible:
                    self.refs.append((None, name))
                elif isinstance(db, exp.Identifier):
                    self.refs.append((normalize_identifier(db, d), name))
        if isinstance(node, exp.Func):
            fname = func_name(node)
            if fname in _UNSAFE_FUNCS[d] or fname.startswith(_UNSAFE_PREFIXES[d]):
                self.unsafe.append(fname)
            op = _WRITE_FUNCS[d].get(fname)
            if op:
                self.ops.add(op)
            if d == "clickhouse" and (fname.startswith(("dict", "joinget"))) and \
                    fname not in ("dictionary",):
                self._dict_ref(node, fname)
            return
        if isinstance(node, _WRITE_CLASS_TUPLE):
            for cls, op in _WRITE_CLASSES:
                if isinstance(node, cls):
                    self._write(node, op)
                    break
            return
        if isinstance(node, exp.Into):
            target = node.this
            if isinstance(target, exp.Table) and isinstance(target.this, exp.Identifier):
                self.ops.add("create")   # SELECT ... INTO new_table creates and fills a table
            else:
                self.ops.add("set")      # SELECT ... INTO @var / variables
            return
        if isinstance(node, exp.Lock):
            # FOR UPDATE / FOR SHARE take row locks: PostgreSQL refuses them in read-only transactions.
            self.ops.add("lock")
            return
        if isinstance(node, exp.PropertyEQ) and isinstance(node.this, (exp.Parameter, exp.SessionParameter)):
            self.ops.add("set")          # SELECT @v := ... writes a session variable kept on a pooled session
            return
        if isinstance(node, exp.Command):
            kw = str(node.this or "").strip().lower().split()
            self.ops.add(kw[0] if kw else "command")
            self.opaque = self.opaque or "a statement qag cannot parse fully"
            return

    def _from_func(self, func: exp.Func) -> None:
        fname = func_name(func)
        if self.dialect != "clickhouse" and fname not in _SAFE_FROM_FUNCS[self.dialect] and \
                fname not in _UNSAFE_FUNCS[self.dialect] and not fname.startswith(_UNSAFE_PREFIXES[self.dialect]):
            self.from_funcs.append(fname)

    def _ch_settings(self, items) -> None:
        # SELECT ... SETTINGS can lift limits the gateway set on the session (time limit, readonly,
        # introspection): those count as a "set" write, which read-only keys may not do.
        for item in items:
            name = item.this.name.lower() if isinstance(item, exp.EQ) and isinstance(item.this, exp.Expression) \
                else ""
            if not name or name in _CH_GUARDED_SETTINGS or (name.startswith(("allow_", "max_", "timeout"))
                                                           and name not in _CH_HARMLESS_SETTINGS):
                self.ops.add("set")

    def _is_delete_alias(self, node: exp.Delete, t) -> bool:
        if not isinstance(t, exp.Table) or t.args.get("db") is not None or not isinstance(t.this, exp.Identifier):
            return False
        name = normalize_identifier(t.this, self.dialect)
        for other in node.find_all(exp.Table):
            if other is t:
                continue
            alias = other.args.get("alias")
            if isinstance(alias, exp.TableAlias) and alias.this is not None and \
                    normalize_identifier(alias.this, self.dialect) == name:
                return True
        return False

    def _write(self, node: exp.Expression, op: str) -> None:
        if isinstance(node, exp.Insert):
            alt = str(node.args.get("alternative") or "").upper()
            if "REPLACE" in alt:
                op = "replace"
            conflict = node.args.get("conflict")
            if conflict is not None and (conflict.args.get("duplicate") or conflict.args.get("expressions")):
                self.ops.add("update")   # upsert: ON CONFLICT DO UPDATE / ON DUPLICATE KEY UPDATE
            if node.args.get("is_function"):
                self.opaque = self.opaque or "INSERT INTO FUNCTION"
        elif isinstance(node, exp.Copy):
            for f in node.args.get("files") or []:
                text = f.name.upper() if isinstance(f, (exp.Identifier, exp.Literal, exp.Var)) else f.sql().upper()
                if text not in ("STDIN", "STDOUT"):
                    self.unsafe.append("COPY " + ("PROGRAM" if text == "PROGRAM" else "file"))
        elif op in ("attach", "detach", "load"):
            self.unsafe.append(op.upper())   # SQLite ATTACH opens any file; LOAD DATA reads server files
        # (USE is a write: it changes the pooled session's database, so later bare names resolve elsewhere.)
        self.ops.add(op)

    def _dict_ref(self, node: exp.Func, fname: str) -> None:
        args = node.expressions if isinstance(node, exp.Anonymous) else [node.this]
        first = args[0] if args else None
        if isinstance(first, exp.Literal) and first.is_string:
            parts = first.name.split(".")
            if len(parts) == 2:
                self.refs.append((parts[0], parts[1]))
            elif len(parts) == 1 and parts[0]:
                self.refs.append((None, parts[0]))
            else:
                self.opaque = self.opaque or f"{fname} with an unusual dictionary name"
        else:
            self.opaque = self.opaque or f"{fname} with a computed dictionary name"
