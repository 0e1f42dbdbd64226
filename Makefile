# shardprep: `make demo` (set up .venv, run the pipeline on a generated sample), `make test`, `make ui`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.shardprep-installed
# the video2dataset oracle of the video tests, in a venv of its own (it pins torch 2.1.2): see the script
V2D    := .venv-v2d/bin/python
export SHARDPREP_V2D_VENV := $(CURDIR)/.venv-v2d
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

.PHONY: setup bytecode chromium demo test ui bench s3 clean

setup: $(STAMP) chromium $(V2D) bytecode

# An editable install leaves our modules uncompiled, and with PYTHONDONTWRITEBYTECODE set (as on the
# benchmark machine) every process compiled ~100 of them again at start (~0.3 CPU-s each: the CLI, the
# queue daemon, a run started cold). Stale files cost nothing but that: Python checks each against its source.
bytecode: $(STAMP)
	$(PY) -m compileall -q shardprep assets resources sensors orchestration definitions.py >/dev/null

# The browser tests drive Debian's chromium through Playwright (never `playwright install`).
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# Idempotent: re-runs only when pyproject.toml or the C extensions change (the install builds them in place).
# dalle2-pytorch is a test oracle installed without its (heavy) model dependencies: the tests load its
# loader modules by file path.
$(STAMP): pyproject.toml shardprep/images/downscale.c shardprep/images/unfilter.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dagster,test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps dalle2-pytorch==1.15.6
	touch $(STAMP)

$(V2D): $(STAMP) tests/fixtures/video2dataset_venv.sh
	bash tests/fixtures/video2dataset_venv.sh $(CURDIR)/.venv-v2d

demo: setup
	$(PY) -m demo.run_demo

# Two test processes, a file each at a time: most long tests wait on subprocesses, servers and daemons.
# (Four: 760 s against 810 s on a 2-core AMD EPYC, 2026-12-06, for 10% more CPU; not worth the timing-
# sensitive tests sharing the cores.)
# Files go out in tests/conftest.py's order, the longest first (SLOW_FIRST), not xdist's (most tests first).
# The 25 slowest tests are listed at the end (CI logs: where the suite's time goes on a slower machine).
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

bench: setup
	$(PY) bench/run.py
	$(PY) bench/dedup.py  # duplicates at 1M embeddings: bench/DEDUP.md
	$(PY) bench/cli_start.py  # `shardprep status` and --help start-up: bench/CLI.md
	$(PY) bench/pixels.py  # one decode per image for CLIP, watermark and captioner: bench/PIXELS.md

# A local S3 server (seaweedfs, from the test extra) in the foreground, data kept under .s3/; it prints
# the AWS_* exports that point shardprep at it. Ctrl-C stops it.
s3: $(STAMP)
	$(PY) -m tests.fixtures.seaweed --dir .s3 --port $${S3_PORT:-8333}

ui: setup
	@test -f demo/work/shardprep.yaml || { echo "run 'make demo' first"; exit 1; }
	$(PY) -m shardprep_dagster.orchestration.instance >/dev/null
	SHARDPREP_CONFIG=$(CURDIR)/demo/work/shardprep.yaml $(PY) -m demo.run_demo --serve-only & \
	SHARDPREP_CONFIG=$(CURDIR)/demo/work/shardprep.yaml $(VENV)/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p $${PORT:-3000}

clean:
	rm -rf demo/work .dagster_home .venv-v2d
