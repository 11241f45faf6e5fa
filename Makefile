# One entry point per task.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test venv lint vectors bench-smoke docs

venv:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,postgres,mysql,clickhouse,dev]'

test: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests/ -q -p no:cacheprovider
	if [ -f rustplane/Cargo.toml ] && command -v cargo >/dev/null; then cd rustplane && cargo test --release -q; fi

lint: venv
	$(VENV)/bin/ruff check qag shm tests

vectors: venv
	$(PY) -m shm.vectors

docs: venv
	$(PY) -m qag.config

bench-smoke: venv
	$(PY) bench/oltp.py --smoke
	$(PY) bench/tpcc_mysql.py --smoke
