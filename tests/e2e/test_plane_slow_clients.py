"""End to end: a few slow clients must not hold the data plane's connections (issue 13): a client that sends its
request header slowly, or keeps a connection idle after its answer, is disconnected after QAG_HEADER_TIMEOUT,
as Python's workers disconnect them, while other callers are answered meanwhile."""
from __future__ import annotations

import socket
import time

import pytest
import requests

from tests.conftest import start_server

pytestmark = pytest.mark.usefixtures("plane")


def closed_by_server(socks: list, wait: float) -> int:
    """How many of socks the server closed within `wait` seconds in all (read to EOF or reset)."""
    import selectors
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + wait
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            try:
                data = key.fileobj.recv(4096)
            except BlockingIOError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            if not data:
                closed += 1
                sel.unregister(key.fileobj)
    sel.close()
    return closed


def test_slow_and_idle_clients_are_disconnected_and_others_served():
    srv = start_server({"QAG_HEADER_TIMEOUT": "1"}, args=("--workers", "1", "--plane", "--plane-threads", "1"))
    try:
        host, port = srv.base.removeprefix("http://").split(":")
        slow = []
        for _ in range(200):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the header
            slow.append(s)
        t0 = time.monotonic()
        assert requests.get(srv.base + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 2, "another caller waited on the slow ones"
        idle = socket.create_connection((host, int(port)), timeout=5)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)
        closed = closed_by_server(slow, 3.0)
        assert closed == len(slow), f"{len(slow) - closed} slow clients still held a connection"
        assert closed_by_server([idle], 3.0) == 1, "an idle kept-alive connection was held past the header timeout"
        for s in slow + [idle]:
            s.close()
        assert requests.get(srv.base + "/health", timeout=5).status_code == 200
    finally:
        srv.stop()
