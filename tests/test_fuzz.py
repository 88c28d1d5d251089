"""Fuzzing a live daemon: hostile bytes on every gRPC method and hostile fast-path requests.

Whatever arrives, the daemon stays up, answers with a typed client error (never
INTERNAL or UNKNOWN), and keeps no fd or shared-memory segment it was sent.
``MILLPOND_FUZZ_EXAMPLES`` sets how many examples each test draws (default 100,
bounded in time in ``make test``; raise it for a longer run).
"""

from __future__ import annotations

import os
import socket

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import ServerProcess, wait_until

import millpond
from millpond.remote.shm import memfd, protocol
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc
from millpond.wire.frames import PUSH_BATCH_FIELD, encode_with_batch

pytestmark = pytest.mark.daemon

EXAMPLES = int(os.environ.get("MILLPOND_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
METHODS = tuple(pb.DESCRIPTOR.services_by_name["Replay"].methods_by_name)
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.PERMISSION_DENIED}  # a Checkpoint: this daemon has no --backup-dir


def target(address: str):
    """The buffer the fuzz aims at (made again if a fuzzed Close deleted it)."""
    buf = millpond.connect(address).create_buffer(
        "target", hot_capacity=4, total_capacity=16, fields={"x": ("float32", (3,)),
                                                           "flag": ("bool", ())})
    buf.push_batch(x=np.ones((8, 3), np.float32), flag=np.ones(8, bool))
    return buf


def episodic_target(address: str):
    """An episodic transition buffer with a meta field, for the episodic calls (made over
    gRPC: a fast-path session of this helper would keep segments mapped in the daemon)."""
    buf = millpond.connect(address, shm=False).create_buffer(
        "episodes", hot_capacity=4, total_capacity=16, obs_dim=2, act_dim=1, episodes=True,
        meta_fields={"task": ("int64", ())})
    with buf.one_episode(task=1):
        for t in range(5):
            buf.push(np.ones(2), [0.0], 1.0, t == 4, False, np.ones(2))
    return buf


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("fuzz") / "data") as server:
        target(server.address)
        episodic_target(server.address)
        yield server


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def valid_push() -> bytes:
    return encode_with_batch(PUSH_BATCH_FIELD, {"x": np.ones((2, 3), np.float32),
                                                "flag": np.ones(2, bool)}, "target")


@st.composite
def mutated(draw, seed: bytes) -> bytes:
    """``seed`` with bytes flipped, cut or inserted."""
    raw = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(raw)))
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip" and at < len(raw):
            raw[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del raw[at:]
        else:
            raw[at:at] = draw(st.binary(min_size=1, max_size=12))
    return bytes(raw)


def mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, and a valid message with bytes flipped, cut or inserted."""
    return st.one_of(st.binary(max_size=300), mutated(seed))


@FUZZ
@given(method=st.sampled_from(METHODS), body=mutations(valid_push()))
def test_hostile_bytes_on_every_method_get_client_errors(daemon, method, body):
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.unary_unary(f"/millpond.v1.Replay/{method}", request_serializer=None,
                                   response_deserializer=None)
        try:
            call(body, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_ERRORS, (method, exc.code(), exc.details())
    assert daemon.proc.poll() is None


@pytest.mark.parametrize("fields", [[""], ["nope"], ["x", "x"]])
def test_read_of_fields_the_buffer_lacks_is_invalid_argument(daemon, fields):
    # Found by the fuzz above: the reply was sized from the names before they were checked.
    target(daemon.address)  # (the fuzz may have closed it)
    with grpc.insecure_channel(daemon.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            pb_grpc.ReplayStub(channel).Read(pb.ReadRequest(name="target", seqs=[0],
                                                            fields=fields), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()


def valid_episodic() -> dict[str, bytes]:
    """A valid request of each episodic call on the episodic target, to mutate."""
    meta = pb.Batch(columns=[pb.Column(name="task", dtype="<i8", shape=[],
                                       data=np.int64(1).tobytes())])
    columns = {"obs": np.ones((2, 2), np.float32), "next_obs": np.ones((2, 2), np.float32),
               "actions": np.zeros((2, 1), np.float32), "rewards": np.ones(2, np.float32),
               "terminated": np.array([False, True]), "truncated": np.zeros(2, bool),
               "#episode": np.array([7, 7])}
    update = pb.EpisodeUpdate(episode_id=7, meta=meta, end=True)
    return {
        "PushBatch": encode_with_batch(PUSH_BATCH_FIELD, columns, "episodes")
        + bytes([5 << 3 | 2, len(update.SerializeToString())]) + update.SerializeToString(),
        "Sample": pb.SampleRequest(name="episodes", batch_size=2, n_step=3, gamma=0.9,
                                   filter_meta=meta).SerializeToString(),
        "SampleSequences": pb.SampleSequencesRequest(
            name="episodes", batch_size=2, seq_len=3, filter_meta=meta).SerializeToString(),
        "SampleEpisodes": pb.SampleEpisodesRequest(
            name="episodes", batch_size=2, max_len=3).SerializeToString(),
        "EpisodeCatalog": pb.EpisodeCatalogRequest(name="episodes",
                                                   filter_meta=meta).SerializeToString(),
        "Read": pb.ReadRequest(name="episodes", seqs=[0, 1, 99],
                               fields=["obs"]).SerializeToString(),
        "UpdateEpisodes": pb.UpdateEpisodesRequest(name="episodes",
                                                   updates=[update]).SerializeToString(),
    }


EPISODIC = valid_episodic()


@FUZZ
@given(call=st.sampled_from(sorted(EPISODIC)).flatmap(
    lambda method: st.tuples(st.just(method), mutations(EPISODIC[method]))))
def test_hostile_episodic_requests_get_client_errors(daemon, call):
    method, body = call
    with grpc.insecure_channel(daemon.address) as channel:
        rpc = channel.unary_unary(f"/millpond.v1.Replay/{method}", request_serializer=None,
                                  response_deserializer=None)
        try:
            rpc(body, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_ERRORS, (method, exc.code(), exc.details())
    assert daemon.proc.poll() is None


def test_the_valid_episodic_requests_are_valid(daemon):
    """The fuzz's seeds succeed unmutated: the fuzz starts from the real thing."""
    with grpc.insecure_channel(daemon.address) as channel:
        for method, body in EPISODIC.items():
            channel.unary_unary(f"/millpond.v1.Replay/{method}", request_serializer=None,
                                response_deserializer=None)(body, timeout=10)


def test_after_the_grpc_fuzz_the_daemon_serves(daemon):
    buf = target(daemon.address)
    assert len(buf) >= 8 and buf.sample(4, seed=0)["x"].shape == (4, 3)
    episodes = episodic_target(daemon.address)
    assert episodes.sample_sequences(2, 3, seed=0)["obs"].shape == (2, 3, 2)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12)
OPS = st.sampled_from(["hello", "push_segment", "push", "result_segment", "sample",
                       "update_priorities", "set_beta", "release", "sample_sequences",
                       "sample_n_step", "read", "nope"])
FIELDS = st.sampled_from(["buffer", "segment", "n", "columns", "offset", "batch_size", "seed",
                          "size", "timeout", "indices", "priorities", "beta", "version",
                          "seq_len", "n_step", "gamma", "filter_meta", "updates", "fields",
                          "push_segment", "seqs"])
MESSAGES = st.builds(lambda op, body: {"op": op, **body}, OPS,
                     st.dictionaries(FIELDS, JSON | st.sampled_from(["target", "episodes"])
                                     | st.integers(0, 1 << 22), max_size=6))


@pytest.fixture(scope="module")
def session(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        offer = pb_grpc.ReplayStub(channel).Negotiate(
            pb.NegotiateRequest(boot_id=protocol.read_boot_id()), timeout=10)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect("\0" + offer.socket)
    protocol.send(sock, {"op": "hello", "version": protocol.VERSION})
    assert protocol.recv(sock)[0]["ok"]
    yield sock
    sock.close()


@FUZZ
@given(message=MESSAGES, attach=st.integers(0, 3), sealed=st.booleans())
def test_hostile_fast_path_requests_get_typed_errors_and_keep_no_fd(daemon, session, message,
                                                                   attach, sealed):
    fds = []
    for _ in range(attach):
        if sealed:
            fds.append(memfd.create_segment(4096, "fuzz"))
        else:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    try:
        protocol.send(session, message, fds)
        reply, reply_fds = protocol.recv(session)
    finally:
        protocol.close_fds(fds)
    protocol.close_fds(reply_fds)
    assert reply is not None, "the session was closed"
    if not reply.get("ok"):
        assert reply["code"] not in ("INTERNAL", "REPLAY_ERROR"), (message, reply)
    assert daemon.proc.poll() is None


BINARY_SAMPLE = protocol.encode({"op": "sample", "buffer": "target", "segment": 1, "offset": 0,
                                 "batch_size": 2, "seed": 3, "timeout": 0.0})
BINARY = st.one_of(mutated(BINARY_SAMPLE), st.binary(max_size=80).map(lambda b: b"\x01" + b),
                   st.binary(max_size=4).map(lambda b: b"\x02" + b)).filter(bool)  # b"": hang-up


@FUZZ
@given(data=BINARY)
def test_hostile_binary_fast_path_messages_get_typed_errors(daemon, session, data):
    assert BINARY_SAMPLE[:1] == b"\x01"  # the binary form, not JSON
    session.sendmsg([data])
    reply, reply_fds = protocol.recv(session)
    protocol.close_fds(reply_fds)
    assert reply is not None, "the session was closed"
    if not reply.get("ok"):
        assert reply["code"] not in ("INTERNAL", "REPLAY_ERROR"), (data, reply)
    assert daemon.proc.poll() is None


def test_after_the_fast_path_fuzz_nothing_is_left_behind(daemon, session):
    """Every segment the fuzz had the server map or make goes with its session
    (a mapped segment holds an fd: CPython's mmap keeps a duplicate)."""
    pid = daemon.proc.pid
    session.close()
    wait_until(lambda: _memfds(pid) == [])
    fresh = millpond.connect(daemon.address)
    assert fresh.transport == "shm"
    target(daemon.address)
    assert len(fresh.buffer("target").sample(2, seed=1)["x"]) == 2


def _memfds(pid: int) -> list[str]:
    return [link for fd in os.listdir(f"/proc/{pid}/fd")
            if (link := _readlink(f"/proc/{pid}/fd/{fd}")).startswith("/memfd:")]


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile
        return ""
