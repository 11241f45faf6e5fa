"""End to end, the instance's life as an operator sees it: a failed start says why in one line and leaves
nothing in /dev/shm; the arbiter logs how a supervised child really ended (issue 13, items 11 and 14)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, free_port, start_server


def _shm_names(home: str, bind: str) -> list[str]:
    """The segment's and its two semaphores' files in /dev/shm (shm/LAYOUT.md L1)."""
    import shm
    name = shm.segment_name(f"{home}|{bind}")[1:]
    return [f"/dev/shm/{name}", f"/dev/shm/sem.{name}-w", f"/dev/shm/sem.{name}-r"]


@pytest.mark.parametrize("why", ["module_missing", "unreachable"])
def test_failed_start_prints_one_line_and_leaves_no_segment(tmp_path, why):
    home = str(tmp_path / "home")
    bind = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, QAG_HOME=home, QAG_BIND=bind, QAG_ADMIN_KEY="adm", QAG_LOG_LEVEL="warning",
               QAG_RUN_STORE_URL="clickhouse://default@127.0.0.1:1/qag")
    if why == "module_missing":  # an install without the clickhouse extra
        shadow = tmp_path / "shadow"
        shadow.mkdir()
        (shadow / "clickhouse_connect.py").write_text(
            "raise ModuleNotFoundError(\"No module named 'clickhouse_connect'\", name='clickhouse_connect')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", ROOT)])
    r = subprocess.run([sys.executable, "-m", "qag.cli", "serve", "--workers", "1"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 3, r.stdout + r.stderr
    assert len(lines) == 1, r.stdout + r.stderr
    assert lines[0].startswith("qag: cannot start: the run store at clickhouse://default@127.0.0.1:1/qag")
    if why == "module_missing":
        assert "pip install 'qag[clickhouse]'" in lines[0]
    left = [p for p in _shm_names(home, bind) if os.path.exists(p)]
    assert left == [], f"a failed start left {left} behind"


def test_a_running_instance_keeps_its_segment_when_a_second_start_fails():
    srv = start_server(args=("--workers", "1"))
    try:
        names = _shm_names(srv.env["QAG_HOME"], srv.env["QAG_BIND"])
        assert all(os.path.exists(p) for p in names)
        r = subprocess.run([sys.executable, "-m", "qag.cli", "serve", "--workers", "1"], env=srv.env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=False)
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
        assert r.returncode == 3 and len(lines) == 1, lines
        assert lines[0] == f"qag: cannot start: cannot listen on {srv.env['QAG_BIND']}: Address already in use"
        assert all(os.path.exists(p) for p in names), "the failed second start removed the running one's segment"
    finally:
        srv.stop()


def _child(srv, title_text: str) -> int:
    out = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True, text=True, check=False).stdout.split()
    for pid in map(int, out):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().replace(b"\x00", b" ").decode().strip() == title_text:
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no child titled {title_text!r}")


def _wait_log(srv, text: str, timeout: float = 10) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = srv.log()
        if text in log:
            return log
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in the log:\n{srv.log()}")


def test_arbiter_logs_how_a_child_really_ended():
    srv = start_server(args=("--workers", "1"))
    try:
        rec = _child(srv, "qag: recorder")
        os.kill(rec, signal.SIGKILL)
        log = _wait_log(srv, f"the recorder (pid {rec}) killed by signal 9 (SIGKILL)")
        assert "exited (code 0)" not in log
        watcher = _child(srv, "qag: changes")
        os.kill(watcher, signal.SIGTERM)  # the watcher stops cleanly on SIGTERM: exit code 0, and it says so
        _wait_log(srv, f"the change watcher (pid {watcher}) exited with code 0")
        # both were restarted
        deadline = time.time() + 10
        while True:
            try:
                assert _child(srv, "qag: recorder") != rec and _child(srv, "qag: changes") != watcher
                break
            except AssertionError:
                assert time.time() < deadline
                time.sleep(0.2)
    finally:
        srv.stop()


def _samples(srv) -> dict[str, float]:
    import requests
    out = {}
    for line in requests.get(srv.base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_every_series_has_a_sample_before_anything_happened():
    """increase() alerts fire at the first loss only if the series existed before it (deploy/prometheus/
    alerts_test.yml models this): a fresh instance exports its counters at 0 and each ring's occupancy."""
    srv = start_server(args=("--workers", "2"))
    try:
        s = _samples(srv)
        for name in ("qag_runs_lost_total", "qag_runs_recorded_total", "qag_rows_total", "qag_recorder_batches_total",
                     'qag_plan_cache_total{result="hit"}', 'qag_plan_cache_total{result="miss"}',
                     "qag_query_duration_seconds_count"):
            assert s.get(name) == 0.0, (name, s.get(name))
        deadline = time.time() + 10
        while not all(f'qag_ring_occupancy_bytes{{slot="{i}"}}' in s for i in (0, 1)):
            assert time.time() < deadline, sorted(k for k in s if "ring" in k)
            time.sleep(0.3)  # the second worker may still be booting
            s = _samples(srv)
        assert s['qag_ring_occupancy_bytes{slot="0"}'] == 0.0
        deadline = time.time() + 10
        while s.get("qag_change_watcher_current") != 1.0:
            assert time.time() < deadline, s.get("qag_change_watcher_current")
            time.sleep(0.3)
            s = _samples(srv)
    finally:
        srv.stop()


def test_address_in_use_is_one_line_and_leaves_no_segment(tmp_path):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        bind = f"127.0.0.1:{busy.getsockname()[1]}"
        home = str(tmp_path / "home")
        env = dict(os.environ, QAG_HOME=home, QAG_BIND=bind, QAG_ADMIN_KEY="adm", QAG_LOG_LEVEL="warning")
        r = subprocess.run([sys.executable, "-m", "qag.cli", "serve", "--workers", "1"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60, check=False)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 3 and lines == [f"qag: cannot start: cannot listen on {bind}: Address already in use"], lines
    assert [p for p in _shm_names(home, bind) if os.path.exists(p)] == []
