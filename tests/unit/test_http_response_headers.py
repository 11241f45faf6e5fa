"""qag's worker writes an answer's head with QagResponse (qag/server/gworker.py), whose process_headers takes a
head gunicorn would keep unchanged in a few calls in C: every list of headers must come out of it exactly as out
of gunicorn's own Response.process_headers - the same headers kept, the same Content-Length, the same upgrade
flag, the same exception - whether its names were seen before or not."""
from __future__ import annotations

from gunicorn.config import Config
from gunicorn.http import wsgi
from hypothesis import given, settings
from hypothesis import strategies as st

from qag.server import gworker

CFG = Config()


def _outcome(cls, headers):
    resp = cls(None, None, CFG)
    try:
        resp.process_headers(headers)
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
        return ("raised", type(exc), str(exc), resp.headers, resp.response_length, resp.upgrade)
    return ("ok", resp.headers, resp.response_length, resp.upgrade)


def _same(headers):
    want = _outcome(wsgi.Response, list(headers))
    for _ in range(2):  # the first time teaches the names, the second takes the fast path where it can
        assert _outcome(gworker.QagResponse, list(headers)) == want, headers


QAG_HEAD = [("x-page", "1"), ("x-page-size", "10"), ("x-row-count", "1"), ("x-has-more", "false"),
            ("content-type", "application/json"), ("server-timing", "auth;dur=0.051, plan;dur=0.012"),
            ("x-request-id", "5f3a9c1d00000001"), ("x-content-type-options", "nosniff"),
            ("cache-control", "no-store"), ("content-length", "52")]


def test_a_data_answers_head_is_kept_as_it_is_with_its_length():
    _same(QAG_HEAD)
    resp = gworker.QagResponse(None, None, CFG)
    resp.process_headers(list(QAG_HEAD))
    assert resp.headers == QAG_HEAD and resp.response_length == 52


def test_heads_gunicorn_changes_or_refuses_are_its_own():
    for head in (
        [],
        [("x-a", " padded\t")],                        # stripped
        [("x-a", "tab\tinside"), ("x-b", "")],           # kept
        [("x-a", "bad\nvalue")], [("x-a", "nul\x00")], [("x-a", "é")], [("x-a", "\u20ac")],
        [("bad name", "v")], [("", "v")], [(b"x-a", "v")], [("x-a", b"v")], [("x-a", 1)],
        [("connection", "upgrade"), ("upgrade", "websocket")], [("Connection", "close")],
        [("keep-alive", "5")], [("transfer-encoding", "chunked")],
        [("content-length", "5"), ("content-length", "7")], [("Content-Length", "9")],
        [("content-length", "abc")], [("content-length", " 12 ")],
        [("x-page", "1"), ("x-unseen", "a"), ("x-page", "2")],
        QAG_HEAD + [("x-a", "a\x00b")],
    ):
        _same(head)


_name = st.one_of(st.sampled_from(["x-page", "content-length", "Content-Length", "connection", "upgrade",
                                   "x-request-id", "cache-control", "server"]),
                  st.text(alphabet="abcxyz-_!#: \t", min_size=0, max_size=6))
_value = st.one_of(st.text(alphabet="ab1 \t\x00\n\x7f\x80é€", max_size=6), st.sampled_from(["12", " 3", "upgrade"]),
                   st.integers(0, 9))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_name, _value), max_size=6))
def test_any_head_comes_out_as_gunicorns(head):
    _same(head)


def test_falcon_keeps_headers_where_the_data_path_writes_them():
    """qag/http/data.py render() and the request-id middleware write falcon's header table directly
    (resp._headers[lower-case name] = str), as set_header does: if falcon changes where it keeps them, this fails
    before an answer loses its headers."""
    import falcon
    a, b = falcon.Response(), falcon.Response()
    for name, value in (("X-Page", "1"), ("Server-Timing", "auth;dur=0.1"), ("Cache-Control", "no-store")):
        a.set_header(name, value)
        b._headers[name.lower()] = value
    a.content_type = b._headers["content-type"] = "application/json"
    assert a._headers == b._headers and a._wsgi_headers() == b._wsgi_headers()
    assert b.get_header("X-Page") == "1" and b.content_type == "application/json"
