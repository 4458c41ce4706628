# Two commands on a fresh machine: `make serve` and `make test`.
# Both create .venv and install kvcellar into it (editable) on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The SSD tier lives in ./.kvcellar-cache, so prefixes survive a restart.
serve: $(STAMP)
	$(BIN)/kvcellar serve --ssd-cache .kvcellar-cache $(ARGS)

# pytest exits 5 when it collects no test; that is a failure here, never a pass.
test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m kvcellar.bench.kvfile_io --write-docs

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
