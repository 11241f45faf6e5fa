#!/usr/bin/env python3
"""The keys block's load generator: oha sends one X-API-Key per run, and the block spreads its calls over up to
10,000 keys (and saved-query names), so this closed loop does what `oha -c N -z S` does with a key and a path
drawn per request. asyncio, one kept-alive HTTP/1.1 connection per caller; prints one JSON object shaped like
harness.run_oha's result. Run pinned to the load CPUs by harness.run_keys; not a general client (Content-Length
bodies only, which every target here sends).

Usage: keysload.py --host H --port P --conns 32 --duration 5 --keys FILE --paths FILE --id-lo A --id-hi B [--sweep]"""
import argparse
import asyncio
import json
import random
import time


async def caller(host, port, keys, paths, lo, hi, deadline, lat, codes, errors, sweep=None):
    """Calls until the deadline, each with a random key and path; `sweep` (a shared iterator of indexes): call
    keys[i] / paths[i] for each i it yields instead, until it runs out (every key and query called once)."""
    reader = writer = None
    rnd = random.Random()
    while time.perf_counter() < deadline:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            if sweep is not None:
                i = next(sweep, None)
                if i is None:
                    break
                path, key = paths[i % len(paths)], keys[i % len(keys)]
            else:
                path, key = rnd.choice(paths), rnd.choice(keys)
            path = path.replace('{id}', str(rnd.randint(lo, hi)))
            req = (f'GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n' +
                   (f'X-API-Key: {key}\r\n' if key else '') + '\r\n').encode()
            t0 = time.perf_counter()
            writer.write(req)
            head = await asyncio.wait_for(reader.readuntil(b'\r\n\r\n'), max(deadline - t0, 0.001))
            status = int(head[9:12])
            length = 0
            close = False
            for line in head.split(b'\r\n')[1:]:
                name, _, value = line.partition(b':')
                name = name.strip().lower()
                if name == b'content-length':
                    length = int(value)
                elif name == b'connection' and value.strip().lower() == b'close':
                    close = True
                elif name == b'transfer-encoding':
                    raise RuntimeError('chunked body')
            if length:
                await asyncio.wait_for(reader.readexactly(length), max(deadline - time.perf_counter(), 0.001))
            lat.append(time.perf_counter() - t0)
            codes[status] = codes.get(status, 0) + 1
            if close:
                writer.close()
                writer = None
        except TimeoutError:
            errors['aborted due to deadline'] = errors.get('aborted due to deadline', 0) + 1
            break
        except Exception as exc:  # noqa: BLE001 - counted like oha's error distribution
            kind = type(exc).__name__ + ': ' + str(exc)[:80]
            errors[kind] = errors.get(kind, 0) + 1
            if writer is not None:
                writer.close()
            writer = None
            await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


async def main_async(o):
    with open(o.keys) as f:
        keys = [line.strip() for line in f] or ['']
    with open(o.paths) as f:
        paths = [line.strip() for line in f if line.strip()]
    lat, codes, errors = [], {}, {}
    start = time.perf_counter()
    deadline = start + o.duration
    sweep = iter(range(max(len(keys), len(paths)))) if o.sweep else None
    await asyncio.gather(*(caller(o.host, o.port, keys, paths, o.id_lo, o.id_hi, deadline, lat, codes, errors,
                                  sweep) for _ in range(o.conns)))
    total = time.perf_counter() - start
    lat.sort()

    def pct(p):
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None
    print(json.dumps({'summary': {'total': total, 'average': sum(lat) / len(lat) if lat else 0},
                      'statusCodeDistribution': {str(k): v for k, v in codes.items()},
                      'errorDistribution': errors,
                      'latencyPercentiles': {'p50': pct(0.5), 'p90': pct(0.9), 'p99': pct(0.99),
                                             'p99.9': pct(0.999)}}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--host', default='127.0.0.1')
    p.add_argument('--port', type=int, required=True)
    p.add_argument('--conns', type=int, default=32)
    p.add_argument('--duration', type=float, default=5.0)
    p.add_argument('--keys', required=True, help='file: one X-API-Key secret a line (an empty file: no header)')
    p.add_argument('--paths', required=True, help='file: one path a line, {id} replaced by a random id')
    p.add_argument('--id-lo', type=int, required=True)
    p.add_argument('--id-hi', type=int, required=True)
    p.add_argument('--sweep', action='store_true', help='call each key and path once (up to --duration), then stop')
    asyncio.run(main_async(p.parse_args()))


if __name__ == '__main__':
    main()
