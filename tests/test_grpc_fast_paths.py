"""The shortcuts of the gRPC path change nothing but speed.

* format 4's checksums computed the fast way equal their definition, bit for bit
  (files written before keep their meaning; format 5's: tests/test_integrity.py);
* a Batch framed like the last one parsed decodes to what the parser gives;
* a sample reply filled in place is the bytes ``encode_with_batch`` makes;
* a received reply is handed out writable only while nothing else holds it;
* small calls run on the server's event loop, yet a buffer another thread
  holds never blocks the loop, and a slow buffer goes back to the pool.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from millpond.core import BufferConfig, Schema
from millpond.core.checksum_v4 import record_checksums
from millpond.v1 import replay_pb2 as pb
from millpond.wire.frames import (
    PUSH_BATCH_FIELD,
    PUSH_PRIORITIES_FIELD,
    PUSH_TIMEOUT_FIELD,
    SAMPLE_BATCH_FIELD,
    decode_batch_field,
    decode_batches,
    decode_double,
    decode_doubles,
    decode_name,
    encode_with_batch,
    split_push_batch,
)
from millpond.wire.inplace import BatchFrame, new_bytes, sole_writable

DTYPES = st.sampled_from(["<f4", "<f8", "|u1", "<i8", "|b1", "<u2", "<f2", "<i4"])


# ---- checksums ---------------------------------------------------------------------------


def reference_checksums(columns, seqs) -> np.ndarray:
    """The definition (core/checksum_v4.py), one field and one byte at a time."""
    k = len(seqs)
    acc = np.zeros(k, np.uint64)
    for column in columns.values():
        raw = np.ascontiguousarray(column).reshape(k, -1).view(np.uint8)
        whole = raw.shape[1] // 8 * 8
        fold = np.zeros(k, np.uint64)
        for j in range(whole // 8):
            fold ^= raw[:, :whole].view(np.uint64)[:, j]
        for b in range(whole, raw.shape[1]):
            fold ^= raw[:, b].astype(np.uint64) << np.uint64(8 * (b - whole))
        acc ^= fold
        acc = (acc << np.uint64(7)) | (acc >> np.uint64(57))
    acc ^= np.asarray(seqs).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    acc ^= acc >> np.uint64(32)
    acc ^= acc >> np.uint64(16)
    return (acc & np.uint64(0xFFFF)).astype("<u2")


@settings(max_examples=200, deadline=None)
@given(data=st.data(), k=st.integers(1, 30), fields=st.integers(1, 7))
def test_checksums_equal_their_definition(data, k, fields):
    columns = {}
    for i in range(fields):
        dtype = np.dtype(data.draw(DTYPES))
        shape = data.draw(st.sampled_from([(), (1,), (3,), (4,), (5, 3), (40,), (0,), (7, 9)]))
        arr = data.draw(hnp.arrays(np.uint8, (k, *shape, dtype.itemsize))).view(dtype)
        columns[f"f{i}"] = arr.reshape((k, *shape))
        if data.draw(st.booleans()) and arr.ndim > 1 and arr.shape[1] > 1:
            columns[f"f{i}"] = columns[f"f{i}"][:, ::-1]  # not contiguous
    seqs = np.array(data.draw(st.lists(st.integers(0, 2**40), min_size=k, max_size=k)), np.int64)
    np.testing.assert_array_equal(record_checksums(columns, seqs), reference_checksums(columns, seqs))


# ---- framing -------------------------------------------------------------------------------


def test_a_batch_framed_like_the_last_one_decodes_as_the_parser_would():
    first = {"ab": np.arange(6, dtype="<f4").reshape(3, 2), "cd": np.arange(3, dtype="<i4")}
    again = {"ab": np.full((3, 2), 7, "<f4"), "cd": np.array([5, 6, 7], "<i4")}
    # as long, other framing: names swapped, another dtype of the same size, another shape
    swapped = {"cd": first["ab"], "ab": first["cd"]}
    retyped = {"ab": first["ab"].view("<i4"), "cd": first["cd"].view("<f4")}
    reshaped = {"ab": first["ab"].reshape(2, 3), "cd": first["cd"]}
    for columns in (first, again, swapped, retyped, reshaped, first):
        raw = encode_with_batch(SAMPLE_BATCH_FIELD, columns)
        decoded = decode_batch_field(raw, SAMPLE_BATCH_FIELD)
        theirs = pb.SampleReply.FromString(raw).batch.columns
        assert list(decoded) == [c.name for c in theirs]
        for column in theirs:
            got = decoded[column.name]
            assert (got.dtype.str, list(got.shape), got.tobytes()) == (
                column.dtype, list(column.shape), column.data)


def test_a_push_request_is_split_in_one_pass_as_the_field_readers_read_it():
    columns = {"x": np.arange(4, dtype="<f8")}
    for priorities, timeout in ((None, None), (np.array([1.0, 2.0, 3.0, 4.0]), 2.5)):
        raw = encode_with_batch(PUSH_BATCH_FIELD, columns, "buf", priorities, timeout)
        name, batches, prios, got_timeout, _ = split_push_batch(raw)
        assert name == decode_name(raw) == "buf"
        assert got_timeout == decode_double(raw, PUSH_TIMEOUT_FIELD) == timeout
        expected = decode_doubles(raw, PUSH_PRIORITIES_FIELD)
        assert (prios is None) == (not len(expected))
        if prios is not None:
            np.testing.assert_array_equal(prios, expected)
        np.testing.assert_array_equal(decode_batches(batches)["x"], columns["x"])


@settings(max_examples=100, deadline=None)
@given(columns=st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True),
    DTYPES.flatmap(lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(
        min_dims=1, max_dims=3, min_side=0, max_side=4))), max_size=4))
def test_a_reply_filled_in_place_is_the_encoded_reply(columns):
    frame = BatchFrame(SAMPLE_BATCH_FIELD, [(k, v.dtype, v.shape) for k, v in columns.items()])
    reply, slots = frame.new()
    for name, arr in columns.items():
        slots[name][...] = arr
    assert reply == encode_with_batch(SAMPLE_BATCH_FIELD, columns)
    assert frame.nbytes == len(reply)


@given(st.dictionaries(st.sampled_from(["obs", "a", "reward"]),
    DTYPES.flatmap(lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(
        min_dims=1, max_dims=3, min_side=0, max_side=4))), max_size=4))
def test_a_reused_reply_is_the_encoded_reply_each_time_one_per_thread(columns):
    frame = BatchFrame(SAMPLE_BATCH_FIELD, [(k, v.dtype, v.shape) for k, v in columns.items()])
    for fill in (0, 1):  # filled again: every byte of the slots is the new data's
        message, slots = frame.reused()
        for name, arr in columns.items():
            slots[name][...] = arr if fill else np.ones_like(arr)
        expected = columns if fill else {k: np.ones_like(v) for k, v in columns.items()}
        assert bytes(message) == encode_with_batch(SAMPLE_BATCH_FIELD, expected)
    others = []
    worker = threading.Thread(target=lambda: others.append(frame.reused()[0]))
    worker.start()
    worker.join()
    assert others[0] is not message and frame.reused()[0] is message
    # A thread keeps one message, of the last frame it used (memory bounded in bytes).
    other = BatchFrame(SAMPLE_BATCH_FIELD, [("x", np.dtype("<f4"), (3,))])
    assert other.reused()[0] is not message and frame.reused()[0] is not message


def test_new_bytes_never_hands_out_a_shared_object():
    for n in (0, 1):
        raw, view = new_bytes(n)
        view[...] = 1  # writes to a scratch array, never to Python's shared b"" or b"\0"
        assert raw == bytes(n)
    raw, view = new_bytes(100)
    view[...] = 3
    assert raw == b"\3" * 100


def test_a_reply_is_writable_in_place_only_while_nothing_else_holds_it():
    def receive() -> bytes:
        return bytes(range(200))  # a new object, like gRPC's reply

    reply = receive()
    whole = sole_writable(reply)
    assert whole is not None and whole.flags.writeable
    whole[:2] = 9
    assert reply[:3] == b"\x09\x09\x02"
    assert sole_writable(reply) is None  # ``whole`` holds it now
    del whole
    other = reply
    assert sole_writable(reply) is None  # two names for one object
    del other
    held = [reply]
    assert sole_writable(reply) is None
    del held
    assert sole_writable(reply) is not None
    assert sole_writable(b"\x01") is None  # Python shares one-byte objects


# ---- small calls on the server's loop ----------------------------------------------------


class _Context:
    def time_remaining(self):
        return 30.0

    def invocation_metadata(self):
        return ()

    def peer_identities(self):
        return None

    async def abort(self, status, details, trailing_metadata=()):
        raise AssertionError(f"{status}: {details}")


def _service(tmp_path):
    from millpond_server.operations import Operations
    from millpond_server.registry import Registry
    from millpond_server.service import ReplayService

    registry = Registry(tmp_path / "data")
    ops = Operations(registry, ThreadPoolExecutor(2))
    return registry, ops, ReplayService(ops, 64)


SCHEMA = Schema.from_spec({"x": ("float32", (3,)), "y": ("int64", ())})


def _sample_request(batch_size: int, seed: int) -> bytes:
    return pb.SampleRequest(name="b", batch_size=batch_size, seed=seed).SerializeToString()


def test_a_small_call_never_blocks_the_loop_on_a_buffer_another_thread_holds(tmp_path):
    registry, ops, service = _service(tmp_path)

    async def main():
        ops.start(asyncio.get_running_loop())
        ops.ready = True
        buffer, _ = registry.create("b", BufferConfig(SCHEMA, 50, 200))
        push = encode_with_batch(PUSH_BATCH_FIELD, {"x": np.ones((100, 3), "<f4"),
                                                    "y": np.arange(100)}, "b")
        await service.PushBatch(push, _Context())  # on the loop: the buffer is free
        held, release = threading.Event(), threading.Event()

        def hold():  # a long operation of another thread (a fast-path session's, say)
            held.set()
            release.wait(10)

        holder = threading.Thread(target=ops.owner(buffer).run_here, args=(hold,))
        holder.start()
        held.wait(10)
        beats = 0

        async def heartbeat():
            nonlocal beats
            while not release.is_set():
                beats += 1
                await asyncio.sleep(0.01)

        beat = asyncio.create_task(heartbeat())
        sample = asyncio.create_task(service.Sample(_sample_request(8, 3), _Context()))
        pushed = asyncio.create_task(service.PushBatch(push, _Context()))
        await asyncio.sleep(0.3)
        assert beats >= 10 and not sample.done() and not pushed.done()  # waiting on the pool
        release.set()
        columns = decode_batch_field(await sample, SAMPLE_BATCH_FIELD)
        assert columns["x"].shape == (8, 3) and columns["y"].shape == (8,)
        assert (await pushed).pushed == 200
        await beat
        holder.join()
        registry.release_all()

    asyncio.run(main())


def test_a_slow_small_call_sends_its_buffer_to_the_pool_for_a_while(tmp_path, monkeypatch):
    from millpond_server import owner

    registry, ops, service = _service(tmp_path)
    monkeypatch.setattr(owner, "INLINE_SLOW_S", 0.0)  # every call counts as slow

    async def main():
        ops.start(asyncio.get_running_loop())
        ops.ready = True
        buffer, _ = registry.create("b", BufferConfig(SCHEMA, 50, 200))
        loop_thread = threading.get_ident()
        threads = []
        original = buffer.sample

        def spy(*args, **kwargs):
            threads.append(threading.get_ident())
            return original(*args, **kwargs)

        buffer.sample = spy
        await service.PushBatch(encode_with_batch(PUSH_BATCH_FIELD, {
            "x": np.ones((10, 3), "<f4"), "y": np.arange(10)}, "b"), _Context())
        for _ in range(2):
            await service.Sample(_sample_request(4, 1), _Context())
        assert threads and all(t != loop_thread for t in threads)  # the push sent it there
        assert ops.owner(buffer)._pooled_until > time.monotonic()
        registry.release_all()

    asyncio.run(main())


WIDE = Schema.from_spec({"x": ("float32", (64,)), "y": ("int64", ())})  # 264 bytes a record


@pytest.mark.parametrize("batch_size", [8, 6_000])  # on the loop / on the pool (1.6 MB)
def test_sample_replies_are_the_same_on_the_loop_and_on_the_pool(tmp_path, batch_size):
    from millpond_server.owner import INLINE_BYTES

    registry, ops, service = _service(tmp_path)

    async def main():
        ops.start(asyncio.get_running_loop())
        ops.ready = True
        buffer, _ = registry.create("b", BufferConfig(WIDE, 4_000, 10_000))
        threads = []
        original = buffer.sample

        def spy(*args, **kwargs):
            threads.append(threading.get_ident())
            return original(*args, **kwargs)

        buffer.sample = spy
        rng = np.random.default_rng(0)
        for _ in range(6):  # through both tiers, and around the ring
            await service.PushBatch(encode_with_batch(PUSH_BATCH_FIELD, {
                "x": rng.random((2_000, 64)).astype("<f4"), "y": rng.integers(0, 9, 2_000)},
                "b"), _Context())
        reply = await service.Sample(_sample_request(batch_size, 5), _Context())
        on_loop = batch_size * WIDE.record_nbytes <= INLINE_BYTES
        assert (threads == [threading.get_ident()]) == on_loop
        expected = original(batch_size, 5)
        assert reply == encode_with_batch(SAMPLE_BATCH_FIELD, expected)
        registry.release_all()

    asyncio.run(main())


def test_a_small_push_that_waits_counts_its_bytes_like_a_large_one(tmp_path):
    from millpond_server.operations import Operations
    from millpond_server.owner import INLINE_BYTES
    from millpond_server.registry import Registry
    from millpond_server.service import ReplayService

    registry = Registry(tmp_path / "data")
    ops = Operations(registry, ThreadPoolExecutor(2), max_waiting_bytes=300_000)
    service = ReplayService(ops, 64)
    record = Schema.from_spec({"x": ("uint8", (150_000,))})

    def push(timeout: float) -> bytes:
        return encode_with_batch(PUSH_BATCH_FIELD, {"x": np.zeros((1, 150_000), np.uint8)}, "q",
                                 None, timeout)

    async def main():
        ops.start(asyncio.get_running_loop())
        ops.ready = True
        buffer, _ = registry.create("q", BufferConfig.build(capacity=1, fields=record, mode="queue"))
        assert len(push(5)) <= INLINE_BYTES  # runs on the loop
        await service.PushBatch(push(5), _Context())  # full now: the next ones wait
        parked = asyncio.create_task(service.PushBatch(push(5), _Context()))
        while not ops.info("q").waiting_inserts:
            await asyncio.sleep(0.01)
        with pytest.raises(AssertionError, match="RESOURCE_EXHAUSTED.*max-waiting-mb"):
            await service.PushBatch(push(5), _Context())  # (the context's abort raises)
        buffer.sample(1)  # room for the parked one
        assert (await parked).pushed == 2
        registry.release_all()

    asyncio.run(main())


def test_a_large_request_is_decoded_off_the_loop(tmp_path, monkeypatch):
    """Decoding megabytes of protobuf would stall every other call: a request over
    DECODE_ON_LOOP_BYTES is parsed on the engine pool, a small one on the loop."""
    from millpond_server import service as service_module

    registry, ops, service = _service(tmp_path)
    threads = []
    real = service_module._REQUESTS["Info"]

    def spy(raw):
        threads.append(threading.get_ident())
        return real(raw)

    monkeypatch.setitem(service_module._REQUESTS, "Info", spy)

    async def main():
        ops.start(asyncio.get_running_loop())
        ops.ready = True
        registry.create("b", BufferConfig(SCHEMA, 50, 200))
        await service.Info(pb.InfoRequest(name="b").SerializeToString(), _Context())
        large = pb.InfoRequest(name="b" * (service_module.DECODE_ON_LOOP_BYTES + 1))
        with pytest.raises(AssertionError, match="NOT_FOUND"):  # (no such buffer)
            await service.Info(large.SerializeToString(), _Context())
        loop_thread = threading.get_ident()
        assert threads[0] == loop_thread and threads[1] != loop_thread
        registry.release_all()

    asyncio.run(main())
