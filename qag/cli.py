"""The `qag` command: serve, demo, admins, migrate, config, export, apply, shm stat, mcp."""
from __future__ import annotations

import argparse
import json
import sys

from qag import __version__, config


def _cfg(args, **over):
    try:
        return config.load(**over)
    except config.SettingError as exc:
        print(f"qag: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_serve(args) -> int:
    from qag.server import serve
    over = {}
    if args.bind:
        over["bind"] = args.bind
    if args.workers:
        try:
            over["workers"] = config._workers(args.workers)
        except ValueError as exc:
            print(f"qag: --workers {args.workers!r} is malformed: {exc}", file=sys.stderr)
            return 2
    if args.threads:
        over["threads"] = args.threads
    cfg = _cfg(args, **over)
    return serve.run(cfg, pin=not args.no_pin, plane=args.plane, plane_threads=args.plane_threads)


def cmd_demo(args) -> int:
    from qag import demo
    return demo.main(args)


def cmd_admins(args) -> int:
    from qag.errors import Conflict
    from qag.store import Store
    cfg = _cfg(args)
    store = Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key)
    if not _migrate(store, "cannot change administrators"):
        return 1
    if args.admins_cmd == "create":
        try:
            token = store.create_admin(args.name)
        except Conflict:
            print(f"qag: an administrator named {args.name!r} exists", file=sys.stderr)
            return 1
        _bump_global(cfg)
        print(token)
        print(f"# administrator {args.name!r} created; use the line above as X-API-Key. It is shown once.",
              file=sys.stderr)
        return 0
    if args.admins_cmd == "list":
        rows = store.list_admins()
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                print(f"{r['name']}\t{'active' if r['active'] else 'revoked'}\t{r['created_at']}")
            if not rows:
                print("# no named administrators: `qag admins create NAME` makes one", file=sys.stderr)
        return 0
    if args.admins_cmd == "revoke":
        if not store.revoke_admin(args.name):
            print(f"qag: no administrator named {args.name!r}", file=sys.stderr)
            return 1
        _bump_global(cfg)
        return 0
    return 2


def _bump_global(cfg) -> None:
    """A CLI change reaches running workers through the segment's generations."""
    try:
        import shm
        from qag.server.arbiter import instance_name
        seg = shm.Segment.attach(instance_name(cfg))
    except Exception:
        return
    try:
        seg.bump("key", "\x00admins")
    finally:
        seg.close()


def _migrate(store, doing: str) -> int:
    """The store's schema version after migrating it; 0 (and one line) when a newer qag migrated it."""
    from qag.errors import SchemaTooNew
    try:
        return store.migrate()
    except SchemaTooNew as exc:
        print(f"qag: {doing}: {exc}", file=sys.stderr)
        return 0


def cmd_migrate(args) -> int:
    from qag.store import Store
    cfg = _cfg(args)
    store = Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key)
    version = _migrate(store, "cannot migrate")
    if not version:
        return 1
    print(f"schema version {version}")
    _bump_global(cfg)  # a running instance on this host rebuilds whatever a migration may have changed
    return 0


def cmd_config(args) -> int:
    if args.reference:
        print(config.reference_markdown())
        return 0
    cfg = _cfg(args)
    if args.json:
        print(json.dumps(config_sources(cfg), indent=2, default=str))
        return 0
    print(repr(cfg))
    return 0


SECRET_SETTINGS = ("admin_key", "secret_key", "mask_key", "metrics_token", "jwt_secret")


def config_sources(cfg, environ=None) -> dict:
    """Every setting: its value in use (secrets shown as set or not), its variable and where it came from."""
    import os
    env = os.environ if environ is None else environ
    out = {}
    for s in config.SETTINGS:
        value = getattr(cfg, s.name)
        secret = s.name in SECRET_SETTINGS or "password" in s.name or "secret" in s.name or "token" in s.name
        if secret:
            value = "(set)" if value else ""
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, str) and "://" in value and "@" in value:
            value = _hide_password(value)
        out[s.name] = {"env": s.env, "value": value, "source": "environment" if s.env in env else "default"}
    return out


def _hide_password(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit
    u = urlsplit(url)
    if u.password is None:
        return url
    netloc = f"{u.username}:***@{u.hostname}" + (f":{u.port}" if u.port else "")
    return urlunsplit(u._replace(netloc=netloc))


def _client(args):
    from qag import manifest
    cfg = _cfg(args)
    key = args.key or cfg.admin_key
    if not key:
        print("qag: an administrator's key is needed: --key, or QAG_ADMIN_KEY", file=sys.stderr)
        raise SystemExit(2)
    url = args.url or ("http://" + cfg.bind if not cfg.bind.startswith("unix:") else None)
    if not url:
        print("qag: QAG_BIND is a unix socket: give the instance's --url", file=sys.stderr)
        raise SystemExit(2)
    return manifest.Client(url, key), url


def cmd_export(args) -> int:
    from qag import manifest
    client, url = _client(args)
    try:
        text = manifest.dump(manifest.read_instance(client), url)
    except (manifest.ApiFailure, manifest.ManifestError, OSError) as exc:
        print(f"qag export: {exc}", file=sys.stderr)
        return 1
    if args.output and args.output != "-":
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_apply(args) -> int:
    from qag import manifest
    try:
        with (sys.stdin if args.file == "-" else open(args.file)) as f:
            text = f.read()
    except OSError as exc:
        print(f"qag apply: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        want = manifest.load(text)
    except manifest.ManifestError as exc:
        print(f"qag apply: {args.file}: {exc}; nothing changed", file=sys.stderr)
        return 2
    client, _ = _client(args)
    try:
        return manifest.apply(client, want, dry_run=args.dry_run, prune=args.prune,
                              update_secrets=args.update_secrets)
    except manifest.ManifestError as exc:
        print(f"qag apply: {args.file}: {exc}; nothing changed", file=sys.stderr)
        return 2
    except (manifest.ApiFailure, OSError) as exc:
        print(f"qag apply: {exc}; nothing changed", file=sys.stderr)
        return 1


def cmd_shm(args) -> int:
    cfg = _cfg(args)
    try:
        import shm
        from qag.server.arbiter import instance_name
        seg = shm.Segment.attach(args.name or instance_name(cfg))
    except Exception as exc:
        print(f"qag: cannot attach the segment: {exc}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(seg.stat(), indent=2, default=str))
    finally:
        seg.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="qag", description="qag: saved SQL served as governed REST endpoints.")
    p.add_argument("--version", action="version", version=f"qag {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the gateway (gunicorn arbiter + pinned Falcon workers)")
    s.add_argument("--bind", help="HOST:PORT (default QAG_BIND)")
    s.add_argument("--workers", help="auto (one per physical core) or a number (default QAG_WORKERS)")
    s.add_argument("--threads", type=int, help="threads per worker (default QAG_THREADS)")
    s.add_argument("--no-pin", action="store_true", help="do not pin workers to CPUs")
    s.add_argument("--plane", action="store_true",
                   help="put the Rust data plane (qag-plane) on the public address, gunicorn on a unix socket")
    s.add_argument("--plane-threads", type=int, default=None, help="data plane threads (default: physical cores)")
    s.set_defaults(fn=cmd_serve)
    d = sub.add_parser("demo", help="example SQLite data, a connection, queries and a key; then serve")
    d.add_argument("--bind", default=None)
    d.add_argument("--no-serve", action="store_true", help="set up and print the calls, do not start serving")
    d.set_defaults(fn=cmd_demo)
    a = sub.add_parser("admins", help="named administrator tokens")
    asub = a.add_subparsers(dest="admins_cmd", required=True)
    ac = asub.add_parser("create")
    ac.add_argument("name")
    al = asub.add_parser("list")
    al.add_argument("--json", action="store_true")
    ar = asub.add_parser("revoke")
    ar.add_argument("name")
    a.set_defaults(fn=cmd_admins)
    m = sub.add_parser("migrate", help="apply the metadata store's migrations")
    m.set_defaults(fn=cmd_migrate)
    c = sub.add_parser("config", help="show the settings in use")
    c.add_argument("--reference", action="store_true", help="print the settings reference (Markdown)")
    c.add_argument("--json", action="store_true",
                   help="every setting with its value and source (environment or default)")
    c.set_defaults(fn=cmd_config)
    for name, fn, hlp in (("export", cmd_export, "write the instance's connections, queries, roles and keys as YAML"),
                          ("apply", cmd_apply, "make the instance match a YAML manifest (prints the diff)")):
        e = sub.add_parser(name, help=hlp)
        e.add_argument("--url", help="the instance (default http://QAG_BIND)")
        e.add_argument("--key", help="an administrator's key (default QAG_ADMIN_KEY)")
        if name == "export":
            e.add_argument("-o", "--output", help="file to write (default standard output)")
        else:
            e.add_argument("-f", "--file", required=True, help="the manifest (- for standard input)")
            e.add_argument("--dry-run", action="store_true", help="print the diff and check it; change nothing")
            e.add_argument("--prune", action="store_true", help="delete what the instance has and the file lacks")
            e.add_argument("--update-secrets", action="store_true",
                           help="send connections' passwords to existing connections too")
        e.set_defaults(fn=fn)
    sh = sub.add_parser("shm", help="the shared segment")
    shsub = sh.add_subparsers(dest="shm_cmd", required=True)
    st = shsub.add_parser("stat")
    st.add_argument("--name", help="segment name (default: this instance's)")
    sh.set_defaults(fn=cmd_shm)
    mc = sub.add_parser("mcp", help="an MCP server (streamable HTTP at /mcp) in front of a running qag serve")
    mc.add_argument("--bind", default="127.0.0.1:8090", help="HOST:PORT for MCP clients (default 127.0.0.1:8090)")
    mc.add_argument("--upstream", default=None, help="the qag instance's URL (default http://QAG_BIND)")
    mc.set_defaults(fn=cmd_mcp)
    args = p.parse_args(argv)
    return args.fn(args) or 0


def cmd_mcp(args) -> int:
    from qag import config, mcpserver
    upstream = args.upstream or "http://" + config.load().bind
    return mcpserver.main(args.bind, upstream)


if __name__ == "__main__":
    sys.exit(main())
