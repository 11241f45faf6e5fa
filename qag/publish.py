"""Publishing metadata and plans into the segment's shared cache (msgpack maps), for other workers and the
Rust data plane. The entry formats are normative for both readers (see shm/LAYOUT.md, "Cache entries"):

- `k:<sha256 hex of secret>` → key entry   (valid while gen == seg.gen("key", name))
- `p:<key name>\\0<query name>` → plan entry (valid while gens == [key, query, connection] generations)
- `c:<connection name>` → connection entry  (valid while gen == seg.gen("connection", name));
  the password never enters the segment: it is in `<QAG_HOME>/plane/conn-<name>.secret` (mode 0600).

Every entry carries the generations it was built from; a reader ignores an entry whose generations
differ from the current ones, so a stale entry can cost a rebuild, never a wrong answer. The fields of
each entry, the version that introduced each one and what a reader does without it:
rustplane/ENTRIES.md (the contract between this module and the plane).

Only the published version of a query is ever published as a plan entry (`published_version` says which
it is): a plan built for `?version=N` stays in its worker, so the plane, which serves calls without
`version`, can never serve another version from the key's entry.
"""
from __future__ import annotations

import os
import tempfile

import msgpack

from qag import params as P, timeutil

_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack


def _us(text: str | None) -> int | None:
    if not text:
        return None
    d = timeutil.parse(text)
    return int(d.timestamp() * 1_000_000)


def key_entry(row: dict, via_prev: bool, gen: int) -> dict:
    g = row["grants"]
    return {"name": row["name"], "active": bool(row["active"]), "expires_at_us": _us(row["expires_at"]),
            "allowed_ips": g.get("allowed_ips") or None, "prev": via_prev,
            "prev_until_us": _us(row.get("prev_valid_until")), "gen": gen, "rate_limit": g.get("rate_limit"),
            "row": {k: row[k] for k in ("name", "active", "expires_at", "prev_valid_until", "grants")}}


def plan_entry(plan, cfg, sql_text: str, published_version: int | None = None) -> dict:
    return {"query": plan.query, "version": plan.version, "published_version": published_version,
            "connection": plan.connection, "dialect": plan.dialect,
            "sql_native": P.compile_native(sql_text, plan.dialect)[0], "sql_driver": plan.sql,
            "sql_pieces": P.split_at_markers(sql_text, plan.dialect) if plan.dialect == "mysql" else None,
            "arg_names": list(plan.arg_names),
            "specs": [_spec(s) for s in plan.specs],
            "transforms": list(plan.transforms) if plan.transforms is not None else None,
            "names": list(plan.names) if getattr(plan, "names", None) is not None else None,
            "page_mode": plan.page_mode, "is_write": bool(plan.is_write), "write_ops": sorted(plan.write_ops),
            "tables": sorted(plan.tables), "gens": list(plan.gens), "cache_ttl": plan.cache_ttl,
            "default_page_size": cfg.default_page_size, "max_page_size": cfg.max_page_size,
            "query_timeout": cfg.query_timeout,
            # connectors S5: false means the plane resets the session after the call (rustplane/ENTRIES.md)
            "state_free": bool(getattr(plan, "state_free", False))}


def _spec(s) -> dict:
    return {"name": s.name, "type": s.type, "required": bool(s.required), "has_default": bool(s.has_default),
            "default": s.default, "enum": s.enum, "min": s.min, "max": s.max, "min_length": s.min_length,
            "max_length": s.max_length, "pattern": s.pattern}


def connection_entry(row: dict, gen: int, connect_timeout: float | None = None) -> dict:
    """What the plane needs to open the sessions Python's connector opens (PostgreSQL and MySQL/MariaDB:
    qag/connectors.py); `connect_timeout` is cfg.connect_timeout (the query time limit is in each plan)."""
    # Only the text and integer options that shape a session (schema, search_path, sslmode...) go to the plane:
    # flags and lists (allow_superuser, trusted_functions) are Python's plan-time decisions, and the plane reads a
    # connection entry with any other value as unusable.
    options = {k: v for k, v in (row["options"] or {}).items()
               if isinstance(v, str) or isinstance(v, int) and not isinstance(v, bool)}
    return {"db": row["db"], "host": row["host"], "port": row["port"], "user": row["user"],
            "database": row["database"], "options": options, "active": bool(row["active"]), "gen": gen,
            "connect_timeout": connect_timeout}


def plan_cache_key(key_name: str, query: str) -> bytes:
    return b"p:" + key_name.encode() + b"\x00" + query.encode()


class Publisher:
    """Writes entries on a cache miss (never on the hot path of a warm call)."""

    def __init__(self, segment, cfg):
        self.seg = segment
        self.cfg = cfg
        self.secret_dir = os.path.join(cfg.home, "plane")

    def key(self, key_hash: str, row: dict, via_prev: bool, gen: int) -> None:
        self.seg.cache_put(b"k:" + key_hash.encode(), _pack(key_entry(row, via_prev, gen)))

    def plan(self, plan, sql_text: str, published_version: int | None) -> None:
        """Publish the plan of a key's call. `published_version`: the query's published version when the plan
        was built; a plan of any other version (a draft, an older one: `?version=N`) is not published."""
        if plan.key_name is None:
            return  # administrators' calls are always served by Python
        if published_version is None or plan.version != published_version:
            return
        self.seg.cache_put(plan_cache_key(plan.key_name, plan.query),
                           _pack(plan_entry(plan, self.cfg, sql_text, published_version)))

    def connection(self, row: dict, password: str | None, gen: int) -> None:
        os.makedirs(self.secret_dir, mode=0o700, exist_ok=True)
        path = os.path.join(self.secret_dir, f"conn-{row['name']}.secret")
        fd, tmp = tempfile.mkstemp(dir=self.secret_dir)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (password or "").encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self.seg.cache_put(b"c:" + row["name"].encode(),
                           _pack(connection_entry(row, gen, getattr(self.cfg, "connect_timeout", None))))

    def get(self, cache_key: bytes) -> dict | None:
        raw = self.seg.cache_get(cache_key)
        if raw is None:
            return None
        try:
            return msgpack.unpackb(raw, raw=False)
        except Exception:
            return None
