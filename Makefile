# shardprep: `make demo` (set up .venv, run the pipeline on a generated sample), `make test`, `make ui`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.shardprep-installed
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE := disabled
# used only with dagster.postgres.yaml (this machine's PostgreSQL)
export DAGSTER_PG_HOST ?= 127.0.0.1
export DAGSTER_PG_PORT ?= 5432
export DAGSTER_PG_USER ?= postgres
export DAGSTER_PG_PASSWORD ?=
export DAGSTER_PG_DB ?= test

.PHONY: setup chromium demo test ui bench clean

setup: $(STAMP) chromium

# The browser tests drive Debian's chromium through Playwright (never `playwright install`).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# Idempotent: re-runs only when pyproject.toml changes. dalle2-pytorch is a test oracle installed
# without its (heavy) model dependencies: the tests load its loader modules by file path.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps dalle2-pytorch==1.15.6
	touch $(STAMP)

demo: setup
	$(PY) -m demo.run_demo

# Two test processes, a file each at a time: most long tests wait on subprocesses, servers and daemons.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: setup
	$(PY) bench/run.py

ui: setup
	@test -f demo/work/shardprep.yaml || { echo "run 'make demo' first"; exit 1; }
	$(PY) -m orchestration.instance >/dev/null
	SHARDPREP_CONFIG=$(CURDIR)/demo/work/shardprep.yaml $(PY) -m demo.run_demo --serve-only & \
	SHARDPREP_CONFIG=$(CURDIR)/demo/work/shardprep.yaml $(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p $${PORT:-3000}

clean:
	rm -rf demo/work .dagster_home
