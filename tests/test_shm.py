"""The same-host fast path against a real daemon: negotiation, hygiene, hostile peers."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest
from support import ServerProcess, wait_until
from test_contract import transitions

import millpond
from millpond.remote.shm import memfd, protocol, session
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc

NOBODY = 65534


def fd_targets(pid: int) -> list[str]:
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed while we looked
            pass
    return targets


def memfd_count(pid: int) -> int:
    """memfd segments the process holds: open fds plus distinct mapped memfds."""
    fds = sum(target.startswith("/memfd:") for target in fd_targets(pid))
    with open(f"/proc/{pid}/maps") as f:
        mapped = {line.split()[4] for line in f if "/memfd:" in line}  # inode numbers
    return fds + len(mapped)


def dev_shm() -> set[str]:
    """/dev/shm's files, but POSIX semaphores (``sem.*``: other processes' multiprocessing
    locks, which come and go on a shared machine; millpond makes none)."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def _as_user(uid: int, address: str, queue) -> None:
    os.setgid(uid)
    os.setuid(uid)
    try:
        client = millpond.connect(address)
        buf = client.buffer("shared")
        queue.put((client.transport, len(buf), buf.sample(2, seed=0)["rewards"].tolist()))
    except Exception as exc:  # report, do not hang the parent
        queue.put((type(exc).__name__, str(exc), None))


def client_as_user(uid: int, address: str) -> tuple:
    """Run a client in a forked child that has dropped to ``uid``; return what it saw.

    Forked (not exec'd) because the interpreter under /root is not readable by
    other users; the child drops privileges after Python is loaded.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_as_user, args=(uid, address, queue))
    child.start()
    try:
        return queue.get(timeout=60)
    finally:
        child.join(10)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")


def test_same_host_client_uses_shared_memory(shared_server):
    client = millpond.connect(shared_server.address)
    assert client.transport == "shm"


@pytest.mark.daemon
def test_server_without_shm_means_grpc_silently_or_an_error_when_required(tmp_path):
    with ServerProcess(tmp_path / "data", "--no-shm") as server:
        client = millpond.connect(server.address)
        assert client.transport == "grpc"
        buf = client.create_buffer("b", capacity=8, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 4))
        assert len(buf) == 4
        with pytest.raises(millpond.SharedMemoryError, match="--no-shm"):
            _ = millpond.connect(server.address, shm=True).transport


@needs_root
def test_other_users_are_refused_and_fall_back_to_grpc(shared_server):
    buf = millpond.connect(shared_server.address).create_buffer("shared", capacity=8, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 4))
    transport, size, _ = client_as_user(NOBODY, shared_server.address)
    assert (transport, size) == ("grpc", 4)


@pytest.mark.daemon
@needs_root
def test_a_configured_group_is_admitted(tmp_path):
    with ServerProcess(tmp_path / "data", "--shm-group", str(NOBODY)) as server:
        buf = millpond.connect(server.address).create_buffer("shared", capacity=8, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 4))
        transport, size, _ = client_as_user(NOBODY, server.address)
        assert (transport, size) == ("shm", 4)


def test_results_never_change_under_the_callers_feet(shared_server):
    buf = millpond.connect(shared_server.address).create_buffer("stable", capacity=64, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 64))
    kept = buf.sample(32, seed=1)
    snapshot = {k: v.copy() for k, v in kept.items()}
    for i in range(40):  # many samples and pushes later...
        buf.sample(32)
        buf.push_batch(**transitions(64 + i, 1))
    for key in kept:  # ...what the caller kept is untouched
        np.testing.assert_array_equal(kept[key], snapshot[key])
    kept["obs"][:] = -1  # private writes never reach the server or later results
    again = buf.sample(32, seed=1)
    assert (again["obs"] != -1).all()


def test_dropped_results_are_reused_not_accumulated(shared_server):
    before = result_segments_mapped()  # earlier tests' clients may still map theirs
    client = millpond.connect(shared_server.address)
    buf = client.create_buffer("reuse", capacity=64, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 64))
    for _ in range(50):
        buf.sample(16)
    assert client.calls["shm", "sample"] == 50
    assert result_segments_mapped() - before <= 2


def test_small_results_are_copied_out_and_free_their_segment_at_once(shared_server):
    """A result of at most COPY_OUT_BYTES is a copy: holding many of them holds no segment
    (with zero-copy results, the 17th held would go over gRPC)."""
    before = result_segments_mapped()
    client = millpond.connect(shared_server.address)
    buf = client.create_buffer("copied", capacity=64, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 64))
    held = [buf.sample(32, seed=i) for i in range(3 * session.MAX_RESULT_SEGMENTS)]
    assert client.calls["shm", "sample"] == len(held) and not client.calls["grpc", "sample"]
    assert result_segments_mapped() - before <= 1
    read = [buf.sample_by_index(np.arange(8)) for _ in range(3 * session.MAX_RESULT_SEGMENTS)]
    assert not client.calls["grpc", "read"] and all(r["obs"].flags.writeable for r in read)
    grpc_buf = millpond.connect(shared_server.address, shm=False).buffer("copied")
    for i, result in enumerate(held):  # each its own, as drawn
        np.testing.assert_array_equal(result["obs"], grpc_buf.sample(32, seed=i)["obs"])


def test_a_session_polls_for_the_next_request_only_after_one_that_came_soon():
    """The daemon's session spins only for a client asking back to back: a learner that
    trains a millisecond between samples is not polled for."""
    from millpond_server.fastpath import next_spin
    spin = protocol.SERVER_SPIN
    assert next_spin(0.0) == spin and next_spin(2 * spin) == spin
    assert next_spin(1e-3 + 2 * spin) == 0.0


def result_segments_mapped() -> int:
    """Result segments this process maps (the kernel's list of its mappings)."""
    with open("/proc/self/maps") as maps:
        return sum("memfd:millpond-result" in line for line in maps)


@pytest.mark.daemon
def test_small_shared_memory_limit_falls_back_to_grpc_with_the_same_result(tmp_path):
    with ServerProcess(tmp_path / "data", "--shm-max-mb", "1") as server:
        client = millpond.connect(server.address)
        buf = client.create_buffer("b", capacity=2_000, fields={"x": ("float32", (1024,))})
        for i in range(4):  # 2 MB pushes exceed the 1 MiB segment limit: sent over gRPC
            buf.push_batch(x=np.full((500, 1024), i, np.float32))
        big = buf.sample(1_000, seed=3)  # a 4 MB result does not fit either
        small = buf.sample(10, seed=3)   # this one does
        assert client.transport == "shm"
        grpc_client = millpond.connect(server.address, shm=False).buffer("b")
        np.testing.assert_array_equal(big["x"], grpc_client.sample(1_000, seed=3)["x"])
        np.testing.assert_array_equal(small["x"], grpc_client.sample(10, seed=3)["x"])


HOLDING_CLIENT = """
    import millpond, numpy as np, sys
    fields = {{"x": ("float32", (256,))}}
    buf = millpond.connect({address!r}).create_buffer("held", capacity=1000, fields=fields)
    buf.push_batch(x=np.ones((1000, 256), np.float32))
    results = [buf.sample(500) for _ in range(3)]  # three live result segments
    print(millpond.connect({address!r}).transport, flush=True)
    sys.stdin.read()  # hold everything until killed
"""


def test_sigkill_of_a_client_releases_every_segment(shared_server):
    server_pid = shared_server.proc.pid
    before_fds, before_shm = memfd_count(server_pid), dev_shm()
    client = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDING_CLIENT.format(
        address=shared_server.address))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert client.stdout.readline().strip() == "shm"
    assert memfd_count(server_pid) > before_fds  # the server holds the client's segments
    client.kill()
    client.wait()
    wait_until(lambda: memfd_count(server_pid) == before_fds, timeout=10)
    assert dev_shm() == before_shm


@pytest.mark.daemon
def test_sigkill_of_the_server_leaves_nothing_and_results_stay_readable(tmp_path):
    before_shm = dev_shm()
    server = ServerProcess(tmp_path / "data").start()
    client = millpond.connect(server.address, timeout=1)
    buf = client.create_buffer("b", capacity=100, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 100))
    kept = buf.sample(50, seed=2)
    expected = kept["rewards"].copy()
    server.stop(signal.SIGKILL)
    assert dev_shm() == before_shm
    np.testing.assert_array_equal(kept["rewards"], expected)  # our mapping outlives the server
    with pytest.raises(millpond.DeadlineExceededError):  # waited for a server to come back
        buf.sample(1)


# ---- a hostile client on the raw socket ----------------------------------------------


@pytest.fixture
def raw(shared_server):
    """A raw fast-path socket to the daemon, plus a helper to send one request."""
    with grpc.insecure_channel(shared_server.address) as channel:
        offer = pb_grpc.ReplayStub(channel).Negotiate(
            pb.NegotiateRequest(boot_id=protocol.read_boot_id()), timeout=10)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect("\0" + offer.socket)

    def call(message, fds=()):
        if isinstance(message, bytes):
            sock.sendmsg([message])
        else:
            protocol.send(sock, message, fds)
        reply, reply_fds = protocol.recv(sock)
        protocol.close_fds(reply_fds)
        return reply

    yield call
    sock.close()


def sealed_segment(size: int) -> int:
    return memfd.create_segment(size, "test")


def test_hostile_requests_get_errors_and_the_server_keeps_serving(shared_server, raw):
    good = millpond.connect(shared_server.address)
    buf = good.create_buffer("victim", capacity=100, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 10))
    server_fds = len([t for t in fd_targets(shared_server.proc.pid) if not t.startswith("/memfd:")])

    unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 4096)
    sealed = sealed_segment(4096)
    cases = [
        b"\xff\xfe not json",
        b"[1, 2, 3]",
        {"op": "format_disk"},
        {"op": "push_segment", "size": 4096},  # no fd
        ({"op": "push_segment", "size": 4096}, (unsealed,)),  # could be truncated under us
        ({"op": "push_segment", "size": 1 << 20}, (sealed,)),  # claims more than it holds
        ({"op": "sample", "buffer": "victim", "segment": 1, "offset": 0, "batch_size": 1}, (sealed,)),
        {"op": "result_segment", "size": -5},
        {"op": "result_segment", "size": 1 << 50},
        {"op": "sample", "buffer": ["not", "a", "name"], "segment": 1, "offset": 0, "batch_size": 1},
        {"op": "release", "segment": 999},
    ]
    for case in cases:
        message, fds = case if isinstance(case, tuple) else (case, ())
        reply = raw(message, fds)
        assert reply["ok"] is False and reply["code"], (case, reply)

    # A proper segment, then pushes that lie about offsets, sizes and types.
    reply = raw({"op": "push_segment", "size": 4096}, (sealed,))
    assert reply["ok"], reply
    seg = reply["segment"]
    with pytest.raises(OSError):  # the seals stop anyone shrinking it under the server
        os.ftruncate(sealed, 0)
    schema = buf.schema
    spans, _ = protocol.layout(schema, 4)

    def columns(**override):
        cols = {f.name: [f.name, spans[f.name][0], f.dtype.str, [4, *f.shape]] for f in schema}
        cols.update(override)
        return list(cols.values())

    lies = [
        {"n": 4, "columns": columns(obs=["obs", 4090, "<f4", [4, 2]])},        # runs past the end
        {"n": 4, "columns": columns(obs=["obs", -64, "<f4", [4, 2]])},         # negative offset
        {"n": 4, "columns": columns(obs=["obs", 2, "<f4", [4, 2]])},           # misaligned
        {"n": 4, "columns": columns(obs=["obs", 0, "<f8", [4, 2]])},           # wrong dtype
        {"n": 4, "columns": columns(obs=["obs", 0, "<f4", [5, 2]])},           # wrong shape
        {"n": 10**9, "columns": columns()},                                     # huge n
        {"n": 4, "columns": columns()[:-1]},                                    # missing field
        {"n": 4, "columns": "everything"},
    ]
    for lie in lies:
        reply = raw({"op": "push", "buffer": "victim", "segment": seg, **lie})
        assert reply["ok"] is False, lie
    reply = raw({"op": "result_segment", "size": 4096})
    assert reply["ok"]
    for offset, batch_size in ((4096, 1), (0, 10_000), (-64, 1), (3, 1)):
        reply = raw({"op": "sample", "buffer": "victim", "segment": reply.get("segment", 2),
                     "offset": offset, "batch_size": batch_size, "seed": 0})
        assert reply["ok"] is False

    # The hostile session still works for an honest request, and so does everyone else.
    assert raw({"op": "push", "buffer": "victim", "segment": seg, "n": 4, "columns": columns()})["ok"]
    assert len(buf) == 14
    assert buf.sample(5, seed=1)["obs"].shape == (5, 2)
    # No received fd leaked: the refused memfds are closed, the accepted one is
    # held once (by its mapping), and nothing else accumulated.
    held = fd_targets(shared_server.proc.pid)
    assert not [t for t in held if t.startswith("/memfd:unsealed")]
    assert len([t for t in held if t.startswith("/memfd:test")]) == 1
    assert len([t for t in held if not t.startswith("/memfd:")]) <= server_fds
    os.close(unsealed)
    os.close(sealed)


def test_unexpected_fds_are_refused_and_nothing_leaks(shared_server, raw):
    fds = [memfd.create_segment(4096, "spam") for _ in range(3)]
    for _ in range(20):
        reply = raw({"op": "release", "segment": 1}, tuple(fds))
        assert reply["ok"] is False
    held = fd_targets(shared_server.proc.pid)
    assert not [t for t in held if t.startswith("/memfd:spam")]  # all 60 closed by the server
    for fd in fds:
        os.close(fd)
    assert raw(json.dumps({"op": "release", "segment": 12345}).encode())["ok"] is False


def test_segment_larger_than_memory_is_a_clear_error_not_the_oom_killer():
    too_big = (memfd.available_memory() or 1 << 40) * 2
    with pytest.raises(millpond.SharedMemoryError, match="available"):
        memfd.create_segment(too_big, "too-big")


def test_hostile_priority_requests_get_typed_errors_and_change_nothing(shared_server, raw):
    client = millpond.connect(shared_server.address)
    prio = client.create_buffer("prio-victim", capacity=100, obs_dim=2, act_dim=1,
                                prioritized=True, alpha=0.6, beta=0.4)
    uniform = client.create_buffer("prio-victim-uniform", capacity=500, obs_dim=2, act_dim=1)
    prio.push_batch(**transitions(0, 10), priorities=np.linspace(1, 2, 10))
    uniform.push_batch(**transitions(0, 200))
    before = {k: v.copy() for k, v in prio.sample(8, seed=5).items()}
    server_fds = len([t for t in fd_targets(shared_server.proc.pid) if not t.startswith("/memfd:")])

    sealed = sealed_segment(4096)
    mm = memfd.map_segment(sealed, 4096, writable=True)
    seg = raw({"op": "push_segment", "size": 4096}, (sealed,))["segment"]
    schema = prio.schema
    spans, total = protocol.layout(schema, 4)
    columns = [[f.name, spans[f.name][0], f.dtype.str, [4, *f.shape]] for f in schema]
    good = [total, "<f8", [4]]
    vector = np.frombuffer(mm, np.float64, 4, total)
    vector[:] = [1.0, 2.0, 3.0, 4.0]

    def push(priorities, buffer="prio-victim"):
        return raw({"op": "push", "buffer": buffer, "segment": seg, "n": 4, "columns": columns,
                    "priorities": priorities})

    def update(indices=(0, "<i8", [4]), priorities=(32, "<f8", [4]), n=4, **extra):
        return raw({"op": "update_priorities", "buffer": "prio-victim", "segment": seg, "n": n,
                    "indices": list(indices), "priorities": list(priorities), **extra})

    def refused(reply, code="INVALID_ARGUMENT", match=""):
        assert reply["ok"] is False and reply["code"] == code and match in reply["message"], reply

    for lie in ([4090, "<f8", [4]], [-8, "<f8", [4]], [total + 3, "<f8", [4]], [True, "<f8", [4]],
                [total, "<f4", [4]], [total, "<f8", [5]], [total, "<f8", [3]], [total, "<f8", 4],
                [total, "<f8"], "everything", None):
        refused(push(lie))
    refused(push(good, buffer="prio-victim-uniform"), match="prioritized")  # as over gRPC
    for bad in (np.nan, -1.0, np.inf):  # checked by the engine, after copying out of the segment
        vector[2] = bad
        refused(push(good), match="priorities")
        vector[:] = [1.0, 2.0, 3.0, 4.0]
        np.frombuffer(mm, np.float64, 4, 32)[:] = [1.0, 1.0, bad, 1.0]
        refused(update(), match="priorities")
    for lie in (dict(indices=(4090, "<i8", [4])), dict(indices=(-8, "<i8", [4])),
                dict(indices=(4, "<i8", [4])), dict(indices=(0, "<f8", [4])),
                dict(priorities=(32, "<f8", [3])), dict(priorities=(4095, "<f8", [4])),
                dict(n=-1), dict(n=True), dict(n=10**9), dict(segment=999),
                dict(buffer="prio-victim-uniform"), dict(buffer="no-such-buffer")):
        reply = update(**lie)
        assert reply["ok"] is False, (lie, reply)
    refused(update(buffer="prio-victim-uniform"), match="prioritized")
    for beta in ("0.5", None, True, [0.5], -1.0, float("nan"), float("inf"), 1):
        refused(raw({"op": "set_beta", "buffer": "prio-victim", "beta": beta}), "INVALID_CONFIG")
    refused(raw({"op": "set_beta", "buffer": "prio-victim-uniform", "beta": 0.5}), match="prioritized")

    # A result segment that holds a uniform sample but not a prioritized one's extras.
    reply = raw({"op": "result_segment", "size": 4096})
    result = reply["segment"]
    batch = max(n for n in range(1, 200) if protocol.sample_layout(schema, n, False)[2] <= 4096)
    assert protocol.sample_layout(schema, batch, True)[2] > 4096
    sample = {"op": "sample", "segment": result, "offset": 0, "batch_size": batch, "seed": 0}
    refused(raw({**sample, "buffer": "prio-victim"}), "MESSAGE_TOO_LARGE", match="does not fit")
    assert raw({**sample, "buffer": "prio-victim-uniform"}) == {"ok": True, "extras": []}

    # Nothing changed, stale or foreign indices are ignored, and the session still serves.
    assert len(prio) == 10
    for key, value in prio.sample(8, seed=5).items():
        np.testing.assert_array_equal(value, before[key])
    np.frombuffer(mm, np.int64, 4, 0)[:] = [-1, 10**12, 3, 3]
    np.frombuffer(mm, np.float64, 4, 32)[:] = 2.0
    assert update() == {"ok": True, "updated": 2}
    assert push(good) == {"ok": True, "size": 14, "pushed": 14}
    assert raw({"op": "set_beta", "buffer": "prio-victim", "beta": 1.0}) == {"ok": True}
    reply = raw({**sample, "batch_size": 4, "buffer": "prio-victim"})
    assert reply == {"ok": True, "extras": ["weights", "indices"]}
    assert len(prio) == 14 and prio.sample(4, seed=0)["weights"].max() == 1.0
    del vector
    mm.close()
    os.close(sealed)
    held = fd_targets(shared_server.proc.pid)
    assert len([t for t in held if not t.startswith("/memfd:")]) <= server_fds


@pytest.mark.daemon
def test_an_actor_keeps_pushing_across_a_daemon_restart(tmp_path):
    """The daemon restarts (same address, same data) between two pushes of an actor on
    the fast path: the second push is not lost to the dead session; it waits for the
    new daemon, and later calls find the fast path again."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    server = ServerProcess(tmp_path / "data", "--port", port).start()
    client = millpond.connect(server.address, timeout=30)
    buf = client.create_buffer("restarts", capacity=100, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 5))
    assert client.calls["shm", "push_batch"] == 1
    server.stop()
    server = ServerProcess(tmp_path / "data", "--port", port).start()
    try:
        buf.push_batch(**transitions(5, 5))  # the old session is dead: this one goes over gRPC
        buf.push_batch(**transitions(10, 5))  # ...and this one over a new fast path
        assert len(buf) == 15
        assert client.calls["grpc", "push_batch"] == 1 and client.calls["shm", "push_batch"] == 2
        assert client.transport == "shm"
    finally:
        server.stop()
