"""The Docker image, for real: ``docker build`` once, then ``docker run`` it.

Skipped, with the reason, where no Docker engine is reachable or the base image is
missing (``/work/shared/tools/docker-local.sh up`` provides both on our machines).
Every container and volume a test creates is removed when it ends, pass or fail.
Waits poll with deadlines; none sleeps a fixed time.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import millpond

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
IMAGE = "millpond:test"
LABEL = "millpond-test=1"       # every container here carries it (manual clean-up)
TOKEN = secrets.token_hex(16)   # the admin token of every container that has one
HEALTH = ["--health-interval", "1s"]  # the image's HEALTHCHECK command, checked every second
DOCKER_STOP_DEFAULT_S = 10.0

# The build (in the first test's set-up) and a stop/start/kill cycle take longer than
# the suite's default per-test timeout. Every test here talks to daemons in containers.
pytestmark = [pytest.mark.docker, pytest.mark.daemon, pytest.mark.slow, pytest.mark.timeout(600)]


def docker(*args: str, timeout: float = 60, check: bool = True,
           env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout}{result.stderr}")
    return result


def pinned_base_image() -> str:
    """The Dockerfile's ``ARG BASE_IMAGE=...`` default: what ``FROM ${BASE_IMAGE}`` builds on."""
    return next(line.partition("=")[2].strip() for line in DOCKERFILE.read_text().splitlines()
                if line.startswith("ARG BASE_IMAGE="))


def _base_image() -> str | None:
    """The base to build on, if the engine has it: the pinned one, else docker-local.sh's
    stand-in (its ``BASE_TAG``, ``python:3.11-slim``): these machines reach no registry,
    and no image made here answers to the pinned digest."""
    for base in (pinned_base_image(), os.environ.get("BASE_TAG") or "python:3.11-slim"):
        if docker("image", "inspect", base, check=False, timeout=30).returncode == 0:
            return base
    return None


@pytest.fixture(scope="module")
def image() -> str:
    """``docker build -f docker/Dockerfile -t millpond:test .``, once per module."""
    how = "run /work/shared/tools/docker-local.sh up (an engine and the base image)"
    if shutil.which("docker") is None:
        pytest.skip(f"no docker command on this machine; {how}")
    info = docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=30)
    if info.returncode != 0 or not info.stdout.strip():
        reason = (info.stderr.strip().splitlines() or ["no answer"])[-1]
        pytest.skip(f"no Docker engine reachable ({reason}); {how}")
    base = _base_image()
    if base is None:
        pytest.skip(f"neither the base image {pinned_base_image()} nor a local stand-in "
                    f"(python:3.11-slim) is there (no registry here); {how}")
    old = docker("image", "inspect", "-f", "{{.Id}}", IMAGE, check=False).stdout.strip()
    docker("build", "--build-arg", f"BASE_IMAGE={base}", "-f", str(DOCKERFILE), "-t", IMAGE,
           str(ROOT), timeout=500)
    if old and old != docker("image", "inspect", "-f", "{{.Id}}", IMAGE).stdout.strip():
        docker("rmi", old, check=False)  # the previous run's image, untagged now
    return IMAGE


class Containers:
    """Runs containers and volumes with unique names; :meth:`cleanup` removes them all."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.volumes: list[str] = []

    def volume(self) -> str:
        name = f"millpond-test-{uuid.uuid4().hex[:10]}"
        self.volumes.append(name)  # created by the first `docker run -v name:/data`
        return name

    def run(self, *args: str, token: str | None = TOKEN) -> str:
        """``docker run -d`` of the image (``args``: options, then ``--`` and serve flags);
        with ``token``, the container gets ``MILLPOND_TOKEN`` (passed by name: the
        value stays out of docker's command line)."""
        name = f"millpond-test-{uuid.uuid4().hex[:10]}"
        self.names.append(name)
        options, serve = (args[:args.index("--")], args[args.index("--") + 1:]) \
            if "--" in args else (args, ())
        env_opt = ["-e", "MILLPOND_TOKEN"] if token else []
        docker("run", "-d", "--name", name, "--label", LABEL, *HEALTH, *env_opt, *options,
               IMAGE, *serve, env={"MILLPOND_TOKEN": token} if token else None)
        return name

    def cleanup(self) -> None:
        if self.names:
            docker("rm", "-f", "-v", *self.names, check=False)
        if self.volumes:
            docker("volume", "rm", "-f", *self.volumes, check=False)


@pytest.fixture
def containers(image, monkeypatch):
    # The client reads MILLPOND_TOKEN: only the token a test passes counts here.
    monkeypatch.delenv("MILLPOND_TOKEN", raising=False)
    made = Containers()
    try:
        yield made
    finally:
        made.cleanup()


def state(name: str) -> dict[str, str]:
    out = docker("inspect", "-f", "{{.State.Status}}|{{.State.ExitCode}}|"
                 "{{if .State.Health}}{{.State.Health.Status}}{{end}}", name).stdout
    status, code, health = out.strip().split("|")
    return {"status": status, "exit_code": code, "health": health}


def logs(name: str) -> str:
    result = docker("logs", name, check=False)
    return result.stdout + result.stderr


def wait_healthy(name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        now = state(name)
        if now["health"] == "healthy":
            return
        if now["status"] in ("exited", "dead"):
            pytest.fail(f"container exited {now['exit_code']} before healthy:\n{logs(name)}")
        if time.monotonic() > deadline:
            pytest.fail(f"not healthy within {timeout} s ({now}):\n{logs(name)}")
        time.sleep(0.2)


def wait_exit(name: str, timeout: float = 30) -> int:
    """The container's exit code once it has stopped."""
    deadline = time.monotonic() + timeout
    while (now := state(name))["status"] not in ("exited", "dead"):
        if time.monotonic() > deadline:
            pytest.fail(f"still {now['status']} after {timeout} s:\n{logs(name)}")
        time.sleep(0.1)
    return int(now["exit_code"])


def published(name: str, port: int = 50051) -> str:
    """The host address of the container's ``port`` (``docker port``; changes on restart)."""
    lines = docker("port", name, f"{port}/tcp").stdout.split()
    assert len(lines) == 1 and lines[0].startswith("127.0.0.1:"), lines  # loopback only
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(address: str, **kwargs) -> millpond.Client:
    return millpond.connect(address, token=TOKEN, timeout=20, **kwargs)


STEPS = {"step": ("int64", ()), "x": ("float32", (3,))}


def steps(start: int, n: int) -> dict[str, np.ndarray]:
    return {"step": np.arange(start, start + n),
            "x": np.arange(start * 3, (start + n) * 3, dtype=np.float32).reshape(n, 3)}


def snapshot(buf) -> tuple[int, dict[str, np.ndarray]]:
    """Size and a seeded sample: equal for equal contents."""
    return len(buf), buf.sample(64, seed=7)


def assert_same(before, after) -> None:
    assert before[0] == after[0]
    assert before[1].keys() == after[1].keys()
    for key in before[1]:
        np.testing.assert_array_equal(before[1][key], after[1][key])


# ---- tests ------------------------------------------------------------------------------

def test_authenticated_client_through_the_published_port(containers):
    name = containers.run("-p", "127.0.0.1::50051", "-v", f"{containers.volume()}:/data")
    wait_healthy(name)  # the HEALTHCHECK carries the container's token
    address = published(name)

    client = connect(address)
    buf = client.create_buffer("docker", capacity=1_000, fields=STEPS)
    buf.push_batch(**steps(0, 100))
    batch = buf.sample(32, seed=1)
    assert batch["step"].shape == (32,) and set(batch["step"]) <= set(range(100))
    np.testing.assert_array_equal(batch["x"][:, 0], batch["step"] * 3)
    assert client.transport == "grpc"  # another network namespace: no fast path
    info = docker("exec", name, "millpond", "info").stdout
    assert info.splitlines()[1].split()[:4] == ["docker", "ok", "replay", "100/1k"]
    client.close()

    stranger = millpond.connect(address, timeout=10)  # no token, none in the environment
    with pytest.raises(millpond.AuthenticationError):
        stranger.list_buffers()
    stranger.close()


def test_healthy_with_the_port_given_as_an_argument(containers):
    name = containers.run("-p", "127.0.0.1::6001", "--", "--port", "6001")
    wait_healthy(name)
    address = docker("exec", name, "cat", "/tmp/millpond.address").stdout.strip()
    assert address == "127.0.0.1:6001"
    published(name, 6001)


def test_refuses_to_serve_beyond_loopback_without_a_token(containers):
    name = containers.run("-p", "127.0.0.1::50051", token=None)
    assert wait_exit(name) == 2
    message = logs(name)
    assert "MILLPOND_TOKEN" in message and "--insecure" in message, message
    assert "Traceback" not in message

    # --insecure consciously, published on loopback only (the docs' token-less recipe)
    name = containers.run("-p", "127.0.0.1::50051", "--", "--insecure", token=None)
    wait_healthy(name)
    assert millpond.connect(published(name), timeout=10).list_buffers() == []


def test_stop_during_a_rate_limited_wait_exits_0_and_data_survives_stop_and_kill(containers):
    name = containers.run("-p", "127.0.0.1::50051", "-v", f"{containers.volume()}:/data")
    wait_healthy(name)
    client = connect(published(name))
    data = client.create_buffer("data", capacity=10_000, fields=STEPS)
    data.push_batch(**steps(0, 500))
    waiter = client.create_buffer("waiter", capacity=100, fields=STEPS,
                                  rate_limiter=millpond.MinSize(50))
    waiter.push_batch(**steps(0, 10))
    before = snapshot(data)

    outcome: list[object] = []

    def sample_forever():
        try:
            outcome.append(waiter.sample(1, timeout=60))
        except Exception as exc:  # the server stopped under it
            outcome.append(exc)

    thread = threading.Thread(target=sample_forever, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while waiter.info()["waiting_samples"] != 1:
        assert time.monotonic() < deadline, "the sample never waited"
        time.sleep(0.05)

    started = time.monotonic()
    docker("stop", name, timeout=30)  # Docker's default: SIGKILL after 10 s
    took = time.monotonic() - started
    assert state(name)["exit_code"] == "0", logs(name)
    assert took < DOCKER_STOP_DEFAULT_S - 2, f"docker stop took {took:.1f} s"
    thread.join(30)
    assert outcome and isinstance(outcome[0], Exception), outcome
    client.close()

    docker("start", name)
    wait_healthy(name)
    client = connect(published(name))  # a new host port after the restart
    data = client.buffer("data")
    assert_same(before, snapshot(data))
    assert len(client.buffer("waiter")) == 10

    data.push_batch(**steps(500, 250))  # acknowledged, then SIGKILL
    before = snapshot(data)
    client.close()
    docker("kill", name)
    assert wait_exit(name) == 137
    docker("start", name)
    wait_healthy(name)
    client = connect(published(name))
    after = snapshot(client.buffer("data"))
    assert after[0] == 750
    assert_same(before, after)
    client.close()


def test_fast_path_with_the_host_network_and_the_callers_uid(containers):
    port = free_port()
    name = containers.run("--network", "host", "--user", str(os.getuid()),
                          "-v", f"{containers.volume()}:/data",
                          "--", "--host", "127.0.0.1", "--port", str(port))
    wait_healthy(name)
    client = connect(f"127.0.0.1:{port}")
    buf = client.create_buffer("shm", capacity=1_000, fields=STEPS)
    buf.push_batch(**steps(0, 100))
    assert buf.sample(16, seed=3)["step"].shape == (16,)
    assert client.transport == "shm"
    client.close()


def test_any_uid_serves_from_a_fresh_named_volume(containers):
    name = containers.run("--user", "12345", "-p", "127.0.0.1::50051",
                          "-v", f"{containers.volume()}:/data")
    wait_healthy(name)
    client = connect(published(name))
    client.create_buffer("mine", capacity=100, fields=STEPS).push_batch(**steps(0, 10))
    client.close()
    stat = docker("exec", name, "stat", "-c", "%a %u %n", "/data", "/data/millpond",
                  "/data/millpond/mine.buffer").stdout.splitlines()
    volume_root, data_dir, buffer_file = (line.split() for line in stat)
    assert volume_root[:2] == ["1777", "0"]            # sticky, world-writable root
    assert data_dir[1] == "12345" and int(data_dir[0], 8) & 0o022 == 0  # others cannot write
    assert buffer_file[1] == "12345"
    # the HEALTHCHECK's address file, written by this uid too
    assert docker("exec", name, "cat", "/tmp/millpond.address").stdout == "127.0.0.1:50051\n"
