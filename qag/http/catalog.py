"""The caller's discovery routes: `GET /catalog` (the queries this caller may run) and
`GET /connections/{name}/schema` (a granted connection's tables and columns, as this caller's grants see them).

Reachability is decided exactly as `/q` decides it: the same grant rule and the same plan, so a query listed here
is one the caller can run, with the masking its plan applies; a query governance refuses for this caller is not
listed. Nothing here runs a saved statement.
"""
from __future__ import annotations

from qag import formats as F
from qag import render
from qag.errors import ApiError, ConnectorError, QueryFailed, SecretKeyProblem
from qag.http import errors as http_errors
from qag.http.common import client_addr

_SYSTEM_SCHEMAS = {"pg_catalog", "information_schema", "pg_toast", "mysql", "performance_schema", "sys", "system",
                   "INFORMATION_SCHEMA"}


def _principal(app, req):
    return app.auth.authenticate_caller(req.get_header("X-API-Key"), req.get_header("Authorization"),
                                        client_addr(req))


def _formats() -> list[str]:
    out = []
    for f in render.FORMATS:
        try:
            F.available(f)
        except ApiError:
            continue
        out.append(f)
    return out


class Catalog:
    ROUTE = "/catalog"

    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        from qag.http.manage import list_page  # a list like the Management API's: ?limit=&cursor=
        principal = _principal(self.app, req)
        # every query when no limit is asked (what `qag mcp` lists as tools), else pages of `limit`
        resp.media = list_page(sorted(items(self.app, principal), key=lambda i: i["name"]), req, "name", default=None)


def items(app, principal) -> list[dict]:
    """The saved queries `principal` may run, as /catalog lists them: published, granted by the same rule as /q and
    not refused by governance for this caller (its plan is built, or taken from the plan cache). /openapi.json and
    /mcp's tools/list list exactly these."""
    from qag.runtime import granted
    rt = app.runtime
    fmts = _formats()
    out = []
    for q in rt.store.list_queries():
        if q["published_version"] is None:
            continue
        if not principal.admin and not granted(principal.key, q):
            continue
        try:
            plan, _, _ = rt.plan(principal, q["name"], None)
        except QueryFailed:
            raise  # the database refused to describe itself to the plan: no listing (500)
        except (ApiError, ConnectorError, SecretKeyProblem) as err:
            if http_errors.status_of(err) in (400, 403, 404):
                continue  # governance refuses it for this caller, or it is gone: not runnable
            plan = None   # the database is unreachable now: listed, without what only a plan knows
        if plan is not None and not principal.admin and not _claims_allow(principal, plan):
            continue
        v = rt.version(q["name"], q["published_version"], rt.query(q["name"])[1]) or {}
        masking = []
        if plan is not None and plan.transforms is not None:
            names = plan.names or ()
            for i, action in enumerate(plan.transforms):
                if action is not None:
                    masking.append({"position": i + 1, "column": names[i] if i < len(names) else None,
                                    "action": action})
        out.append({
            "name": q["name"], "description": q.get("description") or "", "version": q["published_version"],
            "connection_name": q["connection_name"],
            # a claim-bound parameter is the token's, not the caller's to give: not listed
            "parameters": {n: s for n, s in (v.get("parameters") or {}).items()
                           if not (isinstance(s, dict) and s.get("from_claim"))},
            "formats": fmts, "stream_formats": [f for f in render.STREAMERS if f in fmts],
            "cache_ttl": q.get("cache_ttl"),
            "writes": None if plan is None else bool(plan.is_write),
            "masking": None if plan is None else masking,
            "path": f"/q/{q['name']}"})
    return out


def _claims_allow(principal, plan) -> bool:
    """The identity rules of /q's bind stage (qag/identity.py): a query binding a claim is for signed-in callers
    only (an API key gets 403 sign_in_required) whose token holds every claim it binds (403 claim_missing), and a
    role that requires claim binding runs only such queries (403 claim_binding_required). A query the caller would
    be refused this way is not one it may run."""
    if principal.claims is None:
        return not plan.claims
    if any(principal.claims.get(claim) is None for _, claim in plan.claims):
        return False  # 403 claim_missing: the token lacks a claim this query binds
    role = (principal.key or {}).get("role") or {}
    return bool(plan.claims) or not role.get("require_claims")


class Schema:
    ROUTE = "/connections/{name}/schema"

    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp, name):
        from qag.governance import plan as gplan
        from qag.governance import tables as gtables
        rt = self.app.runtime
        principal = _principal(self.app, req)
        grants = {} if principal.admin else (principal.key.get("grants") or {})
        granted = principal.admin or name in (grants.get("connections") or []) or "*" in (grants.get("connections")
                                                                                          or [])
        if not granted:
            # Unknown and ungranted answer alike for a scoped key: no oracle for connection names.
            raise ApiError(403, "connection_forbidden", f"This key is not granted a connection named '{name}'.")
        crow, connector, cgen = rt.connection(name)
        if crow is None or connector is None:
            raise ApiError(404, "connection_not_found", f"There is no connection named '{name}'.")
        if not crow["active"]:
            raise ApiError(403, "connection_inactive",
                           f"The connection '{name}' is inactive; an administrator must reactivate it.")
        dialect = crow["db"]
        default_schema = connector.default_schema()
        allowed = grants.get("allowed_tables")
        allow = gtables.parse_allowed(allowed, dialect, default_schema) if allowed else None
        mask = list(grants.get("mask") or [])
        gplan.parse_rules(mask)
        catalog = connector.introspect()
        flags = _Flags(rt, crow, connector, cgen, mask)
        tables = []
        for (schema, table), cols in sorted(catalog.items()):
            if schema in _SYSTEM_SCHEMAS or schema.startswith("pg_temp") or schema.startswith("pg_toast"):
                continue
            if allow is not None and gtables.forbidden_tables([(schema, table)], allow):
                continue
            actions = flags.of(schema, table, cols)
            out_cols = [{"name": c, "masked": a is not None, "mask": a} for c, a in zip(cols, actions)]
            tables.append({"schema": schema, "name": table, "columns": out_cols})
        resp.media = {"connection": name, "db": dialect, "default_schema": default_schema, "tables": tables}


class _Flags:
    """What a call reading each column would get, decided by the analysis that governs calls: the key's rules
    applied to `SELECT * FROM schema.table` (a view as its definition, a partition as its parent, a generated
    column as a value derived from its sources); where that is refused, each column on its own. "refused":
    a call reading the column is refused (403 mask_unresolvable, view_not_expandable, function_not_allowed).
    Built from the catalogue of the connection's generation, as calls are."""

    def __init__(self, rt, crow, connector, cgen, mask):
        self.mask = mask
        self.dialect = crow["db"]
        if not mask:
            return
        self.kw = dict(dialect=self.dialect, default_schema=connector.default_schema(), allowed_tables=None,
                       mask_rules=mask, server_allows_writes=False, key_allows_writes=False, allowed_write_ops=None,
                       allow_unsafe=False, columns_of=rt.columns_of_factory(crow["name"], connector, cgen),
                       views_of=rt.views_of_factory(crow["name"], connector, cgen),
                       search_path=getattr(connector, "search_path", lambda: None)(),
                       trusted_functions=tuple((crow.get("options") or {}).get("trusted_functions") or ()))

    def _plan(self, sql):
        from qag.governance import GovernanceError, plan_governance
        try:
            return plan_governance(sql=sql, **self.kw)
        except GovernanceError:
            return None     # a call reading it is refused (mask_unresolvable, view_not_expandable, a function...)

    def _quote(self, name: str) -> str:
        if self.dialect in ("mysql", "clickhouse"):
            return "`" + name.replace("`", "``") + "`"
        return '"' + name.replace('"', '""') + '"'

    def of(self, schema: str, table: str, cols: list) -> list:
        if not self.mask:
            return [None] * len(cols)
        rel = f"{self._quote(schema)}.{self._quote(table)}"
        whole = self._plan(f"SELECT * FROM {rel}")
        if whole is not None and (whole.transforms is None or len(whole.transforms) == len(cols)):
            return list(whole.transforms) if whole.transforms is not None else [None] * len(cols)
        out = []
        for c in cols:
            one = self._plan(f"SELECT {self._quote(c)} FROM {rel}")
            out.append("refused" if one is None else (one.transforms[0] if one.transforms else None))
        return out


def register(app) -> None:
    app.falcon.add_route(Catalog.ROUTE, Catalog(app))
    app.falcon.add_route(Schema.ROUTE, Schema(app))
