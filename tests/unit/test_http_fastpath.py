"""qag's worker reads the common request itself (qag/server/fasthttp.py) instead of through gunicorn's parser and
wsgi.create: for every request of a corpus (hand-picked edge cases and a seeded generator of variations), either
the fast path declines it, leaving the buffer as it was, or

- the environ it builds equals gunicorn's (`http.get_parser` + `wsgi.create` over a socketpair) key for key, with
  wsgi.input compared by what the same sequence of read/readline/readlines calls returns, and
- through the worker's handle() (qag/server/gworker.py), the application sees the same environ, the bytes written
  on the socket are the same (status line, headers, Date, Connection, chunked framing, HEAD and 204/304 without
  body), handle() decides the same keep-alive, and the same bytes are left for the next request,

under gunicorn's default limits, qag serve's settings and small limits. The cases that must take the fast path
are checked to take it, so a fast path that declined everything would fail too."""
from __future__ import annotations

import random
import socket
import sys

import pytest
from gunicorn import http
from gunicorn import util as gutil
from gunicorn.config import Config
from gunicorn.glogging import Logger
from gunicorn.http import wsgi
from gunicorn.workers.gthread import TConn

from qag.server import fasthttp, gworker

CLIENT = ("127.0.0.1", 40000)
SERVER = ("127.0.0.1", 8080)
DATE = "Sun, 06 Dec 2026 08:00:00 GMT"


def _cfg(**settings):
    cfg = Config()
    for k, v in settings.items():
        cfg.set(k, v)
    gworker._freeze(cfg)
    return cfg


CONFIGS = {
    "gunicorn": {},
    "qag-serve": {"limit_request_line": 0, "limit_request_field_size": 65536},  # qag/server/serve.py
    "small": {"limit_request_line": 60, "limit_request_fields": 6, "limit_request_field_size": 64},
}


# -- the application: answers chosen by the request, reads wsgi.input, records what it saw ------------------
INPUT_OPS = (("readline", ()), ("read", (3,)), ("readline", (4,)), ("read", (0,)), ("readlines", ()), ("read", ()))


def _snapshot(env, sock):
    """The environ as compared: identity-bound entries by what they are, wsgi.input by what reading gives."""
    out = {}
    for k, v in env.items():
        if k == "wsgi.input":
            out[k] = [getattr(v, op)(*args) for op, args in INPUT_OPS]
        elif k == "wsgi.errors":
            out[k] = (isinstance(v, wsgi.WSGIErrorsWrapper), [id(s) for s in v.streams])
        elif k == "wsgi.early_hints":
            out[k] = v.__qualname__
        elif k == "gunicorn.socket":
            out[k] = v is sock
        else:
            out[k] = v
    return out


ANSWERS = [
    ("200 OK", [("Content-Type", "application/json"), ("X-Request-Id", "abc"), ("Content-Length", "11")],
     [b'{"rows":[]}']),
    ("200 OK", [("Content-Type", "text/plain")], [b"chunk one ", b"", b"chunk two"]),  # no length: chunked / close
    ("204 No Content", [("X-A", "1")], []),
    ("304 Not Modified", [("ETag", '"x"'), ("Content-Length", "5")], []),
    ("404 Not Found", [("content-type", "application/json"), ("content-length", "2"),
                       ("Connection", "close")], [b"{}"]),
    ("200 OK", [("Content-Length", "4"), ("Server-Timing", "auth;dur=0.05, plan;dur=0.01")], [b"ab", b"cd"]),
    ("400 Bad Request", [("Content-Length", "3"), ("X-Empty", ""), ("X-Pad", " padded\t")], [b"bad"]),
    ("500 Internal Server Error", [("Content-Length", "1")], None),  # the application raises: handle_error's 500
]


class App:
    def __init__(self, sock):
        self.sock = sock
        self.seen = []

    def __call__(self, env, start_response):
        self.seen.append(_snapshot(env, self.sock))
        status, headers, body = ANSWERS[sum(env["RAW_URI"].encode("latin-1")) % len(ANSWERS)]
        start_response(status, list(headers))
        if body is None:
            raise RuntimeError("the application failed")
        return list(body)


# -- the two ways ---------------------------------------------------------------------------------------------
def _pair():
    a, b = socket.socketpair()
    a.settimeout(2)
    b.settimeout(2)
    return a, b


def _drain(sock) -> bytes:
    sock.setblocking(False)
    out = b""
    try:
        while True:
            got = sock.recv(1 << 20)
            if not got:
                break
            out += got
    except BlockingIOError:
        pass
    sock.settimeout(2)
    return out


LOGS: dict = {}


def _log(cfg):
    """One Logger per configuration, made before anything is compared: each Logger adds handlers to
    gunicorn.error, whose streams wsgi.errors lists."""
    log = LOGS.get(id(cfg))
    if log is None:
        log = LOGS[id(cfg)] = (cfg, Logger(cfg))
    return log[1]


def _worker(cfg, app, fast):
    w = gworker.QagWorker.__new__(gworker.QagWorker)
    w.cfg, w.log, w.wsgi, w.nr, w.max_requests, w.alive = cfg, _log(cfg), app, 0, sys.maxsize, True
    w.send_timeout = 2.0
    w.pre_hook, w.post_hook, w.timed = gworker._hooks(cfg, w.log)
    w.fast = fasthttp.FastHead(cfg) if fast else None
    return w


def _conn(cfg, sock, raw):
    conn = TConn(cfg, sock, CLIENT, SERVER)
    sock.settimeout(2)
    conn.buf = bytearray(raw)
    conn.too_many = conn.close_after = conn.continued = conn.closing = False
    return conn


def gunicorn_environ(cfg, raw):
    """gunicorn's own reading of `raw`: its parser and wsgi.create, over a socketpair."""
    a, b = _pair()
    try:
        parser = http.get_parser(cfg, a, CLIENT)
        parser.unreader.unread(raw)
        req = next(parser)
        resp, env = wsgi.create(req, a, CLIENT, SERVER, cfg, gworker.QagResponse)
        env["wsgi.multithread"] = True  # as the worker's handle_request sets it
        return _snapshot(env, a)
    finally:
        a.close()
        b.close()


def served(cfg, raw, fast):
    """(what the application saw, the bytes written back, handle()'s answer, the bytes left for what follows)."""
    a, b = _pair()
    try:
        app = App(a)
        w = _worker(cfg, app, fast)
        conn = _conn(cfg, a, raw)
        keep = w.handle(conn)
        rest = bytes(conn.buf)
        return app.seen, _drain(b), keep, rest
    finally:
        a.close()
        b.close()


@pytest.fixture(autouse=True)
def fixed_date(monkeypatch):
    monkeypatch.setattr(gutil, "http_date", lambda timestamp=None: DATE)


def check(cfg, raw: bytes) -> bool:
    """True when the fast path took `raw` (and did what gunicorn does), False when it declined."""
    _log(cfg)
    fh = fasthttp.FastHead(cfg)
    a, b = _pair()
    try:
        probe = _conn(cfg, a, raw)
        got = fh.parse(probe)
    finally:
        a.close()
        b.close()
    if isinstance(got, str):
        assert bytes(probe.buf) == raw, "a declined request must leave the buffer as it was"
        return False
    want_env = gunicorn_environ(cfg, raw)  # raises if gunicorn refuses what the fast path took
    fast = served(cfg, raw, True)
    slow = served(cfg, raw, False)
    assert len(fast[0]) == 1 and len(slow[0]) == 1, (raw, fast, slow)
    want_env = dict(want_env, **{"wsgi.early_hints": slow[0][0]["wsgi.early_hints"]})
    assert slow[0][0] == want_env, raw
    assert fast[0][0] == want_env, raw
    assert fast[1:3] == slow[1:3], raw
    if slow[2] is True:  # what follows is read next on a kept-alive connection (a closed one drops it)
        assert fast[3] == slow[3], raw
    return True


# -- the corpus ------------------------------------------------------------------------------------------------
TAKEN = [  # the common request: the fast path must take each of these, under every configuration
    b"GET /q/account?aid=5 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: oha/1.16.0\r\nAccept: */*\r\n"
    b"X-API-Key: qag_abc\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",
    b"HEAD /q/a HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /q/a HTTP/1.0\r\n\r\n",
    b"GET /q/a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"GET /q/a HTTP/1.1\r\nConnection: close\r\n\r\n",
    b"GET /q/a HTTP/1.1\r\nconnection:   Keep-Alive \t\r\n\r\n",
    b"GET /q/a HTTP/1.1\r\nConnection: upgrade\r\nConnection: close\r\n\r\n",
    b"GET /q/a?x=%41%e9+b&y=a%2Fb HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /q/%41%20b/%zz HTTP/1.1\r\n\r\n",
    b"GET //q//a?b=//c HTTP/1.1\r\n\r\n",
    b"GET /a#frag?x=1 HTTP/1.1\r\n\r\n",
    b"GET /a?x=1#frag HTTP/1.1\r\n\r\n",
    b"GET /a? HTTP/1.1\r\n\r\n",
    b"GET /a:b@c;d HTTP/1.1\r\n\r\n",
    b"GET /q/a HTTP/1.1\r\nX-Dup: one\r\nx-dup: two\r\nX-DUP:three \r\n\r\n",
    b"GET /q/a HTTP/1.1\r\nAccept: a\r\nAccept:\r\nAccept: b\r\n\r\n",
    b"GET /q/a HTTP/1.1\r\nX-Latin: caf\xe9 \x80\xff\r\nX-Tab: a\tb\r\nX-Empty:\r\nX-Spaces:    \r\n\r\n",
    b"POST /api/v1/queries HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n"
    b'{"a":1}\nline2',
    b"POST /x HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    b"PUT /x HTTP/1.1\r\nContent-Length: 007\r\n\r\nabcdefgEXTRA",
    b"DELETE /x HTTP/1.1\r\n\r\nGET /next HTTP/1.1\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: x\r\n\r\nGET /y HTTP/1.1\r\nHost: y\r\n\r\nGET /z HTTP/1.1",
    b"OPTIONS /x HTTP/1.1\r\n\r\n",
    b"PATCH /x HTTP/1.0\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\nabc",
    b"GET /x HTTP/1.1\r\nX-Forwarded-For: 10.0.0.1\r\nForwarded: for=1.2.3.4\r\n\r\n",
    b"GET /x HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
]
DECLINED = [  # left to gunicorn: it refuses some of these, reads others its own way
    b"GET http://h/x HTTP/1.1\r\n\r\n",  # absolute form
    b"OPTIONS * HTTP/1.1\r\n\r\n",
    b"CONNECT h:443 HTTP/1.1\r\n\r\n",
    b"CONNECT /x HTTP/1.1\r\n\r\n",
    b"get /x HTTP/1.1\r\n\r\n",
    b"M-SEARCH /x HTTP/1.1\r\n\r\n",
    b"GET /x HTTP/1.2\r\n\r\n",
    b"GET /x HTTP/2.0\r\n\r\n",
    b"GET /x http/1.1\r\n\r\n",
    b"GET  /x HTTP/1.1\r\n\r\n",
    b"GET /x  HTTP/1.1\r\n\r\n",
    b"GET /x HTTP/1.1 \r\n\r\n",
    b"\r\nGET /x HTTP/1.1\r\n\r\n",
    b"GET /\xe9 HTTP/1.1\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX_Under: 1\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-Fold: a\r\n b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-A : b\r\n\r\n",
    b"GET /x HTTP/1.1\r\n: b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-Nul: a\x00b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-Ctl: a\x01b\x7f\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-Lf: a\nb\r\n\r\n",
    b"GET /x HTTP/1.1\nHost: x\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET /x HTTP/1.1\r\nContent-Type: a\r\ncontent-type: a\r\n\r\n",
    b"POST /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\na",
    b"POST /x HTTP/1.1\r\nContent-Length: +1\r\n\r\na",
    b"POST /x HTTP/1.1\r\nContent-Length: \xb2\r\n\r\naa",
    b"POST /x HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort",
    b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\na",
    b"GET /x HTTP/1.1\r\nX-Forwarded-Proto: https\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-FORWARDED-SSL: on\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: x\r\n",  # no end of head
    b"POST /x HTTP/1.1\r\nContent-Length: 70000\r\n\r\n" + b"a" * 70000,
]


def test_the_common_requests_take_the_fast_path_and_match_gunicorn():
    for name, settings in CONFIGS.items():
        cfg = _cfg(**settings)
        for raw in TAKEN:
            assert check(cfg, raw), (name, raw)


def test_what_the_fast_path_leaves_to_gunicorn():
    for settings in CONFIGS.values():
        cfg = _cfg(**settings)
        for raw in DECLINED:
            assert not check(cfg, raw), raw


def test_limits_are_gunicorns():
    """Near each limit: under it the fast path takes the request as gunicorn does, past it gunicorn answers."""
    cfg = _cfg(**CONFIGS["small"])  # request line 60, 6 fields, 64 bytes a field line
    line = b"GET /" + b"a" * (60 - len(b"GET / HTTP/1.1")) + b" HTTP/1.1\r\n"
    assert len(line) == 62
    assert check(cfg, line + b"\r\n")
    assert not check(cfg, line.replace(b"/a", b"/aa") + b"\r\n")
    six = b"".join(b"X-%d: v\r\n" % i for i in range(6))
    assert check(cfg, b"GET / HTTP/1.1\r\n" + six + b"\r\n")
    assert not check(cfg, b"GET / HTTP/1.1\r\n" + six + b"X-6: v\r\n\r\n")
    field = b"X-Long: " + b"v" * (62 - len(b"X-Long: ")) + b"\r\n"  # 62 + CRLF = 64: at the limit
    assert check(cfg, b"GET / HTTP/1.1\r\n" + field + b"\r\n")
    assert not check(cfg, b"GET / HTTP/1.1\r\n" + field.replace(b"X-Long", b"X-Longer") + b"\r\n")


def _generated(rnd: random.Random) -> bytes:
    method = rnd.choice(["GET"] * 6 + ["HEAD", "POST", "PUT", "DELETE", "OPTIONS", "get", "CONNECT", "PROPFIND"])
    seg = lambda: "".join(rnd.choice(["a", "Z", "0", "-", ".", "_", "~", "%41", "%e9", "%2F", "%zz", "+", ":",
                                      "@", "!", "$", "'", "(", ";", ","]) for _ in range(rnd.randint(0, 6)))
    path = "/" + "/".join(seg() for _ in range(rnd.randint(0, 3)))
    if rnd.random() < 0.15:
        path = "/" + path
    if rnd.random() < 0.6:
        path += "?" + "&".join(f"{seg()}={seg()}" for _ in range(rnd.randint(0, 3)))
    if rnd.random() < 0.1:
        path += "#" + seg()
    if rnd.random() < 0.05:
        path = rnd.choice(["http://h" + path, "*", "", "h:80", "/\x7f", "/a b"])
    version = rnd.choice(["HTTP/1.1"] * 5 + ["HTTP/1.0"] * 2 + ["HTTP/2.0", "HTTP/1.1 "])
    lines = [f"{method} {path} {version}".encode("latin-1")]
    names = ["Host", "host", "HOST", "Accept", "User-Agent", "X-API-Key", "x-api-key", "Authorization", "X-Dup",
             "x-dup", "Connection", "connection", "Accept-Encoding", "Cookie", "Content-Type", "X-Forwarded-For",
             "Keep-Alive", "TE"]
    rare = ["X_Under", "Expect", "Transfer-Encoding", "X-Forwarded-Proto"]  # each declined
    values = ["x", "127.0.0.1:8080", "*/*", "close", "keep-alive", "Keep-Alive", "upgrade", "close, foo",
              "application/json", "a, b", "", "100-continue", "chunked", "https", "caf\xe9", "\x80\xff", "a\tb",
              "q=0.5;x=\"y\""]
    body = b""
    for _ in range(rnd.randint(0, 7)):
        value = rnd.choice(values) if rnd.random() > 0.02 else "a\x01b"
        pad = lambda: rnd.choice(["", "", " ", "  ", "\t", " \t"])
        name = rnd.choice(names) if rnd.random() > 0.03 else rnd.choice(rare)
        lines.append(f"{name}:{pad()}{value}{pad()}".encode("latin-1"))
    if method in ("POST", "PUT") or rnd.random() < 0.1:
        body = bytes(rnd.choice(b"ab\n{}:,") for _ in range(rnd.randint(0, 40)))
        length = rnd.choice([str(len(body))] * 6 + [str(len(body) + 3), "0" + str(len(body)), "-1", " 4"])
        lines.append(f"Content-Length: {length}".encode())
        if rnd.random() < 0.05:
            lines.append(f"content-length: {length}".encode())
    if rnd.random() < 0.05:
        lines.insert(rnd.randint(1, len(lines)), b" folded")
    raw = b"\r\n".join(lines) + b"\r\n\r\n" + body
    if rnd.random() < 0.3:
        raw += b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n"
    return raw


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_generated_requests_match_gunicorn(config):
    cfg = _cfg(**CONFIGS[config])
    rnd = random.Random(19)
    taken = 0
    n = 1500
    for _ in range(n):
        taken += check(cfg, _generated(rnd))
    assert n // 3 < taken < n - n // 10, f"{taken} of {n} generated requests took the fast path"
