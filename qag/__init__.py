"""qag: a governed SQL-to-REST gateway. Saved SQL queries served as `GET /q/<name>` to scoped API keys.

The package, from the wire down (README.md, "Architecture", draws it):

- `http/`: the only package that speaks HTTP (routes, the /q path, the Management API, the Console, OpenAPI).
- `server/`: the processes, in gunicorn's vocabulary (serve, arbiter, gworker, worker, changes).
- `auth.py` (who a call is, may it run now), `identity.py` (signed-in callers, roles), `limits.py` (rate limits
  and quotas, Redis or the segment), `capacity.py` (bounds on what a few callers may hold open).
- `runtime.py` (a worker's generation-validated caches), `plan.py` (plans), `params.py` (markers, typed
  values), `governance/` (what a statement may read and write, and how its columns are masked).
- `connectors.py` (sessions to the data databases and the rules they keep), `render.py`, `formats.py` and
  `values.py` (a result in every format).
- `store.py` and `store_migrations.py` (the metadata store), `entries.py` (what Python and the plane exchange
  through the segment), `recorder/` and `runstore/` (every run, exactly once, into the run store).
- `errors.py` (the domain errors), `config.py` (every setting, declared once), `logs.py` (one log format),
  `metrics.py`, `timeutil.py`; `cli.py`, `demo.py`, `manifest.py` (config as code), `mcpserver.py`.
"""

__version__ = "0.1.0"
