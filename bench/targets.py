"""The things the bench measures, each started on a free port under taskset and stopped again: the peer
(queryapigate 0.43.0 from PyPI, in bench/.peer-venv, with and without its metadata cache), qag (`qag serve`,
and the Rust data plane behind `--plane` when it exists), and the two Falcon floors."""
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import requests
from harness import BENCH_DIR, free_port, progress, stop_process, taskset_prefix, tree_ticks, wait_http

PEER_VERSION = '0.43.0'
PEER_VENV = os.path.join(BENCH_DIR, '.peer-venv')
PG_ADMIN_DSN = 'postgresql://postgres@127.0.0.1:5432/postgres'


# ---------------------------------------------------------------- what a harness hands a target

class Call:
    """One kind of request: a saved query called with one key, as an oha URL regex (random id per request)."""

    def __init__(self, name, query, key, path_regex, floor=None, method='GET'):
        self.name, self.query, self.key, self.path_regex, self.method = name, query, key, path_regex, method
        self.floor = floor  # the floor path regex serving the same work, or None if no floor does

    def __repr__(self):
        return f'Call({self.name})'


HELLO = Call('hello', None, None, '/health', floor='/health')


class Workload:
    """Everything created through the Management API on every gateway: one connection, saved queries, keys."""

    def __init__(self, connection, queries, keys, data_db=None, floor_env=None):
        self.connection, self.queries, self.keys = connection, queries, keys
        self.data_db = data_db
        self.floor_env = floor_env or {}


def recreate_pg_db(name):
    """Drop and create a PostgreSQL database (the gateways' stores start empty every session)."""
    import psycopg2
    conn = psycopg2.connect(PG_ADMIN_DSN)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()


# ---------------------------------------------------------------- base

class Target:
    kind = 'gateway'
    name = 'target'
    records_every_run = False

    def __init__(self, opts, workload):
        self.opts, self.workload = opts, workload
        self.proc = None
        self.port = None
        self.secrets = {}
        self.is_setup = False
        self.workers = self.threads = None
        self.logdir = tempfile.mkdtemp(prefix=f'qagbench-{self.name}-')

    # --- lifecycle
    def command(self, workers, threads):
        raise NotImplementedError

    def env(self):
        return dict(os.environ)

    def start(self, workers=1, threads=None):
        """Start on a fresh free port under taskset --gateway-cpus; set the workload up the first time."""
        threads = threads or self.default_threads
        if self.proc is not None and self.workers == workers and self.threads == threads:
            return
        self.stop()
        self.port = free_port()
        cmd = taskset_prefix(self.opts.gateway_cpus) + self.command(workers, threads)
        log = open(os.path.join(self.logdir, f'server-{workers}w{threads}t.log'), 'ab')
        self.proc = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.logdir)
        log.close()
        self.workers, self.threads = workers, threads
        try:
            wait_http(self.base + '/health', timeout=60, proc=self.proc)
        except Exception:
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f'{self.name} failed to start: {" ".join(cmd)}\n{tail}') from None
        # gunicorn forks workers after the arbiter answers nothing itself; give each worker a moment.
        time.sleep(0.3 * workers)
        if not self.is_setup:
            self.setup()
            self.is_setup = True

    def stop(self):
        stop_process(self.proc)
        self.proc = None

    def log_tail(self, n=30):
        out = []
        for fn in sorted(os.listdir(self.logdir)):
            if fn.endswith('.log'):
                with open(os.path.join(self.logdir, fn), 'rb') as f:
                    out += f.read().decode(errors='replace').splitlines()[-n:]
        return '\n'.join(out[-n:])

    @property
    def base(self):
        return f'http://127.0.0.1:{self.port}'

    def ticks(self, stats=None):
        return tree_ticks(self.proc.pid, stats) if self.proc else {}

    def pids(self):
        return list(self.ticks())

    # --- the workload
    def setup(self):
        pass

    def supports(self, call):
        return True

    def path(self, call):
        return call.path_regex

    def headers(self, call):
        if call.key is None:
            return {}
        return {'X-API-Key': self.secrets[call.key]}

    def count_runs(self, since):
        """How many runs the gateway's history holds since `since` (epoch s), or None if it can't say."""
        return None

    def store_db(self):
        return None


# ---------------------------------------------------------------- gateways sharing the QueryAPIGate Management API

class ManagedGateway(Target):
    admin_key = 'bench-admin-' + secrets.token_hex(8)
    default_threads = 8

    def api(self, method, path, body=None, ok=(200, 201)):
        r = requests.request(method, self.base + path, json=body, headers={'X-API-Key': self.admin_key}, timeout=30)
        if r.status_code not in ok:
            raise RuntimeError(f'{self.name}: {method} {path} -> {r.status_code} {r.text[:400]}')
        return r.json() if r.content else None

    def setup(self):
        """The same management calls on every gateway: the connection, the saved queries, the keys."""
        w = self.workload
        self.api('POST', '/api/v1/connections', w.connection)
        for q in w.queries:
            self.api('POST', '/api/v1/queries', q)
        for name, grants in w.keys.items():
            body = self.api('POST', '/api/v1/api-keys', {'name': name, **grants})
            self.secrets[name] = body['secret']
        progress(f'{self.name}: set up connection, {len(w.queries)} queries, {len(w.keys)} keys')

    def count_runs(self, since):
        """Runs in history since `since`, paging GET /api/v1/history (newest first) until older ones show."""
        total, cursor = 0, None
        since_s = self.history_time(since)
        for _ in range(2000):
            params = {'limit': 1000, 'since': since_s}
            if cursor:
                params['cursor'] = cursor
            r = requests.get(self.base + '/api/v1/history', params=params,
                             headers={'X-API-Key': self.admin_key}, timeout=60)
            if r.status_code != 200:
                return None
            body = r.json()
            total += sum(1 for it in body.get('items', []) if it.get('query'))
            cursor = body.get('next_cursor')
            if not cursor:
                return total
        return total

    def history_time(self, since):
        return time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since))


class Peer(ManagedGateway):
    """QueryAPIGate 0.43.0 as its image runs it: gunicorn, gthread, 8 threads, the access log on."""
    name = 'peer'

    def __init__(self, opts, workload, cache=False):
        self.cache = cache
        self.name = 'peer_cache' if cache else 'peer'
        super().__init__(opts, workload)
        self.home = tempfile.mkdtemp(prefix=f'qagbench-{self.name}-home-')
        # one store per target and harness, so the two harnesses can't drop each other's store
        self.store = 'qag_bench_peerstore' + ('_cache' if cache else '') + getattr(opts, 'store_suffix', '')
        recreate_pg_db(self.store)

    @staticmethod
    def ensure_venv():
        """bench/.peer-venv with queryapigate 0.43.0 from PyPI (created on first use)."""
        gunicorn = os.path.join(PEER_VENV, 'bin', 'gunicorn')
        py = os.path.join(PEER_VENV, 'bin', 'python')
        if os.path.exists(gunicorn):
            check = subprocess.run([py, '-c', 'import importlib.metadata as m; print(m.version("queryapigate"))'],
                                   capture_output=True, text=True)
            if check.stdout.strip() == PEER_VERSION:
                return
        progress(f'building {PEER_VENV} (queryapigate=={PEER_VERSION} from PyPI)')
        subprocess.run([sys.executable, '-m', 'venv', PEER_VENV], check=True)
        subprocess.run([py, '-m', 'pip', 'install', '-q',
                        f'queryapigate[server,postgres,mysql,flow]=={PEER_VERSION}'], check=True)

    def command(self, workers, threads):
        return [os.path.join(PEER_VENV, 'bin', 'gunicorn'), '--bind', f'127.0.0.1:{self.port}',
                '--workers', str(workers), '--worker-class', 'gthread', '--threads', str(threads),
                '--access-logfile', os.path.join(self.logdir, 'access.log'),
                # gunicorn 27's control socket is one fixed path per user; off so parallel servers don't collide
                '--no-control-socket',
                '-c', 'python:queryapigate.gunicorn_conf', 'queryapigate.app:create_app()']

    def env(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith(('QUERYAPIGATE_', 'QAG_'))}
        env.update({
            'QUERYAPIGATE_HOME': self.home,
            'QUERYAPIGATE_API_KEY': self.admin_key,
            'QUERYAPIGATE_DATABASE_URL': f'postgresql://postgres@127.0.0.1:5432/{self.store}',
            'QUERYAPIGATE_ALLOW_WRITES': '1',
            'PATH': os.path.join(PEER_VENV, 'bin') + ':' + env.get('PATH', ''),
        })
        env.pop('VIRTUAL_ENV', None)
        env.pop('PYTHONPATH', None)
        if self.cache:
            env['QUERYAPIGATE_METADATA_CACHE_TTL'] = '5'
        return env

    def history_time(self, since):
        # QueryAPIGate 0.43 stores executed_at in the server's local time, to the second.
        return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))

    def store_db(self):
        return self.store


class Qag(ManagedGateway):
    """qag as shipped: `qag serve` (arbiter, one worker per core, recorder); `plane=True` adds the Rust plane."""
    default_threads = None  # qag's own default unless a block sets threads
    records_every_run = True

    def __init__(self, opts, workload, plane=False):
        self.plane = plane
        self.name = 'qag_plane' if plane else 'qag'
        super().__init__(opts, workload)
        self.home = tempfile.mkdtemp(prefix=f'qagbench-{self.name}-home-')
        self.store = 'qag_bench_store' + ('_plane' if plane else '') + getattr(opts, 'store_suffix', '')
        recreate_pg_db(self.store)

    @staticmethod
    def binary():
        return shutil.which('qag') or os.path.join(os.path.dirname(sys.executable), 'qag')

    def command(self, workers, threads):
        if getattr(self.opts, 'qag_src', None):
            # a snapshot exported with git archive (--qag-ref): the code can't change under a session
            head = [sys.executable, '-c', 'import sys; from qag.cli import main; sys.argv[0] = "qag"; sys.exit(main())']
        else:
            head = [self.binary()]
        cmd = head + ['serve', '--bind', f'127.0.0.1:{self.port}', '--workers', str(workers)]
        if threads:
            cmd += ['--threads', str(threads)]
        if self.plane:
            cmd += ['--plane']  # hook for the Rust data plane (rustplane/); flag name per the lead's CLI
        return cmd

    def env(self):
        # the caller's QAG_* settings stay out of a measured instance, except the data plane's own knobs
        # (QAG_PLANE_NICE, QAG_PLANE_BIN…), which a session may set on purpose
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(('QUERYAPIGATE_', 'QAG_')) or k.startswith('QAG_PLANE_')}
        env.update({
            'QAG_HOME': self.home,
            'QAG_ADMIN_KEY': self.admin_key,
            'QAG_DATABASE_URL': f'postgresql://postgres@127.0.0.1:5432/{self.store}',
            'QAG_ALLOW_WRITES': '1',
        })
        if getattr(self.opts, 'shm_size', ''):
            env['QAG_SHM_SIZE'] = str(self.opts.shm_size)  # sized on purpose (--shm-size), as an operator would
        if getattr(self.opts, 'qag_src', None):
            env['PYTHONPATH'] = self.opts.qag_src
            plane = os.path.join(self.opts.qag_src, 'qag-plane')
            if os.path.exists(plane):
                env['QAG_PLANE_BIN'] = plane
        return env

    def history_time(self, since):
        return time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(since))

    def store_db(self):
        return self.store


# ---------------------------------------------------------------- floors

class Floor(Target):
    kind = 'floor'
    default_threads = 8
    module = None

    def command(self, workers, threads):
        return [os.path.join(os.path.dirname(sys.executable), 'gunicorn'), '--bind', f'127.0.0.1:{self.port}',
                '--workers', str(workers), '--worker-class', 'gthread', '--threads', str(threads),
                '--no-control-socket', '--chdir', os.path.join(BENCH_DIR, 'floors'), f'{self.module}:app']

    def env(self):
        env = dict(os.environ)
        env.update(self.workload.floor_env)
        return env

    def headers(self, call):
        return {}

    def path(self, call):
        return call.floor


class FloorPg(Floor):
    """Bare Falcon + psycopg2 doing the same lookup: what a gateway is compared with."""
    name = 'floor_pg'
    module = 'falcon_pg'

    def supports(self, call):
        return call.floor is not None


class FloorMysql(FloorPg):
    """Bare Falcon + mysql-connector running the tpcc_mysql queries: the floor on MariaDB."""
    name = 'floor_mysql'
    module = 'falcon_mysql'


class FloorHello(Floor):
    """Bare Falcon hello-world: gunicorn + Falcon, no database."""
    name = 'floor_hello'
    module = 'falcon_hello'

    def supports(self, call):
        return call.name == 'hello'


TARGET_NAMES = ('peer', 'peer_cache', 'qag', 'qag_plane', 'floor_pg', 'floor_mysql', 'floor_hello')


def expand_targets(spec, db_floor='floor_pg'):
    """--targets: names, or groups 'peer'/'peers' (both peer modes), 'floor' (the harness's database floor and
    the hello floor), 'all'."""
    out = []
    for part in (spec or '').split(','):
        part = part.strip()
        group = {'all': ['peer', 'peer_cache', 'qag', db_floor, 'floor_hello'],
                 'peer': ['peer', 'peer_cache'], 'peers': ['peer', 'peer_cache'], 'peer_nocache': ['peer'],
                 'floor': [db_floor, 'floor_hello'], 'floors': [db_floor, 'floor_hello'],
                 'plane': ['qag_plane']}.get(part, [part] if part else [])
        for name in group:
            if name not in TARGET_NAMES:
                raise SystemExit(f'unknown target {name!r}; choose from {", ".join(TARGET_NAMES)}')
            if name not in out:
                out.append(name)
    return out


def snapshot_qag(ref):
    """Export qag/ and shm/ at a git ref into a temp dir (git archive: read-only on the shared checkout)."""
    from harness import REPO_DIR
    commit = subprocess.run(['git', '-C', REPO_DIR, 'rev-parse', ref], capture_output=True, text=True,
                            check=True).stdout.strip()
    dest = tempfile.mkdtemp(prefix=f'qagbench-src-{commit[:8]}-')
    archive = subprocess.Popen(['git', '-C', REPO_DIR, 'archive', commit, 'qag', 'shm'], stdout=subprocess.PIPE)
    subprocess.run(['tar', '-x', '-C', dest], stdin=archive.stdout, check=True)
    archive.wait()
    # the data plane binary is a build output, not in git: copy the current release build beside the snapshot
    plane = os.path.join(REPO_DIR, 'rustplane', 'target', 'release', 'qag-plane')
    if os.path.exists(plane):
        shutil.copy2(plane, os.path.join(dest, 'qag-plane'))
    return dest, commit


def working_tree_commit():
    from harness import REPO_DIR
    head = subprocess.run(['git', '-C', REPO_DIR, 'rev-parse', 'HEAD'], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(['git', '-C', REPO_DIR, 'status', '--porcelain', '--', 'qag', 'shm'],
                           capture_output=True, text=True).stdout.strip()
    return head + ('+dirty' if dirty else '')


def make_target(name, opts, workload):
    if name == 'peer':
        return Peer(opts, workload)
    if name == 'peer_cache':
        return Peer(opts, workload, cache=True)
    if name == 'qag':
        return Qag(opts, workload)
    if name == 'qag_plane':
        return Qag(opts, workload, plane=True)
    if name == 'floor_pg':
        return FloorPg(opts, workload)
    if name == 'floor_mysql':
        return FloorMysql(opts, workload)
    if name == 'floor_hello':
        return FloorHello(opts, workload)
    raise ValueError(name)
