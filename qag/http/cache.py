"""The response cache's admin routes (administrators only; docs/api.md "Response cache"):

- `GET /api/v1/cache?query=&limit=` lists this host's cached answers, newest first, with the totals;
- `DELETE /api/v1/cache?query=` evicts every answer (or one query's), `DELETE /api/v1/cache/{query}` one query's.

An eviction is audit-logged (entity `response_cache`, name the query or `*`); the audit row's change notification
makes every other host's change watcher evict the same answers from its own segment (qag/server/changes.py), so an
operator behind a load balancer evicts on all hosts with one call. The cache itself is shm/LAYOUT.md
[Response cache]; its answers are also invalidated by the generations (a publish, a connection or mask change)
without anyone evicting them.
"""
from __future__ import annotations

from qag import params as P
from qag.errors import ApiError
from qag.http.common import ok, require_admin

ENTITY = "response_cache"  # the audit rows' entity (qag/server/changes.py evicts on the other hosts)
ALL = "*"
MAX_LIMIT = 1000


def evict(responses, query: str | None) -> int:
    """Drop this host's cached answers of `query` (all when None): how many (LAYOUT.md R12)."""
    if responses is None:
        return 0
    if query is None:
        return responses.remove()
    return responses.remove(lambda e: e.get("query") == query)


def totals(responses) -> dict:
    if responses is None:
        return {"enabled": False, "capacity_bytes": 0, "bytes_used": 0, "entries": 0, "max_entry_bytes": 0,
                "puts": 0, "evictions": 0, "removals": 0, "rejects": 0, "refreshes": 0, "repairs": 0}
    st = responses.stats()
    return {"enabled": True, "capacity_bytes": st["capacity"], "bytes_used": st["live_bytes"],
            "entries": st["live_entries"], "max_entry_bytes": st["max_record"], "puts": st["puts"],
            "evictions": st["evictions"], "removals": st["removals"], "rejects": st["rejects"],
            "refreshes": st["refreshes"], "repairs": st["repairs"]}


ENTRY_FIELDS = ("query", "version", "connection", "format", "page", "page_size", "bytes", "body_bytes", "rows",
                "age_s", "ttl_s", "ttl_left_s", "fresh", "hits", "etag", "masking")


class CacheList:
    def __init__(self, app):
        self.app = app

    def on_get(self, req, resp):
        require_admin(self.app, req)
        _known(req, {"query", "limit"})
        query = req.get_param("query") or None
        raw = req.get_param("limit")
        try:
            if raw not in (None, "") and not P.INT_RE.fullmatch(raw):
                raise ValueError  # ASCII digits only, as every number of a query string
            limit = 100 if raw in (None, "") else P.text_int(raw)
            if not 1 <= limit <= MAX_LIMIT:
                raise ValueError
        except ValueError:
            raise ApiError(400, "invalid_body", f"limit must be an integer from 1 to {MAX_LIMIT}.",
                           {"errors": {"limit": f"must be an integer from 1 to {MAX_LIMIT}"}}) from None
        rc = self.app.responses
        items = []
        for e in rc.entries() if rc is not None else ():
            if query is not None and e.get("query") != query:
                continue
            e["fresh"] = e["ttl_left_s"] > 0
            items.append({f: e.get(f) for f in ENTRY_FIELDS})
        items.sort(key=lambda e: e["age_s"])
        ok(resp, {"items": items[:limit], "totals": totals(rc), "next_cursor": None}, no_store=True)

    def on_delete(self, req, resp):
        require_admin(self.app, req)
        _known(req, {"query"})
        query = req.get_param("query")
        if query is not None and not query.strip():
            # `?query=$NAME` with an empty NAME must not evict every query's answers: that is the route without it
            raise ApiError(400, "invalid_body", "query must name a saved query; DELETE /api/v1/cache without query "
                           "evicts every answer.", {"errors": {"query": "must not be empty"}})
        _evict(self.app, req, resp, query)


def _known(req, names: set[str]) -> None:
    unknown = set(req.params) - names
    if unknown:
        raise ApiError(400, "unknown_field", f"Unknown filter(s) {', '.join(sorted(unknown))}.")
    for name in names:
        if isinstance(req.params.get(name), list):  # ?query=a&query=b: which one was meant cannot be known
            raise ApiError(400, "invalid_body", f"{name} must be given once.", {"errors": {name: "must be given once"}})


class CacheQuery:
    def __init__(self, app):
        self.app = app

    def on_delete(self, req, resp, name):
        require_admin(self.app, req)
        _known(req, set())
        _evict(self.app, req, resp, name)


def _evict(app, req, resp, query: str | None) -> None:
    p = require_admin(app, req)
    store = app.runtime.store
    if query is not None and store.get_query(query) is None:
        raise ApiError(404, "query_not_found", f"There is no saved query named '{query}'.")
    n = evict(app.responses, query)
    if app.response_tier is not None:  # the Redis tier's answers of it, for every host (its eviction epoch + 1)
        app.response_tier.evict(query)
    # Audit-logged like every administrator's change; its notification evicts on the other hosts too.
    store.run(lambda cur: store.audit(cur, p.name, "evict", ENTITY, query or ALL, None, {"evicted": n}), write=True)
    ok(resp, {"evicted": n, "query": query, "totals": totals(app.responses)})


def register(app) -> None:
    app.falcon.add_route("/api/v1/cache", CacheList(app))
    app.falcon.add_route("/api/v1/cache/{name}", CacheQuery(app))
