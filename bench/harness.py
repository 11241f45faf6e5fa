"""The measuring machinery shared by bench/oltp.py and bench/tpcc_mysql.py: CPU lists and /proc accounting,
oha runs (closed and open loop), the results file, the /health floor and the progress line."""
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CLK_TCK = os.sysconf('SC_CLK_TCK')
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)


# ---------------------------------------------------------------- CPUs and /proc

def parse_cpus(text):
    """A taskset-style list ('0', '0-3', '0,2,4-5') as sorted ints; '' or None means no pinning."""
    if not text:
        return []
    cpus = set()
    for part in text.split(','):
        part = part.strip()
        if '-' in part:
            lo, hi = part.split('-')
            cpus.update(range(int(lo), int(hi) + 1))
        elif part:
            cpus.add(int(part))
    return sorted(cpus)


def cpu_list(cpus):
    return ','.join(str(c) for c in cpus)


def taskset_prefix(cpus):
    return ['taskset', '-c', cpu_list(cpus)] if cpus else []


def _stat(pid):
    """(ppid, comm, cpu ticks user+system) of one process, or None if it is gone."""
    try:
        with open(f'/proc/{pid}/stat', 'rb') as f:
            raw = f.read().decode(errors='replace')
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    rpar = raw.rfind(')')
    comm = raw[raw.find('(') + 1:rpar]
    fields = raw[rpar + 2:].split()
    return int(fields[1]), comm, int(fields[11]) + int(fields[12])


def all_stats():
    out = {}
    for name in os.listdir('/proc'):
        if name.isdigit():
            st = _stat(int(name))
            if st:
                out[int(name)] = st
    return out


def tree_ticks(root_pid, stats=None):
    """{pid: ticks} for root_pid and all its descendants (gateway = arbiter + workers + recorder/plane)."""
    stats = stats or all_stats()
    children = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][2]
            todo.extend(children.get(pid, ()))
    return out


def comm_ticks(names, stats=None):
    """{pid: ticks} of every process whose comm is in names (the database servers, shared with others)."""
    stats = stats or all_stats()
    return {pid: st[2] for pid, st in stats.items() if st[1] in names}


def delta_seconds(before, after):
    """CPU seconds between two {pid: ticks} snapshots; processes born in between count in full."""
    ticks = sum(t - before.get(pid, 0) for pid, t in after.items())
    return max(ticks, 0) / CLK_TCK


def runq_wait_ns(pid):
    """Nanoseconds the threads of this process have spent runnable but not running (the second field of
    /proc/PID/task/TID/schedstat): time a call waited for a CPU, not for the gateway's own work."""
    try:
        tids = os.listdir(f'/proc/{pid}/task')
    except OSError:
        return 0
    total = 0
    for tid in tids:
        try:
            with open(f'/proc/{pid}/task/{tid}/schedstat') as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total


def system_busy():
    """(busy, total) jiffies from /proc/stat per CPU: the noise other users put on each core."""
    out = {}
    with open('/proc/stat') as f:
        for line in f:
            if line.startswith('cpu') and line[3].isdigit():
                parts = line.split()
                vals = [int(v) for v in parts[1:]]
                idle = vals[3] + vals[4]
                out[int(parts[0][3:])] = (sum(vals) - idle, sum(vals))
    return out


def busy_fraction(before, after, cpus):
    res = {}
    for c in cpus or sorted(after):
        b0, t0 = before.get(c, (0, 0))
        b1, t1 = after.get(c, (0, 0))
        res[str(c)] = round((b1 - b0) / max(t1 - t0, 1), 3)
    return res


# ---------------------------------------------------------------- ports and processes

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def wait_http(url, timeout=30.0, proc=None):
    import requests
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f'process exited with {proc.returncode} before {url} answered')
        try:
            r = requests.get(url, timeout=2)
            if r.status_code < 500:
                return
            last = r.status_code
        except Exception as exc:  # noqa: BLE001 - still starting
            last = exc
        time.sleep(0.2)
    raise RuntimeError(f'{url} did not answer within {timeout}s (last: {last})')


def stop_process(proc, timeout=15.0):
    """SIGTERM to the process group we started, then SIGKILL; only our own processes."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


# ---------------------------------------------------------------- oha

OHA_HELP = ('oha not found: install it with `cargo install oha --locked --version 1.16.0` '
            '(puts it in ~/.cargo/bin), or put an oha binary on PATH / pass --oha PATH.')


def find_oha(explicit=None):
    for cand in (explicit, shutil.which('oha'), os.path.expanduser('~/.cargo/bin/oha')):
        if cand and os.path.exists(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def regex_escape_base(url):
    """The literal part of a URL as a regex for oha --rand-regex-url. oha escapes every '.' itself (so a dot is
    always literal, never escaped here); the other regex characters are escaped."""
    out = []
    for ch in url:
        out.append('\\' + ch if ch in '?+*()[]{}|^$\\' else ch)
    return ''.join(out)


def run_oha(oha, url_regex, *, duration, conns, headers=None, rate=None, load_cpus=None, method='GET',
            requests=None, unix_socket=None):
    """One oha run. Closed loop without rate; open loop (latency corrected) with rate. Returns a dict of
    throughput, status codes, latency percentiles (ms), and the load generator's own CPU seconds.
    `unix_socket`: connect there instead of the URL's host (e.g. gunicorn's socket behind the plane)."""
    cmd = taskset_prefix(load_cpus) + [
        oha, '--no-tui', '--output-format', 'json', '-c', str(conns), '-m', method,
        *(['-n', str(requests)] if requests else ['-z', f'{duration}s']),
        '--rand-regex-url',
        # oha's tokio runtime defaults to one thread per physical core of the machine, not of its taskset
        '--worker-threads', str(max(1, len(load_cpus or []) or os.cpu_count()))]
    if rate:
        cmd += ['-q', str(rate), '--latency-correction']
    if unix_socket:
        cmd += ['--unix-socket', unix_socket]
    for k, v in (headers or {}).items():
        cmd += ['-H', f'{k}: {v}']
    cmd.append(url_regex)
    return _load_run(cmd, duration, 'oha')


def run_keys(port, paths, keys, *, duration, conns, id_range, load_cpus=None, sweep=False):
    """One closed-loop run of bench/keysload.py: each call's X-API-Key drawn from `keys` and its path from
    `paths` (`{id}` replaced by an id in `id_range`), which oha (one header per run) cannot do. Same result
    shape as run_oha, the load generator's CPU included. `sweep`: each key and path once, then stop."""
    with tempfile.NamedTemporaryFile('w', suffix='.keys') as kf, \
            tempfile.NamedTemporaryFile('w', suffix='.paths') as pf:
        kf.write('\n'.join(keys) + '\n')
        pf.write('\n'.join(paths) + '\n')
        kf.flush()
        pf.flush()
        cmd = taskset_prefix(load_cpus) + [
            sys.executable, os.path.join(BENCH_DIR, 'keysload.py'), '--port', str(port), '--conns', str(conns),
            '--duration', str(duration), '--keys', kf.name, '--paths', pf.name,
            '--id-lo', str(id_range[0]), '--id-hi', str(id_range[1])] + (['--sweep'] if sweep else [])
        return _load_run(cmd, duration, 'keysload')


def _load_run(cmd, duration, what):
    """Run a load generator that prints oha's JSON summary; wait4 gives its own CPU."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - start
        out.seek(0)
        err.seek(0)
        raw, errtext = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f'{what} failed ({proc.returncode}): {errtext.strip()[:500]}')
    data = json.loads(raw)
    summ = data.get('summary', {})
    codes = {str(k): int(v) for k, v in (data.get('statusCodeDistribution') or {}).items()}
    errors = {str(k): int(v) for k, v in (data.get('errorDistribution') or {}).items()}
    n_total = sum(codes.values())
    n_2xx = sum(v for k, v in codes.items() if k.startswith('2'))
    # Requests still in flight when the time was up are neither served nor failed ("aborted due to deadline").
    aborted = sum(v for k, v in errors.items() if 'deadline' in k.lower())
    other_errors = sum(v for k, v in errors.items() if 'deadline' not in k.lower())
    pct = data.get('latencyPercentiles') or {}

    def ms(key):
        v = pct.get(key)
        return round(v * 1000, 4) if v is not None else None

    total_secs = summ.get('total') or duration or 1
    return {
        'rps': round(n_total / total_secs, 2) if total_secs else 0.0,
        'ok_rps': round(n_2xx / total_secs, 2) if total_secs else 0.0,
        'n': n_total, 'n_2xx': n_2xx, 'non_2xx': n_total - n_2xx, 'errors': other_errors, 'aborted': aborted,
        'codes': codes, 'error_kinds': errors,
        'p50_ms': ms('p50'), 'p90_ms': ms('p90'), 'p99_ms': ms('p99'), 'p999_ms': ms('p99.9'),
        'mean_ms': round((summ.get('average') or 0) * 1000, 4),
        'duration_s': round(total_secs, 3), 'wall_s': round(wall, 3),
        'load_cpu_s': round(usage.ru_utime + usage.ru_stime, 3),
    }


# ---------------------------------------------------------------- results and progress

class Results:
    """Appends one JSON line per run to results.jsonl; keeps them in memory for the smoke check."""

    def __init__(self, path, session, harness, common):
        self.path, self.session, self.harness, self.common = path, session, harness, common
        self.rows = []
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def add(self, **row):
        row = {'session': self.session, 'harness': self.harness,
               'at': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), **self.common, **row}
        self.rows.append(row)
        with open(self.path, 'a') as f:
            f.write(json.dumps(row, sort_keys=True) + '\n')
        return row


def progress(msg):
    print(time.strftime('%H:%M:%S'), msg, flush=True)


def rotated(items, round_no):
    """A B C, then B C A, then C A B: no target always runs first, warmest or coolest."""
    if not items:
        return []
    k = round_no % len(items)
    return list(items[k:]) + list(items[:k])


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt_run(r):
    p = f"p50 {r.get('p50_ms')} p99 {r.get('p99_ms')} ms" if r.get('p50_ms') is not None else ''
    cps = r.get('calls_per_gw_cpu_s')
    return (f"{r.get('rps', 0):8.1f}/s  {p}  non2xx {r.get('non_2xx', 0)}  "
            f"gwCPU {r.get('gw_cpu_s', 0):.2f}s" + (f"  {cps:.0f} calls/gw-cpu-s" if cps else ''))


def die(msg, code=2):
    print('error:', msg, file=sys.stderr, flush=True)
    sys.exit(code)
