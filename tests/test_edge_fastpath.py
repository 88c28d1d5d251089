"""The fast path's edge under a hostile review, each finding reproduced against a real
daemon: connections that never say hello and sessions left idle, sessions capped per
user and in all, a session thread that cannot start, shared memory capped for the
daemon as a whole, and mTLS on the fast path (tickets, never a token alone).

The daemon's fast-path options are given by environment (``MILLPOND_SHM_*``)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from support import ServerProcess, wait_until
from test_contract import transitions
from test_hostile import _raw_socket, fd_count
from test_tls import make_ca, make_cert

import millpond
from millpond.remote.shm import protocol
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc
from millpond_server.shm_listener import MAX_REFUSALS

pytestmark = pytest.mark.daemon

HELLO = {"op": "hello", "version": protocol.VERSION}
TOKEN = "admin-" + secrets.token_urlsafe(24)
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


def sessions_held(pid: int, name: str) -> int:
    """Fast-path connections daemon ``pid`` holds open on its socket ``name`` (the
    listener not counted): its fds among the sockets the kernel lists at that name."""
    inodes = set()
    with open("/proc/net/unix") as f:
        for line in f:
            parts = line.split()
            # Num RefCount Protocol Flags Type St Inode Path; 00010000: the listener
            if len(parts) == 8 and parts[7] == "@" + name and parts[3] != "00010000":
                inodes.add(f"socket:[{parts[6]}]")
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            held += os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
    return held


def shared_memory(pid: int) -> int:
    """Bytes of memfd segments process ``pid`` maps."""
    total = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/memfd:" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                total += end - start
    return total


# ---- 1. Sessions: a hello within --shm-hello-s, a request within --shm-idle-s ---------------

def test_a_connection_that_never_completes_a_hello_is_closed(tmp_path):
    env = {"MILLPOND_TOKEN": TOKEN, "MILLPOND_SHM_HELLO_S": "0.5"}
    with ServerProcess(tmp_path / "data", env=env) as server:
        name = socket_name(server.address, TOKEN)
        opened = time.monotonic()
        silent, failing, greeted = (_raw_socket(server.address, name) for _ in range(3))
        assert call(failing, {**HELLO, "token": "x" * 20})["code"] == "UNAUTHENTICATED"
        assert call(greeted, {**HELLO, "token": TOKEN})["ok"]
        assert closed_by_server(silent, 10) and closed_by_server(failing, 10)
        assert time.monotonic() - opened >= 0.5
        # Its hello done in time, a session stays (until idle for --shm-idle-s: 300 s).
        assert call(greeted, {"op": "result_segment", "size": MiB})["ok"]
        assert sessions_held(server.proc.pid, name) == 1
        for sock in (silent, failing, greeted):
            sock.close()


def test_an_idle_session_is_closed_and_its_shared_memory_released(tmp_path):
    with ServerProcess(tmp_path / "data", env={"MILLPOND_SHM_IDLE_S": "0.5"}) as server:
        pid, name = server.proc.pid, socket_name(server.address)
        sock = _raw_socket(server.address, name)
        hello = call(sock, HELLO)
        assert hello["ok"] and hello.get("idle_s") == 0.5  # the client learns when to expect it
        assert call(sock, {"op": "result_segment", "size": 2 * MiB})["ok"]
        assert shared_memory(pid) == 2 * MiB
        assert closed_by_server(sock, 10)
        wait_until(lambda: shared_memory(pid) == 0 and sessions_held(pid, name) == 0)
        sock.close()


def test_the_client_opens_a_fresh_session_when_the_server_closes_an_idle_one(tmp_path):
    """The client learns --shm-idle-s from the hello and replaces a session idle for half
    of it before its next call: every call stays on shared memory, none fails or falls
    back to gRPC, and results handed out before stay valid."""
    with ServerProcess(tmp_path / "data", env={"MILLPOND_SHM_IDLE_S": "1"}) as server:
        pid, name = server.proc.pid, socket_name(server.address)
        client = millpond.connect(server.address, shm=True, timeout=10)
        buf = client.create_buffer("idle", capacity=100, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 3))
        kept = buf.sample(3, seed=1)
        expected = {key: value.copy() for key, value in kept.items()}
        wait_until(lambda: sessions_held(pid, name) == 0)  # closed for idleness, segments too
        assert shared_memory(pid) == 0
        buf.push_batch(**transitions(3, 3))
        assert len(buf.sample(4)["obs"]) == 4
        for key, value in expected.items():  # a result outlives its session
            np.testing.assert_array_equal(kept[key], value)
        # A call that waits longer than --shm-idle-s is not idle.
        empty = client.create_buffer("waits", capacity=10, obs_dim=2, act_dim=1,
                                     rate_limiter=millpond.MinSize(5))
        with pytest.raises(millpond.RateLimitTimeoutError):
            empty.sample(1, timeout=1.5)
        buf.push_batch(**transitions(6, 1))
        assert client.calls == {("shm", "push_batch"): 3, ("shm", "sample"): 2}  # successes
        client.close()


# ---- 1. Sessions per user and in all --------------------------------------------------------

HOLDER = """
import socket, sys
from millpond.remote.shm import protocol
held, greeted = [], []
for _ in range(int(sys.argv[2])):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect("\\0" + sys.argv[1])
    protocol.send(sock, {"op": "hello", "version": protocol.VERSION})
    held.append(sock)
    greeted.append(protocol.recv(sock)[0]["ok"])
print(all(greeted), flush=True)
sys.stdin.read()  # hold them until told
"""


def hold_sessions(name: str, count: int) -> subprocess.Popen:
    """Another client process holding ``count`` fast-path sessions until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, name, str(count)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "True"
    return proc


def release(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(10)


def test_sessions_are_capped_per_user_across_its_processes(tmp_path):
    with ServerProcess(tmp_path / "data", env={"MILLPOND_SHM_MAX_SESSIONS_PER_USER": "4"}) as server:
        name = socket_name(server.address)
        holders = [hold_sessions(name, 2) for _ in range(2)]  # 2 processes, 4 sessions
        try:
            extra = _raw_socket(server.address, name)
            reply = call(extra, HELLO)
            assert reply["ok"] is False and reply["code"] == "PERMISSION_DENIED"
            assert f"uid {os.getuid()} already has 4" in reply["message"]
            assert "(--shm-max-sessions-per-user)" in reply["message"]
            release(holders[0])
            wait_until(lambda: sessions_held(server.proc.pid, name) == 2)
            again = _raw_socket(server.address, name)
            assert call(again, HELLO)["ok"]
            for sock in (extra, again):
                sock.close()
        finally:
            for proc in holders:
                release(proc)


def test_sessions_are_capped_in_all(tmp_path):
    with ServerProcess(tmp_path / "data", env={"MILLPOND_SHM_MAX_SESSIONS_TOTAL": "3"}) as server:
        name = socket_name(server.address)
        kept = [_raw_socket(server.address, name) for _ in range(3)]
        assert all(call(sock, HELLO)["ok"] for sock in kept)
        extra = _raw_socket(server.address, name)
        reply = call(extra, HELLO)
        assert reply["ok"] is False and "(--shm-max-sessions-total)" in reply["message"]
        kept.pop().close()
        wait_until(lambda: sessions_held(server.proc.pid, name) == 2)
        again = _raw_socket(server.address, name)
        assert call(again, HELLO)["ok"]
        for sock in (*kept, extra, again):
            sock.close()


def test_sessions_without_a_token_cannot_take_the_fds_grpc_needs(tmp_path):
    """The review's attack: sessions held without a hello, many more than one process may
    hold (--shm-max-sessions 1000 stands for many processes). By default the fast path's
    sessions take at most half the open files limit, so gRPC clients still get in."""
    limit = 256
    env = {"MILLPOND_TOKEN": TOKEN, "MILLPOND_SHM_HELLO_S": "60"}  # the caps alone protect
    with ServerProcess(tmp_path / "data", "--shm-max-sessions", "1000", env=env,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                             (limit, limit))) as server:
        pid, name = server.proc.pid, socket_name(server.address, TOKEN)
        attack = []

        def connect_more() -> bool:
            with contextlib.suppress(BlockingIOError):  # backlog full: the daemon catches up
                attack.append(_raw_socket(server.address, name))
            return len(attack) >= 400

        wait_until(connect_more, timeout=10, interval=0.001)
        wait_until(lambda: sessions_held(pid, name) >= limit // 2)
        client = millpond.connect(server.address, token=TOKEN, shm=False, timeout=5)
        buf = client.create_buffer("after", capacity=10, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 3))
        assert len(buf) == 3
        # Half the fds for sessions, and a few for refusals being answered (no hello comes).
        assert sessions_held(pid, name) <= limit // 2 + MAX_REFUSALS
        assert fd_count(pid) < limit - 32
        for sock in attack:
            sock.close()
        client.close()


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


# ---- 3. Shared memory: --shm-max-mb for the daemon, --shm-max-mb-per-client ----------------

PUSHER = """
import json, logging, sys
import numpy as np
import millpond
fallbacks = []
class Fallbacks(logging.Handler):
    def emit(self, record):
        fallbacks.append(record.getMessage())
log = logging.getLogger("millpond.client")
log.addHandler(Fallbacks())
log.setLevel(logging.INFO)
client = millpond.connect(sys.argv[1], shm=True, timeout=20)
buf = client.buffer(sys.argv[2])
for _ in sys.stdin:  # a push of 2 MiB per line
    buf.push_batch(x=np.ones((2, 1 << 20), np.uint8))
    calls = {f"{transport} {op}": n for (transport, op), n in client.calls.items()}
    print(json.dumps({"calls": calls, "fallbacks": fallbacks}), flush=True)
"""


class Pusher:
    """A client process that pushes 2 MiB records (a 2 MiB push segment) when asked."""

    def __init__(self, address: str, buffer: str):
        self.proc = subprocess.Popen([sys.executable, "-c", PUSHER, address, buffer],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def push(self) -> dict:
        self.proc.stdin.write("push\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(20)


def test_shared_memory_is_capped_for_the_daemon_as_a_whole(tmp_path):
    with ServerProcess(tmp_path / "data", "--shm-max-mb", "4") as server:
        pid = server.proc.pid
        owner = millpond.connect(server.address, shm=False)
        records = owner.create_buffer("big", capacity=16, fields={"x": ("uint8", (MiB,))})
        pushers = [Pusher(server.address, "big") for _ in range(3)]
        try:
            first, second, third = (pusher.push() for pusher in pushers)
            assert first["calls"] == second["calls"] == {"shm push_batch": 1}
            # 4 MiB are held: the third's segment would take the daemon over --shm-max-mb,
            # so its push went over gRPC, and said why.
            assert third["calls"] == {"grpc push_batch": 1}
            assert "(--shm-max-mb)" in third["fallbacks"][0]
            assert shared_memory(pid) == 4 * MiB
            raw = _raw_socket(server.address)  # this process, a fourth client
            assert call(raw, HELLO)["ok"]
            reply = call(raw, {"op": "result_segment", "size": MiB})
            with pytest.raises(millpond.SharedMemoryError, match="over the server's limit"):
                protocol.raise_for(reply)
            raw.close()
            # The others keep working, in their segments.
            assert pushers[0].push()["calls"] == pushers[1].push()["calls"] == {"shm push_batch": 2}
            pushers[0].close()  # its 2 MiB are the daemon's to give again
            wait_until(lambda: shared_memory(pid) == 2 * MiB)
            assert pushers[2].push()["calls"] == {"grpc push_batch": 1, "shm push_batch": 1}
            assert shared_memory(pid) == 4 * MiB and len(records) == 12
        finally:
            for pusher in pushers:
                pusher.close()


def test_shared_memory_is_capped_per_client_process_too(tmp_path):
    env = {"MILLPOND_SHM_MAX_MB_PER_CLIENT": "2"}
    with ServerProcess(tmp_path / "data", "--shm-max-mb", "8", env=env) as server:
        owner = millpond.connect(server.address, shm=False)
        owner.create_buffer("big", capacity=16, fields={"x": ("uint8", (MiB,))})
        sessions = [_raw_socket(server.address) for _ in range(2)]
        for sock in sessions:
            assert call(sock, HELLO)["ok"]
            assert call(sock, {"op": "result_segment", "size": MiB})["ok"]
        for sock in sessions:  # 2 MiB for this process, whichever session asks
            reply = call(sock, {"op": "result_segment", "size": MiB})
            assert reply.get("code") == "SHM_UNAVAILABLE"
            assert "(--shm-max-mb-per-client)" in reply["message"]
        other = Pusher(server.address, "big")  # another process has 2 MiB of its own
        try:
            assert other.push()["calls"] == {"shm push_batch": 1}
        finally:
            other.close()
        for sock in sessions:
            sock.close()


# ---- 4. mTLS: the fast path takes the ticket Negotiate issued on the certified channel ------

LEARNER = "learner-" + secrets.token_urlsafe(24)
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    """``(daemon, certificate settings)``: mTLS, and a learner token."""
    pki = tmp_path_factory.mktemp("pki")
    make_ca(pki, "ca")
    make_cert(pki, "server", "ca", "DNS:localhost,IP:127.0.0.1")
    make_cert(pki, "client", "ca")
    tokens = pki / "tokens"
    tokens.write_text(f"learner {LEARNER}\n")
    tokens.chmod(0o600)
    with ServerProcess(pki / "data", "--tls-cert", str(pki / "server.pem"), "--tls-key",
                       str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"),
                       "--token-file", str(tokens), env={"MILLPOND_TOKEN": ""}) as server:
        yield server, {"tls_ca": str(pki / "ca.pem"), "tls_cert": str(pki / "client.pem"),
                       "tls_key": str(pki / "client.key")}


def negotiate(server, certs: dict, token: str | None = None) -> pb.NegotiateReply:
    credentials = grpc.ssl_channel_credentials(
        *(Path(certs[key]).read_bytes() for key in ("tls_ca", "tls_key", "tls_cert")))
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.secure_channel(server.address, credentials) as channel:
        return pb_grpc.ReplayStub(channel).Negotiate(
            pb.NegotiateRequest(boot_id=protocol.read_boot_id()), timeout=10, metadata=metadata)


@needs_openssl
def test_with_mtls_a_token_alone_does_not_open_the_fast_path(mtls):
    server, certs = mtls
    sock = _raw_socket(server.address, negotiate(server, certs).socket)
    reply = call(sock, {**HELLO, "token": LEARNER})
    assert reply["ok"] is False and reply["code"] == "UNAUTHENTICATED"
    assert "ticket" in reply["message"] and "--tls-client-ca" in reply["message"]
    reply = call(sock, {"op": "result_segment", "size": MiB})
    assert reply["code"] == "UNAUTHENTICATED"  # the session has no role
    sock.close()


@needs_openssl
def test_with_mtls_every_negotiate_issues_a_ticket_of_the_calls_role(mtls):
    server, certs = mtls
    learner, admin = negotiate(server, certs, LEARNER), negotiate(server, certs)
    assert len(learner.ticket) >= 32 and len(admin.ticket) >= 32
    push = {"op": "push", "buffer": "absent", "segment": 1, "n": 1, "columns": []}
    for offer, push_code in ((learner, "PERMISSION_DENIED"), (admin, "BUFFER_NOT_FOUND")):
        sock = _raw_socket(server.address, offer.socket)
        assert call(sock, {**HELLO, "ticket": offer.ticket})["ok"]
        assert call(sock, {"op": "result_segment", "size": MiB})["ok"]  # both may sample
        assert call(sock, push)["code"] == push_code  # a learner may not push
        sock.close()


@needs_openssl
def test_with_mtls_the_client_opens_the_fast_path_with_its_ticket(mtls):
    server, certs = mtls
    admin = millpond.connect(server.address, token="", shm=True, **certs)
    owned = admin.create_buffer("mtls-fast", capacity=16, obs_dim=2, act_dim=1)
    owned.push_batch(**transitions(0, 4))
    learner = millpond.connect(server.address, token=LEARNER, shm=True, **certs)
    buf = learner.buffer("mtls-fast")
    assert len(buf.sample(2)["obs"]) == 2
    with pytest.raises(millpond.PermissionDeniedError):
        buf.push_batch(**transitions(4, 1))
    assert learner.calls == {("shm", "sample"): 1}
    assert admin.calls == {("shm", "push_batch"): 1}
    owned.close()
