# syntax=docker/dockerfile:1
# qag image: the Python gateway (gunicorn + Falcon workers) and the Rust data plane `qag-plane`.
#   docker build -t qag .            then   docker run -p 8080:8080 --shm-size=256m -e QAG_ADMIN_KEY=... qag
# `qag serve` is the default command; `qag serve --plane` puts qag-plane on :8080 in front of gunicorn.

# --- stage 1: the data plane --------------------------------------------------------------------
FROM rust:1-slim-bookworm AS plane
WORKDIR /src/rustplane
# Only the crate: a change under qag/ or tests/ does not rebuild the plane.
COPY rustplane/ /src/rustplane/
# --locked: the image gets exactly the committed Cargo.lock. The registry cache survives between builds
# (BuildKit); the binary leaves the stage through /out.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    cargo build --release --locked \
 && install -D -m 0755 target/release/qag-plane /out/qag-plane

# --- stage 2: the runtime -----------------------------------------------------------------------
# Same Debian release as stage 1, so the plane links against the glibc it was built with.
FROM python:3.11-slim-bookworm AS runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed numeric uid, so Kubernetes' runAsNonRoot can check it and volumes can be chowned ahead.
RUN groupadd --system --gid 10001 qag \
 && useradd --system --uid 10001 --gid qag --home-dir /var/lib/qag --no-create-home \
        --shell /usr/sbin/nologin qag \
 && install -d -o qag -g qag -m 0750 /var/lib/qag

# Exactly what the package build reads (setup.cfg reads README.md as long_description).
WORKDIR /build
COPY setup.cfg pyproject.toml README.md ./
COPY qag/ qag/
COPY shm/ shm/
# Every dependency ships manylinux wheels for CPython 3.11, so no compiler is needed in this image.
# Versions are the ranges of setup.cfg: the image installs the project, as `pip install .` anywhere would.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[server,postgres,mysql,clickhouse,formats,mcp]' \
 && rm -rf /build

COPY --from=plane /out/qag-plane /usr/local/bin/qag-plane

ENV QAG_HOME=/var/lib/qag \
    QAG_BIND=0.0.0.0:8080
WORKDIR /var/lib/qag
USER 10001:10001
EXPOSE 8080

# Reads the port from QAG_BIND so a changed bind does not leave a failing check behind.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('QAG_BIND', '0.0.0.0:8080').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=4).read()"]

# gunicorn's arbiter handles SIGTERM (graceful stop: plane, then workers, then the recorder drains).
STOPSIGNAL SIGTERM
ENTRYPOINT ["qag"]
CMD ["serve"]
