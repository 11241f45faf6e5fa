"""What the arbiter does around gunicorn: the shared segment's life and the recorder's supervision.

The segment is created before the first fork (so every worker attaches the same one) and unlinked on
a clean stop. The recorder is a child process, restarted with backoff whenever it dies; it resumes
from the positions it made durable in the run store, so a crash loses no run.
"""
from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from qag.server.changes import watcher_current, watcher_slot

log = logging.getLogger("qag.arbiter")

# Slots: workers take 0..N-1; the recorder and the data plane take fixed slots at the top.
RECORDER_SLOT_FROM_TOP = 1
PLANE_SLOT_FROM_TOP = 2
# (the change watcher's slot is declared with the watcher: qag/server/changes.py watcher_slot)
PLANE_CHILD = "the data plane"


def instance_name(cfg) -> str:
    """Two `qag serve` on one host never share a segment: the name derives from QAG_HOME and the bind."""
    try:
        import shm
        return shm.segment_name(f"{cfg.home}|{getattr(cfg, 'public_bind', cfg.bind)}")
    except (ImportError, AttributeError):
        return "/qag-" + hashlib.sha256(f"{cfg.home}|{getattr(cfg, 'public_bind', cfg.bind)}".encode()).hexdigest()[:16]


def run_store_url(cfg) -> str:
    """ClickHouse when QAG_RUN_STORE_URL is set; else the metadata store's PostgreSQL; else runs.db in
    QAG_HOME (a separate SQLite file, so batches never hold the metadata store's write lock)."""
    if cfg.run_store_url:
        return cfg.run_store_url
    if cfg.database_url:
        return cfg.database_url
    return os.path.join(cfg.home, "runs.db")


def _probe_bind(addr: str) -> None:
    """StartFailed now if a TCP address (HOST:PORT, [V6]:PORT) cannot be listened on; unix sockets are gunicorn's."""
    import socket
    if addr.startswith(("unix:", "fd://")) or ":" not in addr:
        return
    host, _, port = addr.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError) as exc:
        raise StartFailed(f"cannot listen on {addr}: {_one_line(exc)}") from None
    fam, kind, proto, _, sockaddr = infos[0]
    with socket.socket(fam, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise StartFailed(f"cannot listen on {addr}: {exc.strerror or exc}") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= 240 else line[:239] + "…"


def _redact(url: str) -> str:
    import re
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:********@", url)


def slot_count(workers: int) -> int:
    return max(8, workers + 4)


def plane_binary() -> str | None:
    """QAG_PLANE_BIN, else `qag-plane` on PATH, else the crate's release build next to the package."""
    import shutil
    env = os.environ.get("QAG_PLANE_BIN")
    if env:
        return env
    found = shutil.which("qag-plane")
    if found:
        return found
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # qag/server/ -> ..
    here = os.path.join(checkout, "rustplane", "target", "release", "qag-plane")
    return here if os.path.exists(here) else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the arbiter dies, even by SIGKILL (Linux PR_SET_PDEATHSIG),
    so no recorder, watcher or plane outlives its instance."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


class StartFailed(Exception):
    """A start that cannot go on, said in one line; whatever the start had made is gone again."""


def describe_exit(returncode: int | None) -> str:
    """How a child ended, from Popen's returncode (negative: the signal that killed it)."""
    if returncode is None:
        return "ended (its exit status was reaped elsewhere and is unknown)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


class Child:
    """A supervised child process: restarted with backoff (0.2 s doubling to 10 s; reset after 30 s alive)."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None):
        self.name = name
        self.cmd = cmd
        self.env = env or dict(os.environ)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.backoff = 0.2
        self.restarts = 0
        self.next_start = 0.0
        self.exit_status: int | None = None  # Popen-style returncode of the last exit, None = unknown
        self._reap_lock = threading.RLock()  # also taken by gunicorn's SIGCHLD handler, maybe inside stop()

    def reap(self) -> bool:
        """True once the child has ended, its status kept in `exit_status`. Two reapers race for it: this
        supervisor and gunicorn's arbiter, whose reap_workers() waits for *any* child (waitpid(-1)) and
        drops those that are not workers, after which Popen can only say "code 0". Both reap through here
        (see ArbiterHooks.ready), so the real status is never lost."""
        proc = self.proc
        if proc is None:
            return False
        with self._reap_lock:
            if proc.returncode is not None:
                return True
            try:
                pid, status = os.waitpid(proc.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by a nested call (a signal handler), or before the hook was in place
                if proc.returncode is None:
                    proc.returncode = 0
                    self.exit_status = None
                return True
            if pid == 0:
                return False
            proc.returncode = self.exit_status = os.waitstatus_to_exitcode(status)
            return True

    def spawn(self) -> None:
        # Its own session: a signal to the instance's process group (Ctrl-C in a terminal, `kill -- -PGID`,
        # systemd's control-group stop) reaches the arbiter and the workers, never the children directly;
        # the arbiter stops them itself, in order (the plane, then the recorder, which drains what the
        # workers recorded while they finished their last calls). PR_SET_PDEATHSIG still ends them if the
        # arbiter dies.
        with self._reap_lock:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent, start_new_session=True)
            self.exit_status = None
        self.started = time.monotonic()

    def check(self) -> None:
        if not self.reap():
            return
        now = time.monotonic()
        if self.next_start == 0.0:
            if now - self.started > 30:
                self.backoff = 0.2
            log.warning("%s (pid %d) %s; restarting in %.1f s", self.name, self.proc.pid,
                        describe_exit(self.exit_status), self.backoff)
            self.next_start = now + self.backoff
            self.backoff = min(self.backoff * 2, 10.0)
        elif now >= self.next_start:
            self.next_start = 0.0
            self.restarts += 1
            self.spawn()

    def stop(self, timeout: float = 15) -> None:
        if self.reap():
            self.proc = None
            return
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()


AUTO_RESPONSE_CACHE_MB = 16


def response_cache_bytes(cfg, slots: int) -> int:
    """QAG_RESPONSE_CACHE_MB in bytes, checked against QAG_SHM_SIZE (shm/LAYOUT.md [Geometry]): a value set that
    does not fit stops the start with a message naming both settings (issue 17's "Bad input"); `auto` (the
    default) takes 16 MiB or what a smaller segment leaves, so a small QAG_SHM_SIZE alone still starts."""
    from shm import layout
    mb = getattr(cfg, "response_cache_mb", 0) or 0
    most = layout.max_responses_size(cfg.shm_size, slots) if cfg.shm_size >= layout.MIN_SIZE else 0
    if mb == "auto":  # 16 MiB, or what a smaller segment leaves (whole MiB; 0: no response cache)
        return min(AUTO_RESPONSE_CACHE_MB, most >> 20) << 20
    if mb << 20 > most:
        raise StartFailed(f"QAG_RESPONSE_CACHE_MB={mb} does not fit in the shared-memory segment: with "
                          f"QAG_SHM_SIZE={cfg.shm_size} and {slots} process slots the response cache may have at "
                          f"most {most >> 20} MiB; lower QAG_RESPONSE_CACHE_MB or raise QAG_SHM_SIZE")
    return mb << 20


class ArbiterHooks:
    def __init__(self, cfg, workers: int = 1, plane: dict | None = None):
        self.cfg = cfg
        self.workers = workers
        self.plane = plane  # {"listen", "upstream", "threads", "cpus", "mask_key"} when --plane
        self.segment = None
        self.segment_name: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.recorder_restarts = 0
        self.invalidations = 0  # times the supervisor bumped every generation for a watcher not caught up

    def start(self) -> str | None:
        """Create the segment and start the children; a failure raises StartFailed (one line) after removing
        what was made, so a failed start leaves no segment or semaphore in /dev/shm and no child running."""
        import shm
        self.segment_name = instance_name(self.cfg)
        slots = slot_count(self.workers)
        for addr in {getattr(self.cfg, "public_bind", None) or self.cfg.bind, self.cfg.bind}:
            _probe_bind(addr)  # before anything is made: gunicorn would retry for 5 s, logging each try
        responses_size = response_cache_bytes(self.cfg, slots)  # StartFailed naming the settings if too large
        try:
            self.segment = shm.Segment.create(self.segment_name, self.cfg.shm_size, slots=slots,
                                              responses_size=responses_size)
        except shm.LayoutError as exc:  # another running instance owns it: never remove that one's segment
            raise StartFailed(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise StartFailed(f"cannot create the shared-memory segment {self.segment_name}: "
                              f"{_one_line(exc)}") from None
        try:
            self._start_children(slots)
        except BaseException as exc:
            self.stop()
            if isinstance(exc, StartFailed):
                raise
            if not isinstance(exc, Exception):
                raise
            raise StartFailed(_one_line(exc)) from None
        return self.segment_name

    def _start_children(self, slots: int) -> None:
        self.recorder_slot = slots - RECORDER_SLOT_FROM_TOP
        self.plane_slot = slots - PLANE_SLOT_FROM_TOP
        # The store's schema exists before any worker serves (history reads must not race its creation).
        url = run_store_url(self.cfg)
        logging.disable(logging.ERROR)  # the drivers' own log lines would add to the one line that says why
        try:
            from qag.runstore import open_store
            st = open_store(url)
            st.ensure_schema()
            st.close()
        except ImportError as exc:
            extra = "clickhouse" if "clickhouse" in str(exc) or url.startswith(("clickhouse", "chdb")) else "server"
            raise StartFailed(f"the run store at {_redact(url)} needs a module that is not installed "
                              f"({_one_line(exc)}): pip install 'qag[{extra}]'") from None
        except Exception as exc:
            raise StartFailed(f"the run store at {_redact(url)} cannot be opened: {_one_line(exc)}") from None
        finally:
            logging.disable(logging.NOTSET)
        self.children = [Child("the recorder", [sys.executable, "-m", "qag.recorder", "--segment", self.segment_name,
                                                "--store", url, "--slot", str(self.recorder_slot)])]
        self.watcher_slot = watcher_slot(slots)
        self.children.append(Child("the change watcher", [sys.executable, "-m", "qag.server.changes", "--segment",
                                                          self.segment_name, "--slot", str(self.watcher_slot)]))
        if self.plane is not None:
            self.children.append(self._plane_child())
        for c in self.children:
            c.spawn()
        self._thread = threading.Thread(target=self._supervise, name="qag-supervisor", daemon=True)
        self._thread.start()

    @property
    def recorder(self):
        return self.children[0].proc if getattr(self, "children", None) else None

    def _plane_child(self) -> Child:
        p = self.plane
        secret_dir = os.path.join(self.cfg.home, "plane")
        os.makedirs(secret_dir, mode=0o700, exist_ok=True)
        key_file = os.path.join(secret_dir, "mask.key")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, p["mask_key"])
        finally:
            os.close(fd)
        cmd = [p["binary"], "--listen", p["listen"], "--upstream", p["upstream"], "--segment", self.segment_name,
               "--slot", str(self.plane_slot), "--threads", str(p["threads"]), "--home", self.cfg.home]
        if p.get("cpus"):
            cmd += ["--pin-cpus", ",".join(str(c) for c in p["cpus"])]
        env = dict(os.environ, QAG_MASK_KEY_FILE=key_file)
        env.pop("QAG_MASK_KEY", None)
        return Child(PLANE_CHILD, cmd, env)

    def _supervise(self) -> None:
        watcher = self.children[1]
        while not self._stop.wait(0.2):
            for c in self.children:
                if not self._stop.is_set():
                    c.check()
            # W4: while the change watcher is dead or behind, entries published before (and any published
            # since by a worker that had not yet noticed) stop matching: the plane forwards to Python, which
            # re-reads the store on every call until the watcher is caught up again.
            seg = self.segment
            if seg is not None and not self._stop.is_set():
                if watcher.proc is None or watcher.reap() or not watcher_current(seg, self.watcher_slot):
                    try:
                        seg.bump_all()
                        self.invalidations += 1
                    except Exception as exc:  # a lock held too long by a live process: try again next tick
                        log.warning("could not invalidate the segment's generations: %s", exc)

    def ready(self, server) -> None:
        """gunicorn's arbiter is up: let its reaper hand our children's exit statuses to us first."""
        reap_workers = server.reap_workers

        def reap_children_then_workers():
            for c in getattr(self, "children", []):
                c.reap()
            reap_workers()
        server.reap_workers = reap_children_then_workers
        if self.plane is not None:
            # SIGTERM: the plane stops first (it refuses new connections and drains its calls, the ones it
            # forwards included, while the workers still serve them); then gunicorn stops the workers.
            # gunicorn looks its signal handlers up on the arbiter object when the signal is handled.
            term = server.handle_term

            def handle_term():
                self.stop_plane()
                term()
            server.handle_term = handle_term

    def stop_plane(self) -> None:
        for c in getattr(self, "children", []):
            if c.name == PLANE_CHILD:
                c.stop()

    def worker_exited(self, slot, pid) -> None:
        pass

    def stop(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked worker inherits this object; only the arbiter stops things
        self._stop.set()
        # the plane first (no new runs), then the recorder, which drains the rings and commits before it exits
        for c in reversed(getattr(self, "children", [])):
            c.stop()
        seg, self.segment = self.segment, None
        if seg is not None:
            try:
                seg.unlink()
                seg.close()
            except Exception:
                pass
