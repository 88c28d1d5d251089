"""The daemon over a real gRPC channel: generated stub + wire codec, no mocks."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerProcess

from millpond.core import BufferConfig, Schema
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc
from millpond.wire.codec import config_to_proto, decode_batch, encode_batch
from millpond.wire.status import ERROR_CODE_KEY

pytestmark = pytest.mark.daemon

TIMEOUT = 10.0
SCHEMA = Schema.transition(obs_dim=3, act_dim=2)
ATARI = Schema.from_spec({"obs": ("uint8", (84, 84, 4)), "action": ("int64", ())})


@pytest.fixture(scope="module")
def stub(shared_server):
    with grpc.insecure_channel(shared_server.address, options=[
        ("grpc.max_receive_message_length", 1 << 30),
        ("grpc.max_send_message_length", 1 << 30),
    ]) as channel:
        yield replay_pb2_grpc.ReplayStub(channel)


_counter = iter(range(1_000_000))


@pytest.fixture
def name(request):
    return f"{request.node.name[:60].replace('[', '_').replace(']', '')}-{next(_counter)}"


def create(stub, name, schema=SCHEMA, hot=4, total=10):
    """Create (or attach to) ``name``; return its BufferInfo message."""
    config = config_to_proto(BufferConfig(schema, hot, total))
    return stub.Create(pb.CreateRequest(name=name, config=config), timeout=TIMEOUT).info


def transitions(n, start=0, obs_dim=3, act_dim=2):
    base = np.arange(start, start + n, dtype=np.float32)
    return {
        "obs": np.repeat(base[:, None], obs_dim, 1),
        "next_obs": np.repeat(base[:, None] + 0.5, obs_dim, 1),
        "actions": np.repeat(-base[:, None], act_dim, 1),
        "rewards": base * 2,
        "terminated": (np.arange(n) % 2 == 0),
        "truncated": np.zeros(n, bool),
    }


def push_batch(stub, name, columns):
    return stub.PushBatch(pb.PushBatchRequest(name=name, batch=encode_batch(columns)),
                          timeout=TIMEOUT)


def sample(stub, name, batch_size, seed=None):
    req = pb.SampleRequest(name=name, batch_size=batch_size)
    if seed is not None:
        req.seed = seed
    return decode_batch(stub.Sample(req, timeout=TIMEOUT).batch)


def info(stub, name):
    return stub.Info(pb.InfoRequest(name=name), timeout=TIMEOUT)


def error_code(err: grpc.RpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get(ERROR_CODE_KEY)


def expect_error(status, code, fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info_:
        fn(*args, **kwargs)
    err = info_.value
    assert err.code() == status, err.details()
    if code is not None:
        assert error_code(err) == code, err.details()
    return err


# ---- create / attach ---------------------------------------------------------------

def test_create_then_attach_same_config(stub, shared_server, name):
    first = create(stub, name, hot=4, total=10)
    assert first.name == name and first.size == 0
    assert first.config.hot_capacity == 4 and first.config.total_capacity == 10
    assert first.path == f"{name}.buffer"  # relative to the data directory
    assert os.path.exists(shared_server.data_dir / first.path)
    push_batch(stub, name, transitions(3))
    again = create(stub, name, hot=4, total=10)  # attach: data kept
    assert again.size == 3 and again.pushed == 3


@pytest.mark.parametrize("change", [
    {"hot": 5}, {"total": 11}, {"schema": Schema.transition(obs_dim=4, act_dim=2)},
])
def test_create_with_different_config_is_already_exists(stub, name, change):
    create(stub, name, hot=4, total=10)
    kwargs = {"schema": SCHEMA, "hot": 4, "total": 10, **change}
    err = expect_error(grpc.StatusCode.ALREADY_EXISTS, "CONFIG_MISMATCH", create, stub, name, **kwargs)
    assert name in err.details()


@pytest.mark.parametrize("bad", ["", "../evil", "a/b", ".hidden", "x" * 129, "sp ace"])
def test_create_rejects_bad_names(stub, bad):
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", create, stub, bad)


@pytest.mark.parametrize("hot,total", [(0, 10), (10, 5), (-1, 3)])
def test_create_rejects_bad_capacities(stub, name, hot, total):
    config = config_to_proto(BufferConfig(SCHEMA, 4, 10))
    config.hot_capacity, config.total_capacity = hot, total  # as a hostile client may send
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CONFIG", stub.Create,
                 pb.CreateRequest(name=name, config=config), timeout=TIMEOUT)
    expect_error(grpc.StatusCode.NOT_FOUND, "BUFFER_NOT_FOUND", info, stub, name)


def test_create_without_fields_is_invalid(stub, name):
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_CONFIG",
                 stub.Create, pb.CreateRequest(name=name), timeout=TIMEOUT)


# ---- round trips -------------------------------------------------------------------

def test_push_batch_and_sample_round_trip(stub, name):
    create(stub, name, hot=4, total=10)
    reply = push_batch(stub, name, transitions(7))
    assert (reply.size, reply.pushed) == (7, 7)
    out = sample(stub, name, 7, seed=1)
    assert set(out) == set(SCHEMA.names)
    assert out["obs"].shape == (7, 3) and out["actions"].shape == (7, 2)
    assert out["rewards"].shape == (7,) and out["terminated"].dtype == np.bool_
    idx = out["obs"][:, 0]
    assert set(idx.astype(int)) <= set(range(7))
    np.testing.assert_array_equal(out["next_obs"][:, 0], idx + 0.5)
    np.testing.assert_array_equal(out["actions"][:, 1], -idx)
    np.testing.assert_array_equal(out["rewards"], idx * 2)
    np.testing.assert_array_equal(out["terminated"], idx.astype(int) % 2 == 0)
    # seeded samples are deterministic
    again = sample(stub, name, 7, seed=1)
    for key in out:
        np.testing.assert_array_equal(out[key], again[key])


def test_fifo_keeps_newest_total_capacity(stub, name):
    create(stub, name, hot=4, total=10)
    for start in range(0, 25, 5):
        push_batch(stub, name, transitions(5, start))
    i = info(stub, name)
    assert (i.size, i.pushed, i.hot_size, i.cold_size) == (10, 25, 4, 6)
    got = set()
    for seed in range(40):
        got |= set(sample(stub, name, 10, seed=seed)["obs"][:, 0].astype(int))
    assert got == set(range(15, 25))


def test_push_single_record(stub, name):
    create(stub, name, hot=2, total=2)
    rec = {k: v[0] for k, v in transitions(1, start=42).items()}
    reply = stub.Push(pb.PushRequest(name=name, record=encode_batch(rec)), timeout=TIMEOUT)
    assert (reply.size, reply.pushed) == (1, 1)
    out = sample(stub, name, 1, seed=0)
    np.testing.assert_array_equal(out["obs"], np.full((1, 3), 42, np.float32))
    assert out["terminated"].all()


def test_native_dtypes_round_trip(stub, name):
    create(stub, name, schema=ATARI, hot=3, total=8)
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, size=(8, 84, 84, 4), dtype=np.uint8)
    obs[:, 0, 0, 0] = np.arange(8)
    push_batch(stub, name, {"obs": obs, "action": np.arange(8, dtype=np.int64)})
    out = sample(stub, name, 8, seed=5)
    assert out["obs"].dtype == np.uint8 and out["obs"].shape == (8, 84, 84, 4)
    np.testing.assert_array_equal(out["obs"], obs[out["action"]])


def test_sample_reply_matches_protobuf_encoding(stub, name):
    """The hand-encoded Sample reply is exactly what protobuf would produce."""
    create(stub, name, schema=ATARI, hot=3, total=8)
    push_batch(stub, name, {"obs": np.ones((5, 84, 84, 4), np.uint8),
                            "action": np.arange(5, dtype=np.int64)})
    reply = stub.Sample(pb.SampleRequest(name=name, batch_size=5, seed=2), timeout=TIMEOUT)
    assert pb.SampleReply.FromString(reply.SerializeToString()) == reply
    out = decode_batch(reply.batch)
    expected = pb.SampleReply(batch=encode_batch(out))
    assert reply.SerializeToString() == expected.SerializeToString()


def test_info_and_list(stub, name):
    create(stub, name, hot=4, total=4)
    push_batch(stub, name, transitions(6))
    i = info(stub, name)
    assert (i.size, i.pushed, i.hot_size, i.cold_size) == (4, 6, 4, 0)
    assert i.record_nbytes == SCHEMA.record_nbytes and i.path == f"{name}.buffer"
    listed = {b.name: b for b in stub.List(pb.ListRequest(), timeout=TIMEOUT).buffers}
    assert listed[name] == i


def test_close_deletes_cold_file(stub, shared_server, name):
    path = shared_server.data_dir / create(stub, name, hot=2, total=6).path
    push_batch(stub, name, transitions(5))
    assert os.path.exists(path)
    stub.Delete(pb.DeleteRequest(name=name), timeout=TIMEOUT)
    assert not os.path.exists(path)
    names = [b.name for b in stub.List(pb.ListRequest(), timeout=TIMEOUT).buffers]
    assert name not in names
    expect_error(grpc.StatusCode.NOT_FOUND, "BUFFER_NOT_FOUND", info, stub, name)
    # the name can be reused with another config
    assert create(stub, name, hot=3, total=3).config.hot_capacity == 3


@pytest.mark.parametrize("call", ["info", "sample", "push_batch", "push", "close"])
def test_unknown_buffer_is_not_found(stub, call):
    missing = "no-such-buffer"
    calls = {
        "info": lambda: info(stub, missing),
        "sample": lambda: sample(stub, missing, 1),
        "push_batch": lambda: push_batch(stub, missing, transitions(1)),
        "push": lambda: stub.Push(pb.PushRequest(name=missing), timeout=TIMEOUT),
        "close": lambda: stub.Delete(pb.DeleteRequest(name=missing), timeout=TIMEOUT),
    }
    err = expect_error(grpc.StatusCode.NOT_FOUND, "BUFFER_NOT_FOUND", calls[call])
    assert missing in err.details()


# ---- bad input leaves the buffer unchanged ------------------------------------------

def _raw_column(name, dtype, shape, data):
    return pb.Column(name=name, dtype=dtype, shape=shape, data=data)


def _bad_batches():
    good = encode_batch(transitions(3))
    cases = {}
    wrong_shape = transitions(3)
    wrong_shape["obs"] = np.zeros((3, 4), np.float32)
    cases["wrong_shape"] = (encode_batch(wrong_shape), "SHAPE_MISMATCH")
    ragged = transitions(3)
    ragged["rewards"] = np.zeros(2, np.float32)
    cases["ragged_lengths"] = (encode_batch(ragged), "SHAPE_MISMATCH")
    missing = transitions(3)
    del missing["rewards"]
    cases["missing_field"] = (encode_batch(missing), "FIELD_MISMATCH")
    extra = {**transitions(3), "bogus": np.zeros(3, np.float32)}
    cases["extra_field"] = (encode_batch(extra), "FIELD_MISMATCH")
    for label, dtype, nbytes in [("bad_dtype_string", "not-a-dtype", 36),
                                 ("object_dtype", "|O", 24),
                                 ("byte_count_mismatch", "<f4", 35)]:
        batch = pb.Batch()
        batch.CopyFrom(good)
        del batch.columns[0]  # replace obs by a hand-made column
        batch.columns.append(_raw_column("obs", dtype, [3, 3], b"\0" * nbytes))
        code = "SHAPE_MISMATCH" if label == "byte_count_mismatch" else "DTYPE_MISMATCH"
        cases[label] = (batch, code)
    return cases


BAD = _bad_batches()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_push_batch_is_invalid_and_changes_nothing(stub, name, case):
    batch, code = BAD[case]
    create(stub, name, hot=4, total=10)
    push_batch(stub, name, transitions(6))
    snapshot = sample(stub, name, 6, seed=9)
    before = info(stub, name)
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, code, stub.PushBatch,
                 pb.PushBatchRequest(name=name, batch=batch), timeout=TIMEOUT)
    after = info(stub, name)
    assert (after.size, after.pushed) == (before.size, before.pushed)
    assert after == before
    again = sample(stub, name, 6, seed=9)
    for key in snapshot:
        np.testing.assert_array_equal(snapshot[key], again[key])


def test_bad_single_push_changes_nothing(stub, name):
    create(stub, name, hot=4, total=10)
    push_batch(stub, name, transitions(2))
    before = info(stub, name)
    rec = {k: v[0] for k, v in transitions(1).items()}
    rec["obs"] = np.zeros(5, np.float32)
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "SHAPE_MISMATCH", stub.Push,
                 pb.PushRequest(name=name, record=encode_batch(rec)), timeout=TIMEOUT)
    assert info(stub, name) == before


@pytest.mark.parametrize("batch_size,status,code", [
    (0, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_BATCH_SIZE"),
    (-3, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_BATCH_SIZE"),
    (6, grpc.StatusCode.FAILED_PRECONDITION, "NOT_ENOUGH_DATA"),
])
def test_bad_batch_size(stub, name, batch_size, status, code):
    create(stub, name, hot=4, total=10)
    push_batch(stub, name, transitions(5))
    before = info(stub, name)
    expect_error(status, code, sample, stub, name, batch_size)
    assert info(stub, name) == before


def test_empty_buffer_sample_is_failed_precondition(stub, name):
    create(stub, name)
    expect_error(grpc.StatusCode.FAILED_PRECONDITION, "NOT_ENOUGH_DATA", sample, stub, name, 1)


# ---- message size limit -------------------------------------------------------------

def test_oversized_sample_is_resource_exhausted_naming_the_limit(tmp_path):
    with ServerProcess(tmp_path / "data", "--max-message-mb", "1") as srv, \
            grpc.insecure_channel(srv.address) as channel:
        stub = replay_pb2_grpc.ReplayStub(channel)
        create(stub, "atari", schema=ATARI, hot=16, total=16)
        push_batch(stub, "atari", {"obs": np.zeros((16, 84, 84, 4), np.uint8),
                                   "action": np.zeros(16, np.int64)})
        assert len(sample(stub, "atari", 1)["obs"]) == 1  # 28 KB fits
        err = expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "MESSAGE_TOO_LARGE",
                           sample, stub, "atari", 100)  # 2.8 MB does not
        assert "--max-message-mb 1" in err.details()
        assert "2,823," in err.details()  # the reply size, before sampling
        # the request side is limited too (gRPC's own check)
        expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, None, push_batch, stub, "atari",
                     {"obs": np.zeros((50, 84, 84, 4), np.uint8), "action": np.zeros(50, np.int64)})
        assert info(stub, "atari").pushed == 16


# ---- concurrency, health, shutdown ---------------------------------------------------

def test_concurrent_clients_push_to_two_buffers(shared_server):
    names = ["conc-a", "conc-b"]
    threads, per_thread, batch = 8, 20, 50
    with grpc.insecure_channel(shared_server.address) as channel:
        stub = replay_pb2_grpc.ReplayStub(channel)
        for n in names:
            create(stub, n, hot=1000, total=20_000)
    errors = []

    def worker(i):
        try:
            with grpc.insecure_channel(shared_server.address) as ch:  # one client each
                s = replay_pb2_grpc.ReplayStub(ch)
                target = names[i % 2]
                for k in range(per_thread):
                    push_batch(s, target, transitions(batch, start=i * 10_000 + k * batch))
                    if k % 5 == 0:
                        sample(s, target, 16)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    with grpc.insecure_channel(shared_server.address) as channel:
        stub = replay_pb2_grpc.ReplayStub(channel)
        for n in names:
            i = info(stub, n)
            assert i.pushed == threads // 2 * per_thread * batch == i.size
            # every record intact: obs, next_obs and rewards agree row by row
            out = sample(stub, n, 2000, seed=1)
            np.testing.assert_array_equal(out["next_obs"][:, 0], out["obs"][:, 0] + 0.5)
            np.testing.assert_array_equal(out["rewards"], out["obs"][:, 0] * 2)


def test_health_serving(shared_server):
    with grpc.insecure_channel(shared_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "millpond.v1.Replay"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_sigterm_during_traffic_exits_zero_and_cleans_up(tmp_path):
    srv = ServerProcess(tmp_path / "data").start()
    try:
        stop = threading.Event()
        done, failures = [], []
        with grpc.insecure_channel(srv.address) as channel:
            stub = replay_pb2_grpc.ReplayStub(channel)
            path = srv.data_dir / create(stub, "busy", hot=100, total=5000).path

            def traffic():
                with grpc.insecure_channel(srv.address) as ch:
                    s = replay_pb2_grpc.ReplayStub(ch)
                    k = 0
                    while not stop.is_set():
                        started = time.monotonic()
                        try:
                            push_batch(s, "busy", transitions(64, k))
                            sample(s, "busy", 32)
                            done.append(k)
                            k += 64
                        except grpc.RpcError as exc:
                            if exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                  grpc.StatusCode.CANCELLED):
                                failures.append((started, exc))
                            return

            workers = [threading.Thread(target=traffic) for _ in range(3)]
            for w in workers:
                w.start()
            deadline = time.monotonic() + 10
            while len(done) < 20 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(done) >= 20
            assert srv.stop(signal.SIGTERM) == 0
            exited = time.monotonic()
            stop.set()
            for w in workers:
                w.join(15)
        # A call begun once the daemon is gone talks to no daemon: how it fails (it may even
        # hang to its deadline) is gRPC's business, not the daemon's.
        assert not [exc for started, exc in failures if started < exited], failures
        assert os.path.exists(path)  # buffers persist across restarts
        assert (tmp_path / "data").is_dir()  # the data dir itself stays
        assert "Traceback" not in srv.proc.stderr.read()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_health_turns_not_serving_on_sigterm(tmp_path):
    srv = ServerProcess(tmp_path / "data", "--grace", "1").start()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stream = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="millpond.v1.Replay"), timeout=TIMEOUT)
            statuses = iter(stream)
            assert next(statuses).status == health_pb2.HealthCheckResponse.SERVING
            srv.proc.send_signal(signal.SIGTERM)
            assert next(statuses).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stream.cancel()
        assert srv.proc.wait(TIMEOUT) == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
