"""/events subscribers off the request threads: one thread per worker multiplexes every subscriber's socket.

A subscriber mostly waits. Served by a request thread (as gthread must), 8–12 idle subscribers held every
thread of a worker (issue 13 item 2). qag's worker hands a subscriber's connection over once the response
head is sent (`Subscription.qag_detach`); from then on the hub polls the run store for it, writes without
blocking, and drops it when it closes, stops reading (its unsent output passes MAX_BUFFERED bytes, or
nothing could be sent for QAG_SEND_TIMEOUT), its key is revoked, or its `limit` is reached.
"""
from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time

from qag.errors import ApiError

log = logging.getLogger("qag.events")

KEEPALIVE_S = 15.0
POLL_S = 0.1
MAX_BUFFERED = 1 << 20
RETRY = b"retry: 1000\n\n"


class Feed:
    """One subscriber's position in the run store and what it may see."""

    def __init__(self, *, store, auth, secret, addr, admin: bool, key_name, last: int, limit_total: int, release,
                 bearer: str | None = None, not_before: str | None = None):
        self.store, self.auth, self.secret, self.addr = store, auth, secret, addr
        self.bearer = bearer  # a signed-in subscriber's Authorization header, checked again as the key is
        self.not_before = not_before  # a key's created_at: runs recorded under its name before it are not its own
        self.admin, self.key_name, self.last, self.limit_total = admin, key_name, last, limit_total
        self.sent = 0
        self.quiet_since = time.monotonic()
        self._release = release
        self._released = False

    def step(self) -> tuple[bytes, bool, bool]:
        """(bytes to send, whether events came, whether the feed is finished)."""
        # a revoked key's or administrator token's (an expired token's, a deleted role's) stream ends at once
        try:
            if self.bearer is not None:
                self.auth.authenticate_caller(None, self.bearer, self.addr)
            elif not self.auth.authenticate(self.secret, self.addr).admin and self.admin:
                return b"", False, True
        except ApiError:
            return b"", False, True
        batch = self.store.events_after(self.last, self.key_name, 1000)
        if batch:
            out = []
            for ev in batch:
                self.last = ev["event_id"]
                if self.not_before and (ev.get("at") or "") < self.not_before:
                    continue  # a run of an earlier key of the same name, deleted since: not this key's
                out.append(f"id: {ev['event_id']}\nevent: run\ndata: {json.dumps(ev)}\n\n")
                self.sent += 1
                if self.limit_total and self.sent >= self.limit_total:
                    return "".join(out).encode(), True, True
            if not out:
                return b"", True, False
            self.quiet_since = time.monotonic()
            return "".join(out).encode(), True, False
        if time.monotonic() - self.quiet_since >= KEEPALIVE_S:
            self.quiet_since = time.monotonic()
            return b": keep-alive\n\n", False, False
        return b"", False, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class Subscription:
    """The body of an /events answer. qag's worker calls `qag_detach(sock, chunked)` after sending the head and
    the hub serves it; any other server iterates it on its request thread (gunicorn's gthread)."""

    def __init__(self, feed: Feed, send_timeout: float):
        self.feed = feed
        self.send_timeout = send_timeout
        self.handed = False

    def qag_detach(self, sock: socket.socket, chunked: bool) -> None:
        self.handed = True
        hub(self.send_timeout).add(self.feed, sock, chunked)

    def __iter__(self):
        feed = self.feed
        try:
            yield RETRY
            while True:
                data, came, done = feed.step()
                if data:
                    yield data
                if done:
                    return
                if not came:
                    time.sleep(POLL_S)
        finally:
            feed.release()

    def close(self) -> None:
        if not self.handed:
            self.feed.release()


class _Sub:
    __slots__ = ("feed", "sock", "chunked", "out", "closing", "progress")

    def __init__(self, feed, sock, chunked):
        self.feed, self.sock, self.chunked = feed, sock, chunked
        self.out = bytearray()
        self.closing = False
        self.progress = time.monotonic()

    def push(self, data: bytes) -> None:
        if self.chunked:
            self.out += b"%x\r\n%s\r\n" % (len(data), data)
        else:
            self.out += data


class Hub:
    def __init__(self, send_timeout: float):
        self.send_timeout = send_timeout
        self.lock = threading.Lock()
        self.incoming: list[_Sub] = []
        self.subs: dict[int, _Sub] = {}
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self.run, name="qag-events", daemon=True)
        self.thread.start()

    def add(self, feed: Feed, sock: socket.socket, chunked: bool) -> None:
        sock.setblocking(False)
        sub = _Sub(feed, sock, chunked)
        sub.push(RETRY)
        with self.lock:
            self.incoming.append(sub)
        try:
            os.write(self.wake_w, b"\0")
        except OSError:
            pass

    def count(self) -> int:
        return len(self.subs) + len(self.incoming)

    def _drop(self, sub: _Sub) -> None:
        fd = sub.sock.fileno()
        self.subs.pop(fd, None)
        try:
            self.sel.unregister(sub.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            sub.sock.close()
        except OSError:
            pass
        sub.feed.release()

    def _flush(self, sub: _Sub, now: float) -> None:
        while sub.out:
            try:
                n = sub.sock.send(sub.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(sub)
                return
            del sub.out[:n]
            sub.progress = now
        if not sub.out:
            sub.progress = now
            if sub.closing:
                self._drop(sub)
                return
        elif len(sub.out) > MAX_BUFFERED or now - sub.progress > self.send_timeout:
            log.info("an /events subscriber stopped reading: dropped")
            self._drop(sub)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if sub.out else 0)
        try:
            self.sel.modify(sub.sock, events, sub)
        except (KeyError, ValueError, OSError):
            self._drop(sub)

    def run(self) -> None:
        next_poll = 0.0
        while True:
            with self.lock:
                incoming, self.incoming = self.incoming, []
            now = time.monotonic()
            for sub in incoming:
                self.subs[sub.sock.fileno()] = sub
                try:
                    self.sel.register(sub.sock, selectors.EVENT_READ, sub)
                except (ValueError, OSError):
                    self._drop(sub)
                    continue
                self._flush(sub, now)
            for key, ev in self.sel.select(max(0.0, next_poll - time.monotonic())):
                sub = key.data
                if sub is None:
                    try:
                        os.read(self.wake_r, 4096)
                    except OSError:
                        pass
                    continue
                if sub.sock.fileno() not in self.subs:
                    continue
                if ev & selectors.EVENT_READ:
                    try:
                        got = sub.sock.recv(4096)
                    except (BlockingIOError, InterruptedError):
                        got = None
                    except OSError:
                        got = b""
                    if got == b"":  # the subscriber went away
                        self._drop(sub)
                        continue
                if ev & selectors.EVENT_WRITE:
                    self._flush(sub, time.monotonic())
            now = time.monotonic()
            if now < next_poll:
                continue
            next_poll = now + POLL_S
            for sub in list(self.subs.values()):
                if sub.closing:
                    continue
                try:
                    data, _, done = sub.feed.step()
                except Exception:  # the run store failed: this subscriber reconnects and resumes by id
                    log.exception("an /events subscriber's poll failed: dropped")
                    self._drop(sub)
                    continue
                if data:
                    sub.push(data)
                if done:
                    sub.closing = True
                    if sub.chunked:
                        sub.out += b"0\r\n\r\n"
                if sub.out or done:
                    self._flush(sub, now)


_HUB: Hub | None = None
_HUB_LOCK = threading.Lock()


def hub(send_timeout: float) -> Hub:
    """This process's hub, started on first use (after the fork: a thread does not survive one)."""
    global _HUB
    with _HUB_LOCK:
        if _HUB is None or not _HUB.thread.is_alive():
            _HUB = Hub(send_timeout)
        return _HUB


def _after_fork() -> None:
    global _HUB
    _HUB = None


os.register_at_fork(after_in_child=_after_fork)
