# `make run`: set up and start the service on embedded defaults. `make test`: set up and run every test.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup lock chromium run lint test test-fast bench bench-smoke clean

# constraints.txt pins every installed package (dev tools included), so a tool's upgrade is a commit, not a surprise:
# an unpinned pytest once turned `--dist loadgroup` into plain `load`. `make lock` rewrites it from the venv.
# scripts/pip-install.sh installs through uv (same pins, same indexes, several times faster), or pip without it.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || { $(PYTHON) -m venv $(VENV) && scripts/pip-install.sh $(PY) -q --upgrade pip setuptools wheel; }
	scripts/pip-install.sh $(PY) -q -c constraints.txt -e '.[dev,postgres,redis]'
	@touch $(STAMP)

lock: $(STAMP)
	{ echo "# The exact versions \`make setup\` installs (pip constraints; regenerate on purpose with \`make lock\`)."; \
	  $(PY) -m pip freeze --exclude-editable; } > constraints.txt

setup: $(STAMP) chromium

# The dashboard's browser test (tests/e2e/test_dashboard_browser.py) drives Debian's chromium through Playwright (no
# downloaded browser). Installed here when missing and we are root; otherwise that test skips (fails under
# LLMJOBS_REQUIRE_SERVICES=1).
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi

# `llmjobs serve` applies the migrations, prepares the demo data, starts one local worker and the API on
# LLMJOBS_HOST:LLMJOBS_PORT (default 127.0.0.1:8000), and prints the URL and an admin token.
run: setup
	$(VENV)/bin/llmjobs serve

# The gate: ruff (style and bugs), ruff format (layout), mypy (types) and import-linter (the layering: cli -> app |
# worker -> core -> engine, no import cycle). What each covers is configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Two pytest-xdist workers: most tests wait on child processes (torchrun ranks, the service, workers), so two at a time
# fill the machine. Every run is in a random order (pytest-randomly, pinned): the header prints
# `Using --randomly-seed=N`, and `make test PYTEST_ARGS=--randomly-seed=N` replays that order; a test that passes only
# after another fails some day, not never. The tests on PostgreSQL or Redis keep to their own databases and keys
# (tests/conftest.py checks it), so they need no worker of their own and xdist spreads them like any other.
# Longest first: tests/suite_order.py puts the modules with a longer timeout mark, then those with a slow test, ahead
# (stable, so still in the seed's order within each rank), and xdist's `worksteal` spreads them over both workers: a
# worker that runs out takes half of the other's queue. Plain `load` hands out chunks of up to an eighth of what is
# left and never takes them back: at stop 52 one worker sat idle for the last ~15 minutes of the stage while the other
# worked through its chunk (docs/testing.md). (`--dist loadfile`, a whole module per worker, took 50 min against ~25.)
# SERIAL_TESTS run after, in one process: schemathesis gives every case it generates its test function's node id, and
# xdist, which schedules by node id, would run one case of each (tests/conftest.py refuses such duplicates under xdist).
# The chat-flood replay holds another team's p99 under 1 s: on 2 cores it needs the machine to itself.
TEST_WORKERS ?= 2
SERIAL_TESTS := tests/integration/test_api_fuzz.py tests/security/test_openai_flood.py
# The fake-npu device trace registers a private-use backend: torch's autograd engine sizes its device queues at the
# first backward of a process, so these run first in a process of their own (an xdist worker has run CPU backwards),
# and in file order: shuffled, a CPU backward of test_npu_rope.py ran before the fake device existed and 14 of them
# failed on that assert (seed 11).
TRACE_TESTS := tests/unit/engine/trace/test_trace.py tests/unit/engine/trace/test_npu_rope.py

PYTEST_ARGS ?=

# These machines set PYTHONDONTWRITEBYTECODE=1: then no process keeps the .pyc of the project's own modules, nor
# pytest its rewritten test modules, and each of the suite's thousands of processes (torchrun ranks, services,
# workers) compiled them again. The venv's packages get theirs at install (scripts/pip-install.sh).
unexport PYTHONDONTWRITEBYTECODE

test: setup
	$(PY) -m pytest -ra --durations=25 -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS) \
	  $(addprefix --ignore=,$(SERIAL_TESTS) $(TRACE_TESTS))
	$(PY) -m pytest -ra -p no:randomly $(TRACE_TESTS)
	$(PY) -m pytest -ra $(PYTEST_ARGS) $(SERIAL_TESTS)

test-fast: setup
	$(PY) -m pytest -ra -m "not slow and not e2e"

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# Every benchmark's --smoke mode (what CI runs after the tests): each must finish and end with its JSON line.
bench-smoke: setup
	PY=$(PY) .ci/bench

clean:
	rm -rf var .pytest_cache
