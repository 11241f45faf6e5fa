"""Config as code: an instance's connections, queries, roles and keys as one YAML manifest.

`qag export` reads them through the Management API of a running instance and writes the manifest; `qag apply
-f FILE [--dry-run] [--prune]` makes the instance match it through the same API (so the same validation, audit
rows and generation bumps as any administrator's call) and prints what it changed, one line each:

    + connection pg (postgres 10.0.0.5:5432/app)
    ~ key reports: rate_limit null -> '10/s'
    = 7 unchanged

The manifest (`qag: 1`) maps names to objects; fields are the Management API's own:

    qag: 1
    connections:
      pg: {db: postgres, host: 10.0.0.5, port: 5432, user: app, password: "${PG_PASSWORD}", database: app}
    queries:
      orders_by_customer:
        connection_name: pg
        published: 2                 # the version callers get (null: none)
        versions:                    # every version, oldest first: versions are immutable
          - {sql: "SELECT ...", parameters: {cid: int}}
          - {sql: "SELECT ... LIMIT 100", parameters: {cid: int}, mask: [...]}
    roles:
      analyst: {queries: [orders_by_customer], connections: [pg]}
    keys:
      reports: {queries: [orders_by_customer], connections: [pg], rate_limit: 10/s}

Rules, each refused with a message naming the place in the file before anything changes:
- Unknown fields, a missing `qag: 1`, a value of the wrong shape.
- A secret in clear: a connection's password is `"${ENV_NAME}"` (read from the environment of `qag apply`) or
  `password_file: PATH`; keys' secrets are never in a manifest (a key the file creates prints its secret once).
- A version that differs from the instance's version of the same number (versions cannot change: append one),
  or an instance with versions the file lacks.
A connection's password is sent when the connection is created, and on an existing one only with
`--update-secrets` (the instance never shows it, so apply cannot tell whether it changed). Objects on the
instance that the file does not name are kept and counted, or deleted with `--prune`.
Everything is checked before the first change: the whole manifest, each connection a change would save
(`/api/v1/connections/test`) and each new version on an existing connection (`/api/v1/queries/validate`). If
the instance still refuses a change part-way, apply undoes what it had done in this run (created objects are
deleted, edited ones put back) and says so; versions, which cannot be deleted, are the one exception, named.
"""
from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qag.store import GRANT_FIELDS

FORMAT = 1
CONN_FIELDS = ("db", "host", "port", "user", "password", "password_file", "database", "active", "options")
QUERY_FIELDS = ("connection_name", "description", "cache_ttl", "published", "versions")
VERSION_FIELDS = ("sql", "parameters", "mask", "allow_unsafe", "description")
ROLE_FIELDS = ("description", "require_claims") + GRANT_FIELDS
KEY_FIELDS = ("description", "active", "expires_at", "role") + GRANT_FIELDS
SECTIONS = ("connections", "queries", "roles", "keys")
_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
PASSWORD_SHOWN = "********"


class ManifestError(ValueError):
    """The manifest cannot be applied as written; the message names the place in the file."""


class ApiFailure(RuntimeError):
    """The instance refused a call: its status, code and sentence."""

    def __init__(self, method: str, path: str, status: int, body: dict):
        self.status, self.code = status, body.get("code", "")
        super().__init__(f"{method} {path}: {status} {self.code}: {body.get('error', body)}")


# -- talking to the instance ----------------------------------------------------------------------
class Client:
    """The Management API of one instance, as its administrator."""

    def __init__(self, base: str, key: str, timeout: float = 30.0):
        self.base, self.key, self.timeout = base.rstrip("/"), key, timeout

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"X-API-Key": self.key, "Content-Type": "application/json",
                                              "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                err = json.loads(raw)
            except ValueError:
                err = {"error": raw.decode(errors="replace")[:200]}
            raise ApiFailure(method, path, exc.code, err if isinstance(err, dict) else {"error": err}) from None
        return json.loads(raw) if raw else None

    def items(self, path: str) -> list[dict]:
        out, cursor = [], None
        while True:
            sep = "&" if "?" in path else "?"
            page = self.call("GET", path + (f"{sep}cursor={urllib.parse.quote(cursor)}" if cursor else ""))
            out.extend(page["items"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def q(self, name: str) -> str:
        return urllib.parse.quote(name, safe="")


# -- export ---------------------------------------------------------------------------------------
def _env_name(conn: str) -> str:
    return "QAG_SECRET_" + re.sub(r"[^A-Za-z0-9]", "_", conn).upper() + "_PASSWORD"


def read_instance(client: Client) -> dict:
    """The instance's state in the manifest's shape (passwords as references, never in clear)."""
    m: dict = {"qag": FORMAT, "connections": {}, "queries": {}, "roles": {}, "keys": {}}
    for c in client.items("/api/v1/connections"):
        entry = {f: c.get(f) for f in CONN_FIELDS if f not in ("password", "password_file")}
        if c.get("password"):
            entry["password"] = "${" + _env_name(c["name"]) + "}"
        m["connections"][c["name"]] = entry
    for q in client.items("/api/v1/queries"):
        full = client.call("GET", f"/api/v1/queries/{client.q(q['name'])}")
        versions = sorted(full.get("versions", []), key=lambda v: v["version"])
        m["queries"][q["name"]] = {
            "connection_name": full["connection_name"], "description": full.get("description") or "",
            "cache_ttl": full.get("cache_ttl"), "published": full.get("published_version"),
            "versions": [{f: v.get(f) for f in VERSION_FIELDS} for v in versions]}
    try:
        roles = client.items("/api/v1/roles")
    except ApiFailure as exc:
        if exc.status != 404:
            raise
        roles = []
    for r in roles:
        m["roles"][r["name"]] = {f: r.get(f) for f in ROLE_FIELDS}
    for k in client.items("/api/v1/api-keys"):
        m["keys"][k["name"]] = {f: k.get(f) for f in KEY_FIELDS if f != "role"}
    return m


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ManifestError("manifests need PyYAML: pip install 'qag[formats]'") from None
    return yaml


def dump(manifest: dict, source: str = "") -> str:
    yaml = _yaml()

    head = "# qag manifest" + (f" of {source}" if source else "") + (
        "\n# passwords are references: set each ${...} in the environment of `qag apply`\n")
    return head + yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True, default_flow_style=False, width=120)


# -- reading a manifest ---------------------------------------------------------------------------
def load(text: str, environ: dict | None = None) -> dict:
    """Parse and check a manifest whole; secrets resolved. Raises ManifestError naming the place."""
    yaml = _yaml()

    env = os.environ if environ is None else environ
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(f"the file is not YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise ManifestError("the file must be a mapping with `qag: 1` and the sections "
                            + ", ".join(SECTIONS))
    if doc.get("qag") != FORMAT:
        raise ManifestError(f"`qag: {FORMAT}` is missing or another format ({doc.get('qag')!r}): this qag reads "
                            f"format {FORMAT}")
    unknown = sorted(set(doc) - {"qag", *SECTIONS})
    if unknown:
        raise ManifestError(f"unknown top-level field(s) {', '.join(map(str, unknown))}: the sections are "
                            + ", ".join(SECTIONS))
    out = {"qag": FORMAT}
    for sec, allowed in (("connections", CONN_FIELDS), ("queries", QUERY_FIELDS), ("roles", ROLE_FIELDS),
                         ("keys", KEY_FIELDS)):
        items = doc.get(sec) or {}
        if not isinstance(items, dict):
            raise ManifestError(f"{sec}: must map names to objects")
        out[sec] = {}
        for name, body in items.items():
            where = f"{sec}.{name}"
            if not isinstance(name, str) or not name:
                raise ManifestError(f"{sec}: every name must be a non-empty string ({name!r})")
            body = {} if body is None else body
            if not isinstance(body, dict):
                raise ManifestError(f"{where}: must be an object")
            bad = sorted(set(body) - set(allowed))
            if bad:
                hint = " (keys' secrets are never in a manifest)" if sec == "keys" and (
                    {"secret", "prefix"} & set(bad)) else ""
                raise ManifestError(f"{where}: unknown field(s) {', '.join(map(str, bad))}{hint}; allowed: "
                                    + ", ".join(allowed))
            out[sec][name] = dict(body)
    for name, c in out["connections"].items():
        _resolve_secret(f"connections.{name}", c, env)
    for name, q in out["queries"].items():
        where = f"queries.{name}"
        if not isinstance(q.get("connection_name"), str):
            raise ManifestError(f"{where}.connection_name: required, a connection's name")
        vs = q.get("versions")
        if not isinstance(vs, list) or not vs:
            raise ManifestError(f"{where}.versions: required, a list of at least one version (oldest first)")
        for i, v in enumerate(vs, 1):
            if not isinstance(v, dict):
                raise ManifestError(f"{where}.versions[{i}]: must be an object")
            bad = sorted(set(v) - set(VERSION_FIELDS))
            if bad:
                raise ManifestError(f"{where}.versions[{i}]: unknown field(s) {', '.join(bad)}; allowed: "
                                    + ", ".join(VERSION_FIELDS))
            if not isinstance(v.get("sql"), str) or not v["sql"].strip():
                raise ManifestError(f"{where}.versions[{i}].sql: required, the statement")
        pub = q.get("published")
        if pub is not None and (isinstance(pub, bool) or not isinstance(pub, int) or not 1 <= pub <= len(vs)):
            raise ManifestError(f"{where}.published: a version number from 1 to {len(vs)}, or null")
    return out


def _resolve_secret(where: str, c: dict, env) -> None:
    if "password" in c and "password_file" in c:
        raise ManifestError(f"{where}: give password or password_file, not both")
    if "password_file" in c:
        path = c.pop("password_file")
        if not isinstance(path, str):
            raise ManifestError(f"{where}.password_file: a path")
        try:
            with open(os.path.expanduser(path)) as f:
                c["password"] = f.read().rstrip("\r\n")
        except OSError as exc:
            raise ManifestError(f"{where}.password_file: cannot read {path}: {exc.strerror}") from None
        return
    pw = c.get("password")
    if pw is None or pw == "":
        c.pop("password", None)
        return
    m = _REF.match(pw) if isinstance(pw, str) else None
    if not m:
        raise ManifestError(f"{where}.password: a secret in clear is refused; write \"${{ENV_NAME}}\" and set "
                            f"ENV_NAME in the environment, or use password_file: PATH")
    if m.group(1) not in env:
        raise ManifestError(f"{where}.password: {m.group(1)} is not set in the environment")
    c["password"] = env[m.group(1)]


# -- the plan -------------------------------------------------------------------------------------
@dataclass
class Step:
    line: str                                   # what the diff prints
    do: Callable[[], Any]                       # the change
    undo: Callable[[], Any] | None = None       # how to put it back (None: it cannot be undone)
    check: Callable[[], Any] | None = None      # a check before anything changes
    irreversible: str = ""                      # why undo is None


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    unchanged: int = 0
    kept: list[str] = field(default_factory=list)   # on the instance, not in the file, not pruned


def _show(v) -> str:
    return "null" if v is None else repr(v) if isinstance(v, str) else json.dumps(v, sort_keys=True)


def _differs(want: dict, have: dict, fields) -> list[str]:
    return [f for f in fields if f in want and _norm(want[f]) != _norm(have.get(f))]


def _norm(v):
    return json.loads(json.dumps(v, sort_keys=True)) if v is not None else None


def plan(client: Client, want: dict, prune: bool = False, update_secrets: bool = False) -> Plan:
    have = read_instance(client)
    p = Plan()
    q = client.q
    # connections first (queries name them), keys last (they name queries, connections and roles)
    for name, c in want["connections"].items():
        cur = have["connections"].get(name)
        if cur is None:
            body = {"name": name, **c}
            p.steps.append(Step(f"+ connection {name} ({c.get('db')} {_where(c)})",
                                do=lambda body=body: client.call("POST", "/api/v1/connections", body),
                                undo=lambda name=name: client.call("DELETE", f"/api/v1/connections/{q(name)}"),
                                check=(lambda body=body: _test_connection(client, body))
                                if c.get("active", True) is not False else None))
            continue
        fields = [f for f in CONN_FIELDS if f not in ("password", "password_file")]
        diff = _differs(c, cur, fields)
        send_pw = update_secrets and "password" in c
        if not diff and not send_pw:
            p.unchanged += 1
            continue
        patch = {f: c[f] for f in diff}
        if send_pw:
            patch["password"] = c["password"]
        old = {f: cur.get(f) for f in diff}
        line = f"~ connection {name}: " + ", ".join(
            [f"{f} {_show(cur.get(f))} -> {_show(c[f])}" for f in diff] + (["password (set)"] if send_pw else []))
        test_body = {"name": name, **{f: cur.get(f) for f in fields if cur.get(f) is not None}, **patch}
        p.steps.append(Step(line, do=lambda name=name, patch=patch: client.call(
                                "PATCH", f"/api/v1/connections/{q(name)}", patch),
                            undo=(lambda name=name, old=old: client.call(
                                "PATCH", f"/api/v1/connections/{q(name)}", old)) if not send_pw else None,
                            irreversible="" if not send_pw else "a password cannot be read back",
                            check=(lambda b=test_body: _test_connection(client, b))
                            if ("password" in patch or set(diff) - {"active", "options"}) and "password" in patch
                            else None))
    for name, r in want["roles"].items():
        cur = have["roles"].get(name)
        if cur is None:
            body = {"name": name, **r}
            p.steps.append(Step(f"+ role {name}", do=lambda body=body: client.call("POST", "/api/v1/roles", body),
                                undo=lambda name=name: client.call("DELETE", f"/api/v1/roles/{q(name)}")))
            continue
        diff = _differs(r, cur, ROLE_FIELDS)
        if not diff:
            p.unchanged += 1
            continue
        p.steps.append(_patch_step("role", "/api/v1/roles/", name, r, cur, diff, client))
    for name, qd in want["queries"].items():
        _plan_query(client, p, name, qd, have["queries"].get(name), want, have)
    for name, k in want["keys"].items():
        cur = have["keys"].get(name)
        if cur is None:
            body = {"name": name, **k}
            p.steps.append(Step(f"+ key {name}", do=lambda body=body: _create_key(client, body),
                                undo=lambda name=name: client.call("DELETE", f"/api/v1/api-keys/{q(name)}")))
            continue
        diff = _differs(k, cur, [f for f in KEY_FIELDS if f != "role"])
        if not diff:
            p.unchanged += 1
            continue
        p.steps.append(_patch_step("key", "/api/v1/api-keys/", name, k, cur, diff, client))
    for sec, path, what in (("keys", "/api/v1/api-keys/", "key"), ("queries", "/api/v1/queries/", "query"),
                            ("roles", "/api/v1/roles/", "role"), ("connections", "/api/v1/connections/",
                                                                  "connection")):
        for name in have[sec]:
            if name in want[sec]:
                continue
            if prune:
                p.steps.append(Step(f"- {what} {name}", do=lambda path=path, name=name: client.call(
                    "DELETE", path + q(name)), irreversible="a deleted object cannot be brought back"))
            else:
                p.kept.append(f"{what} {name}")
    return p


def _where(c: dict) -> str:
    if c.get("db") == "sqlite":
        return str(c.get("database"))
    return f"{c.get('host')}:{c.get('port')}/{c.get('database')}"


def _patch_step(what, path, name, want, cur, diff, client) -> Step:
    patch = {f: want[f] for f in diff}
    old = {f: cur.get(f) for f in diff}
    line = f"~ {what} {name}: " + ", ".join(f"{f} {_show(cur.get(f))} -> {_show(want[f])}" for f in diff)
    return Step(line, do=lambda: client.call("PATCH", path + client.q(name), patch),
                undo=lambda: client.call("PATCH", path + client.q(name), old))


def _create_key(client: Client, body: dict) -> dict:
    out = client.call("POST", "/api/v1/api-keys", body)
    print(f"  key {body['name']}: secret {out['secret']} (shown once: store it now)")
    return out


def _test_connection(client: Client, body: dict) -> None:
    out = client.call("POST", "/api/v1/connections/test", {k: v for k, v in body.items() if k != "active"})
    if isinstance(out, dict) and out.get("ok") is False:
        raise ManifestError(f"connections.{body['name']}: cannot be reached: {out.get('error') or out}")


def _plan_query(client, p: Plan, name: str, qd: dict, cur: dict | None, want: dict, have: dict) -> None:
    qn = client.q(name)
    versions = qd["versions"]
    meta = {f: qd[f] for f in ("connection_name", "description", "cache_ttl") if f in qd}
    conn_exists = qd["connection_name"] in have["connections"]
    if qd["connection_name"] not in have["connections"] and qd["connection_name"] not in want["connections"]:
        raise ManifestError(f"queries.{name}.connection_name: no connection named {qd['connection_name']!r} "
                            "on the instance or in the file")

    def validate(v, conn=qd["connection_name"]):
        if not conn_exists:
            return None  # validated by the instance when it is created, after its connection
        out = client.call("POST", "/api/v1/queries/validate", {"connection_name": conn, **v})
        if not out.get("valid", False):
            raise ManifestError(f"queries.{name}: the instance refuses a version: "
                                + json.dumps(out.get("errors"), sort_keys=True))
        return None

    if cur is None:
        first = {"name": name, **meta, **versions[0], "publish": qd.get("published") == 1}
        p.steps.append(Step(f"+ query {name} version 1" + (" (published)" if first["publish"] else ""),
                            do=lambda: client.call("POST", "/api/v1/queries", first),
                            undo=lambda: client.call("DELETE", f"/api/v1/queries/{qn}"),
                            check=lambda: validate(versions[0])))
        for i, v in enumerate(versions[1:], 2):
            body = {**v, "publish": qd.get("published") == i}
            p.steps.append(Step(f"+ query {name} version {i}" + (" (published)" if body["publish"] else ""),
                                do=lambda body=body: client.call("POST", f"/api/v1/queries/{qn}/versions", body),
                                undo=None, irreversible=f"query {name} was created in this run and is deleted",
                                check=lambda v=v: validate(v)))
        return
    have_vs = cur["versions"]
    if len(have_vs) > len(versions):
        raise ManifestError(f"queries.{name}.versions: the instance has {len(have_vs)} versions and the file "
                            f"{len(versions)}; versions cannot be deleted: add the missing ones (qag export)")
    for i, (w, h) in enumerate(zip(versions, have_vs), 1):
        diff = [f for f in VERSION_FIELDS if _norm(w.get(f, _DEFAULTS[f])) != _norm(
            h.get(f) if h.get(f) is not None else _DEFAULTS[f])]
        if diff:
            raise ManifestError(f"queries.{name}.versions[{i}]: differs from the instance's version {i} in "
                                f"{', '.join(diff)}; versions cannot change: append a new version instead")
    meta_diff = [f for f in meta if _norm(meta[f]) != _norm(cur.get(f))]
    new = versions[len(have_vs):]
    if meta_diff and not new:
        raise ManifestError(f"queries.{name}: {', '.join(meta_diff)} change only with a new version: append one")
    for j, v in enumerate(new):
        i = len(have_vs) + j + 1
        body = {**v, "publish": qd.get("published") == i, **({f: meta[f] for f in meta_diff} if j == 0 else {})}
        line = f"+ query {name} version {i}" + (" (published)" if body["publish"] else "") + (
            "; " + ", ".join(f"{f} {_show(cur.get(f))} -> {_show(meta[f])}" for f in meta_diff) if j == 0 and
            meta_diff else "")
        p.steps.append(Step(line, do=lambda body=body: client.call("POST", f"/api/v1/queries/{qn}/versions", body),
                            undo=None, irreversible=f"version {i} of query {name} cannot be deleted",
                            check=lambda v=v, conn=qd["connection_name"]: validate(v, conn)))
    pub = qd.get("published", cur.get("published"))
    last_new_published = bool(new) and pub is not None and pub > len(have_vs)
    if pub != cur.get("published") and not last_new_published:
        if pub is None:
            raise ManifestError(f"queries.{name}.published: a published query cannot be unpublished; delete it "
                                "or publish another version")
        old = cur.get("published")
        p.steps.append(Step(f"~ query {name}: published {_show(old)} -> {pub}",
                            do=lambda: client.call("POST", f"/api/v1/queries/{qn}/publish", {"version": pub}),
                            undo=(lambda: client.call("POST", f"/api/v1/queries/{qn}/publish", {"version": old}))
                            if old else None, irreversible="" if old else "a query cannot be unpublished"))
    elif not new and not meta_diff:
        p.unchanged += 1


_DEFAULTS = {"sql": None, "parameters": {}, "mask": [], "allow_unsafe": False, "description": ""}


def apply(client: Client, want: dict, dry_run: bool = False, prune: bool = False, update_secrets: bool = False,
          out=sys.stdout) -> int:
    """Print the diff; unless dry_run, make the changes (undoing this run's on a refusal). Exit status."""
    p = plan(client, want, prune=prune, update_secrets=update_secrets)
    for s in p.steps:  # every check before the first change
        if s.check:
            s.check()
    for s in p.steps:
        print(s.line, file=out)
    print(f"= {p.unchanged} unchanged" + (f"; {len(p.kept)} on the instance and not in the file, kept "
                                          f"(--prune deletes them): {', '.join(p.kept)}" if p.kept else ""), file=out)
    if dry_run or not p.steps:
        print("dry run: nothing changed" if dry_run else "nothing to change", file=out)
        return 0
    done: list[Step] = []
    for s in p.steps:
        try:
            s.do()
        except ApiFailure as exc:
            print(f"qag apply: refused at `{s.line}`: {exc}", file=sys.stderr)
            _undo(done)
            return 1
        done.append(s)
    print(f"applied {len(done)} change(s)", file=out)
    return 0


def _undo(done: list[Step]) -> None:
    for s in reversed(done):
        if s.undo is None:
            print(f"  not undone: `{s.line}` ({s.irreversible or 'cannot be undone'})", file=sys.stderr)
            continue
        try:
            s.undo()
            print(f"  undone: `{s.line}`", file=sys.stderr)
        except ApiFailure as exc:
            print(f"  could not undo `{s.line}`: {exc}", file=sys.stderr)
