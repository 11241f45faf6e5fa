"""Private PostgreSQL and MariaDB instances for the plane's fault tests: each in a temporary directory, on
a port of its own, started and stopped by the test (frozen with SIGSTOP, restarted), never the machine's
shared servers. Also used by bench/faults_plane.py."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

PG_BIN = "/usr/lib/postgresql/15/bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


def _as_postgres() -> dict:
    """initdb and postgres refuse to run as root: run them as the `postgres` account when we are root."""
    return {"user": "postgres", "group": "postgres"} if os.geteuid() == 0 else {}


class PrivatePostgres:
    """initdb + postgres (foreground child, so the test can SIGSTOP it) on 127.0.0.1:<port>, trust auth."""

    def __init__(self):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="qag-rust-pg-")
        self.data = os.path.join(self.dir, "data")
        self.proc: subprocess.Popen | None = None
        self._as = _as_postgres()
        if self._as:
            import pwd
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        subprocess.run([f"{PG_BIN}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync",
                        "-E", "UTF8", "--locale", "C"], check=True, capture_output=True, **self._as)
        try:
            self.start()
        except BaseException:
            self.close()  # never leave a server behind
            raise

    def start(self) -> None:
        with open(os.path.join(self.dir, "log"), "ab") as log:
            self.proc = subprocess.Popen(
                [f"{PG_BIN}/postgres", "-D", self.data, "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
                 "-c", f"unix_socket_directories={self.dir}", "-c", "fsync=off", "-c", "max_connections=60",
                 "-c", "shared_buffers=16MB"],
                stdout=log, stderr=log, start_new_session=True, **self._as)
        _wait_port(self.port)
        deadline = time.time() + 30
        while time.time() < deadline:  # the port opens before the server accepts sessions
            r = subprocess.run([f"{PG_BIN}/pg_isready", "-h", "127.0.0.1", "-p", str(self.port)], check=False,
                               capture_output=True)
            if r.returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError("private PostgreSQL did not become ready")

    def sql(self, sql: str, db: str = "postgres") -> str:
        r = subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", db, "-At",
                            "-v", "ON_ERROR_STOP=1", "-c", sql],
                           check=False, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(r.stderr)
        return r.stdout

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: the kernel still accepts and acknowledges, nobody answers."""
        pids = self._pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        wait_stopped(pids)

    def thaw(self) -> None:
        for pid in self._pids():
            os.kill(pid, signal.SIGCONT)

    def _pids(self) -> list[int]:
        assert self.proc is not None
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], check=False, capture_output=True,
                             text=True).stdout.split()
        return [self.proc.pid] + [int(p) for p in out]

    def stop(self, mode: str = "fast") -> None:
        """Stop (SIGINT: fast shutdown, every session terminated) and wait for the postmaster to exit."""
        if self.proc is None:
            return
        self.thaw()
        self.proc.send_signal(signal.SIGINT if mode == "fast" else signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def wait_stopped(pids, timeout: float = 5.0) -> None:
    """Return once every thread of every pid is stopped (state T in /proc): SIGSTOP reaches a busy process's
    threads only when each is next scheduled, and on a loaded machine a call sent right after the kill could
    still be answered by a thread that had not stopped yet."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        running = 0
        for pid in pids:
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except FileNotFoundError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                except (FileNotFoundError, IndexError):
                    continue
                if state not in ("T", "t"):
                    running += 1
        if not running:
            return
        time.sleep(0.01)
    raise RuntimeError(f"{pids} did not stop within {timeout} s")


class PrivateMariaDB:
    """mariadb-install-db + mariadbd (foreground child) on 127.0.0.1:<port>, root without a password over TCP."""

    def __init__(self):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="qag-rust-my-")
        self.data = os.path.join(self.dir, "data")
        self.sock = os.path.join(self.dir, "sock")
        self.proc: subprocess.Popen | None = None
        user = ["--user=root"] if os.geteuid() == 0 else []
        subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={self.data}",
                        "--auth-root-authentication-method=normal", "--skip-test-db", *user],
                       check=True, capture_output=True)
        try:
            self.start()
            # mysql-connector and the plane come over TCP as root@127.0.0.1 (not root@localhost)
            self.sql("CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY ''; "
                     "GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION; FLUSH PRIVILEGES")
        except BaseException:
            self.close()  # never leave a server behind
            raise

    def start(self) -> None:
        user = ["--user=root"] if os.geteuid() == 0 else []
        with open(os.path.join(self.dir, "log"), "ab") as log:
            self.proc = subprocess.Popen(
                ["mariadbd", "--no-defaults", f"--datadir={self.data}", f"--port={self.port}", f"--socket={self.sock}",
                 "--bind-address=127.0.0.1", "--innodb-buffer-pool-size=16M",
                 "--innodb-log-file-size=8M", "--skip-log-bin", "--max-connections=100",
                 f"--pid-file={os.path.join(self.dir, 'pid')}", *user],
                stdout=log, stderr=log, start_new_session=True)
        _wait_port(self.port)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                self.sql("SELECT 1")
                return
            except RuntimeError:
                time.sleep(0.1)
        raise RuntimeError("private MariaDB did not become ready")

    def sql(self, sql: str, db: str | None = None) -> str:
        cmd = ["mariadb", f"--socket={self.sock}", "-uroot", "-N", "-B", "-e", sql]
        if db:
            cmd.insert(1, f"--database={db}")
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(r.stderr)
        return r.stdout

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_stopped([self.proc.pid])

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.thaw()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
