# The same gates run locally and in CI (.ci/run): `make check` and `make test`.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# Two workers (pytest-xdist): most tests wait on servers, leases and timers, so two at a time
# overlap those waits on two cores. `make test PYTEST_WORKERS=0` runs the suite in one process.
PYTEST_WORKERS ?= 2

.PHONY: test demo check up clean install

install: $(VENV)/.installed

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# Reinstall only when the build inputs change; the editable install rebuilds the extension.
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py $(wildcard trellis/ext/*.pyx trellis/ext/*.pxd)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $@

test: install
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The scripted session, then a short economics run (pooled vs fixed pods on real demand; ~45 s),
# on a data dir of their own: their domains stay out of the one `trellis up` and the README's
# tour use (whose positions assume an empty log), and they run beside a `trellis up`.
DEMO_DATA_DIR ?= $(CURDIR)/.trellis-data/demo
demo: install
	TRELLIS_DATA_DIR=$(DEMO_DATA_DIR) $(BIN)/python -m trellis.adapters.entrypoints.demo
	TRELLIS_DATA_DIR=$(DEMO_DATA_DIR) $(BIN)/trellis demo economics --seconds 10 --requests 40

check: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy trellis examples/scheduler.py bench

up: install
	$(BIN)/trellis up

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	rm -f trellis/ext/*.c trellis/ext/*.so trellis/ext/*.html
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
