"""Start `qag serve --plane` exactly as bench/oltp.py's qag_plane target does (one worker on CPU 0, the oltp
workload), write its base URL, key secrets and arbiter pid to $OUT/target.json, and wait for SIGTERM."""
import json
import os
import signal
import sys
import time
import types

sys.path.insert(0, os.path.join(os.environ['PYTHONPATH'], 'bench'))
import harness as H  # noqa: E402
import oltp  # noqa: E402
import targets as T  # noqa: E402

opts = types.SimpleNamespace(gateway_cpus=H.parse_cpus('0'), load_cpus=H.parse_cpus('1'), qag_src=None,
                             store_suffix='_pprof')
oltp.ensure_data(10)
w, calls, rows_call, cache_calls = oltp.workload(10)
t = T.Qag(opts, w, plane=True)
t.start(workers=1)
with open(os.path.join(os.environ.get('OUT', '.'), 'target.json'), 'w') as f:
    json.dump({'base': t.base, 'secrets': t.secrets, 'pid': t.proc.pid}, f)
print('ready', t.base, t.proc.pid, flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
try:
    while not stop:
        time.sleep(0.5)
finally:
    t.stop()
