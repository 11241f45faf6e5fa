"""The common request read in a few calls in C, with the environ gunicorn would build for it (issue 19).

A lookup through qag's worker class spent about 3,500 Python opcodes in gunicorn's parser and `wsgi.create`
(bench/results/2026-12-02-cost/profile.md): the request line, each header through `parse_headers` and its
policy, `urlsplit`, a `Body` with its reader, `should_close` walking the headers twice, `finish_body`. The main
thread of qag's worker has the whole request in `conn.buf` before a thread takes it, so a request of the common
shape can be checked against one grammar and turned into its environ at once.

`FastHead.parse` takes a request only where gunicorn's Python parser would take it as it is and build the same
environ; for anything else it returns the reason it declined, and the request goes through gunicorn's parser,
so every refusal (400, 414, 417, 431, 501) stays gunicorn's own. Taken:

- request line `METHOD SP origin-form SP HTTP/1.1|HTTP/1.0`: METHOD upper-case letters only, 3-20 of them and
  not CONNECT (gunicorn's method rules hold for those whatever permit_unconventional_http_method and
  casefold_http_method say), the target `/` then printable ASCII (RFC9112_TARGET_INVALID), no absolute form;
- every header line `token:value` with a token without `_` (gunicorn's header_map rule), a value of SP, HTAB,
  VCHAR and obs-text only (no obs-fold, no control byte), within limit_request_fields and
  limit_request_field_size; the request line within limit_request_line;
- Host and Content-Type at most once, Content-Length at most once and ASCII digits, the body already in the
  buffer and under 64 KiB (gunicorn's drain after an answer gives up at 64 KiB unread: below it, a kept-alive
  connection stays kept alive whatever the application read);
- no Transfer-Encoding, no Expect, no header named in secure_scheme_headers (the scheme then depends on
  forwarded_allow_ips: gunicorn decides those).

The whole path is off where gunicorn would not use its Python HTTP/1 parser (gunicorn_h1c installed, the uwsgi
protocol), with the PROXY protocol on, and with a SCRIPT_NAME in the environment (read once per worker: qag sets
none). tests/unit/test_http_fastpath.py compares both ways, environ and answer bytes, over a corpus of requests.
"""
from __future__ import annotations

import os
import re

from gunicorn import SERVER_SOFTWARE
from gunicorn import util as gutil
from gunicorn.http import message as gmessage
from gunicorn.http import wsgi
from gunicorn.http.body import Body, LengthReader
from gunicorn.http.unreader import Unreader

# The request line and the header lines, each ending in CRLF, then the empty line. Header names are RFC 9110
# tokens without "_" (message.TOKEN_RE less one character); values hold no byte RFC9110_5_5_INVALID_AND_DANGEROUS
# refuses and no CR or LF, so no obs-fold line can match either.
_HEAD = re.compile(
    rb"([A-Z]{3,20}) (/[\x21-\x7e]*) HTTP/1\.([01])\r\n"
    rb"((?:[!#$%&'*+\-.^`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*)\r\n")
# One header line of a head _HEAD matched (decoded as latin-1): the name, and the value without the spaces and
# tabs at either end (parse_headers' value.strip(" \t")).
_PAIR = re.compile(r"([^:]+):[ \t]*(.*?)[ \t]*\r\n")
_SINGLE = frozenset(("HTTP_HOST", "CONTENT_TYPE", "CONTENT_LENGTH"))  # a repeat is gunicorn's 400
_BODY_MAX = 64 * 1024  # parser._DRAIN_MAX_BYTES: an unread body this long closes the connection
_KEYS_MAX = 1024


class _Errors(wsgi.WSGIErrorsWrapper):
    """wsgi.errors, one per request as gunicorn's, without gunicorn's `logging.getLogger` and handler walk on
    every request: the streams are found when something is written (the same handlers, looked up the same
    way)."""

    def __init__(self, cfg):  # noqa: D107 - RawIOBase has no __init__ to call, as in gunicorn's
        self._cfg = cfg

    @property
    def streams(self):
        return wsgi.WSGIErrorsWrapper(self._cfg).streams


class _BytesUnreader(Unreader):
    """A request body already read: gunicorn's own Body and LengthReader over it give wsgi.input gunicorn's read,
    readline and readlines."""

    def __init__(self, data: bytes):
        super().__init__()
        self.buf.write(data)

    def chunk(self, size_hint=None):
        return b""


class FastRequest:
    """What gunicorn's Request gives the response writer, the hooks, the access log and handle_error."""

    __slots__ = ("method", "uri", "path", "query", "fragment", "version", "body", "environ", "pairs",
                 "must_close", "closes", "scheme", "peer_addr", "remote_addr", "_expected_100_continue")
    proxy_protocol_info = None
    trailers = ()

    @property
    def headers(self):
        return [(name.upper(), value) for name, value in self.pairs]

    def should_close(self):
        return self.must_close or self.closes

    def force_close(self):
        self.must_close = True


def unavailable(cfg) -> str | None:
    """Why the fast path is off for this configuration, or None."""
    if gmessage._check_fast_parser(cfg):
        return "gunicorn's C parser is in use"
    if getattr(cfg, "protocol", "http") != "http":
        return f"protocol {cfg.protocol}"
    if cfg.proxy_protocol != "off":
        return "PROXY protocol"
    if os.environ.get("SCRIPT_NAME", ""):
        return "SCRIPT_NAME is set"
    return None


class FastHead:
    """One per worker: gunicorn's limits as its Request computes them, and the environ entries that do not
    change from request to request."""

    def __init__(self, cfg):
        self.cfg = cfg
        line = cfg.limit_request_line  # Request.__init__: < 0 or past MAX_REQUEST_LINE is the maximum, 0 none
        self.line_limit = gmessage.MAX_REQUEST_LINE if line < 0 or line >= gmessage.MAX_REQUEST_LINE else line
        fields = cfg.limit_request_fields  # Message.__init__
        self.fields_limit = gmessage.MAX_HEADERS if fields <= 0 or fields > gmessage.MAX_HEADERS else fields
        size = cfg.limit_request_field_size
        self.field_size = size if size > 0 else gmessage.DEFAULT_MAX_HEADERFIELD_SIZE
        self.scheme = "https" if cfg.is_ssl else "http"
        self.refused = frozenset(("EXPECT", "TRANSFER-ENCODING", *cfg.secure_scheme_headers))
        self.base = {  # wsgi.base_environ, less wsgi.errors (per request)
            "wsgi.version": (1, 0), "wsgi.multithread": True, "wsgi.multiprocess": cfg.workers > 1,
            "wsgi.run_once": False, "wsgi.file_wrapper": wsgi.FileWrapper, "wsgi.input_terminated": True,
            "SERVER_SOFTWARE": SERVER_SOFTWARE, "wsgi.url_scheme": self.scheme, "SCRIPT_NAME": "",
        }
        self.keys: dict[str, str] = {}  # header name as sent -> its environ key ("" when declined)

    def conn_environ(self, conn):
        """The entries that stay for a connection's life (wsgi.create's REMOTE_* and SERVER_*), or None where
        gunicorn would work the server's name out of the Host header (a unix socket)."""
        client, server = conn.client, conn.server
        if server.__class__ is not tuple:
            return None
        env = dict(self.base)
        env["gunicorn.socket"] = conn.sock
        if isinstance(client, str):
            env["REMOTE_ADDR"] = client
        elif isinstance(client, bytes):
            env["REMOTE_ADDR"] = client.decode()
        else:
            env["REMOTE_ADDR"] = client[0]
            env["REMOTE_PORT"] = str(client[1])
        env["SERVER_NAME"] = server[0]
        env["SERVER_PORT"] = str(server[1])
        return env

    def _key(self, name: str) -> str:
        up = name.upper()
        if up in self.refused:
            key = ""
        elif up == "CONTENT-TYPE":
            key = "CONTENT_TYPE"
        elif up == "CONTENT-LENGTH":
            key = "CONTENT_LENGTH"
        else:
            key = "HTTP_" + up.replace("-", "_")
        if len(self.keys) >= _KEYS_MAX:
            self.keys.clear()
        self.keys[name] = key
        return key

    def parse(self, conn):
        """The request at the start of conn.buf as a FastRequest with its environ (its bytes taken out of the
        buffer), or a str: why gunicorn's parser reads this one."""
        buf = conn.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return "no end of head"
        m = _HEAD.fullmatch(buf, 0, end + 4)
        if m is None:
            return "head outside the grammar"
        method, target, minor, block = m.groups()
        if method == b"CONNECT":
            return "CONNECT"
        if m.start(4) - 2 > self.line_limit > 0:
            return "request line past limit_request_line"
        if len(block) > self.field_size and max(map(len, block.split(b"\r\n"))) + 2 > self.field_size:
            return "header line past limit_request_field_size"
        pairs = _PAIR.findall(block.decode("latin-1"))
        if len(pairs) > self.fields_limit:
            return "headers past limit_request_fields"
        try:
            env = conn.fenv
        except AttributeError:
            env = conn.fenv = self.conn_environ(conn)
        if env is None:
            return "server address not a tuple"
        env = env.copy()
        keys = self.keys
        repeated = None
        for name, value in pairs:
            key = keys.get(name)
            if key is None:
                key = self._key(name)
            if not key:
                return f"header {name}"
            if key in env:
                if key in _SINGLE:
                    return f"repeated {name}"
                if repeated is None:
                    repeated = {}
                repeated.setdefault(key, [env[key]]).append(value)
            else:
                env[key] = value
        # Message.should_close: the first Connection header decides, else the version.
        close = env.get("HTTP_CONNECTION")
        if close is not None:
            close = close.lower().strip(" \t")
            close = True if close == "close" else False if close == "keep-alive" else minor == b"0"
        else:
            close = minor == b"0"
        if repeated is not None:  # wsgi.create joins repeated fields with ","
            for key, values in repeated.items():
                env[key] = ",".join(values)
        at = end + 4
        length = env.get("CONTENT_LENGTH")
        if length is None:
            body = Body(LengthReader(None, 0))  # gunicorn's EOFReader for a request becomes this
        else:
            if not (length.isascii() and length.isdigit()):
                return "Content-Length not digits"
            n = int(length)
            if n >= _BODY_MAX:
                return "body of 64 KiB or more"
            if len(buf) - at < n:
                return "body not whole"
            body = Body(LengthReader(_BytesUnreader(bytes(buf[at:at + n])), n)) if n else Body(LengthReader(None, 0))
            at += n
        del buf[:at]
        uri = target.decode("latin-1")
        path = uri
        fragment = query = ""
        if "#" in path:  # urllib.parse.urlsplit on an origin-form target ("//" too: split_request_uri)
            path, fragment = path.split("#", 1)
        if "?" in path:
            path, query = path.split("?", 1)
        req = FastRequest()
        req.method = method = method.decode("latin-1")
        req.uri = uri
        req.path = path
        req.query = query
        req.fragment = fragment
        req.version = (1, 1) if minor == b"1" else (1, 0)
        req.body = body
        req.pairs = pairs
        req.must_close = False
        req.closes = close
        req.scheme = self.scheme
        req.peer_addr = req.remote_addr = conn.client
        req._expected_100_continue = False
        env["wsgi.errors"] = _Errors(self.cfg)
        env["wsgi.input"] = body
        env["REQUEST_METHOD"] = method
        env["QUERY_STRING"] = query
        env["RAW_URI"] = uri
        env["SERVER_PROTOCOL"] = "HTTP/1.1" if minor == b"1" else "HTTP/1.0"
        env["PATH_INFO"] = gutil.unquote_to_wsgi_str(path) if "%" in path else path
        req.environ = env
        return req
