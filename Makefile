# millpond: `make run` serves, `make test` tests. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUN_STAMP := $(VENV)/.installed-run
ARGS   ?=
# The tests `make test-fast` runs: none that start a daemon, are slow or need Docker (pyproject.toml)
FAST   := not daemon and not slow and not docker

.PHONY: venv run test test-fast lint bench examples proto docker clean

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

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info .pytest_cache .hypothesis
