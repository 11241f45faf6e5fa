"""Signed-in callers: `Authorization: Bearer <jwt>` verified with PyJWT, their grants from a role, and parameters
bound to a verified claim.

- **Verification.** HS256 with `QAG_JWT_SECRET`, or RS256/ES256 with keys from `QAG_JWT_JWKS_URL` (fetched when the
  first token arrives, refreshed when a token names an unknown `kid`, at most once per `JWKS_REFRESH_S`). The key
  is chosen by the token's `alg` among the algorithms the configuration allows, so an HMAC token is only ever
  checked against the shared secret (never against a public key: no algorithm confusion) and `alg: none` is never
  accepted. `exp` is required; `nbf`, `iss` (`QAG_JWT_ISSUER`) and `aud` (`QAG_JWT_AUDIENCE`) are checked with
  `QAG_JWT_LEEWAY_SECONDS` of clock skew; without QAG_JWT_AUDIENCE a token naming any audience is refused. A
  token whose header names or carries a key (`jku`, `x5u`, `jwk`, `x5c`) is refused without fetching anything.
  Every failure is 401 `unauthorized`, indistinguishable from a bad
  key.
- **Roles** (`/api/v1/roles`) are named grant templates, the grants of a key. A signed-in caller's role is the
  claim `QAG_JWT_ROLE_CLAIM` (default `role`). A role's changes reach its callers on their next call: a role is
  a key-kind generation named `role:<name>` in the segment.
- **Claim-bound parameters**: a parameter rule `"from_claim": "sub"` takes the verified claim's value; a signed-in
  caller may not give it (400 `param_from_claim`), a token without the claim is 403 `claim_missing`, an API key
  cannot run such a query (403 `sign_in_required`), an administrator gives it like any parameter. A role with
  `require_claims` runs only queries that bind at least one claim (403 `claim_binding_required`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
import time

from qag import timeutil
from qag.errors import ApiError, Conflict, NotFound

log = logging.getLogger("qag.identity")

MAX_TOKEN_BYTES = 8192
JWKS_REFRESH_S = 1.0  # an unknown kid refetches the key set at most once a second per worker
# The very sentence of a refused key (qag/auth.py, and the plane's): a caller cannot tell which way in failed.
UNAUTHORIZED = "Give a valid, active API key in the X-API-Key header."
ROLE_PREFIX = "role:"
REMOTE_KEY_HEADERS = frozenset(("jku", "x5u", "jwk", "x5c"))
ROLE_FIELDS_EXTRA = ("name", "description", "require_claims")


class Verifier:
    """Verifies tokens; one per worker (thread-safe)."""

    def __init__(self, cfg):
        self.secret = getattr(cfg, "jwt_secret", "") or ""
        self.jwks_url = getattr(cfg, "jwt_jwks_url", "") or ""
        self.issuer = getattr(cfg, "jwt_issuer", "") or None
        self.audience = getattr(cfg, "jwt_audience", "") or None
        self.leeway = float(getattr(cfg, "jwt_leeway_seconds", 30))
        self.role_claim = getattr(cfg, "jwt_role_claim", "role") or "role"
        self._keys: dict[str, object] = {}
        self._fetched_at = 0.0
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[dict, float]] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.secret or self.jwks_url)

    def _jwks(self, refresh: bool) -> None:
        import jwt
        now = time.monotonic()
        if self._keys and (not refresh or now - self._fetched_at < JWKS_REFRESH_S):
            return
        with self._lock:
            if self._keys and (not refresh or now - self._fetched_at < JWKS_REFRESH_S):
                return
            self._fetched_at = now
            try:
                keys = jwt.PyJWKClient(self.jwks_url, cache_keys=False, timeout=5).get_signing_keys(refresh=True)
            except Exception as exc:  # noqa: BLE001 - an unreachable provider: no token verifies, logged
                log.warning("could not fetch the JWKS at QAG_JWT_JWKS_URL: %s", exc)
                return
            self._keys = {k.key_id: k for k in keys if k.key_id}

    def verify(self, token: str) -> dict:
        import jwt
        if not self.enabled or len(token) > MAX_TOKEN_BYTES:
            raise ApiError(401, "unauthorized", UNAUTHORIZED)
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        hit = self._cache.get(digest)
        now = time.time()
        if hit is not None and hit[1] > now:
            return hit[0]
        try:
            header = jwt.get_unverified_header(token)
            if REMOTE_KEY_HEADERS.intersection(header) or not isinstance(header.get("kid", ""), str):
                # a token naming where its own key is (or carrying it) is refused, never fetched nor used: the
                # keys are the configuration's only
                raise jwt.InvalidTokenError("key reference in the token")
            alg = header.get("alg")
            if alg == "HS256" and self.secret:
                key, algs = self.secret, ["HS256"]
            elif alg in ("RS256", "ES256") and self.jwks_url:
                kid = header.get("kid")
                self._jwks(refresh=False)
                key = self._keys.get(kid)
                if key is None:
                    self._jwks(refresh=True)
                    key = self._keys.get(kid)
                if key is None or getattr(key, "algorithm_name", alg) not in (alg, None):
                    raise jwt.InvalidTokenError("unknown key")
                key, algs = key.key, [alg]
            else:
                raise jwt.InvalidTokenError("algorithm not allowed")
            # aud is always verified: with no QAG_JWT_AUDIENCE a token that names an audience is refused, since
            # qag cannot be it (RFC 7519 4.1.3: a JWT whose aud does not name its processor MUST be rejected)
            claims = jwt.decode(token, key, algorithms=algs, audience=self.audience, issuer=self.issuer,
                                leeway=self.leeway, options={"require": ["exp"]})
        except ApiError:
            raise
        except Exception:  # noqa: BLE001 - every reason is the same 401 (no oracle)
            raise ApiError(401, "unauthorized", UNAUTHORIZED) from None
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[digest] = (claims, min(float(claims["exp"]) + self.leeway, now + 60))
        return claims


# -- roles in the metadata store ---------------------------------------------------------------------------------
_DDL = ("CREATE TABLE IF NOT EXISTS qag_roles (name TEXT PRIMARY KEY, description TEXT NOT NULL DEFAULT '', "
        "grants TEXT NOT NULL, require_claims INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL, "
        "updated_at TEXT NOT NULL)")
_made: set[int] = set()


def _ensure(store) -> None:
    if id(store) in _made:
        return
    store.run(lambda cur: cur.execute(_DDL), write=True)
    _made.add(id(store))


def _row(r) -> dict:
    return {"name": r[0], "description": r[1], "grants": json.loads(r[2]), "require_claims": bool(r[3]),
            "created_at": r[4], "updated_at": r[5]}


COLS = "name, description, grants, require_claims, created_at, updated_at"


def get_role(store, name: str) -> dict | None:
    _ensure(store)

    def q(cur):
        cur.execute(f"SELECT {COLS} FROM qag_roles WHERE name = ?", (name,))
        r = cur.fetchone()
        return _row(r) if r else None
    return store.run(q)


def list_roles(store) -> list[dict]:
    _ensure(store)

    def q(cur):
        cur.execute(f"SELECT {COLS} FROM qag_roles ORDER BY name")
        return [_row(r) for r in cur.fetchall()]
    return store.run(q)


def put_role(store, actor: str, role: dict, create: bool) -> dict:
    """Insert (create) or replace a role, with its audit row and change notice, in one transaction. Conflict: a
    role to create exists already; NotFound: one to change does not."""
    _ensure(store)
    now = timeutil.now_text()

    def q(cur):
        cur.execute(f"SELECT {COLS} FROM qag_roles WHERE name = ?", (role["name"],))
        r = cur.fetchone()
        before = _row(r) if r else None
        if before is not None and create:
            raise Conflict("role_exists", f"A role named '{role['name']}' exists; PATCH it or pick another name.")
        if before is None and not create:
            raise NotFound("role_not_found", f"There is no role named '{role['name']}'.")
        if create:
            cur.execute(f"INSERT INTO qag_roles ({COLS}) VALUES (?,?,?,?,?,?)",
                        (role["name"], role.get("description") or "", json.dumps(role["grants"]),
                         1 if role.get("require_claims") else 0, now, now))
        else:
            cur.execute("UPDATE qag_roles SET description = ?, grants = ?, require_claims = ?, updated_at = ? "
                        "WHERE name = ?", (role.get("description") or "", json.dumps(role["grants"]),
                                           1 if role.get("require_claims") else 0, now, role["name"]))
        store.audit(cur, actor, "create" if create else "update", "role", role["name"], before,
                    {k: role.get(k) for k in ("name", "description", "grants", "require_claims")})
        cur.execute(f"SELECT {COLS} FROM qag_roles WHERE name = ?", (role["name"],))
        return _row(cur.fetchone())
    return store.run(q, write=True)


def delete_role(store, actor: str, name: str) -> None:
    _ensure(store)

    def q(cur):
        cur.execute(f"SELECT {COLS} FROM qag_roles WHERE name = ?", (name,))
        r = cur.fetchone()
        if not r:
            raise NotFound("role_not_found", f"There is no role named '{name}'.")
        cur.execute("DELETE FROM qag_roles WHERE name = ?", (name,))
        store.audit(cur, actor, "delete", "role", name, _row(r), None)
    store.run(q, write=True)


# -- claim-bound parameters ----------------------------------------------------------------------------------
def claim_params(parameters: dict) -> tuple[tuple[str, str], ...]:
    return tuple((n, s["from_claim"]) for n, s in (parameters or {}).items()
                 if isinstance(s, dict) and s.get("from_claim"))


def bind_claims(principal, claims_of_plan, given: dict) -> dict:
    """The parameter values with each claim-bound one taken from the verified token."""
    if principal.admin:
        return given
    claims = getattr(principal, "claims", None)
    if claims is None:
        raise ApiError(403, "sign_in_required", "This query binds parameters to the caller's identity: call it "
                       "signed in (Authorization: Bearer <token>), not with an API key.")
    given = dict(given)
    supplied = [n for n, _ in claims_of_plan if n in given]
    if supplied:
        raise ApiError(400, "param_from_claim", f"{', '.join(supplied)} come(s) from your token, not from the call; "
                       "leave it out.", {"errors": {n: "is taken from your token" for n in supplied}})
    for name, claim in claims_of_plan:
        if claim not in claims or claims[claim] is None:
            raise ApiError(403, "claim_missing", f"Your token has no '{claim}' claim, which this query needs.")
        v = claims[claim]
        given[name] = v if isinstance(v, (str, int, float, bool)) else json.dumps(v)
    return given
