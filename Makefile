# millpond: `make run` serves, `make test` tests. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUN_STAMP := $(VENV)/.installed-run
ARGS   ?=
# The tests `make test-fast` runs: none that start a daemon, are slow or need Docker (pyproject.toml)
FAST   := not daemon and not slow and not docker

.PHONY: venv run test test-fast lint bench examples proto docker clean test-objectrl

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The server and client only (numpy, gRPC): what `make run` needs.
$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e .
	touch $(RUN_STAMP)

# Everything the tests, lint, benchmarks and examples use (torch, SB3, Minari, ...).
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(RUN_STAMP)  ## start the server on 127.0.0.1:50051 (extra flags: make run ARGS="--port 6000")
	$(VENV)/bin/millpond serve $(ARGS)

test: lint  ## lint, type checks and the whole test suite
	$(PY) -m pytest $(ARGS)

test-fast: $(STAMP)  ## engine and in-process tests only, in well under a minute (no daemons, nothing slow)
	$(PY) -m pytest -m "$(FAST)" $(ARGS)

lint: $(STAMP)  ## ruff and mypy (configured in pyproject.toml)
	$(VENV)/bin/ruff check client server tests bench examples
	$(VENV)/bin/mypy

bench: $(STAMP)  ## throughput and memory figures (not a test)
	$(PY) bench/bench.py $(ARGS)

examples: $(STAMP)  ## short runs of examples/ (the long ones: see examples/README.md)
	$(PY) -m pytest tests/test_examples.py $(ARGS)

proto: $(STAMP)  ## regenerate client/millpond/v1 from proto/
	$(PY) -m grpc_tools.protoc -Iproto --python_out=client --pyi_out=client \
	    --grpc_python_out=client proto/millpond/v1/replay.proto

docker:  ## build the image (needs a Docker engine; a local base: make docker BASE_IMAGE=python:3.11-slim)
	docker build $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) -f docker/Dockerfile -t millpond:latest .

# The objectrl adapter against the real objectrl 0.2.1 (Python 3.12; with its CUDA torch about
# 6.4 GB and minutes to install), in a venv of its own: not part of `make test` or CI.
# A Python 3.12: pyenv's if it has one, else python3.12 on PATH (or: make test-objectrl OBJECTRL_PYTHON=...)
OBJECTRL_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) python3.12)
OBJECTRL_VENV   := .venv-objectrl
OBJECTRL_STAMP  := $(OBJECTRL_VENV)/.installed-stamp

$(OBJECTRL_STAMP): pyproject.toml
	test -x $(OBJECTRL_VENV)/bin/python || $(OBJECTRL_PYTHON) -m venv $(OBJECTRL_VENV)
	$(OBJECTRL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OBJECTRL_VENV)/bin/python -m pip install --quiet objectrl==0.2.1 -e . 'pytest>=8' 'pytest-timeout>=2.3'
	touch $(OBJECTRL_STAMP)

test-objectrl: $(OBJECTRL_STAMP)  ## the objectrl adapter against the real objectrl 0.2.1 (own venv, heavy)
	$(OBJECTRL_VENV)/bin/python -m pytest tests/test_objectrl_real.py tests/test_integrations_objectrl.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info .pytest_cache .hypothesis
