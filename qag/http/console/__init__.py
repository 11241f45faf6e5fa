"""The operators' Console at /console: server-rendered pages (Jinja2) over the Management API, in-process.

Every action a page takes is a call of the Management API itself (`_api`), made inside this process on behalf
of the signed-in administrator: the same validation, audit rows and generation bumps as a script's call, and no
second implementation to drift. The session is a random id in an HttpOnly, SameSite=Strict cookie (Secure under
TLS) whose row lives in the metadata store, so every worker and host sees it and sign-out ends it everywhere;
every form carries the session's CSRF token. The cookie authorises nothing but /console: /q and the Management
API read X-API-Key only, and the in-process principal is passed in a WSGI environ key no HTTP header can set.
"""
from __future__ import annotations

import difflib
import hashlib
import hmac
import io
import json
import os
import re
import secrets
import sys
import time
import urllib.parse

import falcon

from qag.errors import ApiError
from qag.http.common import client_addr
from qag.store import hash_secret

COOKIE = "qag_console"
PRINCIPAL_ENV = "qag.console_principal"   # a dotted WSGI key: no request header maps to it (PEP 3333)
HERE = os.path.dirname(os.path.abspath(__file__))
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
STATIC = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}

_env = None


def _templates():
    global _env
    if _env is None:
        import jinja2
        _env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(HERE, "templates")),
                                  autoescape=jinja2.select_autoescape(["html"], default=True),
                                  undefined=jinja2.StrictUndefined)
        _env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)
    return _env


def _headers(resp) -> None:
    resp.set_header("Content-Security-Policy", CSP)
    resp.set_header("X-Content-Type-Options", "nosniff")
    resp.set_header("X-Frame-Options", "DENY")
    resp.set_header("Referrer-Policy", "same-origin")
    resp.set_header("Cache-Control", "no-store")


# -- sessions --------------------------------------------------------------------------------------------------
class Session:
    __slots__ = ("admin", "csrf", "expires", "principal", "sid")


def _row_key(sid: str) -> str:
    return "console_session:" + hashlib.sha256(sid.encode()).hexdigest()


def _kv_put(store, k: str, v: str) -> None:
    def q(cur):
        cur.execute("DELETE FROM qag_kv WHERE k = ?", (k,))
        cur.execute("INSERT INTO qag_kv (k, v) VALUES (?, ?)", (k, v))
    store.run(q, write=True)


def _kv_get(store, k: str) -> str | None:
    def q(cur):
        cur.execute("SELECT v FROM qag_kv WHERE k = ?", (k,))
        r = cur.fetchone()
        return r[0] if r else None
    return store.run(q)


def _kv_del(store, k: str) -> None:
    store.run(lambda cur: cur.execute("DELETE FROM qag_kv WHERE k = ?", (k,)), write=True)


def _secure(req) -> bool:
    return req.scheme == "https" or (req.get_header("X-Forwarded-Proto") or "").lower() == "https"


def _set_cookie(req, resp, value: str, max_age: int) -> None:
    parts = [f"{COOKIE}={value}", "Path=/console", "HttpOnly", "SameSite=Strict", f"Max-Age={max_age}"]
    if _secure(req):
        parts.append("Secure")
    resp.append_header("Set-Cookie", "; ".join(parts))


class Console:
    """All /console routes; one instance per app."""

    def __init__(self, app):
        self.app = app

    # -- plumbing ---------------------------------------------------------------------------------------------
    def session(self, req) -> Session | None:
        sid = req.cookies.get(COOKIE)
        if not sid or len(sid) > 100:
            return None
        store = self.app.runtime.store
        raw = _kv_get(store, _row_key(sid))
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            expires, cred = float(data["expires"]), data.get("cred")
        except (ValueError, TypeError, KeyError):
            data, expires, cred = None, 0.0, None
        if expires <= time.time() or not isinstance(cred, str):
            _kv_del(store, _row_key(sid))  # expired, or a row from before sessions were bound to a credential
            return None
        # The session is worth what the credential it was opened with is worth now: a revoked administrator
        # token (or a QAG_ADMIN_KEY changed since) ends it at its next request, on every worker and host.
        try:
            p = self.app.auth.authenticate_hash(cred, client_addr(req))
        except ApiError:
            p = None
        if p is None or not p.admin:
            _kv_del(store, _row_key(sid))
            return None
        s = Session()
        s.sid, s.admin, s.csrf, s.expires = sid, p.name, data["csrf"], expires
        s.principal = p
        return s

    def render(self, req, resp, template: str, session: Session | None, status=200, **ctx) -> None:
        _headers(resp)
        resp.status = falcon.code_to_http_status(status)
        resp.content_type = "text/html; charset=utf-8"
        resp.text = _templates().get_template(template).render(
            admin=session.admin if session else None, csrf=session.csrf if session else "", page=template[:-5],
            flash=req.get_param("flash") or "", **ctx)

    def api(self, session: Session, method: str, path: str, body=None, query: dict | None = None):
        """Call this app's own API in-process as the signed-in administrator: (status, parsed JSON or text)."""
        data = b"" if body is None else json.dumps(body).encode()
        environ = {
            "REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "",
            "QUERY_STRING": urllib.parse.urlencode(query or {}, doseq=True), "SERVER_NAME": "console",
            "SERVER_PORT": "0", "SERVER_PROTOCOL": "HTTP/1.1", "REMOTE_ADDR": "127.0.0.1",
            "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(data)), "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(data), "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": True, "wsgi.run_once": False,
            PRINCIPAL_ENV: session.principal, "HTTP_X_REQUEST_ID": "console-" + secrets.token_hex(6)}
        out = {}

        def start_response(status, headers, exc_info=None):
            out["status"] = int(status.split()[0])
            out["headers"] = {k.lower(): v for k, v in headers}
        chunks = self.app.falcon(environ, start_response)
        raw = b"".join(chunks)
        if hasattr(chunks, "close"):
            chunks.close()
        ctype = out["headers"].get("content-type", "")
        if ctype.startswith("application/json") and raw:
            try:
                return out["status"], json.loads(raw), out["headers"]
            except ValueError:
                pass
        return out["status"], raw, out["headers"]

    def require(self, req, resp) -> Session | None:
        s = self.session(req)
        if s is None:
            nxt = urllib.parse.quote(req.relative_uri)
            resp.status = falcon.HTTP_303
            resp.set_header("Location", f"/console/login?next={nxt}")
            _headers(resp)
        return s

    def form(self, req, session: Session) -> dict:
        """A POSTed form, refused unless it carries this session's CSRF token (and comes from this origin)."""
        raw = req.bounded_stream.read(self.app.cfg.max_body_bytes + 1)
        if len(raw) > self.app.cfg.max_body_bytes:
            raise ApiError(413, "body_too_large", "The form is too large.")
        fields = {k: v[-1] for k, v in urllib.parse.parse_qs(raw.decode("utf-8", "replace"),
                                                               keep_blank_values=True).items()}
        token = fields.get("csrf", "")
        if not session or not hmac.compare_digest(token.encode(), session.csrf.encode()):
            raise ApiError(403, "csrf_failed", "This form is stale or was not sent by the Console (its CSRF token "
                           "does not match); reload the page and try again.")
        _same_origin(req)
        return fields

    def back(self, resp, where: str, flash: str = "") -> None:
        resp.status = falcon.HTTP_303
        sep = "&" if "?" in where else "?"
        resp.set_header("Location", where + (f"{sep}flash={urllib.parse.quote(flash)}" if flash else ""))
        _headers(resp)

    def error_page(self, req, resp, session, status, message) -> None:
        self.render(req, resp, "error.html", session, status=status, message=message)


def _error_text(status, body) -> str:
    if isinstance(body, dict) and "error" in body:
        return f"{body['error']} ({body.get('code')}, {status})"
    return f"HTTP {status}"


def _lines(text: str) -> list[str]:
    return [x.strip() for x in (text or "").replace(",", "\n").splitlines() if x.strip()]


# -- pages -------------------------------------------------------------------------------------------------
class Login(Console):
    def on_get(self, req, resp):
        self.render(req, resp, "login.html", None, next=_safe_next(req.get_param("next")), message="")

    def on_post(self, req, resp):
        _same_origin(req)  # no sign-in from another site's form (login CSRF)
        raw = req.bounded_stream.read(65536).decode("utf-8", "replace")
        fields = {k: v[-1] for k, v in urllib.parse.parse_qs(raw, keep_blank_values=True).items()}
        token = fields.get("token", "")
        nxt = _safe_next(fields.get("next"))
        try:
            p = self.app.auth.authenticate(token or None, client_addr(req))
        except ApiError:
            p = None
        if p is None or not p.admin:
            # A scoped key's secret is refused exactly like a wrong one.
            self.render(req, resp, "login.html", None, status=401, next=nxt,
                        message="That is not an administrator token. Use QAG_ADMIN_KEY or a token from "
                                "`qag admins create NAME`.")
            return
        sid = secrets.token_urlsafe(32)  # always a new id: a cookie planted before sign-in is never adopted
        ttl = int(self.app.cfg.console_session_seconds)
        _kv_put(self.app.runtime.store, _row_key(sid),
                json.dumps({"admin": p.name, "csrf": secrets.token_urlsafe(32), "expires": time.time() + ttl,
                            "cred": hash_secret(token)}))
        _set_cookie(req, resp, sid, ttl)
        self.back(resp, nxt)


def _same_origin(req) -> None:
    """A state-changing Console request must come from the Console's own pages: refused when the browser says it
    comes from another site (Origin naming another host, or `null` from a sandboxed or privacy-stripped context;
    Sec-Fetch-Site cross-site or same-site). A request without either header (a script, an old browser) is
    judged by its CSRF token alone."""
    origin = req.get_header("Origin")
    if origin is not None:
        host = req.get_header("Host") or ""
        parts = urllib.parse.urlsplit(origin)
        if origin == "null" or parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
            raise ApiError(403, "csrf_failed", "The form was sent from another site; it is refused.")
    fetch_site = (req.get_header("Sec-Fetch-Site") or "").lower()
    if fetch_site in ("cross-site", "same-site"):
        raise ApiError(403, "csrf_failed", "The form was sent from another site; it is refused.")


_NEXT_RE = re.compile(r"/console(?:[/?#][A-Za-z0-9._~!$&'()*+,;=:@/?#%-]*)?")


def _safe_next(nxt) -> str:
    """Where to go after sign-in: a Console path on this origin, or /console. No scheme, host, `//`, backslash,
    control character, space or `..` segment: nothing a browser could read as another site."""
    if isinstance(nxt, str) and len(nxt) <= 2000 and _NEXT_RE.fullmatch(nxt) and "//" not in nxt \
            and "/../" not in nxt + "/" and "%2f" not in nxt.lower() and "%5c" not in nxt.lower():
        return nxt
    return "/console"


class Logout(Console):
    def on_post(self, req, resp):
        s = self.session(req)
        if s is not None:
            self.form(req, s)
            _kv_del(self.app.runtime.store, _row_key(s.sid))
        _set_cookie(req, resp, "", 0)
        self.back(resp, "/console/login", "Signed out.")


class Overview(Console):
    def latency_per_minute(self, s, since: str) -> tuple[list, bool]:
        """p50 and p99 per minute of the last hour, from the run history (GET /api/v1/history, newest first,
        LATENCY_PAGES pages at most). Second value: True when the hour held more runs than were read (the
        charts then cover its latest minutes)."""
        runs, cursor = [], None
        for _ in range(LATENCY_PAGES):
            q = {"since": since, "limit": "1000", **({"cursor": cursor} if cursor else {})}
            st, page, _ = self.api(s, "GET", "/api/v1/history", query=q)
            if st != 200 or not isinstance(page, dict):
                return [], False
            runs.extend(page.get("items", []))
            cursor = page.get("next_cursor")
            if not cursor:
                return _per_minute(runs), False
        return _per_minute(runs), True

    def on_get(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        _, shm, _ = self.api(s, "GET", "/-/shm")
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
        st, usage, _ = self.api(s, "GET", "/api/v1/usage", query={"per": "minute", "since": since})
        items = usage.get("items", []) if isinstance(usage, dict) else []
        metrics = self.app.observer.render().decode("utf-8", "replace") if hasattr(self.app.observer, "render") \
            else ""
        per_minute, sampled = self.latency_per_minute(s, since)
        self.render(req, resp, "overview.html", s, shm=shm if isinstance(shm, dict) else {},
                    latency_minutes=per_minute, latency_sampled=sampled,
                    usage=items, usage_error="" if st == 200 else _error_text(st, usage),
                    charts={"calls": _svg_bars([(i.get("period") or i.get("at") or "", i.get("calls", 0))
                                                for i in items], "calls"),
                            "errors": _svg_bars([(i.get("period") or i.get("at") or "", i.get("errors", 0))
                                                 for i in items], "errors"),
                            "p50": _svg_bars([(m, v["p50"]) for m, v in per_minute], "p50 ms"),
                            "p99": _svg_bars([(m, v["p99"]) for m, v in per_minute], "p99 ms")},
                    latency=_latency(metrics), plane=bool(getattr(self.app.cfg, "public_bind", None)),
                    slots=_slots(shm), runs_lost=_metric_sum(metrics, "qag_runs_lost_total"),
                    recorder_lag=_metric_sum(metrics, "qag_recorder_lag_seconds"))


LATENCY_PAGES = 5  # the overview's latency charts read at most this many pages of 1,000 runs


def _percentile(sorted_values: list, q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    k = max(0, min(len(sorted_values) - 1, int(-(-q * len(sorted_values) // 1)) - 1))
    return sorted_values[k]


def _per_minute(runs) -> list[tuple[str, dict]]:
    """[(minute "YYYY-MM-DDTHH:MM", {"p50", "p99", "calls"})] oldest first, from runs' at and duration_ms."""
    by: dict[str, list] = {}
    for r in runs:
        at, d = r.get("at"), r.get("duration_ms")
        if isinstance(at, str) and len(at) >= 16 and isinstance(d, (int, float)):
            by.setdefault(at[:16], []).append(float(d))
    out = []
    for minute in sorted(by):
        ds = sorted(by[minute])
        out.append((minute, {"p50": round(_percentile(ds, 0.5), 3), "p99": round(_percentile(ds, 0.99), 3),
                             "calls": len(ds)}))
    return out


def _metric_sum(text: str, name: str):
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (len(line) > len(name) and line[len(name)] in " {"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except ValueError:
                continue
    return (int(total) if total.is_integer() else round(total, 3)) if seen else "–"


def cpus_of(pid) -> str:
    """The CPUs a process of this host may run on (its affinity, as /proc says: "0", "0-3,8"), or "–"."""
    try:
        with open(f"/proc/{int(pid)}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    return line.split(":", 1)[1].strip()
    except (OSError, ValueError, TypeError):
        pass
    return "–"


def _slots(shm) -> list[dict]:
    """The segment's live process slots: role, pid, heartbeat age and ring occupancy."""
    now = time.time_ns()  # the segment's heartbeats are wall-clock ns (shm/segment.py _clock)
    out = []
    for sl in (shm or {}).get("process_slots", []) if isinstance(shm, dict) else []:
        if not sl.get("pid"):
            continue
        ring = sl.get("ring") or {}
        hb = sl.get("heartbeat_ns") or 0
        out.append({"slot": sl.get("slot"), "role": sl.get("role"), "pid": sl.get("pid"), "alive": sl.get("alive"),
                    "cpus": cpus_of(sl.get("pid")),
                    "heartbeat_age_s": round((now - hb) / 1e9, 1) if hb and hb <= now else None,
                    "ring": ", ".join(f"{k} {v}" for k, v in ring.items() if isinstance(v, (int, float)))})
    return out


def _latency(text: str) -> dict:
    """p50 and p99 of qag_request_duration_seconds since start, from the cumulative histogram buckets."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("qag_request_duration_seconds_bucket"):
            try:
                le = line.split('le="', 1)[1].split('"', 1)[0]
                v = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            b = float("inf") if le == "+Inf" else float(le)
            buckets[b] = buckets.get(b, 0.0) + v
    if not buckets:
        return {}
    total = buckets.get(float("inf"), max(buckets.values()))
    out = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        for le in sorted(buckets):
            if total and buckets[le] >= q * total:
                out[name] = "≤ " + ("∞" if le == float("inf") else f"{le * 1000:g} ms")
                break
    out["calls"] = int(total)
    return out


def _svg_bars(points, label: str) -> str:
    """A small bar chart as inline SVG (served as a data: image; no script, no external asset)."""
    w, h = 600, 120
    n = max(len(points), 1)
    top = max([v for _, v in points] + [1])
    bw = w / n
    bars = []
    for i, (t, v) in enumerate(points):
        bh = (v / top) * (h - 20)
        bars.append(f'<rect x="{i * bw:.1f}" y="{h - bh:.1f}" width="{max(bw - 1, 1):.1f}" height="{bh:.1f}">'
                    f"<title>{_x(str(t))}: {v}</title></rect>")
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}">'
           f'<text x="4" y="12" font-size="11">{_x(label)} per minute (max {top})</text>'
           f'<g fill="#3b6ea5">{"".join(bars)}</g></svg>')
    return "data:image/svg+xml;charset=utf-8," + urllib.parse.quote(svg)


def _x(t: str) -> str:
    return t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


class Connections(Console):
    def on_get(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        _, body, _ = self.api(s, "GET", "/api/v1/connections", query={"limit": 1000})
        self.render(req, resp, "connections.html", s, items=body.get("items", []), result=None)

    def on_post(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        f = self.form(req, s)
        action = f.get("action")
        name = f.get("name", "")
        if action == "create":
            body = {"name": name, "db": f.get("db", "")}
            for k in ("host", "user", "password", "database"):
                if f.get(k):
                    body[k] = f[k]
            if f.get("port"):
                body["port"] = int(f["port"]) if f["port"].isdigit() else f["port"]
            st, out, _ = self.api(s, "POST", "/api/v1/connections", body)
            self.back(resp, "/console/connections", "Connection created." if st == 201 else _error_text(st, out))
        elif action == "test":
            st, out, _ = self.api(s, "POST", "/api/v1/connections/test", {"name": name})
            msg = f"{name}: reachable ({out.get('latency_ms')} ms)." if st == 200 else _error_text(st, out)
            self.back(resp, "/console/connections", msg)
        elif action in ("deactivate", "activate"):
            st, out, _ = self.api(s, "PATCH", f"/api/v1/connections/{urllib.parse.quote(name)}",
                                  {"active": action == "activate"})
            self.back(resp, "/console/connections", f"{name}: {action}d." if st == 200 else _error_text(st, out))
        elif action == "edit":
            changes = {k: f[k] for k in ("host", "user", "database") if f.get(k)}
            if f.get("password"):
                changes["password"] = f["password"]
            if f.get("port"):
                changes["port"] = int(f["port"]) if f["port"].isdigit() else f["port"]
            st, out, _ = self.api(s, "PATCH", f"/api/v1/connections/{urllib.parse.quote(name)}", changes)
            self.back(resp, "/console/connections", f"{name}: saved." if st == 200 else _error_text(st, out))
        else:
            self.back(resp, "/console/connections", "Unknown action.")


class Queries(Console):
    def on_get(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        _, body, _ = self.api(s, "GET", "/api/v1/queries", query={"limit": 1000})
        items = body.get("items", []) if isinstance(body, dict) else []
        search = (req.get_param("search") or "").strip().lower()
        if search:
            items = [q for q in items if search in q["name"].lower() or search in (q.get("description") or "").lower()
                     or search in (q.get("sql") or "").lower()]
        _, conns, _ = self.api(s, "GET", "/api/v1/connections", query={"limit": 1000})
        self.render(req, resp, "queries.html", s, items=items, search=search,
                    connections=[c["name"] for c in conns.get("items", [])])

    def on_post(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        f = self.form(req, s)
        body = {"name": f.get("name", ""), "connection_name": f.get("connection_name", ""), "sql": f.get("sql", ""),
                "description": f.get("description", ""), "publish": f.get("publish") == "on"}
        if f.get("parameters", "").strip():
            try:
                body["parameters"] = json.loads(f["parameters"])
            except ValueError:
                self.back(resp, "/console/queries", "parameters must be JSON, e.g. {\"id\": \"int\"}.")
                return
        st, out, _ = self.api(s, "POST", "/api/v1/queries", body)
        if st == 201:
            self.back(resp, f"/console/queries/{urllib.parse.quote(body['name'])}", "Query saved.")
        else:
            self.back(resp, "/console/queries", _error_text(st, out))


class QueryPage(Console):
    def on_get(self, req, resp, name):
        s = self.require(req, resp)
        if s is None:
            return
        qn = urllib.parse.quote(name)
        st, q, _ = self.api(s, "GET", f"/api/v1/queries/{qn}")
        if st != 200:
            self.error_page(req, resp, s, st, _error_text(st, q))
            return
        _, vs, _ = self.api(s, "GET", f"/api/v1/queries/{qn}/versions")
        versions = vs.get("items", []) if isinstance(vs, dict) else []
        a = _int(req.get_param("a"), len(versions) - 1 if len(versions) > 1 else 1)
        b = _int(req.get_param("b"), len(versions))
        by_no = {v["version"]: v for v in versions}
        diff = []
        if a in by_no and b in by_no:
            diff = list(difflib.unified_diff(by_no[a]["sql"].splitlines(), by_no[b]["sql"].splitlines(),
                                             f"version {a}", f"version {b}", lineterm=""))
        published = q.get("published_version")
        params = (by_no.get(published) or (versions[-1] if versions else {})).get("parameters") or {}
        self.render(req, resp, "query.html", s, q=q, versions=versions, diff=diff, a=a, b=b,
                    params=_param_fields(params), result=None)

    def on_post(self, req, resp, name):
        s = self.require(req, resp)
        if s is None:
            return
        f = self.form(req, s)
        qn = urllib.parse.quote(name)
        action = f.get("action")
        if action == "version":
            body = {"sql": f.get("sql", ""), "publish": f.get("publish") == "on"}
            if f.get("parameters", "").strip():
                try:
                    body["parameters"] = json.loads(f["parameters"])
                except ValueError:
                    self.back(resp, f"/console/queries/{qn}", "parameters must be JSON.")
                    return
            st, out, _ = self.api(s, "POST", f"/api/v1/queries/{qn}/versions", body)
            self.back(resp, f"/console/queries/{qn}", "New version saved." if st == 201 else _error_text(st, out))
        elif action == "publish":
            v = _int(f.get("version"), 0)
            st, out, _ = self.api(s, "POST", f"/api/v1/queries/{qn}/publish", {"version": v})
            self.back(resp, f"/console/queries/{qn}", f"Version {v} published." if st == 200 else _error_text(st, out))
        elif action == "try":
            given = {k[2:]: v for k, v in f.items() if k.startswith("p_") and v != ""}
            if f.get("version"):
                given["version"] = f["version"]
            t0 = time.perf_counter()
            st, out, headers = self.api(s, "GET", f"/q/{qn}", query=given)
            ms = (time.perf_counter() - t0) * 1000
            _, q, _ = self.api(s, "GET", f"/api/v1/queries/{qn}")
            _, vs, _ = self.api(s, "GET", f"/api/v1/queries/{qn}/versions")
            versions = vs.get("items", []) if isinstance(vs, dict) else []
            by_no = {v["version"]: v for v in versions}
            params = (by_no.get(q.get("published_version")) or (versions[-1] if versions else {})).get(
                "parameters") or {}
            rows = out if isinstance(out, list) else []
            result = {"status": st, "rows": rows, "columns": list(rows[0].keys()) if rows else [],
                      "error": "" if st == 200 else _error_text(st, out), "ms": round(ms, 2),
                      "timing": headers.get("server-timing", ""), "given": given}
            self.render(req, resp, "query.html", s, q=q, versions=versions, diff=[], a=0, b=0,
                        params=_param_fields(params, given), result=result)
        else:
            self.back(resp, f"/console/queries/{qn}", "Unknown action.")


def _int(v, default: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _param_fields(params: dict, given: dict | None = None) -> list[dict]:
    out = []
    for n, spec in (params or {}).items():
        spec = spec if isinstance(spec, dict) else {"type": spec}
        t = spec.get("type", "str")
        kind = {"int": "number", "integer": "number", "float": "number", "number": "number"}.get(t, "text")
        out.append({"name": n, "type": t, "kind": kind, "required": bool(spec.get("required", "default" not in spec)),
                    "enum": spec.get("enum"), "value": (given or {}).get(n, spec.get("default", "")),
                    "step": "any" if t in ("float", "number") else "1"})
    return out


class Keys(Console):
    def on_get(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        _, body, _ = self.api(s, "GET", "/api/v1/api-keys", query={"limit": 1000})
        self.render(req, resp, "keys.html", s, items=body.get("items", []), secret=None)

    def on_post(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        f = self.form(req, s)
        action, name = f.get("action"), f.get("name", "")
        kn = urllib.parse.quote(name)
        if action == "create":
            body: dict = {"name": name}
            for k in ("queries", "connections", "allowed_tables", "allowed_write_ops", "allowed_ips"):
                if f.get(k, "").strip():
                    body[k] = _lines(f[k])
            if f.get("mask", "").strip():
                rules = []
                for line in f["mask"].splitlines():
                    if line.strip():
                        col, _, act = line.strip().partition("=")
                        rules.append({"column": col.strip(), "action": act.strip() or "mask"})
                body["mask"] = rules
            body["allow_writes"] = f.get("allow_writes") == "on"
            for k in ("expires_at", "rate_limit", "quota", "description"):
                if f.get(k, "").strip():
                    body[k] = f[k].strip()
            for k in ("max_rows", "query_timeout", "max_concurrent"):  # numbers; a bad one: the API's 400 names it
                if f.get(k, "").strip():
                    text = f[k].strip()
                    try:
                        body[k] = float(text) if k == "query_timeout" else int(text)
                    except ValueError:
                        body[k] = text
            st, out, _ = self.api(s, "POST", "/api/v1/api-keys", body)
            if st == 201:
                _, lst, _ = self.api(s, "GET", "/api/v1/api-keys", query={"limit": 1000})
                # The secret is shown on this page only, once; it is never stored in clear.
                self.render(req, resp, "keys.html", s, items=lst.get("items", []), secret=out.get("secret"),
                            secret_name=name)
                return
            self.back(resp, "/console/keys", _error_text(st, out))
        elif action == "revoke":
            st, out, _ = self.api(s, "PATCH", f"/api/v1/api-keys/{kn}", {"active": False})
            self.back(resp, "/console/keys", f"{name}: revoked." if st == 200 else _error_text(st, out))
        elif action == "rotate":
            st, out, _ = self.api(s, "POST", f"/api/v1/api-keys/{kn}/rotate", {"grace_minutes": 0})
            if st == 200:
                _, lst, _ = self.api(s, "GET", "/api/v1/api-keys", query={"limit": 1000})
                self.render(req, resp, "keys.html", s, items=lst.get("items", []), secret=out.get("secret"),
                            secret_name=name)
                return
            self.back(resp, "/console/keys", _error_text(st, out))
        else:
            self.back(resp, "/console/keys", "Unknown action.")


class Runs(Console):
    FILTERS = ("query", "key", "status", "since", "until")

    def on_get(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        filters = {k: req.get_param(k) for k in self.FILTERS if req.get_param(k)}
        st, body, _ = self.api(s, "GET", "/api/v1/history", query={**filters, "limit": 100})
        items = body.get("items", []) if st == 200 else []
        self.render(req, resp, "runs.html", s, items=items, filters=filters,
                    error="" if st == 200 else _error_text(st, body))


class RunsTail(Console):
    """The live tail's data: the newest runs as JSON, for the page's script (same cookie, same origin)."""

    def on_get(self, req, resp):
        s = self.session(req)
        if s is None:
            raise ApiError(401, "unauthorized", "Sign in to the Console first.")
        st, body, _ = self.api(s, "GET", "/api/v1/history", query={"limit": 25})
        _headers(resp)
        resp.content_type = "application/json"
        resp.text = json.dumps(body if st == 200 else {"items": [], "error": _error_text(st, body)})


class Usage(Console):
    def on_get(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        per = req.get_param("per") or "hour"
        if per not in ("minute", "hour", "day"):
            per = "hour"
        q = {"per": per}
        for k in ("key", "query", "since", "until"):
            if req.get_param(k):
                q[k] = req.get_param(k)
        st, body, _ = self.api(s, "GET", "/api/v1/usage", query=q)
        items = body.get("items", []) if st == 200 else []
        if req.get_param("download") == "csv":
            import csv
            buf = io.StringIO()
            cols = sorted({k for i in items for k in i})
            w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\r\n")
            w.writeheader()
            w.writerows(items)
            _headers(resp)
            resp.content_type = "text/csv; charset=utf-8"
            resp.set_header("Content-Disposition", f'attachment; filename="usage-{per}.csv"')
            resp.text = buf.getvalue()
            return
        self.render(req, resp, "usage.html", s, items=items, per=per, params=q,
                    error="" if st == 200 else _error_text(st, body),
                    chart=_svg_bars([(i.get("period") or i.get("at") or "", i.get("calls", 0)) for i in items],
                                    f"calls per {per}"))


class Audit(Console):
    def on_get(self, req, resp):
        s = self.require(req, resp)
        if s is None:
            return
        st, body, _ = self.api(s, "GET", "/api/v1/audit")
        items = body.get("items", []) if isinstance(body, dict) else []
        self.render(req, resp, "audit.html", s, items=items, error="" if st == 200 else _error_text(st, body))


class Static:
    def on_get(self, req, resp, filename):
        if filename not in STATIC:
            raise ApiError(404, "not_found", f"There is no file /console/static/{filename}.")
        _headers(resp)
        resp.set_header("Cache-Control", "public, max-age=3600")
        resp.content_type = STATIC[filename]
        with open(os.path.join(HERE, "static", filename), "rb") as f:
            resp.data = f.read()


def register(app) -> None:
    f = app.falcon
    f.add_route("/console", Overview(app))
    f.add_route("/console/login", Login(app))
    f.add_route("/console/logout", Logout(app))
    f.add_route("/console/connections", Connections(app))
    f.add_route("/console/queries", Queries(app))
    f.add_route("/console/queries/{name}", QueryPage(app))
    f.add_route("/console/keys", Keys(app))
    f.add_route("/console/runs", Runs(app))
    f.add_route("/console/runs/tail", RunsTail(app))
    f.add_route("/console/usage", Usage(app))
    f.add_route("/console/audit", Audit(app))
    f.add_route("/console/static/{filename}", Static())


ROUTES = ("/console", "/console/login", "/console/logout", "/console/connections", "/console/queries",
          "/console/queries/{name}", "/console/keys", "/console/runs", "/console/runs/tail", "/console/usage",
          "/console/audit", "/console/static/{filename}")
