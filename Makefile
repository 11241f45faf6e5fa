# One entry point per task.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test venv lint vectors bench-smoke docs oha browser promtool

venv:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,postgres,mysql,clickhouse,formats,mcp,dev]'

OHA_VERSION := 1.16.0

test: venv browser promtool
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests/ -q -p no:cacheprovider
	if [ -f rustplane/Cargo.toml ] && command -v cargo >/dev/null; then cd rustplane && cargo test --release -q; fi
	$(MAKE) bench-smoke

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
	command -v oha >/dev/null || test -x $(HOME)/.cargo/bin/oha || cargo install oha --locked --version $(OHA_VERSION)

lint: venv
	$(VENV)/bin/ruff check qag shm tests

vectors: venv
	$(PY) -m shm.vectors

docs: venv
	$(PY) -m qag.config

bench-smoke: venv oha
	PATH="$(CURDIR)/$(VENV)/bin:$(HOME)/.cargo/bin:$$PATH" $(PY) bench/oltp.py --smoke
	PATH="$(CURDIR)/$(VENV)/bin:$(HOME)/.cargo/bin:$$PATH" $(PY) bench/tpcc_mysql.py --smoke
