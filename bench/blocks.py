"""The measurement blocks both harnesses run (throughput, latency, openloop, workers, threads, recording,
roundtrips), the command line they share, and the smoke check. A harness supplies the database, the workload,
its calls and how to count round trips; this module does the rest (bench/README.md says what each block is)."""
import argparse
import atexit
import os
import signal
import sys
import time
import uuid

import harness as H
import targets as T

BLOCKS = ('dbonly', 'throughput', 'latency', 'governance', 'rows', 'writes', 'cache', 'keys', 'openloop', 'forward',
          'workers', 'threads', 'recording', 'roundtrips', 'profile')
ROWS_LIST, ROWS_FORMATS = (1, 10, 100, 1000), ('json', 'ndjson', 'csv')
# the smoke run's rows cells: each format's per-row path (the other blocks' calls are one row or a hundred)
SMOKE_ROWS = ((1000, 'json'), (1000, 'ndjson'), (1000, 'csv'))
# the keys block: distinct API keys and distinct saved queries the lookup's calls are spread over (smoke: small)
KEYS_LIST, QUERIES_LIST, SMOKE_KEYS = (1, 1000, 10000), (1, 1000), (1, 100)
OPEN_FRACTIONS = (0.25, 0.50, 0.75, 0.90, 1.00, 1.10)


def parse_args(description, default_out, extra=None, db_floor='floor_pg'):
    p = argparse.ArgumentParser(description=description)
    p.add_argument('blocks', nargs='*', help=f'blocks to run (default all): {", ".join(BLOCKS)}')
    p.add_argument('--targets', default='peer,qag,floor',
                   help='comma list of: peer (both modes: without and with the metadata cache), peer_nocache, '
                        'peer_cache, qag, qag_plane, floor (the database floor + hello floor), floor_pg, floor_mysql, '
                        'floor_hello, all. Default peer,qag,floor')
    p.add_argument('--no-peer', action='store_true', help='skip both peer targets (no venv build)')
    p.add_argument('--gateway-cpus', default='0', help='taskset list for every gateway and floor (default 0)')
    p.add_argument('--load-cpus', default='1', help='taskset list for oha and pgbench (default 1)')
    p.add_argument('--db-cpus', default='', help='taskset list applied to the running database server processes '
                                               'for the session and restored after (default: leave unpinned)')
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--duration', type=float, default=10.0, help='seconds per closed-loop run (seeds: 30)')
    p.add_argument('--warmup', type=float, default=3.0, help='seconds of warm-up at 8 callers before each run')
    p.add_argument('--open-duration', type=float, default=10.0, help='seconds per open-loop rate (seeds: 20)')
    p.add_argument('--open-rounds', type=int, default=None, help='rounds for openloop (default --rounds)')
    p.add_argument('--open-fractions', default='', help='fractions of capacity for openloop (default '
                                                       + ','.join(str(f) for f in OPEN_FRACTIONS) + ')')
    p.add_argument('--health-secs', type=float, default=5.0, help='seconds of the /health floor around each block')
    p.add_argument('--callers', type=int, default=32)
    p.add_argument('--scale-callers', type=int, default=64, help='callers in the workers block')
    p.add_argument('--workers-list', default='', help='worker counts for the workers block (default 1..#gateway CPUs)')
    p.add_argument('--threads-list', default='1,2,4,8')
    p.add_argument('--writes-callers', default='1,8,32', help='callers in the writes block')
    p.add_argument('--writes-threads', default='', help='qag threads per worker to try in the writes block '
                                                       '(default: qag\'s own default only), e.g. 4,8,16')
    p.add_argument('--rows-list', default=','.join(map(str, ROWS_LIST)), help='rows per call in the rows block')
    p.add_argument('--rows-formats', default=','.join(ROWS_FORMATS), help='formats in the rows block')
    p.add_argument('--keys-list', default=','.join(map(str, KEYS_LIST)), help='distinct keys in the keys block')
    p.add_argument('--queries-list', default=','.join(map(str, QUERIES_LIST)),
                   help='distinct saved queries in the keys block')
    p.add_argument('--keys-peer-max', type=int, default=1000,
                   help='the most keys/queries created on the reference (its Management API is slow); '
                        'its bigger cells are skipped and the report says so')
    p.add_argument('--roundtrip-rounds', type=int, default=1,
                   help='rounds of the roundtrips block (counts, not timings)')
    p.add_argument('--settle', type=float, default=11.0,
                   help='seconds to wait for PostgreSQL to publish idle backends\' statistics (roundtrips block)')
    p.add_argument('--out', default=default_out, help='results.jsonl to append to')
    p.add_argument('--oha', default=None, help='path to oha (else PATH or ~/.cargo/bin/oha)')
    p.add_argument('--smoke', action='store_true',
                   help='every block for ~2 s, 1 round; checks completion and zero non-2xx, never speed')
    p.add_argument('--qag-ref', default='', help='run qag from `git archive REF` (e.g. HEAD) instead of the installed '
                                                'qag, so commits landing during a session do not change it')
    p.add_argument('--keep-going', action='store_true', help='log a failed run and continue')
    p.add_argument('--store-suffix', default='', help='appended to the store databases this session drops and '
                                                    'recreates (e.g. _mine), so two sessions at once keep apart')
    p.add_argument('--shm-size', default='', help='QAG_SHM_SIZE in bytes for every qag target (default: qag\'s own); '
                                               'the README\'s sizing: about 8 KiB per active key, e.g. for the keys '
                                               'block at 10,000 keys')
    if extra:
        extra(p)
    opts = p.parse_args()
    opts.gateway_cpus = H.parse_cpus(opts.gateway_cpus)
    opts.load_cpus = H.parse_cpus(opts.load_cpus)
    opts.db_cpus = H.parse_cpus(opts.db_cpus)
    if opts.smoke:
        opts.rounds, opts.open_rounds = 1, 1
        opts.duration, opts.warmup, opts.open_duration, opts.health_secs = 1.5, 0.3, 1.0, 0.5
        opts.settle = 1.0
        opts.threads_list = '1,8'
    opts.rows_cells = [(int(n), f) for f in opts.rows_formats.split(',') for n in opts.rows_list.split(',')]
    if opts.smoke:
        opts.rows_cells = list(SMOKE_ROWS)
        opts.writes_callers = '1,32'
        opts.keys_list = opts.queries_list = ','.join(map(str, SMOKE_KEYS))
    opts.open_rounds = opts.open_rounds or opts.rounds
    opts.open_fractions = tuple(float(f) for f in opts.open_fractions.split(',') if f.strip()) or OPEN_FRACTIONS
    for b in opts.blocks:
        if b not in BLOCKS:
            p.error(f'unknown block {b!r}; choose from {", ".join(BLOCKS)}')
    opts.blocks = opts.blocks or list(BLOCKS)
    names = T.expand_targets(opts.targets, db_floor)
    if opts.no_peer:
        names = [n for n in names if not n.startswith('peer')]
    opts.target_names = names
    return opts


class Bench:
    """One session of one harness: targets, the results file, the floors around each block."""

    def __init__(self, opts, harness_name, workload, calls, db_comms, roundtrip_counter=None, dbonly=None,
                 rows_call=None, cache_calls=None, keys_spec=None):
        self.opts, self.workload, self.calls = opts, workload, calls
        self.rows_call = rows_call  # (rows, format) -> Call: the rows block's calls; None: the harness has none
        self.cache_calls = cache_calls  # (uncached Call, cached Call): the cache block's pair; None: none
        # the keys block: {'call': the lookup Call, 'path': its path with {id}, 'id_range': (lo, hi), 'query':
        # the saved query (dict) to copy under Q names}; None: the harness has none
        self.keys_spec = keys_spec
        self.db_comms = db_comms
        self.roundtrip_counter = roundtrip_counter
        self.dbonly = dbonly
        self.oha = H.find_oha(opts.oha)
        if not self.oha:
            H.die(H.OHA_HELP)
        if any(n.startswith('peer') for n in opts.target_names):
            T.Peer.ensure_venv()
        opts.qag_src = None
        if opts.qag_ref:
            opts.qag_src, qag_commit = T.snapshot_qag(opts.qag_ref)
            H.progress(f'qag from git archive {qag_commit[:10]} in {opts.qag_src}')
        else:
            qag_commit = T.working_tree_commit()
        session = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime()) + '-' + uuid.uuid4().hex[:6]
        common = {'gateway_cpus': H.cpu_list(opts.gateway_cpus), 'load_cpus': H.cpu_list(opts.load_cpus),
                  'db_cpus': H.cpu_list(opts.db_cpus) or 'unpinned', 'smoke': opts.smoke, 'nproc': os.cpu_count(),
                  'qag_commit': qag_commit, 'peer_version': T.PEER_VERSION}
        self.results = H.Results(opts.out, session, harness_name, common)
        self.targets = [T.make_target(n, opts, workload) for n in opts.target_names]
        self.health_target = T.FloorHello(opts, workload)
        self.health_target.name = 'health_floor'
        self.failures = []
        self._primed = set()
        self.rotation = 0  # carried across the parts of a block, so no target always gets the first slot
        self._db_affinity = None
        atexit.register(self.close)
        # SIGTERM (CI timeouts) must still stop the servers this session started
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    # ---------------------------------------------------------------- plumbing
    def close(self):
        for t in self.targets + [self.health_target]:
            try:
                t.stop()
            except Exception:  # noqa: BLE001
                pass
        self.restore_db_cpus()

    def pin_db(self):
        if not self.opts.db_cpus:
            return
        stats = H.all_stats()
        pids = list(H.comm_ticks(self.db_comms, stats))
        self._db_affinity = {pid: os.sched_getaffinity(pid) for pid in pids}
        for pid in pids:
            try:
                os.sched_setaffinity(pid, self.opts.db_cpus)
            except OSError:
                pass
        H.progress(f'database processes {len(pids)} pinned to {H.cpu_list(self.opts.db_cpus)}')

    def restore_db_cpus(self):
        if not self._db_affinity:
            return
        for pid, cpus in self._db_affinity.items():
            try:
                os.sched_setaffinity(pid, cpus)
            except OSError:
                pass
        self._db_affinity = None

    def measured(self, target, call, *, conns, duration, rate=None, warm=True, spread=None):
        """One run against a started target: warm-up, then oha with CPU snapshots around it. `spread` (paths,
        keys, id_range): each call's path and key drawn from those lists by bench/keysload.py instead of oha."""
        url = H.regex_escape_base(target.base) + target.path(call)
        headers = target.headers(call)
        self.prime(target, call, url, headers)

        def load(secs, n, rate=None):
            if spread:
                return H.run_keys(target.port, spread[0], spread[1], duration=secs, conns=n, id_range=spread[2],
                                  load_cpus=self.opts.load_cpus)
            return H.run_oha(self.oha, url, duration=secs, conns=n, headers=headers, rate=rate,
                             load_cpus=self.opts.load_cpus, method=call.method)
        if warm and self.opts.warmup > 0:
            load(self.opts.warmup, min(8, conns))
        s0 = H.all_stats()
        b0 = H.system_busy()
        gw0, db0 = target.ticks(s0), H.comm_ticks(self.db_comms, s0)
        w0 = {pid: H.runq_wait_ns(pid) for pid in list(gw0) + list(db0)}
        r = load(duration, conns, rate)
        s1 = H.all_stats()
        b1 = H.system_busy()
        gw1, db1 = target.ticks(s1), H.comm_ticks(self.db_comms, s1)
        gw = H.delta_seconds(gw0, gw1)
        # waiting for a CPU while runnable, per call: on a shared 2-core machine the tail is mostly this
        waits = {pid: H.runq_wait_ns(pid) - w0.get(pid, 0) for pid in list(gw1) + list(db1)}
        gw_wait = sum(max(waits.get(pid, 0), 0) for pid in gw1) / 1e9
        db_wait = sum(max(waits.get(pid, 0), 0) for pid in db1) / 1e9
        # per process of the gateway (arbiter, workers, recorder, plane), by process title: where CPU goes
        by_proc = {}
        for pid, ticks in gw1.items():
            name = s1[pid][1] if pid in s1 else str(pid)
            by_proc[name] = round(by_proc.get(name, 0) + (ticks - gw0.get(pid, 0)) / H.CLK_TCK, 3)
        r.update({
            'gw_cpu_by_proc': by_proc,
            'gw_cpu_s': round(gw, 3), 'gw_cores': round(gw / max(r['duration_s'], 1e-9), 3),
            'db_cpu_s': round(H.delta_seconds(db0, db1), 3),
            'calls_per_gw_cpu_s': round(r['n'] / gw, 1) if gw > 0 else None,
            'gw_cpu_us_per_call': round(gw * 1e6 / r['n'], 1) if r['n'] else None,
            'cpu_busy': H.busy_fraction(b0, b1, None),
            'gw_runq_wait_s': round(gw_wait, 4), 'db_runq_wait_s': round(db_wait, 4),
            'runq_wait_us_per_call': round((gw_wait + db_wait) * 1e6 / r['n'], 1) if r['n'] else None,
        })
        return r

    def prime(self, target, call, url, headers):
        """The first calls of a (server process, call) pair wait for what a gateway loads once (schema reads,
        governance traces, pools): make a few, sequentially and without a deadline, before anything is timed."""
        key = (target.name, target.proc.pid if target.proc else None, call.name)
        if key in self._primed:
            return
        H.run_oha(self.oha, url, duration=None, requests=4, conns=1, headers=headers, load_cpus=self.opts.load_cpus,
                  method=call.method)
        self._primed.add(key)

    def record(self, block, target, call, round_no, r, **extra):
        if getattr(self.opts, 'shm_size', '') and target.name.startswith('qag'):
            extra['shm_size'] = int(self.opts.shm_size)  # a sized segment is part of what was measured
        row = self.results.add(block=block, target=target.name, call=call.name, query=call.query, key=call.key,
                               round=round_no, workers=target.workers, threads=target.threads, **extra, **r)
        H.progress(f'[{block}] r{round_no} {target.name:12s} {call.name:16s} ' +
                   ' '.join(f'{k}={v if not isinstance(v, list) else v[:4]}' for k, v in extra.items()) + ' ' +
                   H.fmt_run(row))
        if row.get('non_2xx') or row.get('errors'):
            H.progress(f'  !! non-2xx {row.get("codes")} errors {row.get("error_kinds")}')
        return row

    def fail(self, block, what, exc):
        msg = f'[{block}] {what}: {exc}'
        self.failures.append(msg)
        H.progress('FAILED ' + msg)
        if not self.opts.keep_going and not self.opts.smoke:
            raise exc

    def health_floor(self, block, when):
        t = self.health_target
        try:
            t.start(workers=1, threads=8)
            r = self.measured(t, T.HELLO, conns=self.opts.callers, duration=self.opts.health_secs, warm=False)
            self.record('health', t, T.HELLO, 0, r, around=block, when=when)
        except Exception as exc:  # noqa: BLE001
            self.fail('health', f'floor {when} {block}', exc)
        finally:
            t.stop()

    def supporting(self, call, kinds=('gateway', 'floor')):
        return [t for t in self.targets if t.kind in kinds and t.supports(call)]

    def start(self, target, **kw):
        target.start(**kw)

    def stop_all(self):
        for t in self.targets:
            t.stop()

    # ---------------------------------------------------------------- blocks
    def run(self):
        H.progress(f'session {self.results.session}: targets {", ".join(t.name for t in self.targets)}; '
                   f'blocks {", ".join(self.opts.blocks)}; gateway CPUs {H.cpu_list(self.opts.gateway_cpus)}, '
                   f'load CPUs {H.cpu_list(self.opts.load_cpus)}, '
                   f'db CPUs {H.cpu_list(self.opts.db_cpus) or "unpinned"}')
        self.pin_db()
        try:
            for block in self.opts.blocks:
                if block == 'dbonly':
                    if self.dbonly:
                        self.dbonly(self)
                    continue
                if block == 'forward' and not any(getattr(t, 'plane', False) for t in self.targets):
                    continue  # measures the plane's forwarding only: no floors around nothing
                if block == 'rows' and self.rows_call is None:
                    continue
                if block == 'cache' and self.cache_calls is None:
                    continue
                if block == 'keys' and self.keys_spec is None:
                    continue
                self.health_floor(block, 'before')
                t0 = time.time()
                try:
                    getattr(self, 'block_' + block)()
                except Exception as exc:  # noqa: BLE001
                    self.fail(block, 'block aborted', exc)
                finally:
                    self.stop_all()
                H.progress(f'[{block}] done in {time.time() - t0:.0f}s')
                self.health_floor(block, 'after')
        finally:
            self.close()
        return self.check()

    def _closed_block(self, block, calls, conns):
        """Each call, each round, the targets that serve it in rotated order; one worker each."""
        for call in calls:
            tgts = self.supporting(call)
            for rnd in range(self.opts.rounds):
                for t in H.rotated(tgts, self.rotation):
                    try:
                        self.start(t, workers=1)
                        r = self.measured(t, call, conns=conns, duration=self.opts.duration)
                        self.record(block, t, call, rnd, r, conns=conns)
                    except Exception as exc:  # noqa: BLE001
                        self.fail(block, f'{t.name} {call.name}', exc)
                self.rotation += 1

    def block_throughput(self):
        """Closed loop at --callers (32): the calls/s and gateway CPU per call of every target."""
        self._closed_block('throughput', self.calls, self.opts.callers)

    def block_latency(self):
        """One caller at a time: p50/p99 of a single call (the lookups and the hello floor)."""
        calls = [c for c in self.calls if c.name.startswith(('lookup', 'customer', 'hello'))]
        self._closed_block('latency', calls, 1)

    def block_rows(self):
        """Rows per call (--rows-list 1,10,100,1000 x --rows-formats json,ndjson,csv): one range query paged at N
        rows, one worker, --callers closed loop; the report plots gateway CPU µs per call against rows per call
        (the slope is each extra row's cost) for every target and the floor."""
        for n, fmt in self.opts.rows_cells:
            call = self.rows_call(n, fmt)
            tgts = [t for t in self.supporting(call) if t.name != 'floor_hello']
            for rnd in range(self.opts.rounds):
                for t in H.rotated(tgts, self.rotation):
                    try:
                        self.start(t, workers=1)
                        r = self.measured(t, call, conns=self.opts.callers, duration=self.opts.duration)
                        self.record('rows', t, call, rnd, r, conns=self.opts.callers, rows=n, format=fmt)
                    except Exception as exc:  # noqa: BLE001
                        self.fail('rows', f'{t.name} {call.name}', exc)
                self.rotation += 1

    def block_cache(self):
        """A response-cache hit against the same call uncached (issue 17: "cache hit against the uncached call, per
        gateway CPU-second"): a saved query with cache_ttl and the same one without, called with the same ids (a
        small set, so after the warm-up every cached call is a hit), one worker, --callers, on one running target
        back to back, the order flipped every round. Each run records the share of hits in a sample of its answers
        (X-Cache). Every gateway that takes the workload runs it: qag (Python's hit), qag_plane (the plane's hit once
        it serves them; until then the plane forwards the cached query to Python) and the peer with its cache."""
        uncached, cached = self.cache_calls
        tgts = self.supporting(cached, kinds=('gateway',))
        for rnd in range(self.opts.rounds):
            for t in H.rotated(tgts, self.rotation):
                try:
                    self.start(t, workers=1)
                    for call in ((uncached, cached) if rnd % 2 == 0 else (cached, uncached)):
                        r = self.measured(t, call, conns=self.opts.callers, duration=self.opts.duration)
                        self.record('cache', t, call, rnd, r, conns=self.opts.callers,
                                    cache='hit' if call is cached else 'uncached',
                                    hit_share=self.hit_share(t, call))
                except Exception as exc:  # noqa: BLE001
                    self.fail('cache', f'{t.name} cache', exc)
            self.rotation += 1

    def hit_share(self, target, call):
        """Of the call's sample paths (`call.samples`, drawn like the run's), the share answered `X-Cache: hit`;
        None when the target says nothing of its cache."""
        import requests
        hits = said = 0
        for path in getattr(call, 'samples', ()):
            x = requests.get(target.base + path, headers=target.headers(call), timeout=30).headers.get('X-Cache')
            if x is not None:
                said += 1
                hits += x == 'hit'
        return round(hits / said, 3) if said else None

    def block_keys(self):
        """The lookup (plain key) spread over K distinct API keys (--keys-list 1,1000,10000) and, separately, over
        Q distinct saved queries (--queries-list 1,1000: the lookup's SQL under Q names, all granted to one key):
        one worker, --callers, every gateway, each call's key or query drawn at random by bench/keysload.py (oha
        sends one header per run). The keys and queries are made through each gateway's own Management API, once,
        the first time a count needs them (the reference up to --keys-peer-max). The floor has no keys: its plain
        lookup runs beside the K=1 and Q=1 cells as the reference point, through the same load generator."""
        spec = self.keys_spec
        call = spec['call']
        gateways = self.supporting(call, kinds=('gateway',))
        floors = [t for t in self.supporting(call, kinds=('floor',)) if t.name != 'floor_hello']
        series = [('keys', [int(x) for x in self.opts.keys_list.split(',') if x.strip()]),
                  ('queries', [int(x) for x in self.opts.queries_list.split(',') if x.strip()])]
        for kind, counts in series:
            for i, n in enumerate(counts):
                tgts = [t for t in gateways if not (t.name.startswith('peer') and n > self.opts.keys_peer_max)]
                skipped = [t.name for t in gateways if t not in tgts]
                if skipped:
                    H.progress(f'[keys] {kind}={n}: skipped on {", ".join(skipped)} (over --keys-peer-max '
                               f'{self.opts.keys_peer_max})')
                tgts += floors if i == 0 else []
                for rnd in range(self.opts.rounds):
                    for t in H.rotated(tgts, self.rotation):
                        try:
                            self.start(t, workers=1)
                            paths, keys = self._spread(t, kind, n)
                            self._sweep(t, kind, n, paths, keys)
                            r = self.measured(t, call, conns=self.opts.callers, duration=self.opts.duration,
                                              spread=(paths, keys, spec['id_range']))
                            self.record('keys', t, call, rnd, r, conns=self.opts.callers, spread=kind,
                                        distinct=n if t.kind == 'gateway' else None)
                        except Exception as exc:  # noqa: BLE001
                            self.fail('keys', f'{t.name} {kind}={n}', exc)
                    self.rotation += 1

    def _sweep(self, t, kind, n, paths, keys):
        """Before a running target's first measured run at a count, every key (or query) called once, so the
        runs measure a gateway that has met them all (a first call may verify a secret, read the store, plan)."""
        mark = (t.name, t.proc.pid, kind, n)
        if mark in self._primed or len(paths) * len(keys) <= 1:
            return
        t0 = time.time()
        r = H.run_keys(t.port, paths, keys, duration=600, conns=8, id_range=self.keys_spec['id_range'],
                       load_cpus=self.opts.load_cpus, sweep=True)
        if r['non_2xx'] or r['errors']:
            raise RuntimeError(f'sweep over {kind}={n}: {r["codes"]} {r["error_kinds"]}')
        self._primed.add(mark)
        H.progress(f'[keys] {t.name}: each of {kind}={n} called once ({r["n"]} calls, {time.time() - t0:.1f}s)')

    def _spread(self, t, kind, n):
        """(paths, secrets) for `n` distinct keys or queries on target t, creating what it lacks (8 at a time)."""
        from concurrent.futures import ThreadPoolExecutor
        spec = self.keys_spec
        path = spec['path']
        if t.kind != 'gateway':
            return [path], ['']
        made = t.__dict__.setdefault('spread_made', {'keys': [], 'queries': 0, 'qkeys': {}})
        t0 = time.time()
        with ThreadPoolExecutor(8) as pool:
            if kind == 'keys':
                grants = {'queries': [spec['query']['name']], 'connections': []}
                new = list(pool.map(lambda i: t.api('POST', '/api/v1/api-keys', {'name': f'kk{i}', **grants})['secret'],
                                    range(len(made['keys']), n)))
                made['keys'] += new
                what = f'{len(new)} keys'
            else:
                start = made['queries']
                list(pool.map(lambda i: t.api('POST', '/api/v1/queries', {**spec['query'], 'name': f'kq{i}'}),
                              range(start, n)))
                made['queries'] = max(start, n)
                if n not in made['qkeys']:
                    body = t.api('POST', '/api/v1/api-keys', {'name': f'kq_key{n}', 'connections': [],
                                                              'queries': [f'kq{i}' for i in range(n)]})
                    made['qkeys'][n] = body['secret']
                what = f'{max(n - start, 0)} queries'
        if time.time() - t0 > 0.5:
            H.progress(f'[keys] {t.name}: made {what} in {time.time() - t0:.1f}s')
        if kind == 'keys':
            return [path], made['keys'][:n]
        base, _, query = path.partition('?')
        prefix = base.rsplit('/', 1)[0]
        return [f'{prefix}/kq{i}?{query}' for i in range(n)], [made['qkeys'][n]]

    def block_writes(self):
        """Writes at --writes-callers (1, 8, 32): one worker; a write waits on its commit, so calls/s at many
        callers is bounded by how many commits are in flight (threads per worker, the pool), not by CPU: the
        gateway's CPU share (gw_cores) beside calls/s says which. --writes-threads 4,8,16 runs qag at each."""
        calls = [c for c in self.calls if c.name.startswith(('deposit', 'write'))]
        threads = [int(x) for x in self.opts.writes_threads.split(',') if x.strip()] or [None]
        for call in calls:
            tgts = [t for t in self.supporting(call)]   # the floor too: one autocommit UPDATE, no reset
            for conns in [int(x) for x in self.opts.writes_callers.split(',')]:
                for rnd in range(self.opts.rounds):
                    for t in H.rotated(tgts, self.rotation):
                        for th in (threads if t.name.startswith('qag') else [None]):
                            try:
                                self.start(t, workers=1, threads=th)
                                r = self.measured(t, call, conns=conns, duration=self.opts.duration)
                                self.record('writes', t, call, rnd, r, conns=conns)
                            except Exception as exc:  # noqa: BLE001
                                self.fail('writes', f'{t.name} {call.name} {conns}c {th}t', exc)
                    self.rotation += 1

    def block_governance(self):
        """What the allow-list and masking cost: on one running target, runs of the plain and the governed key
        alternate back to back (--rounds pairs, the order flipped every pair), so a machine that changes speed
        moves both halves of a pair; the report takes the cost per pair."""
        pairs = []
        for gov in [c for c in self.calls if c.name.endswith('_governed')]:
            plain = next((c for c in self.calls if c.name == gov.name[:-len('_governed')] + '_plain'), None)
            if plain is not None:
                pairs.append((plain, gov))
        for plain, gov in pairs[:1]:  # the lookup (customer on MariaDB): the call the headline is about
            tgts = [t for t in self.targets if t.kind == 'gateway' and t.supports(plain) and t.supports(gov)]
            for t in H.rotated(tgts, self.rotation):
                try:
                    self.start(t, workers=1)
                    for i in range(self.opts.rounds):
                        for call in ((plain, gov) if i % 2 == 0 else (gov, plain)):
                            r = self.measured(t, call, conns=self.opts.callers, duration=self.opts.duration)
                            self.record('governance', t, call, i, r, conns=self.opts.callers, pair=plain.name)
                except Exception as exc:  # noqa: BLE001
                    self.fail('governance', f'{t.name} {gov.name}', exc)
                finally:
                    t.stop()
            self.rotation += 1

    def _capacity(self, target, call):
        """Closed-loop capacity at --callers from this session's throughput block, or measured now."""
        rows = [r['rps'] for r in self.results.rows if r['block'] in ('throughput', 'capacity')
                and r['target'] == target.name and r['call'] == call.name and not r.get('non_2xx')]
        if not rows:
            for rnd in range(max(1, min(self.opts.rounds, 3))):
                self.start(target, workers=1)
                r = self.measured(target, call, conns=self.opts.callers, duration=self.opts.duration)
                rows.append(self.record('capacity', target, call, rnd, r, conns=self.opts.callers)['rps'])
        return H.med(rows)

    def block_openloop(self):
        """Latency against offered load: 25-110% of each target's capacity, open loop, latency corrected."""
        call = self.calls_by_prefix('lookup', 'customer')[0]
        tgts = [t for t in self.supporting(call) if t.name != 'floor_hello']
        caps = {}
        for t in tgts:
            try:
                caps[t.name] = self._capacity(t, call)
            except Exception as exc:  # noqa: BLE001
                self.fail('openloop', f'{t.name} capacity', exc)
        for frac in self.opts.open_fractions:
            for rnd in range(self.opts.open_rounds):
                for t in H.rotated(tgts, self.rotation):
                    if not caps.get(t.name):
                        continue
                    rate = max(1, int(round(caps[t.name] * frac)))
                    try:
                        self.start(t, workers=1)
                        r = self.measured(t, call, conns=128, duration=self.opts.open_duration, rate=rate)
                        self.record('openloop', t, call, rnd, r, conns=128, frac=frac, offered=rate,
                                    capacity=round(caps[t.name], 1))
                    except Exception as exc:  # noqa: BLE001
                        self.fail('openloop', f'{t.name} {frac}', exc)
                self.rotation += 1

    def block_forward(self):
        """What the plane adds to a call it forwards: one caller, p50/p99 of GET /health and of an administrator's
        management GET through the plane vs straight to gunicorn's unix socket behind it, in interleaved rounds
        (each round both ways, the order alternating), both from the same started instance."""
        tgts = [t for t in self.targets if getattr(t, 'plane', False)]
        if not tgts:
            H.progress('[forward] no qag_plane target: skipped')
            return
        t = tgts[0]
        admin = T.Call('admin_get', None, None, '/api/v1/connections')
        rounds = max(self.opts.rounds, 3)
        self.start(t, workers=1)
        sock = os.path.join(t.home, 'gunicorn.sock')
        for call in (T.HELLO, admin):
            headers = {'X-API-Key': t.admin_key} if call is admin else {}
            ways = {'plane': dict(url=H.regex_escape_base(t.base) + call.path_regex, unix_socket=None),
                    'direct': dict(url='http://localhost' + call.path_regex, unix_socket=sock)}
            for w in ways.values():  # warm both paths (kept-alive connections, the worker's caches)
                H.run_oha(self.oha, w['url'], duration=None, requests=20, conns=1, headers=headers,
                          load_cpus=self.opts.load_cpus, unix_socket=w['unix_socket'])
            p50 = {'plane': [], 'direct': []}
            for rnd in range(rounds):
                for via in (('plane', 'direct') if rnd % 2 == 0 else ('direct', 'plane')):
                    w = ways[via]
                    try:
                        r = H.run_oha(self.oha, w['url'], duration=max(1.0, self.opts.duration / 2), conns=1,
                                      headers=headers, load_cpus=self.opts.load_cpus, unix_socket=w['unix_socket'])
                        r['cpu_busy'] = None
                        self.record('forward', t, call, rnd, r, via=via, conns=1)
                        p50[via].append(r['p50_ms'])
                    except Exception as exc:  # noqa: BLE001
                        self.fail('forward', f'{via} {call.name}', exc)
            if p50['plane'] and p50['direct']:
                H.progress(f'[forward] {call.name}: p50 through the plane {H.med(p50["plane"]):.3f} ms, straight to '
                           f'gunicorn {H.med(p50["direct"]):.3f} ms: '
                           f'+{H.med(p50["plane"]) - H.med(p50["direct"]):.3f} ms')

    def block_workers(self):
        """Workers 1..N (one per gateway CPU by default) at --scale-callers: how each target scales."""
        ncpu = max(1, len(self.opts.gateway_cpus) or os.cpu_count())
        counts = [int(x) for x in self.opts.workers_list.split(',')] if self.opts.workers_list else \
            list(range(1, ncpu + 1))
        call = self.calls_by_prefix('lookup', 'customer')[0]
        tgts = [t for t in self.supporting(call) if t.name != 'floor_hello']
        for w in counts:
            for rnd in range(self.opts.rounds):
                for t in H.rotated(tgts, self.rotation):
                    try:
                        self.start(t, workers=w)
                        r = self.measured(t, call, conns=self.opts.scale_callers, duration=self.opts.duration)
                        self.record('workers', t, call, rnd, r, conns=self.opts.scale_callers)
                    except Exception as exc:  # noqa: BLE001
                        self.fail('workers', f'{t.name} {w}w', exc)
                self.rotation += 1
            self.stop_all()

    def block_threads(self):
        """Threads per worker (1, 2, 4, 8), one worker, the lookup at --callers."""
        call = self.calls_by_prefix('lookup', 'customer')[0]
        tgts = [t for t in self.supporting(call) if t.name != 'floor_hello']
        for th in [int(x) for x in self.opts.threads_list.split(',')]:
            for rnd in range(self.opts.rounds):
                for t in H.rotated(tgts, self.rotation):
                    try:
                        self.start(t, workers=1, threads=th)
                        r = self.measured(t, call, conns=self.opts.callers, duration=self.opts.duration)
                        self.record('threads', t, call, rnd, r, conns=self.opts.callers)
                    except Exception as exc:  # noqa: BLE001
                        self.fail('threads', f'{t.name} {th}t', exc)
                self.rotation += 1
            self.stop_all()

    def block_recording(self):
        """Every run accounted for: after a run, the gateway's history must hold each call oha completed
        (and at most the ones still in flight when the run ended on top)."""
        calls = [c for c in self.calls if c.key is not None]
        tgts = [t for t in self.targets if t.kind == 'gateway']
        for rnd in range(self.opts.rounds):
            for call in calls[:2]:
                for t in H.rotated(tgts, self.rotation):
                    try:
                        self.start(t, workers=1)
                        # warm-up first, then a gap past a whole second, so the counted window (history's
                        # `since` has one-second resolution) holds only the measured run's calls
                        self.measured(t, call, conns=8, duration=self.opts.warmup or 0.5, warm=False)
                        time.sleep(1.2)
                        since = int(time.time())
                        r = self.measured(t, call, conns=self.opts.callers, duration=self.opts.duration, warm=False)
                        recorded = None
                        t0 = time.time()
                        # qag must hold every run: give its recorder up to 15 s; the peer is only reported
                        while time.time() - t0 < (15 if t.records_every_run else 1.5):
                            recorded = t.count_runs(since)
                            if recorded is None or recorded >= r['n']:
                                break
                            time.sleep(0.5)
                        waited = round(time.time() - t0, 2)
                        slack = r['n'] + r['aborted'] + self.opts.callers
                        ok = recorded is not None and r['n'] <= recorded <= slack
                        self.record('recording', t, call, rnd, r, conns=self.opts.callers, recorded=recorded,
                                    accounted=ok, must_record=t.records_every_run, record_wait_s=waited)
                        if recorded is not None and not ok:
                            H.progress(f'  !! {t.name}: {recorded} runs recorded for {r["n"]} completed calls')
                    except Exception as exc:  # noqa: BLE001
                        self.fail('recording', f'{t.name} {call.name}', exc)
                self.rotation += 1

    def block_roundtrips(self):
        """Round trips per call, counted from the databases' statistics (not assumed): transactions (PostgreSQL
        pg_stat_database) or statements (MariaDB Questions/Com_select) per completed call, data db and store."""
        if not self.roundtrip_counter:
            return
        # counts, not timings: one round of each call (the lookups and the write) is enough; smoke: one call
        calls = [c for c in self.calls if c.key is not None and not c.name.startswith('page')]
        calls = calls[:1] if self.opts.smoke else calls
        for call in calls:
            tgts = [t for t in self.supporting(call) if t.name != 'floor_hello']
            for rnd in range(self.opts.roundtrip_rounds):
                for t in H.rotated(tgts, self.rotation):
                    try:
                        self.start(t, workers=1)
                        self.measured(t, call, conns=8, duration=self.opts.warmup or 0.5, warm=False)
                        time.sleep(self.opts.settle)
                        c0 = self.roundtrip_counter(t)
                        r = self.measured(t, call, conns=self.opts.callers, duration=self.opts.duration, warm=False)
                        # stopping the target ends its sessions, which makes PostgreSQL publish their statistics
                        t.stop()
                        time.sleep(1.0)
                        c1 = self.roundtrip_counter(t)
                        per = {k: round((c1[k] - c0[k]) / max(r['n'], 1), 3) for k in c0 if k in c1}
                        self.record('roundtrips', t, call, rnd, r, conns=self.opts.callers, per_call=per)
                    except Exception as exc:  # noqa: BLE001
                        self.fail('roundtrips', f'{t.name} {call.name}', exc)
                self.rotation += 1

    def block_profile(self):
        """Where a worker's time goes: py-spy (200 Hz, --nonblocking, --gil: only the thread holding the GIL, so
        samples are Python CPU, not threads waiting on the database) on the busiest worker of each gateway and the
        database floor during one lookup run at --callers; self samples by module and by function."""
        import shutil
        import subprocess
        import tempfile
        import threading
        pyspy = shutil.which('py-spy')
        if not pyspy:
            H.progress('[profile] py-spy not installed (pip install py-spy): skipped')
            return
        call = self.calls_by_prefix('lookup', 'customer')[0]
        # py-spy reads Python processes only: the Rust plane (qag_plane) has nothing for it to sample
        tgts = [t for t in self.supporting(call) if t.name not in ('floor_hello', 'qag_plane')]
        for t in tgts:
            try:
                self.start(t, workers=1)
                self.prime(t, call, H.regex_escape_base(t.base) + t.path(call), t.headers(call))
                s0 = H.all_stats()
                t0 = t.ticks(s0)
                H.run_oha(self.oha, H.regex_escape_base(t.base) + t.path(call), duration=self.opts.warmup or 0.5,
                          conns=8, headers=t.headers(call), load_cpus=self.opts.load_cpus)
                t1 = t.ticks()
                busiest = max((p for p in t1 if p != t.proc.pid), key=lambda p: t1[p] - t0.get(p, 0),
                              default=t.proc.pid)
                out = tempfile.NamedTemporaryFile(suffix='.txt', delete=False).name
                dur = max(1, int(self.opts.duration))
                spy = subprocess.Popen([pyspy, 'record', '--pid', str(busiest), '--duration', str(dur), '--rate', '200',
                                        '--format', 'raw', '--nonblocking', '--gil', '--output', out],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                res = {}
                th = threading.Thread(target=lambda: res.update(self.measured(
                    t, call, conns=self.opts.callers, duration=dur, warm=False)))
                th.start()
                _, err = spy.communicate(timeout=dur + 60)
                th.join()
                mods, funcs, total = profile_summary(out)
                os.unlink(out)
                if not total:
                    raise RuntimeError(f'py-spy recorded nothing: {err.decode(errors="replace")[-300:]}')
                self.record('profile', t, call, 0, res, conns=self.opts.callers, samples=total,
                            by_module=mods[:20], by_function=funcs[:20])
            except Exception as exc:  # noqa: BLE001
                self.fail('profile', t.name, exc)
            finally:
                t.stop()

    def calls_by_prefix(self, *prefixes):
        return [c for c in self.calls if c.name.startswith(prefixes)]

    # ---------------------------------------------------------------- smoke check
    def check(self):
        rows = [r for r in self.results.rows]
        bad = [r for r in rows if r.get('non_2xx') or r.get('errors')]
        # only a gateway that promises every run recorded (qag) fails the check; the peer keeps each version's
        # newest QUERYAPIGATE_HISTORY_LIMIT runs by default, and is reported as measured.
        unaccounted = [r for r in rows if r['block'] == 'recording' and r.get('must_record')
                       and r.get('recorded') is not None and not r.get('accounted')]
        for r in rows:
            if r['block'] == 'recording' and r.get('must_record') and r.get('recorded') is None:
                print(f"  warning: {r['target']} has no readable history (GET /api/v1/history): recording unchecked")
        empty = [r for r in rows if r.get('n', 0) == 0]
        H.progress(f'{len(rows)} runs written to {self.opts.out}; {len(bad)} with non-2xx or errors; '
                   f'{len(unaccounted)} recording mismatches; {len(self.failures)} failures')
        missing = []
        for block in self.opts.blocks:
            if block in ('dbonly',) or (block == 'roundtrips' and not self.roundtrip_counter) \
                    or (block == 'rows' and self.rows_call is None) \
                    or (block == 'cache' and self.cache_calls is None) \
                    or (block == 'keys' and self.keys_spec is None) \
                    or (block == 'writes' and not any(c.name.startswith(('deposit', 'write')) for c in self.calls)) \
                    or (block == 'forward' and not any(getattr(t, 'plane', False) for t in self.targets)):
                continue
            if not any(r['block'] == block for r in rows):
                missing.append(block)
        for f in self.failures:
            print('  failure:', f)
        for r in bad:
            print(f"  non-2xx: [{r['block']}] {r['target']} {r['call']}: {r.get('codes')} {r.get('error_kinds')}")
        if missing:
            print('  blocks with no runs:', ', '.join(missing))
        ok = not (bad or self.failures or missing or empty or unaccounted)
        if self.opts.smoke:
            print('SMOKE', 'PASSED' if ok else 'FAILED', flush=True)
        return 0 if ok else 1


def main_exit(code):
    sys.exit(code)


def _module_of(frame):
    """'func (path/to/pkg/mod.py:12)' -> a readable module: qag.x.y, or the package after site-packages."""
    if '(' not in frame:
        return frame
    path = frame[frame.rfind('(') + 1:].split(':')[0]
    for marker in ('site-packages/', 'lib/python3.11/', '/work/main/', 'qagbench-src-'):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == 'qagbench-src-':
                path = path.split('/', 1)[1] if '/' in path else path
            break
    parts = path.replace('.py', '').split('/')
    if parts[0] in ('qag', 'shm', 'queryapigate') and len(parts) > 1:
        return '.'.join(parts[:2])
    return parts[0]


def profile_summary(path):
    """Self samples by module and by function from py-spy's raw (collapsed) output."""
    import collections
    mods, funcs, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            line = line.rstrip()
            if not line or ' ' not in line:
                continue
            stack, count = line.rsplit(' ', 1)
            try:
                n = int(count)
            except ValueError:
                continue
            leaf = stack.split(';')[-1]
            total += n
            mods[_module_of(leaf)] += n
            funcs[leaf.split(' (')[0] + ' ' + _module_of(leaf)] += n
    pct = lambda c: [[k, round(100.0 * v / total, 1)] for k, v in c.most_common()]  # noqa: E731
    return (pct(mods), pct(funcs), total) if total else ([], [], 0)
