#!/bin/bash
# usage: measure.sh NAME KEY URLPATH CALLERS SECONDS
NAME=$1; KEY=$2; P=$3; C=$4; D=$5
J=${OUT:-.}/target.json
BASE=$(python3 -c "import json;print(json.load(open('$J'))['base'])")
SEC=$(python3 -c "import json;print(json.load(open('$J'))['secrets']['$KEY'])")
export PLANE RECORDER WORKER CHANGES ARBITER
PIDS="$PLANE $RECORDER $WORKER $CHANGES $ARBITER"  # the pids of `qag serve`s processes (ps --ppid ARBITER)
snap() { for p in $PIDS; do
  t=$(awk '{print $14+$15}' /proc/$p/stat); cs=$(awk '/^voluntary_ctxt_switches/{v=$2}/^nonvoluntary/{n=$2}END{print v" "n}' /proc/$p/status)
  # threads' switches too
  tv=0; tn=0; for s in /proc/$p/task/*/status; do read v n < <(awk '/^voluntary_ctxt_switches/{v=$2}/^nonvoluntary/{n=$2}END{print v" "n}' $s); tv=$((tv+v)); tn=$((tn+n)); done
  echo "$p $t $tv $tn"; done; }
snap > ${OUT:-.}/$NAME.before
taskset -c 1 ~/.cargo/bin/oha --no-tui -z ${D}s -c $C --rand-regex-url -H "X-API-Key: $SEC" "$BASE$P" --output-format json > ${OUT:-.}/$NAME.oha.json 2>/dev/null
snap > ${OUT:-.}/$NAME.after
python3 - "$NAME" <<'PY'
import json, os, sys
n = sys.argv[1]
o = json.load(open(os.path.join(os.environ.get('OUT', '.'), f'{n}.oha.json')))
calls = sum(o['statusCodeDistribution'].values())
ok = sum(v for k, v in o['statusCodeDistribution'].items() if k.startswith('2'))
b = {l.split()[0]: list(map(int, l.split()[1:])) for l in open(os.path.join(os.environ.get('OUT', '.'), f'{n}.before'))}
a = {l.split()[0]: list(map(int, l.split()[1:])) for l in open(os.path.join(os.environ.get('OUT', '.'), f'{n}.after'))}
names = {os.environ[v]: v.lower() for v in ('PLANE', 'RECORDER', 'WORKER', 'CHANGES', 'ARBITER')}
lat = o['latencyPercentiles']
print(f"{n}: calls={calls} 2xx={ok} rps={o['summary']['requestsPerSec']:.0f} p50={lat['p50']*1000:.3f}ms p99={lat['p99']*1000:.3f}ms")
tot = 0
for p, nm in names.items():
    us = (a[p][0] - b[p][0]) * 10000 / calls  # 100 Hz ticks
    tot += us
    print(f"  {nm:9s} cpu {us:7.1f} us/call  vol-cs {(a[p][1]-b[p][1])/calls:6.2f}/call  invol-cs {(a[p][2]-b[p][2])/calls:6.2f}/call")
print(f"  total     cpu {tot:7.1f} us/call")
PY
