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
import json
import logging
import queue
import re
import select
import socket
import threading
import time
from collections import deque
from datetime import datetime
from itertools import chain

from gunicorn import config as gconfig
from gunicorn import http
from gunicorn import util as gutil
from gunicorn.http import message as gmessage
from gunicorn.http import wsgi
from gunicorn.workers import gthread
from gunicorn.workers.gthread import TConn, ThreadWorker

from qag.server import fasthttp

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


_PARSE_ERROR_CODES = {400: "bad_request", 403: "forbidden", 414: "uri_too_long", 417: "expectation_failed",
                      431: "headers_too_large", 500: "internal_error", 501: "not_implemented"}


def _contract_errors() -> None:
    """gunicorn answers a request it cannot parse (an invalid method or header name, obsolete line folding,
    headers past limit_request_field_size, a bad chunk) itself, before any application runs, with an HTML
    page. Every error on every route has the contract's JSON shape, so its page is written as one, with a
    fresh request id."""
    from qag.http.common import new_request_id

    def write_error(sock, status_int, reason, mesg):
        rid = new_request_id()
        code = _PARSE_ERROR_CODES.get(status_int, "bad_request")
        text = f"The request could not be read: {mesg}" if status_int < 500 else "The server could not answer."
        body = json.dumps({"error": text, "code": code,
                           "request_id": rid}).encode()
        head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-Request-Id: {rid}\r\nCache-Control: no-store\r\n"
                "X-Content-Type-Options: nosniff\r\n\r\n")
        gutil.write_nonblock(sock, head.encode("latin-1") + body)
    gutil.write_error = write_error


_HEADER_NAMES: set[str] = set()  # response header names gunicorn accepted and keeps (not hop-by-hop)
_HEADER_NAMES_MAX = 512
_STR_ONLY = {str}
# A header value gunicorn would refuse (outside HEADER_VALUE_RE) or strip (a space or tab at either end), in the
# values joined by NUL (itself refused: counted apart).
_VALUE_NOT_AS_IS = re.compile(r"[^ \t\x21-\x7e\x80-\xff\x00]|[ \t]\x00|\x00[ \t]|\A[ \t]|[ \t]\Z")


class QagResponse(wsgi.Response):
    """gunicorn's response writer, whose process_headers takes a head it would keep as it is in a few calls in C:
    an answer of qag's carries a dozen headers, and checking them one by one was about a third of what writing
    its head cost (bench/callcost.py --http). The fast path is taken only when gunicorn's loop would append every
    header unchanged: every name one it accepted before (a token, not hop-by-hop), every value a str it neither
    refuses nor strips, at most one Content-Length (read as gunicorn reads it); anything else goes through
    gunicorn's own loop, so every header is accepted, refused and written as it would be."""

    def process_headers(self, headers):
        names = _HEADER_NAMES
        if headers.__class__ is list and headers:
            try:
                keys, values = zip(*headers)
            except (TypeError, ValueError):
                keys = ()
            if keys and names.issuperset(keys) and set(map(type, values)) == _STR_ONLY:
                joined = "\x00".join(values)
                if joined.count("\x00") == len(values) - 1 and not _VALUE_NOT_AS_IS.search(joined):
                    n = keys.count("content-length")
                    if n < 2:
                        if n:
                            self.response_length = int(values[keys.index("content-length")])
                        self.headers.extend(headers)
                        return
        own = super().process_headers
        for name, value in headers:
            own(((name, value),))
            if name.__class__ is str and name not in names and len(names) < _HEADER_NAMES_MAX \
                    and not gutil.is_hoppish(name) and (name == "content-length" or name.lower() != "content-length"):
                names.add(name)  # gunicorn took it: a valid token (it raises otherwise), kept as it is

    def default_headers(self):
        # No `Server: gunicorn`: an answer the data plane writes itself has no Server header, so one that had it
        # said which process answered, and a 401 said whether the plane knew the key (a real key outside its
        # allowed_ips was answered by the plane, an unknown one by gunicorn): every 401 must look alike.
        return [h for h in super().default_headers() if not h.startswith("Server:")]


class FastResponse(QagResponse):
    """QagResponse for a request the fast path read (fasthttp.FastRequest): the same head in fewer steps, gunicorn's
    default_headers (less the Server line QagResponse drops) and the header lines formatted in one operation
    instead of a list comprehension. Every item of self.headers is a (name, value) pair: process_headers put it
    there, through gunicorn's loop or QagResponse's zip, which takes no item of another length."""

    def _connection(self):
        if self.upgrade:
            return "upgrade"
        return "close" if self.should_close() else "keep-alive"

    def default_headers(self):
        v = self.req.version
        head = [f"HTTP/{v[0]}.{v[1]} {self.status}\r\n", f"Date: {gutil.http_date()}\r\n",
                f"Connection: {self._connection()}\r\n"]
        if self.chunked:
            head.append(_CHUNKED)
        return head

    def _head(self) -> bytes:
        h = self.headers
        head = "".join(self.default_headers()) + ("%s: %s\r\n" * len(h)) % tuple(chain.from_iterable(h)) + "\r\n"
        return head.encode("latin-1")

    def send_headers(self):
        if self.headers_sent:
            return
        gutil.write(self.sock, self._head())
        self.headers_sent = True

    def write(self, arg):
        """The head and the first piece of the body in one send where gunicorn's write would send that piece
        whole right after the head (a body that is not dropped, not cut to Content-Length): the same bytes in
        one system call instead of two. Anything else is gunicorn's write."""
        if self.headers_sent or arg.__class__ is not bytes or self._omits_body:
            return super().write(arg)
        n = len(arg)
        if self.chunked:
            if not n:
                return super().write(arg)
            data = self._head() + b"%X\r\n" % n + arg + b"\r\n"  # util.write_chunk's framing
        elif self.response_length is None or n <= self.response_length:
            data = self._head() + arg
        else:
            return super().write(arg)
        gutil.write(self.sock, data)
        self.headers_sent = True
        self.sent += n


_CHUNKED = "Transfer-Encoding: chunked\r\n"


def _hooks(cfg, log):
    """(pre_request, post_request, timed) for handle_request: gunicorn's default hooks are None when they would do
    nothing (pre_request only logs at debug level, post_request is empty), and a request is timed only for an
    access log that writes it (Logger.access returns at once otherwise)."""
    debug = getattr(log, "error_log", None)
    debug = debug is None or debug.isEnabledFor(logging.DEBUG)
    pre = cfg.pre_request
    if pre is gconfig.PreRequest.default and not debug:
        pre = None
    post = cfg.post_request
    if post is gconfig.PostRequest.default:
        post = None
    timed = getattr(log, "access_log_enabled", True)
    return pre, post, bool(timed)


def _fast_head(cfg, log):
    """The fast path's per-worker state (qag/server/fasthttp.py), or None where the configuration leaves every
    request to gunicorn's parser (said once in the log)."""
    why = fasthttp.unavailable(cfg)
    if why is not None:
        log.info("Every request is read by gunicorn's parser: %s", why)
        return None
    return fasthttp.FastHead(cfg)


# -- what the main thread reads before a thread is committed ------------------------------------------------
HEAD_LIMIT = 256 * 1024  # request line + headers buffered at most; past it the parser answers 400/431
DATA, OPS, HEALTH = 0, 1, 2
_HEALTH_PATHS = (b"/health", b"/metrics")
_OPS_PREFIXES = (b"/api/", b"/-/", b"/openapi.json", b"/docs", b"/console", b"/favicon.ico")
_DETACHED = object()  # handle(): the application took the connection over (an /events subscriber)


def request_ready(buf, max_body: int):
    """Whether `buf` holds a whole request (line, headers and body), parsed just enough to tell: None while
    more bytes are needed; else (route class, key identity, close_after). A body longer than `max_body` is
    not waited for (the application answers 413 from Content-Length alone; the connection closes after)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > HEAD_LIMIT:
            return DATA, b"", True  # the parser reads it and refuses it
        return None
    head = bytes(buf[:end])
    line_end = head.find(b"\r\n")
    line = head if line_end < 0 else head[:line_end]
    lower = head.lower()
    close_after = False
    body_at = end + 4
    i = lower.find(b"\ncontent-length:")
    if i >= 0:
        j = lower.find(b"\r\n", i + 1)
        try:
            length = int(lower[i + 16:j if j >= 0 else None].strip())
        except ValueError:
            length = 0  # the parser refuses it
        if length > max_body:
            close_after = True
        elif len(buf) - body_at < length:
            return None
    elif b"\ntransfer-encoding:" in lower and b"chunked" in lower:
        # A chunked body is complete at its last chunk (no trailers: a trailer waits for the deadline).
        if buf.find(b"0\r\n\r\n", body_at) < 0 and len(buf) - body_at <= max_body:
            return None
    parts = line.split(b" ", 2)
    target = parts[1] if len(parts) > 1 else b""
    if target.startswith(b"http://") or target.startswith(b"https://"):  # absolute form (RFC 9112 3.2.2)
        k = target.find(b"/", target.find(b"//") + 2)
        target = target[k:] if k >= 0 else b"/"
    path = target.split(b"?", 1)[0]
    if path in _HEALTH_PATHS:
        return HEALTH, b"", close_after
    if path == b"/" or path.startswith(_OPS_PREFIXES):
        return OPS, b"", close_after
    key = b""
    for name in (b"\nx-api-key:", b"\nauthorization:"):
        i = lower.find(name)
        if i >= 0:
            j = lower.find(b"\r\n", i + 1)
            key = head[i + len(name):j if j >= 0 else None].strip()[:256]
            break
    return DATA, key, close_after


class FairQueue:
    """Data calls wait here, per key, for a thread: at most `cap` calls of one key in flight in the worker, the
    keys served round-robin, at most `bound` calls of one key waiting (`put` returns False past it). A key
    whose slow calls fill its share leaves the other threads to the other keys, and its waiting calls hold no
    thread (issue 13 item 3)."""

    def __init__(self, cap: int, bound: int):
        self.cap = max(1, cap)
        self.bound = bound
        self.cond = threading.Condition(threading.Lock())
        self.waiting: dict[bytes, deque] = {}
        self.ready: deque = deque()  # keys with a call waiting and room in flight, each once
        self.in_ready: set = set()
        self.in_flight: dict[bytes, int] = {}
        self.stopping = False

    def put(self, conn, key: bytes) -> bool:
        with self.cond:
            q = self.waiting.get(key)
            if q is None:
                q = self.waiting[key] = deque()
            elif self.bound and len(q) >= self.bound:
                return False
            q.append(conn)
            if key not in self.in_ready and self.in_flight.get(key, 0) < self.cap:
                self.in_ready.add(key)
                self.ready.append(key)
                self.cond.notify()
        return True

    def get(self):
        with self.cond:
            while not self.ready:
                if self.stopping:
                    return None, None
                self.cond.wait()
            key = self.ready.popleft()
            q = self.waiting[key]
            conn = q.popleft()
            n = self.in_flight[key] = self.in_flight.get(key, 0) + 1
            if not q:
                del self.waiting[key]
                self.in_ready.discard(key)
            elif n < self.cap:
                self.ready.append(key)
            else:
                self.in_ready.discard(key)
            if self.ready:  # more work than this thread: wake the next one (put notifies only new keys)
                self.cond.notify()
            return conn, key

    def done(self, key: bytes) -> None:
        with self.cond:
            n = self.in_flight[key] - 1
            if n:
                self.in_flight[key] = n
            else:
                del self.in_flight[key]
            if key in self.waiting and key not in self.in_ready:
                self.in_ready.add(key)
                self.ready.append(key)
                self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()


class QagWorker(ThreadWorker):
    """`worker_class = "qag.server.gworker.QagWorker"`. The main thread accepts, reads every request whole without a
    thread, and hands it to one of three pools: the data threads (`threads`, per-key fair), the reserve
    threads (QAG_RESERVE_THREADS: the Management API and the other operations routes) and one thread of
    its own for /health and /metrics, so neither waits behind data calls."""

    qag = None  # the qag settings (qag.config.Config), set by qag.server.serve before the workers fork

    def init_process(self):
        _freeze(self.cfg)
        _cache_per_worker()
        _contract_errors()
        q = self.qag
        threads = self.cfg.threads
        self.max_body = q.max_body_bytes if q is not None else 1 << 20
        self.header_timeout = q.header_timeout if q is not None else 10.0
        self.send_timeout = q.send_timeout if q is not None else 30.0
        self.reserve = q.reserve_threads if q is not None else 2
        key_calls = (q.key_calls if q is not None else 0) or max(1, threads - 1)
        self.ep = select.epoll()
        self.data = FairQueue(key_calls, q.key_queue if q is not None else 1000)
        self.ops: queue.SimpleQueue = queue.SimpleQueue()
        self.health: queue.SimpleQueue = queue.SimpleQueue()
        self.conns: dict[int, TConn] = {}  # fd -> connection, busy or idle
        self.listen_fds: dict[int, socket.socket] = {}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()  # guards self.conns: threads drop closed connections, the loop adds
        self.poller = None  # gthread's selector is not used
        self.pre_hook, self.post_hook, self.timed = _hooks(self.cfg, self.log)
        self.fast = _fast_head(self.cfg, self.log)
        self.tpool = None
        # base.Worker.init_process ends by calling run(); it also installs the signal handlers.
        super(ThreadWorker, self).init_process()

    # -- the threads -------------------------------------------------------------------------------------
    def _serve_data(self):
        get, done = self.data.get, self.data.done
        while True:
            conn, key = get()
            if conn is None:
                return
            try:
                self._serve_one(conn)
            finally:
                done(key)

    def _serve_queue(self, q):
        get = q.get
        while True:
            conn = get()
            if conn is _STOP:
                return
            self._serve_one(conn)

    def _serve_one(self, conn):
        try:
            keep = self.handle(conn)
        except BaseException:  # handle() logs what it can; never lose the thread
            keep = False
        if keep is _DETACHED:
            self._forget(conn)
            return
        if keep is True:
            # Bytes read ahead (a pipelined request) came back from the parser into conn.buf: a whole
            # request goes straight back to its pool; a part waits in epoll for the rest.
            if conn.buf and self._submit(conn):
                return
            conn.busy = False
            now = time.monotonic()
            conn.timeout = now + (self.header_timeout if conn.buf else self.cfg.keepalive)
            conn.idle_since = now
            if not self.alive:
                conn.timeout = min(conn.timeout, now + gthread.STOP_KEEPALIVE_LINGER)
            try:
                self.ep.modify(conn.fd, _EV_CONN)
                return
            except (OSError, ValueError):
                pass
        if keep is None:
            self._drop(conn)
        else:
            self._linger(conn)

    def _linger(self, conn):
        """Close after an answer as RFC 9112 9.6 asks (FIN first, then read what the client still sends, so
        the kernel does not reset the answer's last segment): gunicorn lingers up to 2 s in the thread; here
        the main thread does it, and no thread waits on the client."""
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(conn)
            return
        conn.closing = True
        conn.drained = 0
        conn.buf.clear()
        conn.timeout = time.monotonic() + 2.0
        conn.busy = False
        try:
            self.ep.modify(conn.fd, _EV_CONN)
        except (OSError, ValueError):
            self._drop(conn)

    def handle(self, conn):
        """One request, already whole in conn.buf: parse it, run the application, send the answer. The socket
        has a timeout of QAG_SEND_TIMEOUT, so a client that stops reading fails the send instead of holding
        the thread (a stream's generators close and release its database session)."""
        req = None
        try:
            fast = self.fast
            if fast is not None:
                req = fast.parse(conn)
                if req.__class__ is not str:  # read here: the buffer holds what follows the request
                    keep = self.handle_request(req, conn)
                    if keep is _DETACHED:
                        return keep
                    if not keep or conn.close_after:
                        return False
                    conn.continued = False
                    return True
                req = None  # gunicorn's parser reads it (the str says why)
            if conn.parser is None:
                conn.parser = http.get_parser(self.cfg, conn.sock, conn.client)
            conn.parser.unreader.unread(bytes(conn.buf))
            conn.buf.clear()
            req = next(conn.parser)
            if not req:
                return False
            keep = self.handle_request(req, conn)
            if keep is _DETACHED:
                return keep
            if not keep or conn.close_after:
                return False
            if not conn.parser.finish_body(deadline=time.monotonic() + 1.0):
                return False
            conn.buf += conn.parser.unreader.take_buffered()
            conn.continued = False
            return True
        except http.errors.NoMoreData as e:
            self.log.debug("Ignored premature client disconnection. %s", e)
        except StopIteration as e:
            self.log.debug("Closing connection. %s", e)
        except TimeoutError:
            self.log.debug("A client stopped reading for %s s: dropped", self.send_timeout)
            self._observe("send_timeout")
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.exception("Socket error processing request.")
        except Exception as e:
            self.handle_error(req, conn.sock, conn.client, e)
        return False

    def handle_request(self, req, conn):
        """gthread's handle_request, plus the environ entries qag's application reads: `qag.too_many_calls`
        (this key's queue was full) and, on a response that carries `qag_detach`, the hand-over of the
        connection (the response head is sent here, the rest by whoever took it)."""
        environ = {}
        resp = None
        try:
            if self.pre_hook is not None:
                self.pre_hook(self, req)
            request_start = datetime.now() if self.timed else None
            if conn.continued:  # this worker's main thread sent the 100 already (_continue)
                req._expected_100_continue = False
            if req.__class__ is fasthttp.FastRequest:  # its environ is wsgi.create's, less early_hints
                resp = FastResponse(req, conn.sock, self.cfg)
                environ = req.environ
                environ["wsgi.early_hints"] = wsgi._make_early_hints_callback(req, conn.sock, resp)
            else:
                resp, environ = wsgi.create(req, conn.sock, conn.client, conn.server, self.cfg, QagResponse)
                environ["wsgi.multithread"] = True
            if conn.too_many:
                environ["qag.too_many_calls"] = True
                conn.too_many = False
            self.nr += 1
            if self.nr >= self.max_requests:
                if self.alive:
                    self.log.info("Autorestarting worker after current request.")
                    self.alive = False
                resp.force_close()
            if not self.alive or not self.cfg.keepalive:
                resp.force_close()
            respiter = self.wsgi(environ, resp.start_response)
            take = getattr(respiter, "qag_detach", None)
            if take is not None and resp.status_code == 200:
                resp.force_close()
                resp.send_headers()
                take(conn.sock, resp.chunked)
                return _DETACHED
            try:
                if isinstance(respiter, environ["wsgi.file_wrapper"]):
                    resp.write_file(respiter)
                else:
                    for item in respiter:
                        resp.write(item)
                resp.close()
            finally:
                if self.timed:
                    self.log.access(resp, req, environ, datetime.now() - request_start)
                if hasattr(respiter, "close"):
                    respiter.close()
            if resp.should_close():
                return False
        except OSError:
            raise
        except (Exception, SystemExit):
            if resp and resp.headers_sent:
                self.log.exception("Error handling request")
                raise StopIteration() from None
            raise
        finally:
            if self.post_hook is not None:
                try:
                    self.post_hook(self, req, environ, resp)
                except Exception:
                    self.log.exception("Exception in post_request hook")
        return True

    def _forget(self, conn):
        """The connection now belongs to someone else: out of epoll and the table, not closed."""
        with self.lock:
            if self.conns.get(conn.fd) is conn:
                del self.conns[conn.fd]
                try:
                    self.ep.unregister(conn.fd)
                except (OSError, ValueError):
                    pass
                self.nr_conns = len(self.conns)

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
    def _submit(self, conn) -> bool:
        """Hand a connection whose buffer holds a whole request to its pool; False while it does not."""
        ready = request_ready(conn.buf, self.max_body)
        if ready is None:
            return False
        kind, key, conn.close_after = ready
        conn.busy = True
        if kind == HEALTH:
            self.health.put(conn)
        elif kind == OPS:
            self.ops.put(conn)
        elif not self.data.put(conn, key):
            conn.too_many = True  # answered 429 too_many_calls by a reserve thread, after authentication
            self.ops.put(conn)
        return True

    def _read(self, conn):
        """A connection is readable: take what it sent, without blocking; a whole request goes to a thread,
        a part waits (its deadline is QAG_HEADER_TIMEOUT from the request's first byte)."""
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError:
            data = b""
        if data == b"" or conn.closing and (data is None or conn.drained + len(data) > 65536):
            self._drop(conn)
            return
        if conn.closing:  # lingering after the last answer: what the client still sends is discarded
            conn.drained += len(data)
        elif data:
            if not conn.buf:
                conn.timeout = time.monotonic() + self.header_timeout
            conn.buf += data
            if self._submit(conn):
                return
            self._continue(conn)
        try:
            self.ep.modify(conn.fd, _EV_CONN)
        except (OSError, ValueError):
            self._drop(conn)

    def _continue(self, conn):
        """A client that sent `Expect: 100-continue` waits for the interim answer before its body (RFC 9110
        10.1.1): send it from here, since the body is read here."""
        if conn.continued:
            return
        end = conn.buf.find(b"\r\n\r\n")
        if end >= 0 and b"\nexpect: 100-continue" in bytes(conn.buf[:end]).lower():
            conn.continued = True
            try:
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                pass

    def _accept(self, listener):
        """One connection per readiness event, as gthread does: every worker waits on the same listening
        socket, and taking the whole backlog at once would give one worker every connection of a burst."""
        try:
            sock, addr = listener.accept()
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED, errno.EINVAL):
                return False
            raise
        if self.nr_conns >= self.worker_connections:
            self._evict_idle()
        conn = TConn(self.cfg, sock, addr, listener.getsockname())
        sock.settimeout(self.send_timeout)  # bounds every send (and any read) a thread makes on it
        conn.fd = sock.fileno()
        conn.busy = False
        conn.buf = bytearray()
        conn.too_many = False
        conn.close_after = False
        conn.continued = False
        conn.closing = False
        conn.idle_since = now = time.monotonic()
        conn.timeout = now + gthread.DEFAULT_WORKER_DATA_TIMEOUT
        with self.lock:
            self.conns[conn.fd] = conn
            self.nr_conns = len(self.conns)
            self.ep.register(conn.fd, _EV_CONN)
        if self.nr_conns >= self.worker_connections and not self._has_idle():
            self._set_accepting(False)
        return True

    def _has_idle(self) -> bool:
        with self.lock:
            return any(not c.busy for c in self.conns.values())

    def _evict_idle(self):
        """At QAG_MAX_CONNECTIONS, make room for a new connection: close the one idle longest (a kept-alive
        connection between requests, or one that never sent a byte); a connection being served stays."""
        with self.lock:
            idle = [c for c in self.conns.values() if not c.busy]
        if idle:
            self._observe("evicted")
            self._drop(min(idle, key=lambda c: (bool(c.buf), c.idle_since)))

    def _set_accepting(self, on: bool):
        if on == self._accepting:
            return
        for fd in self.listen_fds:
            if on:
                self.ep.register(fd, select.EPOLLIN)
            else:
                try:
                    self.ep.unregister(fd)
                except (OSError, ValueError):
                    pass
        self._accepting = on

    def _expire(self, now: float, force: bool = False):
        """Close idle connections past their keep-alive, first-byte or whole-request deadline."""
        with self.lock:
            idle = [c for c in self.conns.values() if not c.busy and (force or c.timeout <= now)]
        for conn in idle:
            if conn.buf and not conn.closing and not force:
                self._observe("header_timeout")
            self._drop(conn)

    def _observe(self, reason: str) -> None:
        observer = getattr(self.wsgi, "observer", None)  # qag's app; any other WSGI app has none
        if observer is not None:
            try:
                observer.http_dropped(reason)
            except Exception:  # a metric must never take the worker's loop down
                pass

    def _dispatch(self, timeout: float):
        try:
            events = self.ep.poll(timeout)
        except InterruptedError:
            return
        for fd, _ev in events:
            listener = self.listen_fds.get(fd)
            if listener is not None:
                self._accept(listener)
                continue
            conn = self.conns.get(fd)
            if conn is None or conn.busy:
                continue
            self._read(conn)

    def run(self):
        for s in self.sockets:
            s.setblocking(False)
            self.listen_fds[s.fileno()] = s
        self._accepting = False
        self._set_accepting(True)
        pools = [(f"qag-http-{i}", self._serve_data, ()) for i in range(self.cfg.threads)]
        pools += [(f"qag-ops-{i}", self._serve_queue, (self.ops,)) for i in range(self.reserve)]
        pools.append(("qag-health", self._serve_queue, (self.health,)))
        for name, target, args in pools:
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            t.start()
            self.threads.append(t)
        last_expire = time.monotonic()
        while self.alive:
            self.notify()
            if not self._accepting and (self.nr_conns < self.worker_connections or self._has_idle()):
                self._set_accepting(True)
            self._dispatch(1.0)
            now = time.monotonic()
            if now - last_expire >= 0.5:
                self._expire(now)
                last_expire = now
            if not self.is_parent_alive():
                break
        # Graceful stop: take what the listening socket still holds (the arbiter shut it for new
        # connections before it signalled us, qag.server.serve), then serve what is in flight.
        while any(self._accept(s) for s in self.listen_fds.values()):
            pass
        self._set_accepting(False)
        for s in self.sockets:
            s.close()
        deadline = time.monotonic() + self.cfg.graceful_timeout
        linger = time.monotonic() + gthread.STOP_KEEPALIVE_LINGER
        for c in list(self.conns.values()):
            c.timeout = min(c.timeout, linger)
        while self.conns and time.monotonic() < deadline:
            self.notify()
            self._dispatch(0.2)
            self._expire(time.monotonic())
        self._expire(time.monotonic(), force=True)
        self.data.stop()
        for _ in range(self.reserve):
            self.ops.put(_STOP)
        self.health.put(_STOP)
        self.ep.close()

    def handle_exit(self, sig, frame):
        self.alive = False  # the main loop sees it within its poll timeout (1 s at most)

    def handle_quit(self, sig, frame):
        super(ThreadWorker, self).handle_quit(sig, frame)
