"""Issue 10's defects, each reproduced against a real daemon: a hostile client gets a
typed error, never INTERNAL, never a crash, a leak, or a file that blocks the next start."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from support import ServerProcess, wait_for_ready, wait_until
from test_contract import transitions

import millpond
from millpond.core import BufferConfig, Schema
from millpond.remote.shm import protocol
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc
from millpond.wire.codec import config_to_proto
from millpond.wire.status import ERROR_CODE_KEY

SCHEMA = Schema.transition(2, 1)


def fd_count(pid: int, target: str | None = None) -> int:
    """Open fds of process ``pid`` (only those open on ``target``, if given)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += target is None or os.readlink(f"/proc/{pid}/fd/{fd}") == target
        except OSError:
            pass  # closed meanwhile
    return count


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def status_of(call, *args, **kwargs) -> tuple[grpc.StatusCode, str | None]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    code = dict(info.value.trailing_metadata() or ()).get(ERROR_CODE_KEY)
    return info.value.code(), code


@pytest.fixture
def stub(shared_server):
    with grpc.insecure_channel(shared_server.address) as channel:
        yield pb_grpc.ReplayStub(channel)


def restarts_cleanly(data_dir) -> None:
    """The daemon starts again on ``data_dir`` and serves."""
    with ServerProcess(data_dir) as again:
        millpond.connect(again.address).list_buffers()


# ---- 1. Close racing Create ----------------------------------------------------------

@pytest.mark.daemon
def test_close_racing_create_with_samples_in_flight_never_kills_the_daemon(tmp_path):
    server = ServerProcess(tmp_path / "data").start()
    try:
        client = millpond.connect(server.address, shm=False)
        stop, errors = threading.Event(), []

        def sampler():
            learner = millpond.connect(server.address, shm=False)
            while not stop.is_set():
                try:
                    learner.buffer("raced").sample(64)
                except (millpond.BufferNotFoundError, millpond.BufferClosedError,
                        millpond.NotEnoughDataError):
                    pass  # the buffer is between a Close and a Create: typed errors
                except Exception as exc:  # anything else is the bug
                    errors.append(repr(exc))
                    return

        threads = [threading.Thread(target=sampler) for _ in range(3)]
        for round_ in range(30):
            buf = client.create_buffer("raced", hot_capacity=64, total_capacity=4096,
                                       obs_dim=2, act_dim=1)
            buf.push_batch(**transitions(0, 1000))
            if round_ == 0:
                for thread in threads:
                    thread.start()
            client.delete_buffer("raced")
        stop.set()
        for thread in threads:
            thread.join(30)
        assert server.proc.poll() is None, "the daemon died"
        assert not errors, errors
        buf = client.create_buffer("raced", capacity=10, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 3))
    finally:
        assert server.stop() == 0
    with ServerProcess(tmp_path / "data") as again:  # and the files are sound
        assert len(millpond.connect(again.address).buffer("raced")) == 3


# ---- 2. A failed Create leaves nothing --------------------------------------------------

@pytest.mark.daemon
def test_failed_creates_leave_no_file_no_fd_and_the_next_start_works(tmp_path):
    data = tmp_path / "data"
    with ServerProcess(data) as server, grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ReplayStub(channel)
        deep = config_to_proto(BufferConfig(SCHEMA, 4, 10))
        deep.fields[0].ClearField("shape")
        deep.fields[0].shape.extend([1] * 64)  # 64 dims: numpy cannot even make its column
        too_big = config_to_proto(BufferConfig.build(
            capacity=10, obs_dim=2, act_dim=1, prioritized=True))
        too_big.hot_capacity = too_big.total_capacity = 2**36  # a sum tree beyond the RAM
        fds = []
        for _ in range(4):  # each round fails both ways; none may keep an fd
            for name, config, expected in (
                ("deep", deep, (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CONFIG")),
                ("huge", too_big, (grpc.StatusCode.RESOURCE_EXHAUSTED, "STORAGE_FULL")),
            ):
                got = status_of(stub.Create, pb.CreateRequest(name=name, config=config), timeout=30)
                assert got == expected, name
            fds.append(fd_count(server.proc.pid))
        assert sorted(p.name for p in data.iterdir()) == [".millpond.lock"]
        assert fds[1:] == fds[:-1], fds  # the first round may open what the server keeps
    restarts_cleanly(data)


# ---- 3. Memory: waiting calls are bounded, and give their memory back -----------------

@pytest.mark.daemon
def test_waiting_calls_are_bounded_in_number_and_bytes(tmp_path):
    args = ("--max-waiting-calls", "2", "--max-waiting-mb", "8")
    with ServerProcess(tmp_path / "data", *args) as server:
        client = millpond.connect(server.address, shm=False, timeout=30)
        queue = client.create_buffer("full", capacity=16, fields={"x": ("uint8", (1 << 20,))},
                                     mode="queue")
        queue.push_batch(x=np.zeros((16, 1 << 20), np.uint8))  # full: pushes now wait
        outcomes = []

        def parked_push(n: int):
            try:
                queue.push_batch(x=np.zeros((n, 1 << 20), np.uint8), timeout=20)
                outcomes.append("stored")
            except millpond.ReplayError as exc:
                outcomes.append(type(exc).__name__)

        first = threading.Thread(target=parked_push, args=(1,))  # 1 MiB waits
        first.start()
        wait_until(lambda: queue.info()["waiting_inserts"] == 1)
        with pytest.raises(millpond.LimitExceededError, match="max-waiting-mb"):
            queue.push_batch(x=np.zeros((8, 1 << 20), np.uint8), timeout=20)  # 8 MiB more
        second = threading.Thread(target=parked_push, args=(1,))
        second.start()
        wait_until(lambda: queue.info()["waiting_inserts"] == 2)
        with pytest.raises(millpond.LimitExceededError, match="max-waiting-calls"):
            queue.push_batch(x=np.zeros((1, 1 << 20), np.uint8), timeout=20)
        assert len(queue) == 16  # refused calls changed nothing
        queue.sample(2)  # room for the two that wait
        for thread in (first, second):
            thread.join(30)
        assert outcomes == ["stored", "stored"]


@pytest.mark.daemon
def test_memory_held_by_cancelled_waiting_pushes_is_given_back(tmp_path):
    with ServerProcess(tmp_path / "data") as server:
        client = millpond.connect(server.address, shm=False, timeout=30)
        queue = client.create_buffer("parked", capacity=1, fields={"x": ("uint8", (16 << 20,))},
                                     mode="queue")
        queue.push_batch(x=np.zeros((1, 16 << 20), np.uint8))
        baseline = rss(server.proc.pid)
        threads = [threading.Thread(target=_push_expecting_timeout, args=(queue,))
                   for _ in range(12)]  # 12 x 16 MiB parked, then they give up
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        wait_until(lambda: queue.info()["waiting_inserts"] == 0, timeout=30)
        wait_until(lambda: rss(server.proc.pid) < baseline + (64 << 20), timeout=10)


def _push_expecting_timeout(queue) -> None:
    with pytest.raises(millpond.RateLimitTimeoutError):
        queue.push_batch(x=np.zeros((1, 16 << 20), np.uint8), timeout=1.0)


@pytest.mark.daemon
def test_concurrent_calls_are_capped_with_a_typed_error(tmp_path):
    args = ("--max-concurrent-calls", "3", "--max-waiting-calls", "2")
    with ServerProcess(tmp_path / "data", *args) as server:
        client = millpond.connect(server.address, shm=False, timeout=30)
        buf = client.create_buffer("capped", capacity=10, obs_dim=2, act_dim=1,
                                   rate_limiter=millpond.MinSize(5))
        got = []
        waiting = [threading.Thread(target=lambda: got.append(len(buf.sample(1, timeout=30)["obs"])))
                   for _ in range(2)]
        for thread in waiting:
            thread.start()
        wait_until(lambda: buf.info()["waiting_samples"] == 2)
        with pytest.raises(millpond.LimitExceededError, match="max-waiting-calls"):
            buf.sample(1, timeout=5)
        buf.push_batch(**transitions(0, 5))  # waiting calls never take the last call slot
        for thread in waiting:
            thread.join(30)
        assert got == [1, 1]


@pytest.mark.daemon
def test_waiting_calls_may_not_take_every_call_slot(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "millpond_server", "serve", "--port", "0", "--data-dir",
         str(tmp_path / "data"), "--max-concurrent-calls", "4", "--max-waiting-calls", "4"],
        capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "--max-waiting-calls" in proc.stderr


# ---- 4. The fast path under abuse -----------------------------------------------------

def _socket_name(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ReplayStub(channel).Negotiate(
            pb.NegotiateRequest(boot_id=protocol.read_boot_id()), timeout=10).socket


def _raw_socket(address: str, name: str | None = None) -> socket.socket:
    """A raw connection to the daemon's fast-path socket (``name``: known already)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    try:
        sock.connect("\0" + (name or _socket_name(address)))
    except OSError:
        sock.close()
        raise
    return sock


def test_a_deeply_nested_hello_with_fds_is_refused_and_leaks_nothing(shared_server):
    pid = shared_server.proc.pid
    sock = _raw_socket(shared_server.address)
    before = fd_count(pid, os.devnull)  # only ours: the server's other fds come and go
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]
    try:
        for _ in range(3):
            sock.sendmsg([b'{"op":' + b"[" * 30_000 + b"]" * 30_000 + b"}"],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(np.array(fds, "i4")))])
            reply, _ = protocol.recv(sock)
            assert reply["ok"] is False and reply["code"] == "INVALID_ARGUMENT"
        protocol.send(sock, {"op": "hello", "version": protocol.VERSION})
        assert protocol.recv(sock)[0]["ok"]  # the session still serves
    finally:
        for fd in fds:
            os.close(fd)
    assert fd_count(pid, os.devnull) <= before  # the 12 fds it was sent were all closed
    sock.close()


@pytest.mark.daemon
def test_running_out_of_fds_pauses_the_fast_path_and_it_recovers(tmp_path):
    limit = 128
    proc = subprocess.Popen(
        [sys.executable, "-m", "millpond_server", "serve", "--host", "127.0.0.1", "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--shm-max-sessions", "1000",
         "--shm-max-sessions-total", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    try:
        address = wait_for_ready(proc, 30)
        held, name = [], _socket_name(address)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:  # each accepted connection costs the server an fd
                held.append(_raw_socket(address, name))
            except BlockingIOError:  # its backlog is full: it accepts no more
                break
        wait_until(lambda: fd_count(proc.pid) >= limit - 2, timeout=20)  # it accepts until EMFILE
        for sock in held:
            sock.close()
        client = millpond.connect(address, timeout=20)
        wait_until(lambda: client.transport == "shm", timeout=20)
        buf = client.create_buffer("after", capacity=10, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 3))
        assert client.calls["shm", "push_batch"] == 1 and len(buf) == 3
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.daemon
def test_the_shared_memory_cap_holds_for_a_client_across_its_sessions(tmp_path):
    with ServerProcess(tmp_path / "data", "--shm-max-mb", "3") as server:
        sessions = [_raw_socket(server.address) for _ in range(4)]
        replies = []
        for sock in sessions:
            protocol.send(sock, {"op": "hello", "version": protocol.VERSION})
            protocol.recv(sock)
            protocol.send(sock, {"op": "result_segment", "size": 1 << 20})
            reply, fds = protocol.recv(sock)
            protocol.close_fds(fds)
            replies.append(reply.get("code", "ok"))
        assert replies == ["ok", "ok", "ok", "SHM_UNAVAILABLE"]  # 3 MiB per client, not per session
        sessions[0].close()  # its segment is released with it...
        wait_until(lambda: _reserve_ok(sessions[3]), timeout=10)  # ...and counts no more
        for sock in sessions[1:]:
            sock.close()


def _reserve_ok(sock: socket.socket) -> bool:
    protocol.send(sock, {"op": "result_segment", "size": 1 << 20})
    reply, fds = protocol.recv(sock)
    protocol.close_fds(fds)
    return bool(reply.get("ok"))


@pytest.mark.daemon
def test_too_many_sessions_from_one_client_are_refused_with_the_reason(tmp_path):
    with ServerProcess(tmp_path / "data", "--shm-max-sessions", "2") as server:
        kept = [_raw_socket(server.address) for _ in range(2)]
        extra = _raw_socket(server.address)
        protocol.send(extra, {"op": "hello", "version": protocol.VERSION})
        reply, _ = protocol.recv(extra)
        assert reply["ok"] is False and "--shm-max-sessions" in reply["message"]
        for sock in (*kept, extra):
            sock.close()


# ---- 5. Symlinks and the data directory -------------------------------------------------

@pytest.mark.daemon
def test_a_planted_symlink_is_never_followed(tmp_path):
    data = tmp_path / "data"
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    with ServerProcess(data) as server:
        (data / "victim.buffer").symlink_to(target)
        client = millpond.connect(server.address)
        with pytest.raises(millpond.FileConflictError):
            client.create_buffer("victim", capacity=10, obs_dim=2, act_dim=1)
    assert target.read_text() == "keep me"
    restarts_cleanly(data)  # the link is ignored (with a warning), not followed
    assert target.read_text() == "keep me"


@pytest.mark.daemon
def test_a_data_directory_others_may_write_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    proc = subprocess.run(
        [sys.executable, "-m", "millpond_server", "serve", "--port", "0", "--data-dir", str(data)],
        capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "writable by other users" in proc.stderr and "Traceback" not in proc.stderr


# ---- 6. The small ones ---------------------------------------------------------------------

def test_a_name_with_a_trailing_newline_is_refused(stub):
    config = config_to_proto(BufferConfig(SCHEMA, 4, 10))
    assert status_of(stub.Create, pb.CreateRequest(name="bad\n", config=config), timeout=10) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")


@pytest.mark.parametrize("shape", [[0, 2**62], [1] * 70, [2**40]])
def test_hostile_column_shapes_are_invalid_arguments_not_internal(shared_server, stub, shape):
    millpond.connect(shared_server.address).create_buffer("shapes", capacity=10, obs_dim=2,
                                                          act_dim=1)
    column = pb.Column(name="obs", dtype="<f4", shape=shape, data=b"")
    request = pb.PushBatchRequest(name="shapes", batch=pb.Batch(columns=[column]))
    code, _ = status_of(stub.PushBatch, request, timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_hostile_configs_are_invalid_configs(stub):
    config = config_to_proto(BufferConfig(SCHEMA, 4, 10))
    config.max_times_sampled = 2**62
    assert status_of(stub.Create, pb.CreateRequest(name="times", config=config), timeout=10) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CONFIG")


@pytest.mark.daemon
def test_hostile_requests_never_make_the_daemon_log_a_traceback(tmp_path):
    """A client can never make the daemon log an internal error (or flood its log)."""
    server = ServerProcess(tmp_path / "data").start()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ReplayStub(channel)
        millpond.connect(server.address).create_buffer("x", capacity=4, obs_dim=2, act_dim=1)
        for shape in ([1] * 70, [0, 2**62], [2**40]):
            column = pb.Column(name="obs", dtype="<f4", shape=shape, data=b"")
            status_of(stub.PushBatch,
                      pb.PushBatchRequest(name="x", batch=pb.Batch(columns=[column])), timeout=10)
        config = config_to_proto(BufferConfig(SCHEMA, 4, 10))
        config.max_times_sampled = 2**62
        status_of(stub.Create, pb.CreateRequest(name="y", config=config), timeout=10)
    server.proc.terminate()
    _, err = server.proc.communicate(timeout=30)
    assert "Traceback" not in err and "unexpected error" not in err, err


@pytest.mark.daemon
@pytest.mark.parametrize("text,needle", [
    ("[[buffers]]\nname='x'\ncapacity=10\nobs_dim=1\nact_dim=1\nrate_limiter={"
     "samples_per_insert=1.0, error_buffer=[1]}", "error_buffer must be"),
    ("a = " + "[" * 3000 + "]" * 3000, "nested too deep"),
    ("[[buffers]]\nname='x'\ncapacity=100000000000000\nobs_dim=1\nact_dim=1", "at most"),
])
def test_hostile_toml_is_a_clear_message_not_a_traceback(tmp_path, text, needle):
    path = tmp_path / "hostile.toml"
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "millpond_server", "serve", "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--config", str(path)],
        capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.daemon
def test_a_failed_start_says_why_and_nothing_else(tmp_path):
    path = tmp_path / "big.toml"
    path.write_text("[[buffers]]\nname='x'\ncapacity=100000000000\nobs_dim=64\nact_dim=1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "millpond_server", "serve", "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--config", str(path)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    # A RAM-only buffer this large is refused for memory before the disk is asked. Before
    # it, only the start's info lines (the default level): no warning, error or traceback.
    assert "needs" in lines[-1] and "available" in lines[-1], proc.stderr
    assert lines[-1].startswith("millpond serve: ")
    assert all(line.startswith("ts=") and " level=info " in line for line in lines[:-1]), lines
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "data").iterdir())


def test_bool_columns_store_what_numpy_means_not_the_raw_byte(shared_server, stub):
    queue = millpond.connect(shared_server.address).create_buffer(
        "bools", capacity=4, fields={"flag": ("bool", ())}, mode="queue")
    column = pb.Column(name="flag", dtype="|b1", shape=[3], data=bytes([0, 2, 255]))
    stub.PushBatch(pb.PushBatchRequest(name="bools", batch=pb.Batch(columns=[column])), timeout=10)
    stored = queue.sample(3)["flag"]  # oldest first: exactly what was pushed
    assert stored.tolist() == [False, True, True]
    assert stored.view(np.uint8).tolist() == [0, 1, 1]


def test_info_shows_file_names_relative_to_the_data_directory(shared_server):
    client = millpond.connect(shared_server.address)
    client.create_buffer("relative", capacity=4, obs_dim=2, act_dim=1)
    info = client.buffer("relative").info()
    assert info["path"] == "relative.buffer"
    assert all(not i["path"].startswith("/") for i in client.list_buffers())


def test_a_reply_with_a_hostile_error_code_is_a_plain_replay_error():
    with pytest.raises(millpond.ReplayError) as info:
        protocol.raise_for({"ok": False, "code": ["not", "a", "code"], "message": "x"})
    assert type(info.value) is millpond.ReplayError


@pytest.mark.daemon
def test_the_number_of_buffers_and_their_disk_are_capped(tmp_path):
    with ServerProcess(tmp_path / "data", "--max-buffers", "2", "--max-data-gb", "0.01") as server:
        client = millpond.connect(server.address)
        for name in ("a", "b"):
            client.create_buffer(name, capacity=10, obs_dim=2, act_dim=1)
        with pytest.raises(millpond.LimitExceededError, match="max-buffers"):
            client.create_buffer("c", capacity=10, obs_dim=2, act_dim=1)
        client.delete_buffer("b")
        with pytest.raises(millpond.LimitExceededError, match="max-data-gb"):  # 10 MB budget
            client.create_buffer("big", capacity=1_000_000, obs_dim=2, act_dim=1)
        client.create_buffer("c", capacity=10, obs_dim=2, act_dim=1)  # room again
        assert sorted(p.name for p in (tmp_path / "data").glob("*.buffer")) == ["a.buffer",
                                                                               "c.buffer"]
