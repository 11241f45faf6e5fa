"""End to end: qag's gunicorn worker class (qag/server/gworker.py) keeps gthread's HTTP behaviour: keep-alive,
pipelining, idle connections that hold no thread, idle time-outs, a graceful stop that finishes what is in
flight; and QAG_HTTP_WORKER=gthread still selects gunicorn's own worker."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest
import requests

from tests.conftest import pg_fresh_db, start_server

J = {"Content-Type": "application/json"}


def worker_class(srv) -> str:
    for line in open(srv.log_path):
        if "Using worker:" in line:
            return line.rsplit(":", 1)[1].strip()
    return ""


def raw(srv) -> socket.socket:
    host, port = srv.base.rsplit("/", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def read_responses(s: socket.socket, n: int) -> list[bytes]:
    """n HTTP/1.1 responses with Content-Length bodies off one socket."""
    buf, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"connection closed after {len(out)} responses"
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(buf) < length:
            buf += s.recv(65536)
        out.append(head + b"\r\n\r\n" + buf[:length])
        buf = buf[length:]
    return out


@pytest.fixture(scope="module")
def srv():
    s = start_server({"QAG_LOG_LEVEL": "info"}, args=("--workers", "1", "--threads", "2"))
    yield s
    s.stop()


def test_qag_worker_is_the_default(srv):
    assert worker_class(srv) == "qag.server.gworker.QagWorker"


def test_keepalive_and_pipelined_requests_on_one_connection(srv):
    s = raw(srv)
    try:
        for _ in range(50):  # one after another on one connection
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            (resp,) = read_responses(s, 1)
            assert resp.startswith(b"HTTP/1.1 200"), resp[:80]
        # three requests in one write: every one answered, in order
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        r = read_responses(s, 3)
        assert [x.split(b" ", 2)[1] for x in r] == [b"200", b"404", b"200"]
    finally:
        s.close()


def test_pipelined_fast_and_gunicorn_read_requests_on_one_connection(srv):
    """The worker reads the common request itself (qag/server/fasthttp.py) and leaves the others to gunicorn's
    parser: one connection carrying both kinds, pipelined in one write (a body, HEAD, HTTP/1.0 keep-alive, an
    absolute-form target and a forwarded-scheme header for gunicorn), gets every answer in order, each with its
    Connection header, and is closed after the request that asks for it."""
    key = srv.admin["X-API-Key"]
    body = json.dumps({"name": "cpipe", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                       "user": "postgres", "database": "postgres"}).encode()
    reqs = [
        (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200", b"keep-alive"),
        (b"GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200", b"keep-alive"),  # gunicorn's
        (f"POST /api/v1/connections HTTP/1.1\r\nHost: x\r\nX-API-Key: {key}\r\nContent-Type: application/json"
         f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body, b"HTTP/1.1 201", b"keep-alive"),
        (b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200", b"keep-alive"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Forwarded-Proto: https\r\n\r\n", b"HTTP/1.1 200",
         b"keep-alive"),  # gunicorn's
        (b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", b"HTTP/1.0 200", b"keep-alive"),
        (f"GET /api/v1/connections HTTP/1.1\r\nHost: x\r\nx-api-key:  {key} \r\n\r\n".encode(), b"HTTP/1.1 200",
         b"keep-alive"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", b"HTTP/1.1 200", b"close"),
    ]
    s = raw(srv)
    try:
        s.sendall(b"".join(r for r, _, _ in reqs))
        buf = b""
        for r, status, connection in reqs:
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                assert chunk, f"closed before the answer to {r[:40]!r}"
                buf += chunk
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            assert lines[0].startswith(status), (r[:40], head)
            fields = {k.strip().lower(): v.strip() for k, v in (x.split(b":", 1) for x in lines[1:])}
            assert fields[b"connection"] == connection, (r[:40], head)
            length = 0 if r.startswith(b"HEAD") else int(fields[b"content-length"])
            while len(buf) < length:
                buf += s.recv(65536)
            answer, buf = buf[:length], buf[length:]
            if b"/api/v1/connections HTTP" in r and r.startswith(b"GET"):
                assert b'"cpipe"' in answer, answer[:300]
        s.settimeout(5)
        assert buf == b"" and s.recv(65536) == b"", "the connection stays open after Connection: close"
    finally:
        s.close()


def test_idle_connections_hold_no_thread(srv):
    """Connections that never send a byte wait in epoll: with 2 threads, 6 of them don't delay a call
    (gthread would hold a thread up to 5 s for each one that sends nothing)."""
    idle = [raw(srv) for _ in range(6)]
    try:
        time.sleep(0.2)
        t = time.monotonic()
        for _ in range(5):
            assert requests.get(srv.base + "/health", timeout=10).status_code == 200
        assert time.monotonic() - t < 3
    finally:
        for s in idle:
            s.close()


def test_post_body_sent_in_pieces(srv):
    body = json.dumps({"name": "c1", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                       "user": "postgres", "database": "postgres"}).encode()
    s = raw(srv)
    try:
        head = (f"POST /api/v1/connections HTTP/1.1\r\nHost: x\r\nX-API-Key: {srv.admin['X-API-Key']}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        s.sendall(head + body[:10])
        time.sleep(0.3)
        s.sendall(body[10:])
        (resp,) = read_responses(s, 1)
        assert resp.startswith(b"HTTP/1.1 201"), resp[:300]
    finally:
        s.close()


def test_idle_keepalive_connection_is_closed():
    srv = start_server(args=("--workers", "1"))
    s = raw(srv)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        read_responses(s, 1)
        s.settimeout(15)
        t = time.monotonic()
        assert s.recv(100) == b""  # closed by the server after its keep-alive time (5 s)
        assert 3 < time.monotonic() - t < 12
    finally:
        s.close()
        srv.stop()


def test_graceful_stop_finishes_calls_in_flight():
    dsn_db = "qag_core_gworker"
    pg_fresh_db(dsn_db)
    srv = start_server(args=("--workers", "1"))
    adm = {**srv.admin, **J}
    assert requests.post(srv.base + "/api/v1/connections", headers=adm, data=json.dumps(
        {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "postgres",
         "database": dsn_db})).status_code == 201
    assert requests.post(srv.base + "/api/v1/queries", headers=adm, data=json.dumps(
        {"name": "slow", "connection_name": "pg", "sql": "SELECT 7 AS n FROM pg_sleep(1.5)",
         "publish": True})).status_code == 201
    out = {}

    def call():
        out["r"] = requests.get(srv.base + "/q/slow", headers=srv.admin, timeout=30)
    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert out["r"].status_code == 200 and out["r"].json() == [{"n": 7}]
    assert srv.proc.wait(30) == 0


def test_gthread_still_selectable():
    srv = start_server({"QAG_HTTP_WORKER": "gthread", "QAG_LOG_LEVEL": "info"}, args=("--workers", "1"))
    try:
        assert worker_class(srv) == "gthread"
        assert requests.get(srv.base + "/health").status_code == 200
    finally:
        srv.stop()


def test_expect_100_continue_gets_its_interim_answer(srv):
    """The worker reads bodies itself before a thread is committed: a client waiting for `100 Continue`
    gets it from there (once), then its answer."""
    body = json.dumps({"name": "c100", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                       "user": "postgres", "database": "postgres"}).encode()
    s = raw(srv)
    try:
        s.sendall((f"POST /api/v1/connections HTTP/1.1\r\nHost: x\r\nX-API-Key: {srv.admin['X-API-Key']}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                   "Expect: 100-continue\r\n\r\n").encode())
        s.settimeout(3)
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        (resp,) = read_responses(s, 1)
        assert resp.startswith(b"HTTP/1.1 201"), resp[:200]
        assert b"100 Continue" not in resp
    finally:
        s.close()
