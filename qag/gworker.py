"""qag's gunicorn worker class: gthread's HTTP handling with a cheaper hand-off between the event loop and
the threads.

gunicorn's `gthread` worker pays, for every request on a kept-alive connection, an epoll unregister, a
`Future`, a wake-up byte through a pipe back to the main thread and an epoll register: about a third of a
worker's CPU on a primary-key lookup (bench/results, "where the time goes"). This worker keeps every
connection registered once with `EPOLLONESHOT`; the main thread puts a readable connection on a queue,
a thread serves it with gthread's own `handle` (the same parser, limits, keep-alive and error rules) and
re-arms it itself. A new connection waits in epoll, not in a thread, until its first bytes arrive, so a
slow client holds no thread.
"""
from __future__ import annotations

import errno
import os
import queue
import select
import socket
import threading
import time

from gunicorn import util as gutil
from gunicorn.http import message as gmessage
from gunicorn.workers import gthread
from gunicorn.workers.gthread import TConn, ThreadWorker

_EV_CONN = select.EPOLLIN | select.EPOLLONESHOT | select.EPOLLRDHUP
_STOP = object()


def _freeze(cfg) -> None:
    """gunicorn reads every setting through `Config.__getattr__` (a dict lookup and a call, a dozen times
    a request). A worker's settings don't change after it forked (a reload forks new workers), so copy
    each value onto the instance, where a plain attribute lookup finds it first."""
    for name, setting in cfg.settings.items():
        cfg.__dict__[name] = setting.get()


def _cache_per_worker() -> None:
    """Two per-request computations with per-worker answers: the Date header (formatted once a second,
    not once a response) and whether a peer address is in forwarded_allow_ips (parsed by `ipaddress` on
    every request; the lists are fixed once the worker runs, so the answer per address is too)."""
    fmt = gutil.http_date
    last = [0, ""]

    def http_date(timestamp=None):
        if timestamp is not None:
            return fmt(timestamp)
        now = int(time.time())
        if now != last[0]:
            last[1] = fmt(now)
            last[0] = now
        return last[1]
    gutil.http_date = http_date

    check = getattr(gmessage, "_ip_in_allow_list", None)
    if check is not None:
        seen: dict = {}

        def ip_in_allow_list(ip_str, allow_list, networks):
            k = (ip_str, id(allow_list), id(networks))
            hit = seen.get(k)
            if hit is None:
                if len(seen) > 4096:
                    seen.clear()
                hit = seen[k] = check(ip_str, allow_list, networks)
            return hit
        gmessage._ip_in_allow_list = ip_in_allow_list


class QagWorker(ThreadWorker):
    """`worker_class = "qag.gworker.QagWorker"`; `threads` threads serve, the main thread only waits."""

    def init_process(self):
        _freeze(self.cfg)
        _cache_per_worker()
        self.ep = select.epoll()
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        self.conns: dict[int, TConn] = {}  # fd -> connection, busy or idle
        self.listen_fds: dict[int, socket.socket] = {}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()  # guards self.conns: threads drop closed connections, the loop adds
        self.poller = None  # gthread's selector is not used
        self.tpool = None
        # base.Worker.init_process ends by calling run(); it also installs the signal handlers.
        super(ThreadWorker, self).init_process()

    # -- the threads -------------------------------------------------------------------------------------
    def _serve(self):
        get = self.work.get
        while True:
            conn = get()
            if conn is _STOP:
                return
            try:
                keep = self.handle(conn)
                # A request read ahead (pipelining, or a body drain that read into the next request) is
                # already in the parser's buffer: serve it here, the socket won't signal it again.
                while keep is True and self.alive and conn.parser is not None and conn.parser.unreader.buf.getvalue():
                    keep = self.handle(conn)
            except BaseException:  # handle() logs what it can; never lose the thread
                keep = False
            if keep is True or keep is gthread._DEFER:
                conn.timeout = time.monotonic() + (self.cfg.keepalive if keep is True
                                                   else gthread.DEFAULT_WORKER_DATA_TIMEOUT)
                conn.busy = False
                if not self.alive and keep is True:
                    conn.timeout = min(conn.timeout, time.monotonic() + gthread.STOP_KEEPALIVE_LINGER)
                try:
                    self.ep.modify(conn.sock.fileno(), _EV_CONN)
                    continue
                except (OSError, ValueError):
                    pass
            self._drop(conn, graceful=keep is not None)

    def _drop(self, conn, graceful: bool = False):
        fd = getattr(conn, "fd", None)
        with self.lock:
            mine = fd is not None and self.conns.get(fd) is conn
            if mine:
                del self.conns[fd]
                try:
                    self.ep.unregister(fd)  # before close: the fd number may be reused at once
                except (OSError, ValueError):
                    pass
                self.nr_conns = len(self.conns)
        try:
            conn.close(graceful=graceful)
        except OSError:
            pass

    # -- the main thread ---------------------------------------------------------------------------------
    def _accept(self, listener):
        """One connection per readiness event, as gthread does: every worker waits on the same listening
        socket, and taking the whole backlog at once would give one worker every connection of a burst."""
        try:
            sock, addr = listener.accept()
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED):
                return
            raise
        conn = TConn(self.cfg, sock, addr, listener.getsockname())
        sock.setblocking(True)  # TConn made it non-blocking for gthread's selector; epoll doesn't need that
        conn.fd = sock.fileno()
        conn.busy = False
        conn.timeout = time.monotonic() + gthread.DEFAULT_WORKER_DATA_TIMEOUT
        with self.lock:
            self.conns[conn.fd] = conn
            self.nr_conns = len(self.conns)
            self.ep.register(conn.fd, _EV_CONN)
        if self.nr_conns >= self.worker_connections:
            self._set_accepting(False)

    def _set_accepting(self, on: bool):
        if on == self._accepting:
            return
        for fd, listener in self.listen_fds.items():
            if on:
                self.ep.register(fd, select.EPOLLIN)
            else:
                try:
                    self.ep.unregister(fd)
                except (OSError, ValueError):
                    pass
        self._accepting = on

    def _expire(self, now: float, force: bool = False):
        """Close idle connections past their keep-alive (or first-byte) deadline."""
        with self.lock:
            idle = [c for c in self.conns.values() if not c.busy and (force or c.timeout <= now)]
        for conn in idle:
            self._drop(conn)

    def _dispatch(self, timeout: float):
        try:
            events = self.ep.poll(timeout)
        except InterruptedError:
            return
        for fd, ev in events:
            listener = self.listen_fds.get(fd)
            if listener is not None:
                self._accept(listener)
                continue
            conn = self.conns.get(fd)
            if conn is None:
                continue
            conn.busy = True
            conn.data_ready = True  # readable (or hung up): handle() needn't wait for it
            self.work.put(conn)

    def run(self):
        for s in self.sockets:
            s.setblocking(False)
            self.listen_fds[s.fileno()] = s
        self._accepting = False
        self._set_accepting(True)
        for i in range(self.cfg.threads):
            t = threading.Thread(target=self._serve, name=f"qag-http-{i}", daemon=True)
            t.start()
            self.threads.append(t)
        last_expire = time.monotonic()
        while self.alive:
            self.notify()
            if not self._accepting and self.nr_conns < self.worker_connections:
                self._set_accepting(True)
            self._dispatch(1.0)
            now = time.monotonic()
            if now - last_expire >= 0.5:
                self._expire(now)
                last_expire = now
            if not self.is_parent_alive():
                break
        # Graceful stop: no new connections; idle ones linger briefly, busy ones get the grace period.
        self._set_accepting(False)
        deadline = time.monotonic() + self.cfg.graceful_timeout
        linger = time.monotonic() + gthread.STOP_KEEPALIVE_LINGER
        for c in list(self.conns.values()):
            c.timeout = min(c.timeout, linger)
        while self.conns and time.monotonic() < deadline:
            self.notify()
            self._dispatch(0.2)
            self._expire(time.monotonic())
        self._expire(time.monotonic(), force=True)
        for _ in self.threads:
            self.work.put(_STOP)
        for s in self.sockets:
            s.close()
        self.ep.close()

    def handle_exit(self, sig, frame):
        self.alive = False  # the main loop sees it within its poll timeout (1 s at most)

    def handle_quit(self, sig, frame):
        super(ThreadWorker, self).handle_quit(sig, frame)
