"""The entries and the run record Python and the plane exchange (shm/LAYOUT.md [Entries], [Run record]): the golden
vectors decoded field by field, each test naming the rule it checks. Every declaration is compared with this
language's writers, with LAYOUT.md's tables and with rustplane/src/entries.rs's declaration: a field added on one
side only fails here (and in rustplane/tests/entries_vectors.rs)."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import msgpack
import pytest

from qag import entries
from shm import vectors

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "shm" / "vectors"
LAYOUT = (ROOT / "shm" / "LAYOUT.md").read_text()
RUST = (ROOT / "rustplane" / "src" / "entries.rs").read_text()


def vector(name: str):
    return msgpack.unpackb((VECTORS / name).read_bytes(), raw=False)


def layout_table(heading: str) -> list[tuple[str, str]]:
    """(field, type) of the table under `### heading` (or `## heading`) in LAYOUT.md, in its `#` order."""
    m = re.search(rf"^##+ {re.escape(heading)}\n(.*?)(?=^##)", LAYOUT, re.S | re.M)
    assert m, f"LAYOUT.md has a section {heading}"
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| ([^|]+(?:\\\|[^|]+)*) \|", m.group(1), re.M)
    assert [int(n) for n, _, _ in rows] == list(range(1, len(rows) + 1)), f"{heading}: # counts 1, 2, ..."
    return [(f, t.replace("\\|", "|").strip()) for _, f, t in rows]


def rust_fields(name: str) -> tuple[str, ...]:
    m = re.search(rf"pub const {name}: [^=]+=\s*&?\[(.*?)\];", RUST, re.S)
    assert m, f"rustplane/src/entries.rs declares {name}"
    return tuple(re.findall(r'"(\w+)"', m.group(1)))


ENTRY_CASES = [  # (declaration, LAYOUT.md section, Rust constant, vector)
    (entries.KEY_ENTRY, "Key entry", "KEY_FIELDS", "key_entry.bin"),
    (entries.PLAN_ENTRY, "Plan entry", "PLAN_FIELDS", "plan_entry.bin"),
    (entries.CONNECTION_ENTRY, "Connection entry", "CONNECTION_FIELDS", "connection_entry.bin"),
]


@pytest.mark.parametrize("decl,section,rust,name", ENTRY_CASES, ids=[c[1] for c in ENTRY_CASES])
def test_entry_fields_E4_are_declared_alike_everywhere(decl, section, rust, name):
    """E4: the vector's keys, in order, are the declaration's, LAYOUT.md's table's and the plane's."""
    assert list(vector(name)) == [f for f, _ in decl], f"{name}: the writer follows the declaration"
    assert layout_table(section) == list(decl), f"LAYOUT.md [{section}] against qag/entries.py"
    assert rust_fields(rust) == tuple(f for f, _ in decl), f"rustplane/src/entries.rs {rust} against qag/entries.py"


def test_spec_fields_E4():
    """E4: a plan entry's parameter specs, declared alike in Python, LAYOUT.md and the plane."""
    spec = vector("plan_entry.bin")["specs"][0]
    assert list(spec) == list(entries.SPEC_FIELDS)
    assert layout_table("Parameter spec") == list(entries.SPEC_ENTRY)
    assert rust_fields("SPEC_FIELDS") == entries.SPEC_FIELDS


def test_key_entry_vector_fields():
    """[Key entry] field by field; E1 gen is the segment vector's generation of key alice."""
    k = vector("key_entry.bin")
    assert k["name"] == "alice" and k["active"] is True
    assert k["expires_at_us"] == 1_798_761_600_000_000  # 2027-01-01T00:00:00Z
    assert k["allowed_ips"] == ["10.0.0.0/8"] and k["prev"] is False and k["prev_until_us"] is None
    assert k["gen"] == 2 and k["rate_limit"] is None
    assert k["row"] == {"name": "alice", "active": 1, "expires_at": "2027-01-01T00:00:00Z", "prev_valid_until": None,
                        "grants": vectors.KEY_ROW["grants"]}


def test_plan_entry_vector_fields():
    """[Plan entry] field by field (P2 published_version, S5 state_free, E1 gens)."""
    p = vector("plan_entry.bin")
    assert (p["query"], p["version"], p["published_version"], p["connection"], p["dialect"]) == (
        "orders_by_id", 1, 1, "main", "postgres")
    assert p["sql_native"] == "SELECT id, total FROM orders WHERE id = $1"
    assert p["sql_driver"] == "SELECT id, total FROM orders WHERE id = %(id)s" and p["sql_pieces"] is None
    assert p["arg_names"] == ["id"]
    assert p["specs"] == [{"name": "id", "type": "int", "required": True, "has_default": False, "default": None,
                           "enum": None, "min": 1, "max": None, "min_length": None, "max_length": None,
                           "pattern": None}]
    assert p["transforms"] == [None, "mask"] and p["names"] == ["id", "total"]
    assert (p["page_mode"], p["is_write"], p["write_ops"], p["tables"]) == ("append", False, [], ["orders"])
    assert p["gens"] == [2, 1, 1] and p["cache_ttl"] is None
    assert (p["default_page_size"], p["max_page_size"], p["query_timeout"], p["state_free"]) == (100, 1000, 30.0, True)
    assert (p["server_allows_writes"], p["key_allows_writes"], p["allowed_write_ops"]) == (False, False, None)


def test_connection_entry_vector_fields_E6():
    """[Connection entry] field by field; only text and integer options; E6 no password anywhere."""
    c = vector("connection_entry.bin")
    assert c == {"db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "qag", "database": "shop",
                 "options": {"search_path": "app"}, "active": True, "gen": 1, "connect_timeout": 3.0}
    assert "password" not in (VECTORS / "connection_entry.bin").read_bytes().decode("utf-8", "replace")


def test_cache_keys_E5():
    """E5: k:<sha256 hex>, p:<key>\\0<query>, c:<connection>, as the plane computes them."""
    assert entries.key_cache_key("ab" * 32) == b"k:" + b"ab" * 32
    assert entries.plan_cache_key("alice", "orders_by_id") == b"p:alice\x00orders_by_id" == vectors.PLAN_KEY
    assert entries.connection_cache_key("main") == b"c:main" == vectors.CONNECTION_KEY
    assert 'format!("k:{secret_sha256_hex}")' in RUST and 'format!("c:{name}")' in RUST and "k.push(0);" in RUST


def test_publisher_writes_plans_of_the_published_version_only_E3():
    """E3/P2: a plan of another version than the published one, or an administrator's, is not written."""
    from types import SimpleNamespace

    from qag import params
    from shm import Segment
    seg = Segment.in_buffer(bytearray(vectors.SIZE), vectors.SLOTS, pid=vectors.PID, now_ns=vectors.NOW_NS)
    pub = entries.Publisher(seg, SimpleNamespace(home="/nonexistent", **vectors.PLAN_CFG))
    plan = SimpleNamespace(**vectors.PLAN, specs=params.build_specs(vectors.PLAN_PARAMS))
    pub.plan(plan, vectors.PLAN_SQL, 2)
    pub.plan(SimpleNamespace(**{**vars(plan), "key_name": None}), vectors.PLAN_SQL, 1)
    assert seg.cache_stats()["puts"] == 0 and seg.cache_get(vectors.PLAN_KEY) is None
    pub.plan(plan, vectors.PLAN_SQL, 1)
    assert seg.cache_get(vectors.PLAN_KEY) == (VECTORS / "plan_entry.bin").read_bytes()
    assert pub.get(vectors.PLAN_KEY) == vector("plan_entry.bin")
    seg.close()


# -- the run record -----------------------------------------------------------------------------------------------

def test_run_record_fields_RR1_are_declared_alike_everywhere():
    """RR1: the one Python declaration, LAYOUT.md's table, the plane's RUN_FIELDS and the vector agree."""
    assert entries.RUN_FIELDS == entries.RunRecord._fields and entries.RUN_NFIELDS == 16
    table = layout_table("Run record")
    assert [f for f, _ in table] == list(entries.RUN_FIELDS)
    py_types = [t.replace(" | None", "|nil") for t in entries.RUN_TYPES]
    assert [t.replace("uint", "int") for _, t in table] == py_types, "LAYOUT.md's types against RunRecord's"
    assert rust_fields("RUN_FIELDS") == entries.RUN_FIELDS
    assert len(vector("run_record.bin")) == entries.RUN_NFIELDS


def test_run_record_vector_fields_RR1_RR3_RR4():
    """The run_record.bin vector decoded field by field; RR3 v = 1; RR4 it starts with array16(16), 1."""
    raw = (VECTORS / "run_record.bin").read_bytes()
    assert raw[:4] == b"\xdc\x00\x10\x01"
    rec = entries.decode_run(raw)
    assert rec._asdict() == {"v": 1, **vectors.RUN}
    assert rec.at_us == 1_700_000_000_000_000 and rec.served_by == "plane" and rec.code is None
    assert rec.error is None


def test_run_record_failed_vector_RR5():
    """run_record_failed.bin: a failure with the database's words in `error` (a str8 with a non-ASCII character),
    as every writer writes it."""
    raw = (VECTORS / "run_record_failed.bin").read_bytes()
    rec = entries.decode_run(raw)
    assert rec._asdict() == {"v": 1, **vectors.RUN_FAILED}
    assert (rec.status, rec.code, rec.error) == (500, "query_failed", 'relation "public.ordres" does not exist (é)')
    assert entries.pack_run(*[vectors.RUN_FAILED[f] for f in entries.RUN_FIELDS[1:]]) == raw
    assert entries.pack_run_of(vectors.RUN_FAILED, "worker:1") == raw


def test_run_record_writers_follow_the_declaration():
    """pack_run's parameters and pack_run_of's keys are RUN_FIELDS after v; all three writers agree."""
    params = list(inspect.signature(entries.pack_run).parameters)
    assert [("bytes" if p == "nbytes" else p) for p in params] == list(entries.RUN_FIELDS[1:])
    run = {f: f"value-{i}" for i, f in enumerate(entries.RUN_FIELDS)}  # a distinct value per field
    rec = entries.decode_run(entries.pack_run_of(run, run["served_by"]))
    assert rec._asdict() == {**run, "v": 1}
    values = [vectors.RUN[f] for f in entries.RUN_FIELDS[1:]]
    assert entries.pack_run(*values) == entries.encode_run(**vectors.RUN) == entries.pack_run_of(
        vectors.RUN, "plane") == (VECTORS / "run_record.bin").read_bytes()


def test_run_stores_columns_derive_from_the_declaration():
    """The SQL store's and ClickHouse's run columns follow RunRecord, one column per field."""
    from qag.runstore import clickhouse, sql
    assert len(sql._COLS) == entries.RUN_NFIELDS  # event_id + every field but v
    assert sql._COLS[1:] == tuple(sql._COLUMN[f][0] for f in entries.RUN_FIELDS[1:])
    assert clickhouse.INSERT_COLUMNS[5:] == [clickhouse._COLUMN[f][0] for f in entries.RUN_FIELDS]
    assert clickhouse._RECORD_HEAD == (VECTORS / "run_record.bin").read_bytes()[:4]
    assert sql._COLUMN["error"] == ("error", "TEXT") and clickhouse._COLUMN["error"] == ("error", "Nullable(String)")


def _write_plan(grants: dict, allow_writes: bool = True):
    from types import SimpleNamespace

    from qag import plan as plan_mod
    cfg = SimpleNamespace(allow_writes=allow_writes, default_page_size=10, max_page_size=1000, query_timeout=30.0)
    connector = SimpleNamespace(default_schema=lambda: "public")
    p = plan_mod.build(key={"name": "w", "grants": grants}, query={"name": "dep", "cache_ttl": None},
                       version={"version": 1, "sql": "UPDATE t SET x = x + :d WHERE id = :id",
                                "parameters": {"d": {"type": "int"}, "id": {"type": "int"}}},
                       connection={"name": "c", "db": "postgres", "options": {}}, connector=connector, cfg=cfg,
                       gens=(1, 1, 1), columns_of=lambda: {})
    return entries.plan_entry(p, cfg, "UPDATE t SET x = x + :d WHERE id = :id", 1)


def test_plan_entry_carries_the_write_decisions_P3():
    """[Plan entry] P3: a write plan's entry carries the server's, the key's and the operations' decisions it was
    approved with (the plane re-checks them); a refused write publishes nothing, since build() raises."""
    from qag.errors import ApiError
    e = _write_plan({"allow_writes": True, "allowed_write_ops": ["UPDATE", "insert"]})
    assert (e["is_write"], e["write_ops"]) == (True, ["update"])
    assert (e["server_allows_writes"], e["key_allows_writes"], e["allowed_write_ops"]) == (True, True,
                                                                                          ["insert", "update"])
    e = _write_plan({"allow_writes": True})
    assert (e["server_allows_writes"], e["key_allows_writes"], e["allowed_write_ops"]) == (True, True, None)
    for grants, allow, code in (({"allow_writes": False}, True, "read_only"), ({"allow_writes": True}, False,
                                "read_only"), ({"allow_writes": True, "allowed_write_ops": ["insert"]}, True,
                                               "write_op_not_allowed")):
        with pytest.raises(ApiError) as exc:
            _write_plan(grants, allow)
        assert exc.value.code == code
    # a plan without the decisions (built without governance) says no to all: the plane forwards its writes
    from types import SimpleNamespace
    bare = SimpleNamespace(**{**vectors.PLAN, "write_grant": None, "is_write": True}, specs=())
    e = entries.plan_entry(bare, SimpleNamespace(**vectors.PLAN_CFG), vectors.PLAN_SQL, 1)
    assert (e["server_allows_writes"], e["key_allows_writes"], e["allowed_write_ops"]) == (False, False, None)
