"""`qag serve`: gunicorn's arbiter running the Falcon app, one worker per physical core, pinned.

The arbiter migrates the store, creates the shared segment before it forks, starts the recorder, and
gives each worker a slot (its index, reused by the worker that replaces it) and one logical CPU of
its own physical core.

Sizing threads (docs/operations.md): threads wait on databases, they add no CPU. QAG_THREADS bounds the
calls a worker has in the database at once: count the calls in flight at the peak (calls/s × mean
database seconds per call / workers), add what the slowest key may hold (QAG_KEY_CALLS, by default all
threads but one), and keep QAG_THREADS × workers within the sessions the database may give qag. The
Management API and the operations routes have reserve threads (QAG_RESERVE_THREADS) and /health and
/metrics one of their own, so none of them is sized into QAG_THREADS.
"""
from __future__ import annotations

import logging
import os
import sys

from gunicorn.app.base import BaseApplication

from qag import logs

log = logging.getLogger("qag.serve")

# Exit codes (named, as gunicorn names its own).
EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_STORE = 3

_WORKER_SLOT: int | None = None
_WORKER_CPU: int | None = None


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def physical_cores(cpus: list[int] | None = None) -> list[list[int]]:
    """Allowed logical CPUs grouped by physical core (package, core id), in CPU order."""
    cpus = allowed_cpus() if cpus is None else cpus
    groups: dict[tuple, list[int]] = {}
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            core = open(base + "core_id").read().strip()
            pkg = open(base + "physical_package_id").read().strip()
            key = (pkg, core)
        except OSError:
            key = ("cpu", str(cpu))  # no topology: every logical CPU is its own core
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values(), key=lambda g: g[0])


def plan_workers(workers, cpus: list[int] | None = None) -> list[int]:
    """The CPU each worker slot is pinned to: slot i gets the first logical CPU of core i (mod cores)."""
    cores = physical_cores(cpus)
    n = len(cores) if workers == "auto" else int(workers)
    return [cores[i % len(cores)][0] for i in range(n)]


def set_title(title: str) -> None:
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover
        pass


class QagGunicorn(BaseApplication):
    def __init__(self, cfg, *, pin: bool, workers: int, cpu_plan: list[int], segment_name: str | None):
        self.qcfg = cfg
        self.pin = pin
        self.nworkers = workers
        self.cpu_plan = cpu_plan
        self.segment_name = segment_name
        super().__init__()

    def load_config(self):
        qcfg = self.qcfg
        s = self.cfg.set
        s("bind", [qcfg.bind])
        s("workers", self.nworkers)
        s("threads", qcfg.threads)
        s("worker_class", "qag.server.gworker.QagWorker" if qcfg.http_worker == "qag" else "gthread")
        s("proc_name", "qag")
        s("limit_request_line", 0)  # a 1 MB parameter gets our JSON 400, not gunicorn's HTML
        s("limit_request_field_size", 65536)
        s("graceful_timeout", 20)
        s("timeout", 60)
        s("keepalive", qcfg.keepalive)
        s("worker_connections", qcfg.max_connections)
        s("loglevel", qcfg.log_level)
        s("errorlog", "-")
        s("logger_class", logs.gunicorn_logger_class())  # QAG_LOG_FORMAT=json: gunicorn's lines too
        if qcfg.access_log:
            s("accesslog", "-")
        s("pre_fork", self._pre_fork)
        s("post_fork", self._post_fork)
        s("when_ready", self._when_ready)
        s("on_exit", self._on_exit)
        s("child_exit", self._child_exit)
        s("worker_exit", self._worker_exit)
        s("control_socket_disable", True)  # two instances on one host must not share ~/.gunicorn/gunicorn.ctl

    def _when_ready(self, server):
        set_title("qag: arbiter")
        hooks = getattr(self, "arbiter_hooks", None)
        if hooks is not None:
            hooks.ready(server)

    def _pre_fork(self, server, worker):
        used = {getattr(w, "qag_slot", None) for w in server.WORKERS.values()}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        worker.qag_slot = slot

    def _post_fork(self, server, worker):
        global _WORKER_SLOT, _WORKER_CPU
        slot = worker.qag_slot
        _WORKER_SLOT = slot
        logs.rename(f"worker:{slot}")
        cpu = None
        if self.pin and self.cpu_plan:
            cpu = self.cpu_plan[slot % len(self.cpu_plan)]
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError as exc:
                log.warning("could not pin worker %d to CPU %d: %s", slot, cpu, exc)
                cpu = None
        _WORKER_CPU = cpu
        set_title(f"qag: worker {slot} [cpu {cpu}]" if cpu is not None else f"qag: worker {slot}")

    def _child_exit(self, server, worker):
        hooks = getattr(self, "arbiter_hooks", None)
        if hooks is not None:
            hooks.worker_exited(getattr(worker, "qag_slot", None), worker.pid)

    def _worker_exit(self, server, worker):
        """In the stopping worker, after its last call: its quota and rate-limit leases go back to Redis, so the
        counters hold exactly what it spent (qag/limits.py)."""
        limiter = getattr(getattr(getattr(worker, "wsgi", None), "auth", None), "limiter", None)
        if limiter is not None:
            try:
                limiter.return_leases()
            except Exception as exc:  # noqa: BLE001 - a stop must finish; unreturned units only under-admit
                log.warning("could not give back this worker's limit leases: %s", exc)

    def _on_exit(self, server):
        hooks = getattr(self, "arbiter_hooks", None)
        if hooks is not None:
            hooks.stop()

    def load(self):
        from qag.server.worker import build_worker_app
        return build_worker_app(self.qcfg, slot=_WORKER_SLOT or 0, segment_name=self.segment_name,
                                plane_slot=getattr(self.arbiter_hooks, "plane_slot", None))


def _refuse_on_stop() -> None:
    """On a stop, new connections are refused, not accepted and reset (issue 13 item 5). gunicorn's arbiter
    closes its listening sockets before it signals the workers, but each worker holds the same socket, so
    the kernel would go on completing handshakes into the backlog until the last worker exits, and reset
    them all then. `shutdown()` stops the socket itself listening, in every process at once: from then on a
    connect is refused. Before that, the workers (still running) get up to 100 ms to take what the backlog
    already holds, which they then serve. Only the arbiter's stop calls close_sockets; a reload or a
    replaced worker keeps the socket listening."""
    import socket as _socket
    import struct
    import time

    from gunicorn import sock as gsock
    close = gsock.close_sockets

    def backlog(s) -> int:
        try:  # TCP_INFO's tcpi_unacked is a listening socket's accept queue length (Linux)
            info = s.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_INFO, 104)
            return struct.unpack_from("I", info, 24)[0]
        except (OSError, AttributeError, struct.error):
            return 0

    def close_sockets(listeners, unlink=True):
        deadline = time.monotonic() + 0.1
        for s in listeners:
            tcp = s.family in (_socket.AF_INET, _socket.AF_INET6)
            while tcp and backlog(s) and time.monotonic() < deadline:
                time.sleep(0.002)
            try:
                s.shutdown(_socket.SHUT_RDWR)
            except OSError:
                pass
        close(listeners, unlink)
    gsock.close_sockets = close_sockets


def _check_redis(url: str) -> None:
    """Redis is asked once at start; one that does not answer is no reason to refuse calls (limits and quotas
    are decided per host meanwhile, and moved to Redis by themselves when it answers), but the operator
    hears of it now, not at the first limited call."""
    import redis
    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        _say(f"qag: warning: Redis at QAG_REDIS_URL does not answer ({type(exc).__name__}: {exc}); rate limits and "
             "quotas start per host (fallback, counted in qag_limits_fallback_total) and move to Redis when it "
             "answers")
    finally:
        client.close()


def _say(message: str, level: int = logging.WARNING) -> None:
    """A line of the start-up (before gunicorn logs anything): as it always read, or one JSON object."""
    if logs.is_json():
        logging.getLogger("qag.serve").log(level, message.removeprefix("qag: ").removeprefix("warning: "))
    else:
        print(message, file=sys.stderr)


def run(cfg, *, pin: bool = True, plane: bool = False, plane_threads: int | None = None) -> int:
    """Start the arbiter in this process (returns when it stops)."""
    from qag import config as _config
    logs.setup("arbiter", cfg.log_format, cfg.log_level if cfg.log_format == "json" else None)
    from qag.errors import SchemaTooNew, StoreUnavailable
    from qag.store import Store
    for name in _config.unknown_variables():
        _say(f"qag: warning: {name} is not a qag setting (misspelt?); it is ignored. `qag config` lists them.")
    store = Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key)
    try:
        store.migrate()
    except (StoreUnavailable, SchemaTooNew) as exc:  # SchemaTooNew: a newer qag migrated it (rolling upgrades)
        _say(f"qag: cannot start: {exc}", logging.ERROR)
        return EXIT_STORE
    except Exception as exc:  # e.g. a corrupt SQLite file, a PostgreSQL permission error
        _say(f"qag: cannot start: the metadata store failed to open: {exc}", logging.ERROR)
        return EXIT_STORE
    if not cfg.admin_key and not store.run(lambda cur: (cur.execute("SELECT 1 FROM qag_admins WHERE active = 1"),
                                                        cur.fetchone())[1]):
        _say("qag: warning: no administrator can sign in (QAG_ADMIN_KEY is empty and there is no administrator "
             "token): create one with `qag admins create NAME`")
    if cfg.redis_url:
        _check_redis(cfg.redis_url)
    plane_opts = None
    if plane:
        from qag.server import arbiter as _arb
        binary = _arb.plane_binary()
        if binary is None:
            _say("qag: cannot start: --plane needs the qag-plane binary (cargo build --release in rustplane/, "
                 "or set QAG_PLANE_BIN)", logging.ERROR)
            store.close()
            return EXIT_CONFIG
        import secrets as _secrets
        mask_key = (cfg.mask_key.encode() if cfg.mask_key else
                    store.kv_get_or_set("mask_key", lambda: _secrets.token_hex(32)).encode())
        upstream = "unix:" + os.path.join(cfg.home, "gunicorn.sock")
        plane_opts = {"binary": binary, "listen": cfg.bind, "upstream": upstream, "mask_key": mask_key,
                      "threads": plane_threads or len(physical_cores()),
                      "cpus": [c[0] for c in physical_cores()] if pin and cfg.pin else None}
        cfg.behind_plane(upstream)
    store.close()
    cpu_plan = plan_workers(cfg.workers)
    workers = len(cpu_plan)
    from qag.server import arbiter
    hooks = arbiter.ArbiterHooks(cfg, workers, plane_opts)
    try:
        segment_name = hooks.start()
    except arbiter.StartFailed as exc:  # one line; start() left nothing behind in /dev/shm
        _say(f"qag: cannot start: {exc}", logging.ERROR)
        return EXIT_STORE
    import gunicorn.util

    def _title(title: str) -> None:  # gunicorn names its master "master [qag]"; ours is "qag: arbiter"
        if title.startswith("master"):
            set_title("qag: arbiter")
    gunicorn.util._setproctitle = _title
    from qag.server import gworker
    gworker.QagWorker.qag = cfg  # read by each worker after fork
    _refuse_on_stop()
    app = QagGunicorn(cfg, pin=pin and cfg.pin, workers=workers, cpu_plan=cpu_plan, segment_name=segment_name)
    app.arbiter_hooks = hooks
    try:
        app.run()
    finally:
        hooks.stop()
    return EXIT_OK

