"""The fast path's edge under a hostile review, each finding reproduced against a real
daemon: a session thread that cannot start."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import grpc
import pytest
from support import ServerProcess
from test_contract import transitions
from test_hostile import _raw_socket

import millpond
from millpond.remote.shm import protocol
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc

pytestmark = pytest.mark.daemon

HELLO = {"op": "hello", "version": protocol.VERSION}
MiB = 1 << 20


def socket_name(address: str, token: str | None = None) -> str:
    """The daemon's fast-path socket, as Negotiate names it."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ReplayStub(channel).Negotiate(
            pb.NegotiateRequest(boot_id=protocol.read_boot_id()), timeout=10,
            metadata=metadata).socket


def call(sock, message: dict) -> dict | None:
    """Send one request on a raw fast-path socket; its reply (None: closed)."""
    protocol.send(sock, message)
    reply, fds = protocol.recv(sock)
    protocol.close_fds(fds)
    return reply


def closed_by_server(sock, timeout: float) -> bool:
    """Whether the daemon closes ``sock`` (sending nothing) within ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        return sock.recv(MiB) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# ---- 2. A session thread that cannot start ---------------------------------------------------

@contextlib.contextmanager
def threads_refused(pid: int):
    """While inside, process ``pid`` cannot start a thread: a pids cgroup (v1 or v2) holds it
    to the tasks it has. Needs root, whom RLIMIT_NPROC does not bind; skips the test where
    no such cgroup can be made."""
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "pids" in line.split(":")[1].split(",")), None)
    parent = Path("/sys/fs/cgroup/pids" + own) if own is not None else Path(
        "/sys/fs/cgroup" + next(line[3:] for line in Path("/proc/self/cgroup").read_text()
                                .splitlines() if line.startswith("0::")))
    group = parent / f"millpond-test-{os.getpid()}-{time.monotonic_ns()}"
    why = "cannot limit the daemon's threads with a pids cgroup here"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"{why} ({exc})")
    try:
        try:
            (group / "cgroup.procs").write_text(str(pid))
            (group / "pids.max").write_text((group / "pids.current").read_text().strip())
        except OSError as exc:
            pytest.skip(f"{why} ({exc})")
        yield
    finally:
        with contextlib.suppress(OSError):  # no pids controller in it
            (group / "pids.max").write_text("max")
        with contextlib.suppress(OSError):  # the daemon may have exited
            (parent / "cgroup.procs").write_text(str(pid))
        group.rmdir()


def test_a_session_thread_that_cannot_start_costs_that_connection_only(tmp_path):
    """Thread creation made to fail for real (a pids cgroup at its limit): the daemon
    closes the connection it could not serve, logs why, and goes on accepting."""
    log_file = tmp_path / "daemon.log"
    with ServerProcess(tmp_path / "data", log_file=log_file) as server:
        name = socket_name(server.address)
        with threads_refused(server.proc.pid):
            failed = _raw_socket(server.address, name)
            assert closed_by_server(failed, 5)
        later = _raw_socket(server.address, name)
        later.settimeout(5)
        assert call(later, HELLO)["ok"]
        client = millpond.connect(server.address, shm=True, timeout=10)
        buf = client.create_buffer("after", capacity=10, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 3))
        assert client.calls == {("shm", "push_batch"): 1}
        for sock in (failed, later):
            sock.close()
        client.close()
    assert "fast path could not admit a connection" in log_file.read_text()


