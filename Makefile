# One entry point per task.
VENV ?= .venv
PY := $(VENV)/bin/python

# Where `cargo install` puts oha: $CARGO_HOME/bin (CI may point CARGO_HOME at an empty registry), else ~/.cargo/bin.
CARGO_BIN := $(or $(CARGO_HOME),$(HOME)/.cargo)/bin

.PHONY: test venv lint vectors bench-smoke docs oha browser promtool plane

venv:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,postgres,mysql,clickhouse,formats,mcp,dev]'

OHA_VERSION := 1.16.0

# Everything slow to build comes first, once, with its progress shown (plane, oha): no build runs under a test's
# timeout. Then the lint, pytest, the plane's own tests and the benchmark smoke.
test: venv browser promtool plane oha lint
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests/ -q -p no:cacheprovider
	cd rustplane && cargo test --release --locked -q
	$(MAKE) bench-smoke

# The Rust data plane (rustplane/target/release/qag-plane). The plane's e2e tests run this build and never make
# one (a cold release build is longer than pytest's 300 s timeout on a 2-core machine); without it they fail
# saying `make plane`. Cargo prints each crate as it compiles.
plane:
	@command -v cargo >/dev/null || { echo "cargo not found: install Rust (rustup) to build the data plane" >&2; exit 1; }
	@echo "building the data plane: cd rustplane && cargo build --release"
	cd rustplane && cargo build --release --locked

# The Console's browser tests drive Debian's Chromium through its chromedriver (nothing downloads a browser).
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] && S= || S=sudo; \
		  $$S apt-get update -q && $$S env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } ; } || \
		echo "chromium not installed: the Console's browser tests will be skipped"

# promtool runs deploy/prometheus's rule unit tests (tests/deploy/test_deploy.py); it comes with Debian's `prometheus`
# package. Where apt-get is missing or we are not root, nothing is installed and those tests skip.
PROMTOOL_APT := DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null
promtool:
	command -v promtool >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  { $(PROMTOOL_APT) || { apt-get update -q >/dev/null && $(PROMTOOL_APT); }; }; } || \
	  echo "promtool unavailable (no apt-get, or not root): the promtool tests skip"

# The benchmark harness's smoke run: every block for a few seconds against the peer, qag, the plane and the
# floors; it checks completion and zero non-2xx, never speed. oha is the load generator (crates.io).
oha:
	@command -v oha >/dev/null || test -x $(CARGO_BIN)/oha || { echo "building oha $(OHA_VERSION) (the bench's load generator)"; \
	  cargo install oha --locked --version $(OHA_VERSION); }

# ruff's version and rules are pinned (setup.cfg's dev extra, pyproject.toml's [tool.ruff]); clippy's in Cargo.toml.
lint: venv
	$(VENV)/bin/ruff check qag shm tests bench
	cd rustplane && cargo clippy --release --locked --all-targets -- -D warnings

vectors: venv
	$(PY) -m shm.vectors

docs: venv
	$(PY) -m qag.config

bench-smoke: venv oha
	PATH="$(CURDIR)/$(VENV)/bin:$(CARGO_BIN):$$PATH" $(PY) bench/oltp.py --smoke
	PATH="$(CURDIR)/$(VENV)/bin:$(CARGO_BIN):$$PATH" $(PY) bench/tpcc_mysql.py --smoke
	PATH="$(CURDIR)/$(VENV)/bin:$(CARGO_BIN):$$PATH" $(PY) bench/formats.py --smoke
