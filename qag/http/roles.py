"""`/api/v1/roles` (administrators): named grant templates for signed-in callers (qag/identity.py) and for
creating keys. A change commits (with its audit row), bumps the role's generation, then answers: the role's
signed-in callers get the new grants on their next call."""
from __future__ import annotations

import falcon

from qag import identity
from qag.errors import ApiError
from qag.http.common import ok, read_json, require_admin
from qag.http.manage import GRANT_FIELDS, _type_error, check_fields, check_name, list_page, validate_grants

ROLE_FIELDS = ("name", "description", "require_claims") + GRANT_FIELDS


def _body(body: dict, partial: bool) -> dict:
    check_fields(body, ROLE_FIELDS, () if partial else ("name",))
    out = {"grants": validate_grants(body)}
    if "description" in body:
        if body["description"] is not None and not isinstance(body["description"], str):
            raise _type_error("description", "a string")
        out["description"] = body["description"] or ""
    if "require_claims" in body:
        if not isinstance(body["require_claims"], bool):
            raise _type_error("require_claims", "true or false")
        out["require_claims"] = body["require_claims"]
    return out


def public_role(r: dict) -> dict:
    out = {"name": r["name"], "description": r["description"], "require_claims": r["require_claims"]}
    for f in GRANT_FIELDS:
        out[f] = r["grants"].get(f)
    out.update(created_at=r["created_at"], updated_at=r["updated_at"])
    return out


def _changed(app, name: str) -> None:
    app.runtime.changed("key", identity.ROLE_PREFIX + name)


class Roles:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        ok(resp, list_page([public_role(r) for r in identity.list_roles(self.app.runtime.store)], req, "name"))

    def on_post(self, req, resp):
        p = require_admin(self.app, req)
        body = read_json(req, self.app.cfg)
        v = _body(body, partial=False)
        name = check_name(body["name"], "name")
        grants = v["grants"]
        for f in GRANT_FIELDS:
            grants.setdefault(f, None if f not in ("queries", "connections", "mask", "allow_writes") else
                              ([] if f != "allow_writes" else False))
        row = identity.put_role(self.app.runtime.store, p.name, {"name": name, **v}, create=True)
        _changed(self.app, name)
        ok(resp, public_role(row), 201)


class Role:
    def __init__(self, app):
        self.app = app

    def _get(self, name):
        row = identity.get_role(self.app.runtime.store, name)
        if row is None:
            raise ApiError(404, "role_not_found", f"There is no role named '{name}'.")
        return row

    def on_get(self, req, resp, name):
        require_admin(self.app, req)
        ok(resp, public_role(self._get(name)))

    def on_patch(self, req, resp, name):
        p = require_admin(self.app, req)
        body = read_json(req, self.app.cfg)
        if "name" in body and body["name"] != name:
            raise ApiError(400, "invalid_field", "A role cannot be renamed; create a new one.", {"field": "name"})
        body.pop("name", None)
        v = _body(body, partial=True)
        cur = self._get(name)
        merged = {"name": name, "description": v.get("description", cur["description"]),
                  "require_claims": v.get("require_claims", cur["require_claims"]),
                  "grants": {**cur["grants"], **v["grants"]}}
        row = identity.put_role(self.app.runtime.store, p.name, merged, create=False)
        _changed(self.app, name)
        ok(resp, public_role(row))

    def on_delete(self, req, resp, name):
        p = require_admin(self.app, req)
        identity.delete_role(self.app.runtime.store, p.name, name)
        _changed(self.app, name)
        resp.status = falcon.HTTP_204


def register(app) -> None:
    app.falcon.add_route("/api/v1/roles", Roles(app))
    app.falcon.add_route("/api/v1/roles/{name}", Role(app))
