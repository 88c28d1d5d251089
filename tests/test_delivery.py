"""Samples that consume records consume them only when their reply will be delivered.

Queue and stack samples remove what they return; a buffer with ``max_times_sampled``
counts each draw. Such a sample whose reply could not reach the client (larger than
the daemon's --max-message-mb, than the client's ``max_message_mb``, or than the
fast-path result segment it names) is refused with MessageTooLargeError before
anything is drawn: ``len(buf)`` and every record stay as they were, all still
sampleable. Every transport: unary Sample, SampleStream, the episodic calls, the
fast path, and a fast-path call that falls back to gRPC.
"""

from __future__ import annotations

import itertools

import grpc
import numpy as np
import pytest
from support import ServerProcess, wait_until

import millpond
from millpond.core import BufferConfig, TieredBuffer
from millpond.core.sequences import (
    episodic_reply_nbytes,
    n_step_specs,
    reply_specs,
    sequence_specs,
)
from millpond.remote.shm import protocol
from millpond.v1 import replay_pb2 as pb
from millpond.wire.frames import encode_with_batch, reply_nbytes
from millpond.wire.status import error_from_rpc

MiB = 1 << 20
# Transitions of obs_dim=2, act_dim=1: 26 bytes a record; a prioritized sample adds
# 12 (weights float32, indices int64). 30,000 records: 0.78 MB of columns, under 1 MiB;
# with weights and indices 1.14 MB, over it.
OVER_BY_EXTRAS = 30_000
_names = itertools.count()


def records(start: int, n: int, episodic: bool = False) -> dict:
    """``n`` records whose ``rewards`` are their ids ``start..start+n``."""
    ids = np.arange(start, start + n, dtype=np.float32)
    return {"obs": np.repeat(ids[:, None], 2, 1), "next_obs": np.repeat(ids[:, None], 2, 1),
            "actions": ids[:, None] * 0.5, "rewards": ids,
            "terminated": np.zeros(n, bool) if episodic else ids % 7 == 0,
            "truncated": np.zeros(n, np.float32)}


def limits(tmp_path, where: str):
    """(daemon, client settings) with a 1 MiB limit on ``where``'s side."""
    args = ("--max-message-mb", "1") if where == "daemon" else ()
    server = ServerProcess(tmp_path / "data", *args)
    return server, ({"max_message_mb": 1} if where == "client" else {})


def refused(call) -> None:
    with pytest.raises(millpond.MessageTooLargeError):
        call()


def drain(buf, n: int, chunk: int = 5_000) -> np.ndarray:
    """The ids of ``n`` records sampled ``chunk`` at a time (each reply fits any limit)."""
    return np.concatenate([buf.sample(min(chunk, n - i))["rewards"] for i in range(0, n, chunk)])


def episodic(address: str, name: str, episodes: int, steps: int, **kwargs):
    """An episodic prioritized buffer, each record drawn at most once, holding ``episodes``
    complete episodes of ``steps`` steps (meta ``task=0``)."""
    buf = millpond.connect(address, shm=False).create_buffer(
        name, capacity=episodes * steps, obs_dim=2, act_dim=1, episodes=True,
        meta_fields={"task": ("int64", ())}, prioritized=True, max_times_sampled=1, **kwargs)
    for e in range(episodes):
        with buf.one_episode(task=0):
            buf.push_batch(**records(e * steps, steps, episodic=True))
    return buf


def without_extras(specs):
    return tuple(spec for spec in specs if spec[0] not in ("weights", "indices"))


def largest_fitting(nbytes, limit: int = MiB) -> int:
    """The largest ``count`` whose array bytes ``nbytes(count)`` are at most ``limit``."""
    n = 1
    while nbytes(n * 2) <= limit:
        n *= 2
    step = n
    while step > 1:
        step //= 2
        if nbytes(n + step) <= limit:
            n += step
    return n


# ---- sizes known before the draw ------------------------------------------------------


@pytest.mark.parametrize("prioritized", [False, True])
def test_replies_are_sized_exactly_before_the_draw(prioritized):
    """What the daemon checks before a sample draws is the size of the reply it then sends,
    byte for byte: every column, the weights and indices, and the framing."""
    from millpond_server.service import sample_reply_nbytes

    config = BufferConfig.build(capacity=500, obs_dim=2, act_dim=1, episodes=True,
                                meta_fields={"task": ("int64", ()), "level": ("float32", (2,))},
                                prioritized=prioritized)
    buf = TieredBuffer(config)
    for e in range(10):
        steps = records(e * 30, 30, episodic=True)
        steps["terminated"][-1] = True
        buf.push_batch(steps, episodes=np.full(30, e + 1),
                       updates=[(e + 1, {"task": np.int64(e % 2), "level": np.ones(2, "f4")},
                                 True)])
    calls = {
        "sample": ({}, lambda n: buf.sample(n, seed=1)),
        "filtered": ({}, lambda n: buf.sample(n, seed=1, filter_meta={"task": 1})),
        "sample_sequences": ({"seq_len": 7}, lambda n: buf.sample_sequences(n, 7, seed=1)),
        "sample_n_step": ({"n_step": 3}, lambda n: buf.sample_n_step(n, 3, seed=1)),
        "sample_episodes": ({"max_len": 20}, lambda n: buf.sample_episodes(n, seed=1,
                                                                           max_len=20)),
        "read": ({"fields": ["obs", "rewards"], "episode_ids": True},
                 lambda n: buf.read(np.arange(n), ["obs", "rewards"], episode_ids=True)),
    }
    for op, (params, call) in calls.items():
        for n in (1, 5, 128):
            sent = len(encode_with_batch(1, call(n)))
            specs = reply_specs(config, "sample" if op == "filtered" else op, n, params)
            assert reply_nbytes(specs) == sent, (op, n)
            if op == "sample":
                assert sample_reply_nbytes(config, n) == sent
    assert reply_specs(config, "sample_episodes", 4, {"max_len": None}) is None


# ---- the fast path: its result segment ------------------------------------------------


def test_a_fast_path_sample_into_a_segment_that_cannot_hold_its_extras_uses_nothing(server):
    """The fast path's limit is the result segment the request names: one that holds the
    columns but not the weights and indices is refused before the draw."""
    client = millpond.connect(server.address, shm=True)
    n = OVER_BY_EXTRAS
    buf = client.create_buffer("shm-prio", capacity=n, obs_dim=2, act_dim=1, prioritized=True,
                               max_times_sampled=1)
    buf.push_batch(**records(0, n))
    schema = buf.config.schema
    columns_only = protocol.sample_layout(schema, n, False)[2]
    assert columns_only <= MiB < protocol.sample_layout(schema, n, True)[2]

    def into_small_segment(session):
        segment = session._free_result_segment(columns_only)  # 1 MiB
        try:
            return session._request({"op": "sample", "buffer": "shm-prio", "offset": 0,
                                     "segment": segment.id, "batch_size": n, "seed": None,
                                     "timeout": 0.0})
        finally:
            segment.free = True

    refused(lambda: client.connection.shm._on_session(10.0, into_small_segment))
    # Episodic: a window sample whose weights and indices do not fit either.
    ep = episodic(server.address, "shm-episodes", 40, 1_000)
    config = ep.config
    seq_len = 40
    batch = largest_fitting(lambda b: protocol.spec_layout(without_extras(
        sequence_specs(config, b, seq_len)))[1])
    assert protocol.spec_layout(sequence_specs(config, batch, seq_len))[1] > MiB

    def windows_into_small_segment(session):
        segment = session._free_result_segment(MiB)
        try:
            return session._request({"op": "sample_sequences", "buffer": "shm-episodes",
                                     "offset": 0, "segment": segment.id, "batch_size": batch,
                                     "seq_len": seq_len, "timeout": 0.0, "filter_meta": None})
        finally:
            segment.free = True

    refused(lambda: client.connection.shm._on_session(10.0, windows_into_small_segment))
    assert (len(buf), len(ep)) == (n, 40_000)
    assert client.transport == "shm"
    np.testing.assert_array_equal(np.sort(drain(buf, n)), np.arange(n, dtype=np.float32))
    np.testing.assert_array_equal(np.sort(drain(ep, 40_000)), np.arange(40_000, dtype=np.float32))
    assert client.calls["shm", "sample"] > 0


# ---- queues and stacks ----------------------------------------------------------------


@pytest.mark.daemon
@pytest.mark.parametrize("mode", ["queue", "stack"])
@pytest.mark.parametrize("where", ["client", "daemon"])
def test_a_queue_sample_larger_than_a_limit_removes_nothing(tmp_path, mode, where):
    server, settings = limits(tmp_path, where)
    n = 50_000  # 1.3 MB of columns
    with server:
        name = f"q-{next(_names)}"
        pusher = millpond.connect(server.address, shm=False).create_buffer(
            name, capacity=n, obs_dim=2, act_dim=1, mode=mode)
        for start in range(0, n, 10_000):
            pusher.push_batch(**records(start, 10_000))
        learner = millpond.connect(server.address, shm=False, **settings).buffer(name)
        refused(lambda: learner.sample(n, timeout=0))
        refused(lambda: learner.sample(41_000, timeout=0))  # just over: 1,066,000 bytes
        assert len(learner) == len(pusher) == n
        ids = drain(learner, n)
        expected = np.arange(n, dtype=np.float32)
        np.testing.assert_array_equal(ids, expected if mode == "queue" else expected[::-1])
        assert len(learner) == 0


def test_a_streamed_sample_larger_than_the_limit_sent_at_stream_start_removes_nothing(server):
    """Small samples travel as messages of a SampleStream; the client's limit comes with the
    stream's metadata, and every message is held to it. Without it: the daemon's limit."""
    buf = millpond.connect(server.address, shm=False).create_buffer(
        "streamed", capacity=100, obs_dim=2, act_dim=1, mode="queue")
    buf.push_batch(**records(0, 100))
    request = pb.SampleRequest(name="streamed", batch_size=80, timeout=0).SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        stream = channel.stream_stream("/millpond.v1.Replay/SampleStream",
                                       request_serializer=None, response_deserializer=None)
        replies = stream(iter([request]), metadata=(("millpond-max-receive-bytes", "1000"),))
        with pytest.raises(grpc.RpcError) as caught:
            next(replies)
        assert isinstance(error_from_rpc(caught.value), millpond.MessageTooLargeError)
        assert len(buf) == 100
        # Samples that fit the client's limit are served.
        small = pb.SampleRequest(name="streamed", batch_size=10, timeout=0).SerializeToString()
        replies = stream(iter([small, small]), metadata=(("millpond-max-receive-bytes", "1000"),))
        assert [len(reply) > 0 for reply in replies] == [True, True]
        assert len(buf) == 80
        # No limit of the client's (an older client): the daemon's own; a malformed one is refused.
        unary = channel.unary_unary("/millpond.v1.Replay/Sample", request_serializer=None,
                                    response_deserializer=None)
        assert len(unary(small)) > 0
        with pytest.raises(grpc.RpcError) as caught:
            unary(small, metadata=(("millpond-max-receive-bytes", "lots"),))
        assert isinstance(error_from_rpc(caught.value), millpond.InvalidArgumentError)
    assert len(buf) == 70
    np.testing.assert_array_equal(drain(buf, 70), np.arange(30, 100, dtype=np.float32))


def test_a_queue_sample_whose_client_cancelled_while_it_waited_removes_nothing(server):
    """A sample parked for the rate limiter (a queue waits for records) ends with its call:
    records pushed after the client cancelled stay in the queue."""
    buf = millpond.connect(server.address, shm=False).create_buffer(
        "cancelled", capacity=100, obs_dim=2, act_dim=1, mode="queue")
    request = pb.SampleRequest(name="cancelled", batch_size=10, timeout=60).SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        unary = channel.unary_unary("/millpond.v1.Replay/Sample", request_serializer=None,
                                    response_deserializer=None)
        future = unary.future(request, timeout=60)
        wait_until(lambda: buf.info()["waiting_samples"] == 1)
        future.cancel()
        wait_until(lambda: buf.info()["waiting_samples"] == 0)
    buf.push_batch(**records(0, 10))
    assert len(buf) == 10
    np.testing.assert_array_equal(drain(buf, 10), np.arange(10, dtype=np.float32))


# ---- max_times_sampled ----------------------------------------------------------------


@pytest.mark.daemon
@pytest.mark.parametrize("where", ["client", "daemon"])
def test_a_used_up_sample_over_a_limit_only_by_weights_and_indices_uses_nothing(tmp_path, where):
    server, settings = limits(tmp_path, where)
    n = OVER_BY_EXTRAS
    with server:
        name = f"p-{next(_names)}"
        pusher = millpond.connect(server.address, shm=False).create_buffer(
            name, capacity=n, obs_dim=2, act_dim=1, prioritized=True, max_times_sampled=1)
        pusher.push_batch(**records(0, n))
        learner = millpond.connect(server.address, shm=False, **settings).buffer(name)
        refused(lambda: learner.sample(n))
        assert len(learner) == n
        # Every record is still there, each drawn exactly once before it is used up.
        ids = drain(learner, n)
        np.testing.assert_array_equal(np.sort(ids), np.arange(n, dtype=np.float32))
        assert len(learner) == 0


# ---- episodic samples -----------------------------------------------------------------


@pytest.mark.daemon
@pytest.mark.parametrize("where", ["client", "daemon"])
def test_episodic_samples_over_a_limit_use_nothing(tmp_path, where):
    server, settings = limits(tmp_path, where)
    with server:
        name = f"e-{next(_names)}"
        pusher = episodic(server.address, name, 40, 1_000)
        learner = millpond.connect(server.address, shm=False, **settings).buffer(name)
        config = learner.config
        before = len(learner)
        # Over the limit only by the weights and indices of each window's start.
        seq_len = 40
        batch = largest_fitting(lambda b: reply_nbytes(without_extras(
            sequence_specs(config, b, seq_len))))
        assert reply_nbytes(sequence_specs(config, batch, seq_len)) > MiB
        refused(lambda: learner.sample_sequences(batch, seq_len))
        refused(lambda: learner.sample(35_000, n_step=3))
        refused(lambda: learner.sample(30_000, filter_meta={"task": 0}))
        refused(lambda: learner.sample_episodes(40, max_len=1_000))
        assert len(learner) == len(pusher) == before
        ids = drain(learner, before)
        np.testing.assert_array_equal(np.sort(ids), np.arange(before, dtype=np.float32))


@pytest.mark.daemon
def test_an_episodic_sample_over_the_daemons_limit_only_by_its_framing_uses_nothing(tmp_path):
    """The daemon sized episodic replies by their arrays, then encoded them with their
    framing (names, dtypes, shapes: a few hundred bytes) after the draw."""
    with ServerProcess(tmp_path / "data", "--max-message-mb", "1") as server:
        buf = episodic(server.address, "framing", 40, 1_000)
        config = buf.config
        n = largest_fitting(lambda b: episodic_reply_nbytes(config, "sample_n_step", b,
                                                               {"n_step": 3}))
        assert reply_nbytes(n_step_specs(config, n)) > MiB
        refused(lambda: buf.sample(n, n_step=3))
        assert len(buf) == 40_000


# ---- a fast-path call that falls back to gRPC -----------------------------------------


@pytest.mark.daemon
def test_a_fast_path_sample_that_falls_back_to_grpc_is_held_to_the_clients_limit(tmp_path):
    """A result segment over --shm-max-mb sends the call over gRPC, where the client's
    max_message_mb bounds the reply: refused there too, before the draw."""
    n = OVER_BY_EXTRAS
    with ServerProcess(tmp_path / "data", "--shm-max-mb", "1") as server:
        millpond.connect(server.address, shm=False).create_buffer(
            "fallback", capacity=n, obs_dim=2, act_dim=1, prioritized=True,
            max_times_sampled=1).push_batch(**records(0, n))
        client = millpond.connect(server.address, shm=True, max_message_mb=1)
        buf = client.buffer("fallback")
        assert client.transport == "shm"
        refused(lambda: buf.sample(n))  # a 2 MiB segment: over --shm-max-mb, then over 1 MiB
        assert len(buf) == n
        np.testing.assert_array_equal(np.sort(drain(buf, n)), np.arange(n, dtype=np.float32))
