# millpond: `make run` serves, `make test` tests. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUN_STAMP := $(VENV)/.installed-run
ARGS   ?=
# The tests `make test-fast` runs: none that start a daemon, are slow or need Docker (pyproject.toml)
FAST   := not daemon and not slow and not docker
# `make test-pythons`: the CPythons millpond supports (README, "Platforms"); those found here
# (on PATH or installed by pyenv) each get a venv of their own, .venv-X.Y, with the light
# `test` extra only (the tests of torch, SB3 and Minari skip). Each runs the fast suite, less
# the long model-based suites of the engine (`make test` runs them), then SMOKE: daemon tests
# of what differs between Pythons (TOML, asyncio timeouts and cancellation, the event loop,
# exception notes) and of both transports and both clients (threads, asyncio), with the
# fast path's needs taken away too (test_platforms.py).
PYTHONS ?= 3.10 3.11 3.12 3.13
FAST_SKIP := --ignore=tests/test_buffer_model.py --ignore=tests/test_episodes_model.py \
             --ignore=tests/test_removal_model.py
SMOKE  := tests/test_platforms.py tests/test_client.py tests/test_aio.py \
          tests/test_shm.py::test_same_host_client_uses_shared_memory \
          tests/test_shm.py::test_server_without_shm_means_grpc_silently_or_an_error_when_required \
          tests/test_cli.py::test_toml_buffers_exist_at_start \
          tests/test_cli.py::test_bad_config_exits_2_with_a_clear_message \
          tests/test_grpc_streams.py::test_an_idle_stream_ends_and_the_next_call_opens_another \
          tests/test_edge.py::test_calls_that_never_send_their_request_cannot_take_the_daemon \
          tests/test_push_window.py::test_a_refused_push_is_raised_at_the_next_call_and_what_followed_was_not_stored \
          tests/test_ratelimit_server.py::test_a_sample_times_out_with_a_clear_error_and_changes_nothing \
          tests/test_ratelimit_server.py::test_waiting_samples_block_neither_other_buffers_nor_the_server \
          tests/test_ratelimit_server.py::test_sigterm_while_calls_wait_stops_the_server_cleanly

.PHONY: venv run test test-fast test-pythons lint bench examples proto docker clean test-objectrl \
        dist test-wheel

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

test-pythons:  ## the fast suite and daemon smoke tests on each CPython of PYTHONS found here
	PYTHONS="$(PYTHONS)" FAST="$(FAST)" FAST_SKIP="$(FAST_SKIP)" SMOKE="$(SMOKE)" ARGS="$(ARGS)" \
	    bash tests/pythons.sh

dist: $(STAMP)  ## an sdist and a wheel in dist/ (the wheel built from the sdist, in an isolated env)
	rm -rf dist
	$(PY) -m build --outdir dist .

test-wheel: dist  ## install the wheel into a fresh venv elsewhere; serve, push and sample from there
	$(PY) tests/wheel_smoke.py dist

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
	rm -rf $(VENV) $(VENV)-3.* build dist *.egg-info client/*.egg-info .pytest_cache .hypothesis
