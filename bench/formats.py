#!/usr/bin/env python3
"""Formats side by side (issue 16's measure): the 100-row page as json, csv and parquet, a 100,000-row
`?stream=true` as csv and parquet, qag against QueryAPIGate 0.43 (its metadata cache on) per gateway CPU-second in
interleaved rounds; then the qag worker's RSS, sampled from /proc every 50 ms, during a 2,000,000-row stream.

Usage: python bench/formats.py [--rounds 4] [--out-dir DIR] [--no-peer] [--smoke]. `--smoke` (seconds, tiny sizes)
checks that every cell completes with 200s and well-formed bodies, never speed."""
import argparse
import atexit
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as H  # noqa: E402
import targets as T  # noqa: E402

TABLE = 'fmt_rows'
COLUMNS = 'id, qty, amount, label, created'
# id int, qty int, amount numeric(12,2), label text, created timestamp: a row as a report or an export has them
GENERATE = (f'CREATE TABLE {TABLE} AS SELECT g::int AS id, (g * 7 %% 1000)::int AS qty, '
            "round((g %% 100000) * 1.37 / 100, 2)::numeric(12,2) AS amount, 'item-' || md5(g::text) AS label, "
            "timestamp '2026-01-01' + g * interval '1 second' AS created FROM generate_series(1, %s) g")
PAGE_FORMATS = ('json', 'csv', 'parquet')
STREAM_FORMATS = ('csv', 'parquet')
# QueryAPIGate's image ships DuckDB, which writes its Parquet (queryapigate/parquet.py); the harness's peer venv
# (queryapigate[server,postgres,mysql,flow]) does not have it, so the peer here gets it beside, on PYTHONPATH.
PEER_DUCKDB = 'duckdb==2.0.1'
PEER_DUCKDB_DIR = os.path.join(H.BENCH_DIR, '.work', 'peer-duckdb')

FULL = dict(rows=2_000_000, page=100, stream_rows=100_000, rss_rows=2_000_000, duration=6.0, warmup=1.0,
            callers=16, stream_calls=3, db='qag_fmtbench_data')
SMOKE = dict(rows=20_000, page=100, stream_rows=5_000, rss_rows=20_000, duration=1.0, warmup=0.2,
             callers=4, stream_calls=1, db='qag_fmtbench_smoke')


def pg_connect(db):
    import psycopg2
    conn = psycopg2.connect(f'postgresql://postgres@127.0.0.1:5432/{db}')
    conn.autocommit = True
    return conn


def ensure_data(db, rows):
    """The generated table in its own database, made again only when its row count differs."""
    conn = pg_connect('postgres')
    with conn.cursor() as cur:
        cur.execute('SELECT 1 FROM pg_database WHERE datname = %s', (db,))
        if cur.fetchone() is None:
            cur.execute(f'CREATE DATABASE {db}')
    conn.close()
    conn = pg_connect(db)
    with conn.cursor() as cur:
        cur.execute('SELECT to_regclass(%s)', (TABLE,))
        have = None
        if cur.fetchone()[0]:
            cur.execute(f'SELECT count(*) FROM {TABLE}')
            have = cur.fetchone()[0]
        if have != rows:
            H.progress(f'generating {rows:,} rows in {db}.{TABLE} (had {have})')
            cur.execute(f'DROP TABLE IF EXISTS {TABLE}')
            cur.execute(GENERATE, (rows,))
            cur.execute(f'ALTER TABLE {TABLE} ADD PRIMARY KEY (id)')
            cur.execute(f'ANALYZE {TABLE}')
    conn.close()


def workload(db):
    connection = {'name': 'fmt', 'db': 'postgres', 'host': '127.0.0.1', 'port': 5432, 'user': 'postgres',
                  'password': '', 'database': db, 'options': {'allow_superuser': True}}
    queries = [
        {'name': 'fmt_page', 'connection_name': 'fmt', 'publish': True, 'description': 'A 100-row page',
         'sql': f'SELECT {COLUMNS} FROM {TABLE} WHERE id BETWEEN :start AND :start + 99 ORDER BY id',
         'parameters': {'start': {'type': 'int', 'required': True}}},
        {'name': 'fmt_rows', 'connection_name': 'fmt', 'publish': True, 'description': 'The first n rows',
         'sql': f'SELECT {COLUMNS} FROM {TABLE} WHERE id <= :n ORDER BY id',
         'parameters': {'n': {'type': 'int', 'required': True}}},
    ]
    keys = {'plain': {'queries': ['fmt_page', 'fmt_rows'], 'connections': []}}
    return T.Workload(connection, queries, keys, data_db=db)


class PeerImage(T.Peer):
    """The peer with its metadata cache, as the harness starts it, plus the DuckDB its image carries."""

    def env(self):
        env = super().env()
        if os.path.isdir(PEER_DUCKDB_DIR):
            env['PYTHONPATH'] = PEER_DUCKDB_DIR
        return env


def ensure_peer_duckdb():
    if os.path.isdir(os.path.join(PEER_DUCKDB_DIR, 'duckdb')):
        return True
    H.progress(f'installing {PEER_DUCKDB} for the peer into {PEER_DUCKDB_DIR}')
    py = os.path.join(T.PEER_VENV, 'bin', 'python')
    r = subprocess.run([py, '-m', 'pip', 'install', '-q', '--target', PEER_DUCKDB_DIR, PEER_DUCKDB])
    return r.returncode == 0


# ---------------------------------------------------------------- bodies

def check_body(fmt, body, want_rows):
    """None when the body is a well-formed answer of want_rows rows in fmt, else what is wrong."""
    try:
        if fmt == 'json':
            doc = json.loads(body)
            rows = doc.get('data', doc.get('rows')) if isinstance(doc, dict) else doc
            n = len(rows)
        elif fmt == 'csv':
            import csv
            lines = list(csv.reader(io.StringIO(body.decode())))
            if lines[0] != COLUMNS.split(', '):
                return f'csv header {lines[0]}'
            n = len(lines) - 1
        elif fmt == 'parquet':
            import pyarrow.parquet as pq
            table = pq.read_table(io.BytesIO(body))
            if table.column_names != COLUMNS.split(', '):
                return f'parquet columns {table.column_names}'
            n = table.num_rows
        else:
            return f'no check for {fmt}'
    except Exception as exc:  # noqa: BLE001 - a malformed body is the finding
        return f'{type(exc).__name__}: {str(exc)[:200]}'
    return None if n == want_rows else f'{n} rows, expected {want_rows}'


def parquet_types(body):
    import pyarrow.parquet as pq
    return {f.name: str(f.type) for f in pq.read_schema(io.BytesIO(body))}


def parquet_nulls(source):
    """{column: nulls} from a Parquet file's row-group statistics: the table has no nulls, so any is a value lost
    on the way (e.g. a decimal wider than the schema the first row group fixed)."""
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(source).metadata
    out = {}
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            n = col.statistics.null_count if col.statistics is not None and col.statistics.has_null_count else 0
            if n:
                out[col.path_in_schema] = out.get(col.path_in_schema, 0) + n
    return out


# ---------------------------------------------------------------- the run

class FormatsBench:
    def __init__(self, opts):
        self.opts = opts
        self.size = SMOKE if opts.smoke else FULL
        self.oha = H.find_oha(opts.oha)
        if not self.oha:
            H.die(H.OHA_HELP)
        os.makedirs(opts.out_dir, exist_ok=True)
        session = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime()) + '-' + uuid.uuid4().hex[:6]
        common = {'gateway_cpus': H.cpu_list(opts.gateway_cpus), 'load_cpus': H.cpu_list(opts.load_cpus),
                  'smoke': opts.smoke, 'nproc': os.cpu_count(), 'qag_commit': T.working_tree_commit(),
                  'peer_version': T.PEER_VERSION, 'table_rows': self.size['rows']}
        self.results = H.Results(os.path.join(opts.out_dir, 'results.jsonl'), session, 'formats', common)
        self.failures, self.unsupported = [], {}
        opts.store_suffix = '_fmtbench'  # never the stores another harness is using right now
        ensure_data(self.size['db'], self.size['rows'])
        w = workload(self.size['db'])
        self.qag = T.Qag(opts, w)
        self.targets = [self.qag]
        self.peer_duckdb = False
        if not opts.no_peer:
            T.Peer.ensure_venv()
            self.peer_duckdb = ensure_peer_duckdb()
            self.targets.append(PeerImage(opts, w, cache=True))
        atexit.register(self.close)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def close(self):
        for t in self.targets:
            try:
                t.stop()
            except Exception:  # noqa: BLE001
                pass

    def fail(self, what):
        self.failures.append(what)
        H.progress('FAILED ' + what)

    def page_path(self, fmt, start=None):
        digits = len(str(self.size['rows'])) - 1  # every page of 100 from a d-digit start exists
        start_re = '[1-9]' + f'[0-9]{{{digits - 1}}}'
        if start is not None:
            return f'/q/fmt_page?start={start}&page_size={self.size["page"]}&format={fmt}'
        return rf'/q/fmt_page\?start={start_re}&page_size={self.size["page"]}&format={fmt}'

    def stream_path(self, fmt, rows):
        return f'/q/fmt_rows?n={rows}&stream=true&format={fmt}'

    # --- one check call: status, headers, a well-formed body (also the prime of the first calls)
    def check(self, target, cell, fmt, path, want_rows):
        import requests
        t0 = time.time()
        r = requests.get(target.base + path, headers=target.headers(_KEY), timeout=600)
        wall = time.time() - t0
        info = {'status': r.status_code, 'content_type': r.headers.get('Content-Type'),
                'transfer_encoding': r.headers.get('Transfer-Encoding'),
                'content_length': r.headers.get('Content-Length'),
                'disposition': r.headers.get('Content-Disposition'), 'bytes': len(r.content), 'wall_s': round(wall, 3)}
        if r.status_code != 200:
            try:
                info['error'] = r.json()
            except ValueError:
                info['error'] = r.text[:300]
        else:
            info['body_problem'] = check_body(fmt, r.content, want_rows)
            if fmt == 'parquet' and not info['body_problem']:
                info['parquet_types'] = parquet_types(r.content)
                info['parquet_nulls'] = parquet_nulls(io.BytesIO(r.content))
                if info['parquet_nulls']:
                    self.fail(f'{target.name} {cell}: nulls in a table without nulls {info["parquet_nulls"]}')
        self.results.add(block='check', target=target.name, cell=cell, format=fmt, path=path, rows=want_rows, **info)
        ok = r.status_code == 200 and not info.get('body_problem')
        H.progress(f'[check] {target.name:10s} {cell:14s} {r.status_code} {info["bytes"]:,} B in {wall:.2f}s '
                   f'{info.get("transfer_encoding") or "length " + str(info.get("content_length"))}'
                   + ('' if ok else f'  !! {info.get("body_problem") or info.get("error")}'))
        return ok, info

    # --- a measured oha run with the gateway tree's CPU around it
    def measured(self, target, url_regex, *, conns, duration=None, requests=None):
        headers = target.headers(_KEY)
        if duration and self.size['warmup']:
            H.run_oha(self.oha, url_regex, duration=self.size['warmup'], conns=min(8, conns), headers=headers,
                      load_cpus=self.opts.load_cpus)
        s0 = H.all_stats()
        gw0 = target.ticks(s0)
        load0 = os.getloadavg()[0]
        r = H.run_oha(self.oha, url_regex, duration=duration, requests=requests, conns=conns, headers=headers,
                      load_cpus=self.opts.load_cpus)
        gw = H.delta_seconds(gw0, target.ticks(H.all_stats()))
        r.update({'gw_cpu_s': round(gw, 3), 'calls_per_gw_cpu_s': round(r['n_2xx'] / gw, 2) if gw > 0 else None,
                  'gw_cpu_ms_per_call': round(gw * 1e3 / r['n_2xx'], 3) if r['n_2xx'] else None,
                  'loadavg_1m': round((load0 + os.getloadavg()[0]) / 2, 2)})
        return r

    def cells(self):
        s = self.size
        out = [('page_' + f, f, self.page_path(f), s['page'], self.page_path(f, start=1000)) for f in PAGE_FORMATS]
        out += [('stream_' + f, f, self.stream_path(f, s['stream_rows']), s['stream_rows'],
                 self.stream_path(f, s['stream_rows'])) for f in STREAM_FORMATS]
        return out

    def run(self):
        s, opts = self.size, self.opts
        H.progress(f'session {self.results.session}: targets {", ".join(t.name for t in self.targets)}; '
                   f'{opts.rounds} rounds; load average {os.getloadavg()}')
        self.results.add(block='session', loadavg=os.getloadavg(), peer_duckdb=self.peer_duckdb, size=s)
        for t in self.targets:
            t.start(workers=1)
        cells = self.cells()
        live = {}  # (target, cell) -> True when it answers well-formed 200s
        for cell, fmt, _, want, check_path in cells:
            for t in self.targets:
                ok, info = self.check(t, cell, fmt, check_path, want)
                live[(t.name, cell)] = ok
                if not ok:
                    if t.name == 'qag':
                        self.fail(f'qag {cell}: {info.get("body_problem") or info.get("error")}')
                    else:
                        self.unsupported[(t.name, cell)] = info.get('body_problem') or info.get('error')
        for rnd in range(opts.rounds):
            for i, (cell, fmt, path, want, _) in enumerate(cells):
                for t in H.rotated(self.targets, rnd + i):
                    if not live[(t.name, cell)]:
                        continue
                    url = H.regex_escape_base(t.base + path) if cell.startswith('stream') else \
                        H.regex_escape_base(t.base) + path
                    try:
                        if cell.startswith('stream'):
                            r = self.measured(t, url, conns=1, requests=s['stream_calls'])
                        else:
                            r = self.measured(t, url, conns=s['callers'], duration=s['duration'])
                    except Exception as exc:  # noqa: BLE001
                        self.fail(f'{t.name} {cell} r{rnd}: {exc}')
                        continue
                    row = self.results.add(block='cell', target=t.name, cell=cell, format=fmt, rows=want, round=rnd,
                                           conns=1 if cell.startswith('stream') else s['callers'], **r)
                    H.progress(f'[{cell}] r{rnd} {t.name:10s} {H.fmt_run(row)}')
                    if r['non_2xx'] or r['errors'] or not r['n_2xx']:
                        self.fail(f'{t.name} {cell} r{rnd}: codes {r["codes"]} errors {r["error_kinds"]}')
        for fmt in STREAM_FORMATS:
            self.rss(fmt, s['rss_rows'])
        return self.failures

    # --- the worker's RSS during a long stream
    def worker_pids(self, target):
        out = []
        for pid in target.ticks():
            try:
                with open(f'/proc/{pid}/cmdline', 'rb') as f:
                    cmd = f.read().replace(b'\0', b' ').decode(errors='replace')
            except OSError:
                continue
            if 'worker' in cmd:
                out.append(pid)
        return out

    def rss(self, fmt, rows):
        import requests
        t = self.qag
        t.stop()  # a fresh worker: its high-water mark then says what this stream needed
        t.start(workers=1)
        workers = self.worker_pids(t)
        if len(workers) != 1:
            self.fail(f'rss {fmt}: expected one qag worker, found {workers}')
            return
        pid = workers[0]
        # warm the path (imports, pool, plan) with a short stream, so "before" is a worker that has streamed
        warm = requests.get(t.base + self.stream_path(fmt, 1000), headers=t.headers(_KEY), timeout=60)
        if warm.status_code != 200:
            self.fail(f'rss {fmt}: warm-up stream {warm.status_code}')
            return
        time.sleep(0.3)
        before = [status_kib(pid)[0] for _ in range(10) if not time.sleep(0.05)]
        hwm_before = status_kib(pid)[1]
        samples, stop = [], threading.Event()
        t0 = time.time()

        def sample():
            while not stop.is_set():
                rss_kib, _ = status_kib(pid)
                samples.append((round(time.time() - t0, 3), rss_kib))
                stop.wait(0.05)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        nbytes, problem, nulls = 0, None, None
        with tempfile.TemporaryFile() as spool:
            with requests.get(t.base + self.stream_path(fmt, rows), headers=t.headers(_KEY), stream=True,
                              timeout=600) as r:
                status, te = r.status_code, r.headers.get('Transfer-Encoding')
                for chunk in r.iter_content(1 << 16):
                    nbytes += len(chunk)
                    spool.write(chunk)
            wall = time.time() - t0
            stop.set()
            th.join()
            spool.seek(0)
            if status != 200:
                problem = f'status {status}'
            elif fmt == 'csv':
                n = sum(1 for _ in spool) - 1
                problem = None if n == rows else f'{n} rows, expected {rows}'
            else:
                import pyarrow.parquet as pq
                pf = pq.ParquetFile(spool)
                n = pf.metadata.num_rows
                problem = None if n == rows else f'{n} rows, expected {rows}'
                row_groups = pf.metadata.num_row_groups
                spool.seek(0)
                nulls = parquet_nulls(spool)
                if nulls:
                    self.fail(f'rss {fmt}: nulls in a table without nulls {nulls}')
        hwm_after = status_kib(pid)[1]
        base = statistics.median(before)
        values = [v for _, v in samples if v]
        q = max(1, len(values) // 4)
        peak = max(values) if values else None
        row = self.results.add(
            block='rss', target=t.name, format=fmt, rows=rows, status=status, transfer_encoding=te, bytes=nbytes,
            wall_s=round(wall, 2), rss_before_kib=base, rss_peak_kib=peak,
            rss_peak_over_before_kib=(peak - base) if peak else None,
            rss_end_kib=values[-1] if values else None,
            # a flat stream: the last quarter's peak is not above the first quarter's
            rss_first_quarter_max_kib=max(values[:q]) if values else None,
            rss_last_quarter_max_kib=max(values[-q:]) if values else None,
            hwm_before_kib=hwm_before, hwm_after_kib=hwm_after, n_samples=len(samples),
            row_groups=row_groups if fmt == 'parquet' and status == 200 else None, body_problem=problem,
            parquet_nulls=nulls,
            loadavg_1m=os.getloadavg()[0], samples=samples)
        H.progress(f'[rss] {fmt} {rows:,} rows {nbytes:,} B in {wall:.1f}s: RSS before {base / 1024:.1f} MiB, '
                   f'peak {(peak or 0) / 1024:.1f} MiB (+{(row["rss_peak_over_before_kib"] or 0) / 1024:.1f}), '
                   f'{len(samples)} samples' + (f'  !! {problem}' if problem else ''))
        if problem:
            self.fail(f'rss {fmt}: {problem}')


class _Key:
    key = 'plain'


_KEY = _Key()


def status_kib(pid):
    """(VmRSS, VmHWM) of a process in KiB from /proc/PID/status; (None, None) once it is gone."""
    rss = hwm = None
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                if line.startswith('VmRSS:'):
                    rss = int(line.split()[1])
                elif line.startswith('VmHWM:'):
                    hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


# ---------------------------------------------------------------- the report

def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def fmt_spread(s, digits=1, suffix=''):
    if s is None:
        return 'n/a'
    return f'{s[0]:.{digits}f}{suffix} ({s[1]:.{digits}f}-{s[2]:.{digits}f})'


def report(path_jsonl, session=None):
    """Markdown from one session of results.jsonl (the newest, unless named)."""
    rows = [json.loads(line) for line in open(path_jsonl)]
    session = session or rows[-1]['session']
    rows = [r for r in rows if r['session'] == session]
    head = next(r for r in rows if r['block'] == 'session')
    cells = [r for r in rows if r['block'] == 'cell']
    checks = [r for r in rows if r['block'] == 'check']
    rss = [r for r in rows if r['block'] == 'rss']
    names = sorted({r['cell'] for r in checks}, key=lambda c: [x[0] for x in _CELL_ORDER].index(c))
    out = [f'# Formats side by side (bench/formats.py), {head["at"][:10]}', '',
           f'Session `{session}`, qag `{head["qag_commit"][:10]}`, QueryAPIGate {head["peer_version"]} with its '
           f'metadata cache on (gunicorn gthread, 1 worker, 8 threads, as the harness starts it'
           + (', plus DuckDB, which its image ships and writes its Parquet' if head.get('peer_duckdb') else '')
           + f'); qag `qag serve --workers 1`, the Python path. Gateways on CPU {head["gateway_cpus"]}, oha on CPU '
           f'{head["load_cpus"]}, PostgreSQL unpinned; table of {head["table_rows"]:,} generated rows (int, int, '
           'numeric(12,2), text, timestamp). Pages: '
           f'{max([r["conns"] for r in cells if r["cell"].startswith("page")] or [0])} callers, closed loop, '
           f'{head["size"]["duration"]} s a run; streams of {head["size"]["stream_rows"]:,} rows: one caller, '
           f'{head["size"]["stream_calls"]} calls a run, each read to its end by oha. Gateway CPU is the whole process '
           'tree\'s, from /proc.', '',
           f'Load average (1 min) at the start {head["loadavg"][0]:.1f}, during the cells '
           f'{fmt_spread(spread([r["loadavg_1m"] for r in cells]))} on {head["nproc"]} cores shared with other '
           'engineers\' test suites: absolute figures are low and noisy, the per-round ratios are the result.', '',
           '## Calls per gateway CPU-second and calls/s', '',
           'Median (min-max) over the interleaved rounds; the ratio is qag ÷ reference within each round.', '',
           '| cell | qag calls/gw-CPU-s | reference | qag ÷ ref | qag calls/s | reference | qag ÷ ref |',
           '|---|---|---|---|---|---|---|']
    dagger = False
    for cell in names:
        by = {}
        for r in cells:
            if r['cell'] == cell:
                by.setdefault(r['target'], {})[r['round']] = r
        q, p = by.get('qag', {}), by.get('peer_cache', {})
        rounds = sorted(set(q) & set(p))
        ratio_cpu = spread([q[i]['calls_per_gw_cpu_s'] / p[i]['calls_per_gw_cpu_s'] for i in rounds
                            if q[i]['calls_per_gw_cpu_s'] and p[i]['calls_per_gw_cpu_s']])
        ratio_rps = spread([q[i]['ok_rps'] / p[i]['ok_rps'] for i in rounds if p[i]['ok_rps']])
        digits = 1 if cell.startswith('page') else 2
        note = next((c for c in checks if c['cell'] == cell and c['target'] == 'peer_cache'), None)
        ref_cpu = fmt_spread(spread([r['calls_per_gw_cpu_s'] for r in p.values()]), digits)
        ref_rps = fmt_spread(spread([r['ok_rps'] for r in p.values()]), digits)
        if note and (note['status'] != 200 or note.get('body_problem')):
            why = note.get('body_problem') or json.dumps(note.get('error'))[:120]
            ref_cpu = ref_rps = f'not served: {note["status"]} {why}'
        lost = any(c.get('parquet_nulls') for c in checks if c['cell'] == cell and c['target'] == 'qag')
        dagger = dagger or lost
        out.append(f'| {cell}{" †" if lost else ""} | '
                   f'{fmt_spread(spread([r["calls_per_gw_cpu_s"] for r in q.values()]), digits)} | '
                   f'{ref_cpu} | {fmt_spread(ratio_cpu, 2, "x")} | '
                   f'{fmt_spread(spread([r["ok_rps"] for r in q.values()]), digits)} | {ref_rps} | '
                   f'{fmt_spread(ratio_rps, 2, "x")} |')
    if dagger:
        out += ['', '† qag\'s answer lost values (Findings): the figure is the cost of a wrong answer.']
    out += ['', '## What each gateway answered (the check call before the rounds)', '',
            '| cell | gateway | status | bytes | transfer | content type | parquet column types |',
            '|---|---|---|---|---|---|---|']
    for cell in names:
        for c in [c for c in checks if c['cell'] == cell]:
            transfer = 'chunked (streamed)' if c.get('transfer_encoding') == 'chunked' else \
                f'Content-Length {c.get("content_length")}'
            types = ', '.join(f'{k} {v}' for k, v in (c.get('parquet_types') or {}).items())
            if c.get('parquet_nulls'):
                types += f' — **nulls where the table has none: {c["parquet_nulls"]}**'
            problem = ' ' + c['body_problem'] if c.get('body_problem') else ''
            out.append(f'| {cell} | {c["target"]} | {c["status"]}{problem}'
                       f' | {c["bytes"]:,} | {transfer} | {c.get("content_type")} | {types} |')
    out += ['', '## qag worker RSS during a long stream', '',
            'A fresh `qag serve --workers 1`, one 1,000-row stream to warm the path, then the long stream read to its '
            'end; the worker\'s VmRSS from /proc/PID/status every 50 ms. "Before" is the median of 10 samples just '
            'before; VmHWM is the kernel\'s high-water mark of the worker since it started.', '',
            '| format | rows | bytes | seconds | RSS before | peak | peak - before | first/last quarter max | '
            'VmHWM before → after | samples |', '|---|---|---|---|---|---|---|---|---|---|']
    for r in rss:
        mib = lambda k: f'{k / 1024:.1f} MiB' if k is not None else 'n/a'
        out.append(f'| {r["format"]} | {r["rows"]:,} | {r["bytes"]:,} | {r["wall_s"]} | {mib(r["rss_before_kib"])} | '
                   f'{mib(r["rss_peak_kib"])} | {mib(r["rss_peak_over_before_kib"])} | '
                   f'{mib(r["rss_first_quarter_max_kib"])} / {mib(r["rss_last_quarter_max_kib"])} | '
                   f'{mib(r["hwm_before_kib"])} → {mib(r["hwm_after_kib"])} | {r["n_samples"]} |'
                   + (f' !! {r["body_problem"]}' if r.get('body_problem') else ''))
    out += ['', '## Findings', ''] + findings(head, checks, rss)
    return '\n'.join(out) + '\n'


def findings(head, checks, rss):
    """What the figures say that a reader should not have to work out: streamed or not, formats not served,
    values lost, memory flat or growing."""
    out = []
    for c in checks:
        if c['status'] != 200 or c.get('body_problem'):
            out.append(f'- {c["target"]} does not serve {c["cell"]}: {c["status"]} '
                       f'{c.get("body_problem") or json.dumps(c.get("error"))[:200]}')
        if c['cell'].startswith('stream') and c['status'] == 200:
            how = 'streams it (chunked, no Content-Length)' if c.get('transfer_encoding') == 'chunked' else \
                f'answers it in full (Content-Length {c.get("content_length")}), not as a stream'
            out.append(f'- {c["target"]}, `?stream=true&format={c["format"]}`: {how}.')
        if c.get('parquet_nulls'):
            rows = c.get('rows') or head['size']['stream_rows' if c['cell'].startswith('stream') else 'page']
            out.append(f'- **{c["target"]}\'s {c["cell"]} loses values**: {c["parquet_nulls"]} nulls of '
                       f'{rows:,} rows in a table without nulls (Parquet types {c.get("parquet_types")}). '
                       'The first row group fixes each column\'s type from its values, and a later group whose '
                       'values do not fit that type is written as nulls.')
        types = c.get('parquet_types') or {}
        if c['target'] == 'qag' and types.get('amount', '').startswith('decimal') and '(12, 2)' not in types['amount']:
            out.append(f'- qag\'s {c["cell"]}: `amount` (numeric(12,2) in PostgreSQL) is {types["amount"]} in the '
                       'Parquet schema: its precision comes from the values, not from the cursor\'s column type.')
    for r in rss:
        if r.get('rss_peak_kib') is None:
            continue
        growth = r['rss_last_quarter_max_kib'] - r['rss_first_quarter_max_kib']
        if r['n_samples'] < 40:  # a smoke-sized stream: a few samples, nothing to judge a trend by
            out.append(f'- qag worker, {r["rows"]:,}-row {r["format"]} stream: {r["n_samples"]} samples, too short to '
                       'judge whether memory stays flat.')
            continue
        verdict = ('flat: the last quarter of the stream peaks no higher than the first (within 1 MiB), so it does '
                   'not grow with the rows') if growth <= 1024 else \
            f'**growing**: the last quarter\'s peak is {growth / 1024:.1f} MiB above the first quarter\'s'
        out.append(f'- qag worker, {r["rows"]:,}-row {r["format"]} stream: peak '
                   f'{r["rss_peak_over_before_kib"] / 1024:.1f} MiB over the {r["rss_before_kib"] / 1024:.1f} MiB '
                   f'before it, {verdict}.'
                   + (f' (This stream also lost values: {r["parquet_nulls"]} nulls, so a correct one may hold a '
                      'little more per row group.)' if r.get('parquet_nulls') else ''))
    return out or ['- nothing beyond the tables.']


_CELL_ORDER = [('page_' + f, f) for f in PAGE_FORMATS] + [('stream_' + f, f) for f in STREAM_FORMATS]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--rounds', type=int, default=4)
    p.add_argument('--gateway-cpus', default='0', help='taskset list for both gateways (default 0)')
    p.add_argument('--load-cpus', default='1', help='taskset list for oha (default 1)')
    p.add_argument('--no-peer', action='store_true', help='qag only (no reference venv)')
    p.add_argument('--out-dir', default=os.path.join(H.BENCH_DIR, 'out', 'formats'),
                   help='where results.jsonl is appended to and results.md written (default bench/out/formats)')
    p.add_argument('--oha', default=None)
    p.add_argument('--smoke', action='store_true', help='tiny sizes, 1 round: completion, 200s, well-formed bodies')
    p.add_argument('--report-only', action='store_true', help='write results.md from the newest session and exit')
    opts = p.parse_args()
    opts.gateway_cpus = H.parse_cpus(opts.gateway_cpus)
    opts.load_cpus = H.parse_cpus(opts.load_cpus)
    jsonl = os.path.join(opts.out_dir, 'results.jsonl')
    if not opts.report_only:
        if opts.smoke:
            opts.rounds = 1
        bench = FormatsBench(opts)
        t0 = time.time()
        failures = bench.run()
        bench.close()
        bench.results.add(block='end', seconds=round(time.time() - t0, 1), loadavg=os.getloadavg(),
                          failures=failures,
                          unsupported={f'{k[0]} {k[1]}': str(v) for k, v in bench.unsupported.items()})
        for k, v in bench.unsupported.items():
            H.progress(f'reference does not serve {k[1]}: {v}')
    md = report(jsonl)
    with open(os.path.join(opts.out_dir, 'results.md'), 'w') as f:
        f.write(md)
    if not opts.report_only:
        H.progress(f'{"FAILED: " + "; ".join(failures) if failures else "ok"} ({time.time() - t0:.0f}s); '
                   f'report in {os.path.join(opts.out_dir, "results.md")}')
        sys.exit(1 if failures else 0)


if __name__ == '__main__':
    main()
