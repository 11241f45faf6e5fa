"""The ClickHouse run store over clickhouse-connect's real HTTP path, through a small loopback server
that hands each request to a chDB session (CLICKHOUSE.md, "Over HTTP"). Run as a script, this file
is that server: `python tests/integration/test_runstore_http.py DATA_DIR PORT`."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# URL parameters that belong to the HTTP transport, not to the query's settings
TRANSPORT = {"query", "database", "session_id", "session_timeout", "session_check", "compress", "decompress",
             "default_format", "query_id", "wait_end_of_query", "user", "password", "buffer_size",
             "enable_http_compression", "http_headers_progress_interval_ms", "send_progress_in_http_headers",
             "client_protocol_version", "quota_key", "role", "http_zlib_compression_level",
             "cancel_http_readonly_queries_on_client_close"}
_FORMAT_AT_END = re.compile(r"\s+FORMAT\s+(\w+)\s*;?\s*$", re.IGNORECASE)
_INSERT_FORMAT = re.compile(r"^(\s*INSERT\s+INTO\s+.*?)\s+FORMAT\s+(\w+)\s*$", re.IGNORECASE | re.DOTALL)


def serve(path: str, port: int) -> None:
    import chdb

    conn = chdb.connect(path)
    lock = threading.Lock()

    def run(sql, fmt="TabSeparated", params=None):
        return conn.query(sql, fmt, params=params or {})

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # ~50 ms per request without it (CLICKHOUSE.md)

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.handle_request(b"")

        def do_POST(self):
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = bytearray()
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    body += self.rfile.read(size)
                    self.rfile.readline()
                body = bytes(body)
            else:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            enc = self.headers.get("Content-Encoding", "")
            if enc == "lz4":
                import lz4.frame

                body = lz4.frame.decompress(body)
            elif enc == "gzip":
                import gzip

                body = gzip.decompress(body)
            elif enc == "zstd":
                import zstandard

                body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
            self.handle_request(body)

        def reply(self, status, data: bytes, headers=None):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def handle_request(self, body: bytes):
            u = urllib.parse.urlsplit(self.path)
            if u.path == "/ping":
                return self.reply(200, b"Ok.\n")
            qs = {k: v[-1] for k, v in urllib.parse.parse_qs(u.query, keep_blank_values=True).items()}
            params = {k[6:]: v for k, v in qs.items() if k.startswith("param_")}
            settings = {k: v for k, v in qs.items() if k not in TRANSPORT and not k.startswith("param_")}
            sql = qs.get("query", "")
            data = None
            head = body.partition(b"\n")[0]
            if _INSERT_FORMAT.match(sql) and body:
                data = body  # statement in the URL, rows in the body
            elif body and _INSERT_FORMAT.match(head.decode("utf-8", "replace")):
                data = body[len(head) + 1:]  # statement on the body's first line, then the rows
                sql = head.decode()
            elif body:
                sql = (sql + "\n" if sql else "") + body.decode()
            qid = qs.get("query_id") or str(uuid.uuid4())
            fmt = qs.get("default_format", "TabSeparated")
            with lock:
                applied = []
                try:
                    if qs.get("database"):
                        run(f"USE `{qs['database']}`")
                    for k, v in settings.items():
                        run(f"SET {k} = {v if re.fullmatch(r'-?[0-9.]+', v) else repr(v)}")
                        applied.append(k)
                    if data is not None:
                        m = _INSERT_FORMAT.match(sql)
                        if not m:
                            raise RuntimeError(f"Code: 62. cannot read an insert from {sql[:200]!r}")
                        with tempfile.NamedTemporaryFile(suffix=".bin", delete=False) as f:
                            f.write(data)
                        try:
                            res = run(f"{m.group(1)} FROM INFILE '{f.name}' FORMAT {m.group(2)}")
                        finally:
                            os.unlink(f.name)
                        out = b""
                        summary = {"written_rows": str(res.rows_read()), "read_rows": "0"}
                    else:
                        m = _FORMAT_AT_END.search(sql)
                        if m:
                            fmt = m.group(1)
                            sql = sql[:m.start()]
                        res = run(sql, fmt, params)
                        out = res.bytes() or b""
                        summary = {"read_rows": str(res.rows_read()), "written_rows": "0"}
                except Exception as e:  # the engine's error becomes ClickHouse's HTTP error shape
                    text = str(e)
                    code = int(re.search(r"Code: (\d+)", text).group(1)) if re.search(r"Code: (\d+)", text) else 1000
                    status = 404 if code in (60, 81) else 400 if code in (62, 47) else 403 if code == 497 else 500
                    return self.reply(status, text.encode(), {"X-ClickHouse-Exception-Code": str(code)})
                finally:
                    for k in applied:
                        try:
                            run(f"SET {k} = DEFAULT")
                        except Exception:
                            pass
            self.reply(200, out, {"X-ClickHouse-Format": fmt, "X-ClickHouse-Timezone": "UTC",
                                  "X-ClickHouse-Query-Id": qid, "X-ClickHouse-Summary": json.dumps(summary),
                                  "Content-Type": "application/octet-stream"})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
    raise SystemExit(0)

import pytest  # noqa: E402

from qag import entries  # noqa: E402
from qag.runstore import StoreSettings, open_store  # noqa: E402
from qag.runstore.sql import chunks_of  # noqa: E402


@pytest.fixture(scope="module")
def http_url():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="qag-chhttp-")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), os.path.join(tmp, "ch"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=1).read() == b"Ok.\n":
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(proc.stderr.read().decode()[-3000:]) from None
            time.sleep(0.1)
    yield f"http://default:@127.0.0.1:{port}/default"
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)


def test_runs_through_clickhouse_connect_over_http(http_url):
    store = open_store(http_url, StoreSettings())
    store.ensure_schema()
    now = time.time_ns() // 1000
    recs = [(i % 2, i // 2 + 1, entries.encode_run(at_us=now - 1000 + i // 100, key_name=f"k{i % 3}", query="q",
                                          status=500 if i % 10 == 0 else 200, rows=2, request_id=f"h{i}"))
            for i in range(20_000)]
    for j in range(0, 20_000, 5000):
        store.write_batch("http", recs[j:j + 5000])
    again = store.prepare("http", chunks_of(recs[:10]))
    store.commit(again)
    store.commit(again)  # a retry over HTTP: the token keeps it to one copy
    c = store.counts()
    assert c == {"qag_events": 20_010, "qag_history": 20_010, "usage_calls": 20_010}
    ev, last = [], 0
    while True:
        got = store.events_after(last, limit=7000)
        if not got:
            break
        ev += got
        last = got[-1]["event_id"]
    assert len(ev) == 20_010 and len({e["event_id"] for e in ev}) == 20_010
    items, cursor = store.history(key="k1", status="ok", limit=50)
    assert len(items) == 50 and cursor and all(i["key_name"] == "k1" and i["status"] == 200 for i in items)
    usage = store.usage(per="minute")
    assert sum(u["calls"] for u in usage) == 20_010 and sum(u["errors"] for u in usage) == 2001
    assert store.positions("http") == {0: 5, 1: 5}  # the last insert: the retried first ten runs
    store.close()
