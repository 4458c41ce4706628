# Two commands on a fresh machine: `make serve` and `make test`.
# Both create .venv and install kvcellar into it (editable) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# `make test` runs `make lint` first (ruff check, ruff format --check, mypy), so the one test
# command runs everything CI runs; `make test LINT=0` skips it while iterating.
LINT ?= 1
# pytest-xdist spreads the tests over this many worker processes (`PYTEST_JOBS=0`: one
# process, `auto`: one per core). Two keeps the suite inside its budget on a 2-core CI machine.
PYTEST_JOBS ?= 2
# mypy checks the installed package `kvcellar`, whose files are the repository root
# (design §1): it finds them through a link of that name in the venv.
TYPECHECK_PATH := $(VENV)/typecheck

.PHONY: serve test test-slow lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The SSD tier lives in ./.kvcellar-cache, so prefixes survive a restart.
serve: $(STAMP)
	$(BIN)/kvcellar serve --ssd-cache .kvcellar-cache $(ARGS)

# pytest exits 5 when it collects no test; that is a failure here, never a pass.
# `make test` leaves out the tests marked `slow`; `make test-slow` runs only those (nightly: the
# simulator's long crash sweeps, docs/development.md).
test: $(STAMP) $(if $(filter 1,$(LINT)),lint)
	$(BIN)/python -m pytest -n $(PYTEST_JOBS) -m "not slow" $(ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_JOBS) -m slow $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	mkdir -p $(TYPECHECK_PATH) && ln -sfn "$(CURDIR)" $(TYPECHECK_PATH)/kvcellar
	MYPYPATH=$(TYPECHECK_PATH) $(BIN)/mypy -p kvcellar

bench: $(STAMP)
	$(BIN)/python -m kvcellar.bench.kvfile_io --write-docs

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
