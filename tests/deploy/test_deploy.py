"""Deployment files (Dockerfile, systemd, Compose, Prometheus, Grafana, Helm) checked against what they name:
repository paths, setup.cfg extras, qag/config.py settings, qag/metrics.py metrics, the CLI; real tools when installed.
"""
from __future__ import annotations

import configparser
import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

import qag
import qag.cli
from qag import config
from qag.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SETTINGS = {s.env for s in config.SETTINGS}
# Variables the deployment files may set that are not settings of qag/config.py.
DEPLOY_ONLY_VARS = {"QAG_PLANE_BIN"}


def _yaml():
    # pyyaml is needed only here (it belongs in the dev extra).
    return pytest.importorskip("yaml")


def _load_yaml(path: Path):
    return _yaml().safe_load(path.read_text())


# --- helpers: the CLI's own parser ----------------------------------------------------------------

def _serve_args(monkeypatch, argv: list[str]):
    """Parse argv with qag's real argument parser; returns the `serve` namespace (SystemExit if rejected)."""
    seen = {}

    def fake_serve(args):
        seen["args"] = args
        return 0
    monkeypatch.setattr(qag.cli, "cmd_serve", fake_serve)
    assert qag.cli.main(argv) == 0
    assert "args" in seen, f"{argv} is not `qag serve`"
    return seen["args"]


def _setup_cfg() -> configparser.ConfigParser:
    cp = configparser.ConfigParser()
    cp.read(ROOT / "setup.cfg")
    return cp


def _cfg_list(value: str) -> list[str]:
    return [line.strip() for line in value.strip().splitlines() if line.strip()]


def _console_scripts() -> dict[str, str]:
    out = {}
    for line in _cfg_list(_setup_cfg()["options.entry_points"]["console_scripts"]):
        name, _, target = line.partition("=")
        out[name.strip()] = target.strip()
    return out


def _extras() -> set[str]:
    return set(_setup_cfg()["options.extras_require"].keys())


# --- the Dockerfile --------------------------------------------------------------------------------

def _dockerfile() -> list[dict]:
    """Instructions in order: {"op", "args", "flags", "stage"} with continuation lines joined."""
    lines, buf = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        if not buf and (raw.lstrip().startswith("#") or not raw.strip()):
            continue
        if buf and raw.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        lines.append(buf + raw)
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    out, stage = [], -1
    for line in lines:
        op, _, rest = line.strip().partition(" ")
        op = op.upper()
        if op == "FROM":
            stage += 1
        flags, args = {}, rest.strip()
        while args.startswith("--"):
            flag, _, args = args.partition(" ")
            k, _, v = flag[2:].partition("=")
            flags[k] = v
            args = args.strip()
        out.append({"op": op, "args": args, "flags": flags, "stage": stage})
    return out


def _stages() -> dict[str, int]:
    names = {}
    for ins in _dockerfile():
        if ins["op"] == "FROM":
            parts = ins["args"].split()
            names[parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(ins["stage"])] = ins["stage"]
    return names


def _final(op: str) -> list[dict]:
    last = max(i["stage"] for i in _dockerfile())
    return [i for i in _dockerfile() if i["op"] == op and i["stage"] == last]


def _env(stage: int) -> dict[str, str]:
    env = {}
    for ins in _dockerfile():
        if ins["op"] == "ENV" and ins["stage"] == stage:
            for tok in shlex.split(ins["args"]):
                k, _, v = tok.partition("=")
                env[k] = v
    return env


def _copy_sources(ins: dict) -> tuple[list[str], str]:
    parts = json.loads(ins["args"]) if ins["args"].startswith("[") else shlex.split(ins["args"])
    return parts[:-1], parts[-1]


def _dockerignore() -> list[str]:
    return [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def _pattern(pat: str) -> re.Pattern:
    """A .dockerignore pattern as a regex (Go's filepath.Match plus `**`, anchored at the context root)."""
    out, i = "", 0
    while i < len(pat):
        if pat.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pat.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pat[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pat[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pat[i]), i + 1
    return re.compile(out)


def _ignored(rel: str) -> bool:
    """Docker's rule: a path is excluded when it or a parent directory matches (the last match wins)."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for pat in _dockerignore():
        neg = pat.startswith("!")
        rx = _pattern(pat.lstrip("!").strip("/"))
        if any(rx.fullmatch(p) for p in prefixes):
            excluded = not neg
    return excluded


def _kept_files(src: str) -> list[str]:
    """Files of the build context under src that .dockerignore keeps (ignored directories not walked)."""
    if (ROOT / src).is_file():
        return [] if _ignored(src) else [src]
    kept = []
    for top, dirs, files in os.walk(ROOT / src):
        rel = os.path.relpath(top, ROOT)
        dirs[:] = [d for d in dirs if not _ignored(f"{rel}/{d}")]
        kept += [f"{rel}/{f}" for f in files if not _ignored(f"{rel}/{f}")]
    return kept


def test_dockerfile_two_stages_on_the_same_debian():
    froms = [i["args"].split() for i in _dockerfile() if i["op"] == "FROM"]
    assert [f[0] for f in froms] == ["rust:1-slim-bookworm", "python:3.11-slim-bookworm"]
    # The plane is linked against stage 1's glibc; the runtime must be the same Debian release.
    assert all(f[0].endswith("-bookworm") for f in froms)
    assert "plane" in _stages()


def test_dockerfile_copy_sources_exist_and_are_not_dockerignored():
    copies = [i for i in _dockerfile() if i["op"] == "COPY" and "from" not in i["flags"]]
    assert copies
    for ins in copies:
        sources, _ = _copy_sources(ins)
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"COPY {src}: not in the repository"
            assert not _ignored(src), f"COPY {src}: excluded by .dockerignore"
            assert _kept_files(src), f"COPY {src}: every file under it is excluded by .dockerignore"


def test_dockerignore_keeps_local_builds_and_caches_out():
    for rel in (".git", ".venv", "qag.egg-info", "qag/__pycache__/app.cpython-311.pyc", "rustplane/target",
                "rustplane/target/release/qag-plane", "tests/deploy/test_deploy.py", "shm/__pycache__/x.pyc"):
        assert _ignored(rel), f"{rel} should be excluded from the build context"
    for rel in ("setup.cfg", "qag/http/app.py", "shm/LAYOUT.md", "rustplane/Cargo.toml", "rustplane/src/main.rs"):
        assert not _ignored(rel), f"{rel} is needed by the build"


def test_runtime_stage_copies_exactly_the_package_build_inputs():
    sources = set()
    for ins in _final("COPY"):
        if "from" not in ins["flags"]:
            sources.update(s.rstrip("/") for s in _copy_sources(ins)[0])
    assert sources == {"setup.cfg", "pyproject.toml", "README.md", "qag", "shm"}
    cp = _setup_cfg()
    # Every top-level package setup.cfg builds, and every file it reads, is in the image's build dir.
    roots = {p.split(".")[0] for p in _cfg_list(cp["options.packages.find"]["include"])}
    assert roots <= sources
    for key in ("long_description", "version"):
        value = cp["metadata"].get(key, "")
        if value.startswith("file:"):
            for f in value[5:].split(","):
                assert f.strip() in sources, f"setup.cfg reads {f.strip()}, which the image does not copy"
    for pkg, globs in cp["options.package_data"].items():
        for g in (x.strip() for x in globs.split(",")):
            assert list((ROOT / pkg.replace(".", "/")).glob(g)), f"package_data {pkg}/{g} matches nothing"


@pytest.mark.xfail(condition=not (ROOT / "qag" / "http" / "__init__.py").exists(), strict=True,
                   reason="qag/http/ has no __init__.py: `packages = find:` leaves qag.http out of the wheel, so an "
                          "installed qag (the image, /opt/qag) fails to boot its workers")
def test_installed_package_holds_every_module_of_the_source_tree():
    """What `pip install .` ships is what setuptools finds; a directory of modules it misses runs from the
    checkout (tests, `pip install -e`) but not from the image."""
    find_packages = pytest.importorskip("setuptools").find_packages
    cp = _setup_cfg()
    found = set(find_packages(where=str(ROOT), include=_cfg_list(cp["options.packages.find"]["include"])))
    roots = {p.split(".")[0] for p in _cfg_list(cp["options.packages.find"]["include"])}
    in_tree = set()
    for root in roots:
        for top, dirs, files in os.walk(ROOT / root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if any(f.endswith(".py") for f in files):
                in_tree.add(os.path.relpath(top, ROOT).replace(os.sep, "."))
    assert not in_tree - found, f"not installed by pip: {sorted(in_tree - found)}"


def test_pip_install_names_existing_extras():
    runs = [i["args"] for i in _final("RUN") if "pip install" in i["args"]]
    assert len(runs) == 1
    m = re.search(r"'\.\[([a-z0-9_,-]+)\]'", runs[0])
    assert m, "pip install '.[extras]' from the copied source"
    named = set(m.group(1).split(","))
    assert named == {"server", "postgres", "mysql", "clickhouse", "formats", "mcp"}
    assert named <= _extras(), f"extras missing from setup.cfg: {named - _extras()}"
    assert "--no-cache-dir" in runs[0]


def test_entrypoint_is_the_console_script_and_cmd_is_serve(monkeypatch):
    entry = json.loads(_final("ENTRYPOINT")[-1]["args"])
    cmd = json.loads(_final("CMD")[-1]["args"])
    assert entry == ["qag"] and cmd == ["serve"]
    assert _console_scripts().get("qag") == "qag.cli:main"
    _serve_args(monkeypatch, entry[1:] + cmd)


def test_image_settings_parse_and_port_matches_bind():
    last = max(i["stage"] for i in _dockerfile())
    env = _env(last)
    assert env["QAG_HOME"] == "/var/lib/qag"
    assert {k for k in env if k.startswith("QAG_")} <= SETTINGS | DEPLOY_ONLY_VARS
    cfg = config.load(environ={k: v for k, v in env.items() if k in SETTINGS})
    host, _, port = cfg.bind.rpartition(":")
    assert host == "0.0.0.0", "inside a container qag must listen on every interface"
    exposed = [p.split("/")[0] for i in _final("EXPOSE") for p in i["args"].split()]
    assert exposed == [port]


def test_image_runs_as_the_qag_user_which_owns_qag_home():
    runs = " ".join(i["args"] for i in _final("RUN"))
    uid = re.search(r"useradd [^&]*--uid (\d+)[^&]* qag\b", runs)
    gid = re.search(r"groupadd [^&]*--gid (\d+) qag\b", runs)
    assert uid and gid
    user = _final("USER")[-1]["args"]
    assert user in (f"{uid.group(1)}:{gid.group(1)}", "qag", "qag:qag", uid.group(1))
    assert uid.group(1) != "0"
    assert re.search(r"install -d -o qag -g qag [^&]*/var/lib/qag", runs), "QAG_HOME must be writable by qag"


def test_plane_stage_builds_the_crates_binary_where_qag_looks_for_it(tmp_path, monkeypatch):
    plane = _stages()["plane"]
    ins = [i for i in _dockerfile() if i["stage"] == plane]
    workdir = [i["args"] for i in ins if i["op"] == "WORKDIR"][-1]
    assert workdir == "/src/rustplane"
    build = " ".join(i["args"] for i in ins if i["op"] == "RUN")
    assert "cargo build --release" in build
    cargo = tomllib.loads((ROOT / "rustplane" / "Cargo.toml").read_text())
    bins = [b["name"] for b in cargo.get("bin", [])] or [cargo["package"]["name"]]
    assert "qag-plane" in bins
    m = re.search(r"install -D -m 0755 (\S+) (\S+)", build)
    assert m and m.group(1) == "target/release/qag-plane"
    copied = [i for i in _final("COPY") if i["flags"].get("from") == "plane"]
    assert len(copied) == 1
    src, dest = _copy_sources(copied[0])
    assert src == [m.group(2)] and dest == "/usr/local/bin/qag-plane"
    # qag serve --plane finds the binary on PATH, as it is in the image.
    from qag.server import arbiter
    binary = tmp_path / "qag-plane"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.delenv("QAG_PLANE_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert arbiter.plane_binary() == str(binary)


def test_plane_lock_file_covers_every_dependency():
    """The image builds with --locked: a dependency added to Cargo.toml but not to Cargo.lock fails it."""
    plane = _stages()["plane"]
    build = " ".join(i["args"] for i in _dockerfile() if i["stage"] == plane and i["op"] == "RUN")
    assert "--locked" in build
    crate = ROOT / "rustplane"
    manifest = tomllib.loads((crate / "Cargo.toml").read_text())
    lock = tomllib.loads((crate / "Cargo.lock").read_text())
    root = [p for p in lock["package"] if p["name"] == manifest["package"]["name"]]
    assert len(root) == 1
    locked = {d.split()[0] for d in root[0].get("dependencies", [])}
    declared = set()
    for table in ("dependencies", "dev-dependencies", "build-dependencies"):
        for name, spec in manifest.get(table, {}).items():
            declared.add(spec.get("package", name) if isinstance(spec, dict) else name)
    assert declared == locked, f"Cargo.lock is out of step with Cargo.toml: {sorted(declared ^ locked)}"


def test_plane_sources_stay_inside_the_crate():
    """Stage 1 copies only rustplane/: an include_bytes!("../../shm/…") would break the image build."""
    crate = ROOT / "rustplane"
    for rs in [*crate.glob("src/**/*.rs"), *crate.glob("build.rs")]:
        for m in re.finditer(r'include_(?:bytes|str)!\s*\(\s*"([^"]+)"', rs.read_text()):
            target = (rs.parent / m.group(1)).resolve()
            assert crate.resolve() in target.parents, f"{rs}: {m.group(1)} is outside rustplane/"


@pytest.mark.skipif(importlib.util.find_spec("dockerfile") is None,
                    reason="dockerfile (BuildKit's parser) not installed")
def test_buildkit_parser_reads_the_same_instructions():
    """The official parser (PyPI `dockerfile`) agrees with the one these tests use, so the checks above see
    what `docker build` sees."""
    import dockerfile
    official = [(c.cmd.upper(), sorted(f.lstrip("-").split("=")[0] for f in c.flags))
                for c in dockerfile.parse_file(str(ROOT / "Dockerfile"))]
    ours = [(i["op"], sorted(i["flags"])) for i in _dockerfile()]
    assert ours == official


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed")
def test_hadolint_finds_nothing():
    r = subprocess.run(["hadolint", "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def _serve_health(status: int):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = status if self.path == "/health" else 404
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.parametrize("status,ok", [(200, True), (503, False)])
def test_healthcheck_command_gets_health_on_the_bind_port(status, ok):
    hc = _final("HEALTHCHECK")[-1]["args"]
    argv = json.loads(hc[hc.index("CMD") + 3:].strip())
    assert argv[0] == "python", "the image's interpreter; curl and wget are not in python:slim"
    srv = _serve_health(status)
    try:
        env = dict(os.environ, QAG_BIND=f"0.0.0.0:{srv.server_address[1]}")
        rc = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, timeout=20,
                            check=False).returncode
    finally:
        srv.shutdown()
        srv.server_close()
    assert (rc == 0) is ok


# --- systemd ---------------------------------------------------------------------------------------

def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (keys repeat in units, so no configparser)."""
    out, section = {}, None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and section is not None, f"{path}: malformed line {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return out


UNITS = ["qag.service", "qag@.service"]
HARDENING = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
             "PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes",
             "RestrictSUIDSGID": "yes", "LockPersonality": "yes", "CapabilityBoundingSet": "",
             "KillMode": "mixed", "Type": "notify", "User": "qag", "RemoveIPC": "no"}


@pytest.mark.parametrize("name", UNITS)
def test_unit_runs_qag_serve_hardened_with_home_and_dev_shm_writable(name, monkeypatch):
    unit = _unit(DEPLOY / "systemd" / name)
    svc = unit["Service"]
    start = shlex.split(svc["ExecStart"][-1].replace("$SERVE_ARGS", ""))
    assert Path(start[0]).name == "qag" and start[1] == "serve"
    _serve_args(monkeypatch, start[1:])
    for key, want in HARDENING.items():
        assert svc.get(key, [None])[-1] == want, f"{name}: {key}={want}"
    # DynamicUser implies RemoveIPC=yes, which unlinks every segment of the user when one instance stops.
    assert svc.get("DynamicUser", ["no"])[-1] == "no"
    envs = dict(e.split("=", 1) for e in svc["Environment"])
    home = envs["QAG_HOME"]
    rw = " ".join(svc["ReadWritePaths"]).split()
    assert home in rw and "/dev/shm" in rw
    assert home == "/var/lib/" + svc["StateDirectory"][-1]
    for key in ("InaccessiblePaths", "TemporaryFileSystem", "ReadOnlyPaths"):
        assert not any("/dev" in v for v in svc.get(key, [])), f"{name}: {key} hides /dev/shm"
    assert {k for k in envs if k.startswith("QAG_")} <= SETTINGS


def test_template_unit_reads_its_instance_env_file_and_state_dir():
    svc = _unit(DEPLOY / "systemd" / "qag@.service")["Service"]
    assert svc["EnvironmentFile"] == ["/etc/qag/%i.env"]  # required: without it instances share a bind
    assert "QAG_HOME=/var/lib/qag/%i" in svc["Environment"]
    assert svc["StateDirectory"] == ["qag/%i"]
    assert "CPUAffinity" in svc


def _cpus(spec: str) -> set[int]:
    out = set()
    for part in spec.replace(",", " ").split():
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            env[k.strip()] = v.strip()
    return env


def test_instances_have_own_binds_disjoint_cpus_and_valid_settings(monkeypatch):
    sysd = DEPLOY / "systemd"
    envs = {p.stem: _env_file(p) for p in sorted((sysd / "instances").glob("*.env"))}
    assert len(envs) >= 2
    binds, cpus = set(), []
    for inst, env in envs.items():
        assert {k for k in env if k.startswith("QAG_")} <= SETTINGS | DEPLOY_ONLY_VARS
        cfg = config.load(environ=env)
        binds.add(cfg.bind)
        _serve_args(monkeypatch, ["serve", *shlex.split(env.get("SERVE_ARGS", ""))])
        dropin = _unit(sysd / f"qag@{inst}.service.d" / "cpus.conf")["Service"]["CPUAffinity"]
        assert dropin[0] == "", "reset first, so the drop-in's list is the whole set"
        cpus.append(_cpus(" ".join(dropin)))
    assert len(binds) == len(envs), "two instances on one bind"
    for i, a in enumerate(cpus):
        for b in cpus[i + 1:]:
            assert not a & b, "instances pinned to the same CPUs"
    example = _env_file(sysd / "qag.env.example")
    assert {k for k in example if k.startswith("QAG_")} <= SETTINGS
    config.load(environ=example)


def _verify(unit_dir: Path, unit: str) -> str:
    r = subprocess.run(["systemd-analyze", "verify", str(unit_dir / unit)], capture_output=True, text=True,
                       timeout=60, check=False, env=dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:"))
    return (r.stdout + r.stderr).strip() if r.returncode or (r.stdout + r.stderr).strip() else ""


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart exists: point it at an executable that does.
    exe = shutil.which("qag") or sys.executable
    src = DEPLOY / "systemd"
    for f in UNITS:
        (tmp_path / f).write_text((src / f).read_text().replace("/opt/qag/bin/qag", exe))
    problems = {"qag.service": _verify(tmp_path, "qag.service")}
    for dropin in src.glob("qag@*.service.d"):
        shutil.copytree(dropin, tmp_path / dropin.name)
        inst = dropin.name.removesuffix(".d")
        os.symlink("qag@.service", tmp_path / inst)
        problems[inst] = _verify(tmp_path, inst)
    assert len(problems) >= 3
    assert not any(problems.values()), problems


# --- Compose, HAProxy, Prometheus, Grafana -----------------------------------------------------------

def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} and ${VAR:?error} with nothing set (required ones get a placeholder)."""
    value = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{[A-Z0-9_]+:\?[^}]*\}", "required-placeholder", value)


def _compose() -> dict:
    return _load_yaml(DEPLOY / "compose" / "docker-compose.yml")


def _qag_services(compose) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if s.get("image", "").startswith("qag")}


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)b?", str(text).lower())
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]


def test_compose_two_plane_instances_share_one_postgres_store_and_clickhouse(monkeypatch):
    compose = _compose()
    services = compose["services"]
    qags = _qag_services(compose)
    assert len(qags) == 2
    assert {"lb", "postgres", "clickhouse", "redis", "prometheus", "grafana"} <= set(services)
    urls = set()
    for name, svc in qags.items():
        args = _serve_args(monkeypatch, svc["command"])
        assert args.plane, f"{name}: qag serve --plane"
        assert (ROOT / "deploy" / "compose" / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == \
            (ROOT / "Dockerfile").resolve()
        env = {k: _interpolate(str(v)) for k, v in svc["environment"].items()}
        assert set(env) <= SETTINGS
        cfg = config.load(environ=env)
        assert cfg.database_url.split("@", 1)[1].startswith("postgres:5432/")
        assert cfg.run_store_url.startswith("http://") and "@clickhouse:8123" in cfg.run_store_url
        urls.add((cfg.database_url, cfg.secret_key))
        # Docker's /dev/shm (64 MiB by default) must hold the segment plus its semaphore.
        assert _size(svc["shm_size"]) > cfg.shm_size
        assert {"postgres", "clickhouse"} <= set(svc["depends_on"])
    assert len(urls) == 1, "both instances must share the store and the key encrypting it"
    cpusets = [_cpus(_interpolate(s["cpuset"])) for s in qags.values()]
    assert not cpusets[0] & cpusets[1], "instances pinned to the same CPUs"


def test_compose_bind_mounts_exist():
    compose = _compose()
    base = DEPLOY / "compose"
    n = 0
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                n += 1
                assert (base / src).exists(), f"{name}: {src} does not exist"
    assert n >= 5


def test_load_balancer_sends_to_every_instance_and_checks_health():
    compose = _compose()
    ports = {config.load(environ={k: _interpolate(str(v)) for k, v in s["environment"].items()}).bind.rpartition(":")[2]
             for s in _qag_services(compose).values()}
    assert len(ports) == 1
    (port,) = ports
    cfg = (DEPLOY / "compose" / "haproxy.cfg").read_text()
    servers = re.findall(r"^\s*server\s+\S+\s+([\w.-]+):(\d+)", cfg, re.MULTILINE)
    assert sorted(servers) == sorted((n, port) for n in _qag_services(compose))
    assert re.search(r"http-check send meth GET uri /health", cfg)
    mounts = compose["services"]["lb"]["volumes"]
    assert any(m.startswith("./haproxy.cfg:") for m in mounts)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy not installed")
def test_haproxy_accepts_its_config():
    r = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "compose" / "haproxy.cfg")], capture_output=True,
                       text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[ALERT]" not in r.stdout + r.stderr


def test_prometheus_scrapes_every_instance_and_loads_the_alerts():
    compose = _compose()
    prom = _load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = [j for j in prom["scrape_configs"] if j["job_name"] == "qag"]
    assert len(jobs) == 1 and jobs[0].get("metrics_path", "/metrics") == "/metrics"
    targets = sorted(t for sc in jobs[0]["static_configs"] for t in sc["targets"])
    assert targets == sorted(f"{n}:8080" for n in _qag_services(compose))
    mounts = dict(v.split(":")[:2] for v in compose["services"]["prometheus"]["volumes"] if v.startswith("."))
    assert mounts["../prometheus/alerts.yml"] in prom["rule_files"]


def _alerts() -> list[dict]:
    return [r for g in _load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"] for r in g["rules"]]


def test_alert_rules_cover_down_errors_lost_runs_lag_and_latency():
    rules = {r["alert"]: r for r in _alerts()}
    assert set(rules) == {"QagInstanceDown", "QagHighErrorRatio", "QagRunsLost", "QagRecorderLag",
                          "QagHighLatencyP99", "QagChangeWatcherBehind"}
    assert "up" in rules["QagInstanceDown"]["expr"]
    assert "> 0.05" in rules["QagHighErrorRatio"]["expr"]
    assert "qag_runs_lost_total" in rules["QagRunsLost"]["expr"] and "> 0" in rules["QagRunsLost"]["expr"]
    assert "> 30" in rules["QagRecorderLag"]["expr"]
    assert "histogram_quantile(0.99" in rules["QagHighLatencyP99"]["expr"]
    assert "> 0.1" in rules["QagHighLatencyP99"]["expr"]
    assert "qag_change_watcher_current == 0" in rules["QagChangeWatcherBehind"]["expr"]
    for r in rules.values():
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "qag.json").read_text())


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


def _promql_for_check(expr: str) -> str:
    """Grafana's variables replaced by what they expand to, so promtool can parse the expression."""
    return (expr.replace("$__rate_interval", "1m").replace("$__range", "1h").replace("$instance", ".*")
            .replace("$route", ".*"))


SERIES_SUFFIXES = ("_bucket", "_sum", "_count")


def _metric_refs(expr: str) -> list[tuple[str, str]]:
    """(metric as in METRICS, the series suffix used) for every qag_ name in a PromQL expression."""
    out = []
    for name in re.findall(r"\bqag_[a-z0-9_]+", expr):
        base, suffix = name, ""
        if name not in METRICS:
            for s in SERIES_SUFFIXES:
                if name.endswith(s) and name[: -len(s)] in METRICS:
                    base, suffix = name[: -len(s)], s
        out.append((base, suffix))
    return out


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_and_label_used_is_exported(source):
    exprs = _dashboard_exprs() if source == "dashboard" else [r["expr"] for r in _alerts()]
    assert exprs
    used = set()
    for expr in exprs:
        for name, suffix in _metric_refs(expr):
            assert name in METRICS, f"{name} is not in qag/metrics.py METRICS: {expr}"
            kind = METRICS[name][0]
            assert (kind == "histogram") == bool(suffix), f"{name}{suffix}: series of a {kind}"
            used.add(name)
        # Labels in by(...) and in selectors must be labels of the metrics, or Prometheus' own.
        allowed = {"instance", "job", "le", "service"}
        for name, _ in _metric_refs(expr):
            allowed |= set(METRICS[name][2])
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in allowed, f"label {label} not on {expr}"
        for sel in re.findall(r"\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel):
                assert label in allowed, f"label {label} not on {expr}"
        if "histogram_quantile" in expr:
            assert all(s == "_bucket" for _, s in _metric_refs(expr))
    if source == "dashboard":
        assert {"qag_requests_total", "qag_request_duration_seconds", "qag_errors_total", "qag_runs_lost_total",
                "qag_recorder_lag_seconds", "qag_plan_cache_total"} <= used


def test_dashboard_panels_asked_for():
    exprs = _dashboard_exprs()
    joined = "\n".join(exprs)
    assert re.search(r"sum by \(status\) \(rate\(qag_requests_total", joined)
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(qag_request_duration_seconds_bucket" in joined
    assert re.search(r"sum by \(code\) \(rate\(qag_errors_total", joined)
    assert 'qag_plan_cache_total{instance=~"$instance", result="hit"}' in joined
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_grafana_provisioning_matches_dashboard_and_compose():
    ds = _load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert [d["uid"] for d in ds] == ["prometheus"]
    assert ds[0]["url"] == "http://prometheus:9090"
    dash = _dashboard()
    var = next(v for v in dash["templating"]["list"] if v["type"] == "datasource")
    assert var["current"]["value"] == ds[0]["uid"]
    prov = _load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "qag.yml")["providers"][0]
    mounts = dict(v.split(":")[:2] for v in _compose()["services"]["grafana"]["volumes"] if v.startswith("."))
    assert mounts["../grafana/dashboards"] == prov["options"]["path"]
    assert mounts["../grafana/provisioning"] == "/etc/grafana/provisioning"


def _promtool(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_checks_config_rules_and_alert_unit_tests(tmp_path):
    prom = DEPLOY / "prometheus"
    r = _promtool("check", "rules", str(prom / "alerts.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    # The alerts fire (and stay quiet) on the series of alerts_test.yml.
    r = _promtool("test", "rules", str(prom / "alerts_test.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    text = (prom / "prometheus.yml").read_text().replace("/etc/prometheus/alerts.yml", str(prom / "alerts.yml"))
    (tmp_path / "prometheus.yml").write_text(text)
    r = _promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    # Every dashboard expression parses as PromQL.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"qag:dashboard:{i}", "expr": _promql_for_check(e)} for i, e in enumerate(_dashboard_exprs())]}]}
    (tmp_path / "dash.yml").write_text(json.dumps(rules))
    r = _promtool("check", "rules", str(tmp_path / "dash.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


# --- Helm --------------------------------------------------------------------------------------------

CHART = DEPLOY / "helm" / "qag"
TEMPLATES = sorted((CHART / "templates").glob("*"))


def _values() -> dict:
    return _load_yaml(CHART / "values.yaml")


def _lookup(values: dict, dotted: str) -> bool:
    node = values
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_chart_metadata():
    chart = _load_yaml(CHART / "Chart.yaml")
    assert chart["apiVersion"] == "v2" and chart["name"] == "qag"
    assert chart["appVersion"] == qag.__version__


def test_every_values_reference_exists():
    values = _values()
    refs = set()
    for t in TEMPLATES:
        refs.update(re.findall(r"\$?\.Values\.([A-Za-z0-9_.]+[A-Za-z0-9_])", t.read_text()))
    assert len(refs) > 20
    missing = sorted(r for r in refs if not _lookup(values, r))
    assert not missing, f"templates use values that values.yaml lacks: {missing}"


def _actions(text: str) -> list[str]:
    return re.findall(r"\{\{-?\s*(.*?)\s*-?\}\}", text, re.DOTALL)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_delimiters_and_blocks_balance(path):
    text = path.read_text()
    assert text.count("{{") == text.count("}}"), "unbalanced {{ }}"
    assert not re.search(r"\{\{[^}]*\{\{", text), "nested {{"
    stack = []
    for action in _actions(text):
        if action.startswith("/*"):
            continue
        word = action.split()[0] if action.split() else ""
        if word in ("if", "range", "with", "define", "block"):
            stack.append(word)
        elif word == "end":
            assert stack, f"{path.name}: end without a block"
            stack.pop()
        elif word == "else":
            assert stack and stack[-1] in ("if", "range", "with"), f"{path.name}: else outside a block"
    assert not stack, f"{path.name}: unclosed {stack}"


def test_included_templates_are_defined():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    defined = set(re.findall(r'define "([^"]+)"', helpers))
    for t in TEMPLATES:
        for name in re.findall(r'(?:include|template) "([^"]+)"', t.read_text()):
            assert name in defined, f"{t.name}: {name} is not defined in _helpers.tpl"


def _strip_template(text: str) -> str:
    """The manifest's YAML skeleton: lines holding only actions dropped, inline actions replaced by a scalar."""
    out = []
    for line in text.splitlines():
        if re.fullmatch(r"\s*(\{\{.*?\}\}\s*)+", line):
            continue
        out.append(re.sub(r"\{\{.*?\}\}", "x", line))
    return "\n".join(out)


@pytest.mark.parametrize("path", [t for t in TEMPLATES if t.suffix == ".yaml"], ids=lambda p: p.name)
def test_template_skeleton_is_yaml(path):
    doc = _yaml().safe_load(_strip_template(path.read_text()))
    assert doc["apiVersion"] and doc["kind"] and "name" in doc["metadata"]


def test_deployment_env_settings_secrets_and_resources(monkeypatch):
    values = _values()
    dep = (CHART / "templates" / "statefulset.yaml").read_text()
    secret = (CHART / "templates" / "secret.yaml").read_text()
    # Plain settings are real settings, parse, and leave secrets and the container's bind to the template.
    env = {k: str(v) for k, v in values["env"].items()}
    assert set(env) <= SETTINGS
    secret_keys = set(re.findall(r"^\s*(QAG_[A-Z_]+):", secret, re.MULTILINE))
    referenced = set(re.findall(r"key: (QAG_[A-Z_]+)", dep))
    assert {"QAG_ADMIN_KEY", "QAG_SECRET_KEY", "QAG_DATABASE_URL"} <= secret_keys
    assert secret_keys == referenced and secret_keys <= SETTINGS
    assert not set(env) & (secret_keys | {"QAG_BIND", "QAG_HOME"})
    config.load(environ=env)
    names = set(re.findall(r"- name: (QAG_[A-Z_]+)", dep))
    assert names <= SETTINGS and {"QAG_BIND", "QAG_HOME"} <= names
    bind = re.search(r'name: QAG_BIND\s+value: "([^"]+)"', dep).group(1)
    port = re.search(r"containerPort: (\d+)", dep).group(1)
    assert bind.rpartition(":")[2] == port
    exposed = [p.split("/")[0] for i in _final("EXPOSE") for p in i["args"].split()]
    assert [port] == exposed
    # Pinning needs a Guaranteed pod with whole CPUs.
    res = values["resources"]
    assert res["requests"] == res["limits"]
    assert float(res["limits"]["cpu"]) == int(float(res["limits"]["cpu"])) >= 1
    # The image's uid, and /dev/shm large enough for the segment.
    assert values["podSecurityContext"]["runAsUser"] == int(_final("USER")[-1]["args"].split(":")[0])
    assert "mountPath: /dev/shm" in dep and "medium: Memory" in dep
    assert _size(values["shm"]["sizeLimit"].replace("Mi", "m").replace("Gi", "g")) > config.load(environ=env).shm_size
    # What the template passes to qag parses (args with the plane on, and its optional threads).
    _serve_args(monkeypatch, ["serve", "--plane", "--plane-threads", "2"])
    assert re.search(r"args:\s+- serve\s+\{\{- if \.Values\.plane\.enabled \}\}\s+- --plane", dep)


def test_servicemonitor_is_gated_by_values():
    text = (CHART / "templates" / "servicemonitor.yaml").read_text()
    assert text.lstrip().startswith("{{- if .Values.metrics.serviceMonitor.enabled }}")
    assert _values()["metrics"]["serviceMonitor"]["enabled"] is False
    assert "path: /metrics" in text


# Rendering by Helm itself, when the helm-python-sdk wheel (Helm's Go SDK as a C library) is installed. It runs
# in a subprocess, so a fault in the native library cannot take the test session down.
_RENDER = r"""
import json, sys
import helm_python as helm
req = json.load(sys.stdin)
try:
    if req["op"] == "lint":
        out = helm.lint(req["chart"], req["values"])
    else:
        with helm.Chart.load(req["chart"]) as chart:
            out = {"manifests": chart.render(req["values"], name="rel", namespace="ns")}
except Exception as exc:
    out = {"error": str(exc)}
json.dump(out, sys.stdout)
"""
needs_helm = pytest.mark.skipif(importlib.util.find_spec("helm_python") is None,
                                reason="helm-python-sdk not installed (no helm binary reachable here)")
SHARED = {"secrets": {"databaseUrl": "postgresql://qag:pw@pg:5432/qag", "adminKey": "k"}}


def _helm(op: str, values: dict) -> dict:
    r = subprocess.run([sys.executable, "-c", _RENDER], input=json.dumps({"op": op, "chart": str(CHART),
                       "values": values}), capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _rendered(values: dict) -> dict[str, dict]:
    """kind -> manifest, from a successful render."""
    out = _helm("render", values)
    assert "error" not in out, out.get("error")
    docs = {}
    for name, text in out["manifests"].items():
        if name.endswith(".yaml"):
            for doc in _yaml().safe_load_all(text):
                if doc:
                    assert doc["kind"] not in docs
                    docs[doc["kind"]] = doc
    return docs


def _container(docs) -> dict:
    (c,) = docs["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return c


def _plain_env(c) -> dict[str, str]:
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)), f"duplicate env: {names}"
    assert set(names) <= SETTINGS
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


@needs_helm
def test_helm_lint_finds_nothing_above_info():
    out = _helm("lint", SHARED)
    assert not out["errors"] and all(m["severity"] < 2 for m in out["messages"]), out


@needs_helm
def test_helm_refuses_replicas_without_the_shared_store():
    out = _helm("render", {})
    assert "shared PostgreSQL store" in out.get("error", ""), out


@needs_helm
def test_helm_renders_settings_qag_accepts(monkeypatch):
    docs = _rendered({**SHARED, "metrics": {"serviceMonitor": {"enabled": True}}, "plane": {"threads": 3}})
    assert set(docs) == {"StatefulSet", "Service", "Secret", "ServiceMonitor", "PodDisruptionBudget"}
    c = _container(docs)
    cfg = config.load(environ=_plain_env(c))
    assert cfg.bind == "0.0.0.0:8080" and cfg.workers == "auto" and cfg.pin
    args = _serve_args(monkeypatch, c["args"])
    assert args.plane and args.plane_threads == 3
    exposed = [p.split("/")[0] for i in _final("EXPOSE") for p in i["args"].split()]
    assert [str(p["containerPort"]) for p in c["ports"]] == exposed
    secret = docs["Secret"]["data"]
    for e in c["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] == docs["Secret"]["metadata"]["name"]
            assert ref["key"] == e["name"] and (ref["key"] in secret or ref["optional"] is True)
    pod = docs["StatefulSet"]["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert pod["securityContext"]["runAsUser"] == int(_final("USER")[-1]["args"].split(":")[0])
    assert c["resources"]["requests"] == c["resources"]["limits"]
    sm = docs["ServiceMonitor"]["spec"]["endpoints"][0]
    assert sm["path"] == "/metrics" and "authorization" not in sm
    # The alert rules select job="qag"; the release is called "rel" here.
    assert {"targetLabel": "job", "replacement": "qag"} in sm["relabelings"]
    assert 'up{job="qag"}' in {r["alert"]: r["expr"] for r in _alerts()}["QagInstanceDown"]
    assert docs["Service"]["spec"]["selector"] == docs["StatefulSet"]["spec"]["selector"]["matchLabels"]


@needs_helm
def test_helm_without_exclusive_cpus_sizes_workers_by_the_limit():
    docs = _rendered({**SHARED, "pinning": {"exclusiveCpus": False}})
    cfg = config.load(environ=_plain_env(_container(docs)))
    assert cfg.workers == 2 and not cfg.pin


@needs_helm
def test_helm_existing_secret_single_replica_no_plane(monkeypatch):
    docs = _rendered({"replicaCount": 1, "secrets": {"existingSecret": "qag-prod", "metricsToken": ""},
                      "plane": {"enabled": False}})
    assert set(docs) == {"StatefulSet", "Service"}
    c = _container(docs)
    refs = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert refs and all(r["name"] == "qag-prod" for r in refs)
    assert not _serve_args(monkeypatch, c["args"]).plane


def _pods(docs) -> list[dict[str, str]]:
    """Each pod's environment as the kubelet gives it: a StatefulSet's pods are named <name>-<ordinal>, and
    QAG_RUN_WRITER_ID comes from the pod's name (the downward API)."""
    sts = docs["StatefulSet"]
    c = _container(docs)
    ref = next(e for e in c["env"] if e["name"] == "QAG_RUN_WRITER_ID")
    assert ref["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    plain = _plain_env(c)
    return [{**plain, "QAG_RUN_WRITER_ID": f"{sts['metadata']['name']}-{i}"} for i in range(sts["spec"]["replicas"])]


def test_chart_numbers_its_pods_run_writers_without_helm():
    """Without Helm's engine: the template passes the pod's own name as QAG_RUN_WRITER_ID, from a StatefulSet."""
    text = (CHART / "templates" / "statefulset.yaml").read_text()
    assert re.search(r"^kind: StatefulSet$", text, re.MULTILINE)
    assert re.search(r"name: QAG_RUN_WRITER_ID\s+valueFrom:\s+fieldRef:\s+fieldPath: metadata\.name", text)
    assert re.search(r"name: QAG_RUN_WRITERS\s+value: \{\{ \.Values\.runWriters \| quote \}\}", text)
    values = _values()
    assert values["runWriters"] in (1, 2, 4, 8, 16) and values["replicaCount"] <= values["runWriters"]


@needs_helm
def test_helm_pods_on_one_clickhouse_mint_distinct_event_ids():
    """Every pod of the release gets its own writer id (its ordinal) below QAG_RUN_WRITERS, so their event id
    progressions never meet; the chart refuses more replicas than writers, and qag a pod name past them."""
    from qag.runstore.eventid import IdClock
    docs = _rendered({**SHARED, "replicaCount": 5, "secrets": {**SHARED["secrets"],
                                                                "runStoreUrl": "http://qag:pw@ch:8123/qag"}})
    sts = docs["StatefulSet"]["spec"]
    assert sts["serviceName"] == docs["Service"]["metadata"]["name"] and sts["podManagementPolicy"] == "Parallel"
    cfgs = [config.load(environ=env) for env in _pods(docs)]
    assert [c.run_writer_id for c in cfgs] == [0, 1, 2, 3, 4] and {c.run_writers for c in cfgs} == {16}
    assert {c.events_settle_ms for c in cfgs} == {1000}
    clocks = [IdClock(0, clock=lambda: 1_800_000_000_000, writer=c.run_writer_id, writers=c.run_writers)
              for c in cfgs]
    minted = [clock.take(1) + clock.stride * i for clock in clocks for i in range(500)]
    assert len(set(minted)) == len(minted), "two pods minted the same event id"
    for values, words in (({"replicaCount": 17}, "above runWriters"), ({"runWriters": 3}, "runWriters must be"),
                          ({"replicaCount": 3, "runWriters": 2}, "above runWriters")):
        out = _helm("render", {**SHARED, **values})
        assert words in out.get("error", ""), (values, out)
    env = _pods(_rendered({**SHARED, "replicaCount": 2, "runWriters": 2}))[1]
    assert config.load(environ=env).run_writer_id == 1
    with pytest.raises(config.SettingError) as ei:   # a pod past the writers (scaled by hand) does not start
        config.load(environ={**env, "QAG_RUN_WRITER_ID": env["QAG_RUN_WRITER_ID"][:-1] + "2"})
    assert "QAG_RUN_WRITER_ID" in str(ei.value)


# --- the README ----------------------------------------------------------------------------------------

def test_deploy_readme_names_every_file():
    readme = (DEPLOY / "README.md").read_text()
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.name != "README.md"):
        rel = path.relative_to(DEPLOY)
        assert str(rel) in readme or (path.parent != DEPLOY and f"{rel.parent}/" in readme), \
            f"deploy/README.md does not mention {rel}"
