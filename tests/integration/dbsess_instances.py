"""Private PostgreSQL and MariaDB instances for fault tests (a temp dir and a port of their own; never the
machine's shared servers): start, freeze (SIGSTOP every process of the instance), thaw, restart, stop."""
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


def _as_user(user: str):
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", user, "--"]


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return out


class Instance:
    pid: int

    def pids(self) -> list[int]:
        return [self.pid, *_children(self.pid)]

    def freeze(self) -> None:
        for p in self.pids():
            os.kill(p, signal.SIGSTOP)

    def thaw(self) -> None:
        for p in self.pids():
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


class PrivatePostgres(Instance):
    """initdb + postgres on its own port; `log_statement=all` with the application name in front of each line,
    so a test can count the messages qag's sessions sent."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="qag-dbsess-pg-")
        os.chmod(self.dir, 0o777)
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "pg.log")
        self.port = free_port()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        subprocess.run([*_as_user("postgres"), f"{PG_BIN}/initdb", "-D", self.data, "-U", "postgres", "-A", "trust",
                        "--no-sync"], check=True, capture_output=True)
        self.proc = None
        self.start()

    def start(self) -> None:
        logf = open(self.log, "a")
        self.proc = subprocess.Popen(
            [*_as_user("postgres"), f"{PG_BIN}/postgres", "-D", self.data, "-p", str(self.port), "-k", self.dir,
             "-c", "listen_addresses=127.0.0.1", "-c", "log_statement=all", "-c", "log_line_prefix=%a|",
             "-c", "fsync=off", "-c", "shared_buffers=16MB", "-c", "max_connections=50"],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self._postmaster_pid()
        self.wait_ready()

    def _postmaster_pid(self) -> int:
        pidfile = os.path.join(self.data, "postmaster.pid")
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                with open(pidfile) as f:
                    return int(f.readline())
            except (OSError, ValueError):
                time.sleep(0.05)
        raise RuntimeError("private PostgreSQL did not start")

    def wait_ready(self) -> None:
        import psycopg2
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres").close()
                return
            except psycopg2.OperationalError:
                time.sleep(0.1)
        raise RuntimeError("private PostgreSQL is not ready")

    def execute(self, sql: str, dbname: str = "postgres"):
        import psycopg2
        c = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname)
        c.autocommit = True
        try:
            cur = c.cursor()
            cur.execute(sql)
            return cur.fetchall() if cur.description else None
        finally:
            c.close()

    def row(self, dbname: str) -> dict:
        return {"name": "private-pg", "db": "postgres", "host": "127.0.0.1", "port": self.port, "user": "postgres",
                "database": dbname, "options": {}}

    def statements(self, app: str = "qag") -> list[str]:
        """The statements sessions named `app` sent, one per simple-query message (log_statement=all)."""
        with open(self.log, errors="replace") as f:
            return [ln.split("statement: ", 1)[1].strip() for ln in f if ln.startswith(app + "|")
                    and "statement: " in ln]

    def restart(self) -> None:
        self.stop(keep=True)
        self.start()

    def stop(self, keep: bool = False) -> None:
        if self.proc is not None:
            self.thaw()
            subprocess.run([*_as_user("postgres"), f"{PG_BIN}/pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop"],
                           capture_output=True)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc = None
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


class PrivateMariaDB(Instance):
    """mariadb-install-db + mariadbd on its own port and socket."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="qag-dbsess-my-")
        self.data = os.path.join(self.dir, "data")
        self.sock = os.path.join(self.dir, "my.sock")
        self.port = free_port()
        subprocess.run(["mariadb-install-db", f"--datadir={self.data}", "--user=root",
                        "--auth-root-authentication-method=normal", "--skip-test-db", "--no-defaults"],
                       check=True, capture_output=True)
        self.proc = None
        self.start()

    def start(self) -> None:
        logf = open(os.path.join(self.dir, "my.log"), "a")
        self.proc = subprocess.Popen(
            ["mariadbd", "--no-defaults", f"--datadir={self.data}", f"--port={self.port}", "--bind-address=127.0.0.1",
             f"--socket={self.sock}", "--user=root", "--skip-log-bin", "--innodb-buffer-pool-size=16M",
             f"--pid-file={os.path.join(self.dir, 'my.pid')}", "--skip-name-resolve"],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.wait_ready()

    def wait_ready(self) -> None:
        import mysql.connector
        deadline = time.time() + 40
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("private MariaDB exited")
            try:
                mysql.connector.connect(host="127.0.0.1", port=self.port, user="root", password="").close()
                return
            except mysql.connector.Error:
                time.sleep(0.2)
        raise RuntimeError("private MariaDB is not ready")

    def execute(self, sql: str, database: str | None = None):
        import mysql.connector
        c = mysql.connector.connect(host="127.0.0.1", port=self.port, user="root", password="", database=database,
                                    autocommit=True)
        try:
            cur = c.cursor()
            cur.execute(sql)
            return cur.fetchall() if cur.description else None
        finally:
            c.close()

    def status(self, *names: str) -> dict[str, int]:
        rows = self.execute("SHOW GLOBAL STATUS")
        return {k: int(v) for k, v in rows if k in names}

    def row(self, database: str) -> dict:
        return {"name": "private-my", "db": "mysql", "host": "127.0.0.1", "port": self.port, "user": "root",
                "database": database, "options": {}}

    def restart(self) -> None:
        self.stop(keep=True)
        self.start()

    def stop(self, keep: bool = False) -> None:
        if self.proc is not None:
            self.thaw()
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self.proc = None
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)
