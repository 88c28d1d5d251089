"""Samples in the stored form (millpond.core.stored; issue 26): shared frames once,
compressed ones as stored, rebuilt by whoever reads them.

The engine's ``sample_stored`` draws exactly as the plain call with the same seed
(uniform, prioritized, sequences, n-step), for every combination of the options; a daemon
replies in that form to clients that ask (``stored_form`` in the request) and plainly to
those that do not (older clients); the client rebuilds the arrays, on every transport,
and refuses a stored-form reply that cannot be (tests/lying_daemon.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ServerProcess
from test_pixels import fields_of, same, synthetic

import millpond
from millpond.core.buffer import TieredBuffer
from millpond.core.config import BufferConfig
from millpond.core.stored import StoredBatch, StoredFormError
from millpond.errors import ProtocolError
from millpond.v1 import replay_pb2 as pb
from millpond.wire.frames import SAMPLE_BATCH_FIELD, decode_batch_field

FRAMES = {"frame_stack": {"obs": 0}, "next_of": {"next_obs": "obs"}}
COMBOS = {
    "frames": FRAMES,
    "frames-lz4": dict(FRAMES, compression="lz4"),
    "frames-zstd": dict(FRAMES, compression="zstd"),
    "lz4": dict(compression="lz4"),
}
KINDS = {
    "ram": dict(capacity=300, episodes=True),
    "tiered-prioritized": dict(hot_capacity=100, total_capacity=300, prioritized=True,
                               episodes=True),
}
LYING = str(Path(__file__).with_name("lying_daemon.py"))


def pixel_steps(n: int = 600, seed: int = 0) -> dict[str, np.ndarray]:
    """Transitions of frame stacks ``uint8[4, 32, 40]`` (frames of 1,280 bytes: large enough
    to be compressed) of interleaved episodes with resets."""
    rng = np.random.default_rng(seed)
    data = synthetic(rng, n, shape=(32, 40))
    data.update(actions=rng.integers(0, 4, n), rewards=rng.random(n).astype(np.float32),
                truncated=np.zeros(n, bool))
    return data


DATA = pixel_steps()
NAMES = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")


def push(buffer, data=DATA, batch=50):
    """Push ``data`` (a TieredBuffer with its episode ids; a handle as records only: its
    episodes are its own)."""
    for lo in range(0, len(data["obs"]), batch):
        cols = {name: data[name][lo:lo + batch] for name in NAMES}
        if isinstance(buffer, TieredBuffer):
            buffer.push_batch(cols, episodes=data["episode"][lo:lo + batch])
        else:
            buffer.push_batch(**cols)


# ---- the engine -------------------------------------------------------------------------

@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_stored_sample_rebuilds_the_plain_one_of_the_same_seed(kind, combo):
    config = dict(KINDS[kind], fields=fields_of(DATA, NAMES))
    plain = TieredBuffer(BufferConfig.build(**config))
    packed = TieredBuffer(BufferConfig.build(**config, **COMBOS[combo]))
    push(plain)
    push(packed)
    for seed in range(3):
        stored = packed.sample_stored(32, seed)
        same(plain.sample(32, seed), stored.rebuild(packed.schema))
        assert stored.nbytes < sum(a.nbytes for a in plain.sample(32, seed).values())
        windows = packed.sample_stored(4, seed, seq_len=8)
        same(plain.sample_sequences(4, 8, seed), windows.rebuild(packed.schema))
        # and through the wire form's columns
        again = StoredBatch.from_columns(windows.to_columns())
        assert again is not None
        same(plain.sample_sequences(4, 8, seed), again.rebuild(packed.schema))
    if "frames" in combo:  # a window of stacks reads each frame once: ~1 new frame a step
        windows = packed.sample_stored(4, 0, seq_len=8)
        assert len(windows.tables["obs"]) <= 4 * (8 + 3 + 1)


@pytest.mark.parametrize("combo", ["frames", "frames-zstd"])
@pytest.mark.parametrize("padding", ["reset", "zero", "noise"])
def test_stacks_on_another_axis_and_misaligned_ones(combo, padding):
    rng = np.random.default_rng(11)
    data = synthetic(rng, 400, shape=(32, 40), padding=padding)
    data.update(actions=rng.integers(0, 4, 400), rewards=rng.random(400).astype(np.float32),
                truncated=np.zeros(400, bool))
    data["obs"], data["next_obs"] = (np.ascontiguousarray(np.moveaxis(data[name], 1, 3))
                                     for name in ("obs", "next_obs"))
    options = dict(COMBOS[combo], frame_stack={"obs": 2}, frame_capacity=2 * 4 * 300)
    config = dict(hot_capacity=60, total_capacity=250, fields=fields_of(data, NAMES),
                  episodes=True)
    plain = TieredBuffer(BufferConfig.build(**config))
    packed = TieredBuffer(BufferConfig.build(**config, **options))
    push(plain, data)
    push(packed, data)
    for seed in range(3):
        same(plain.sample(32, seed), packed.sample_stored(32, seed).rebuild(packed.schema))
        same(plain.sample_sequences(3, 10, seed),
             packed.sample_stored(3, seed, seq_len=10).rebuild(packed.schema))


def test_n_step_samples_of_the_transition_schema():
    data = transition_steps()
    config = dict(capacity=300, obs_dim=512, act_dim=1, episodes=True)
    plain = TieredBuffer(BufferConfig.build(**config))
    packed = TieredBuffer(BufferConfig.build(**config, **NEXT_LZ4))
    episodes = np.cumsum(data["terminated"]) - data["terminated"]
    for buffer in (plain, packed):
        buffer.push_batch(data, episodes=episodes)
    for seed in range(3):
        stored = packed.sample_stored(16, seed, n_step=3, gamma=0.9)
        same(plain.sample(16, seed, n_step=3, gamma=0.9), stored.rebuild(packed.schema))


# ---- a daemon: every transport, old clients -----------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A daemon holding a buffer of each combination (and a plain one), and a local
    plain buffer with the same pushes."""
    with ServerProcess(tmp_path_factory.mktemp("stored") / "data") as server:
        config = dict(capacity=300, fields=fields_of(DATA, NAMES), episodes=True)
        with millpond.connect(server.address, shm=False) as client:
            for name, combo in {"plain": {}, **COMBOS}.items():
                push(client.create_buffer(name, **config, **combo))
                client.buffer(name).flush()
            prioritized = dict(config, prioritized=True)
            for name, combo in {"prio-plain": {}, "prio-frames-zstd": COMBOS["frames-zstd"]}.items():
                push(client.create_buffer(name, **prioritized, **combo))
            steps = transition_steps()
            for name, combo in {"nstep-plain": {}, "nstep-lz4": NEXT_LZ4}.items():
                buffer = client.create_buffer(name, capacity=300, obs_dim=512, act_dim=1,
                                              episodes=True, **combo)
                buffer.push_batch(**steps)
                buffer.flush()
        local = TieredBuffer(BufferConfig.build(**config))
        push(local)
        yield server, local


def transition_steps(n: int = 400) -> dict[str, np.ndarray]:
    """Transitions of the reference schema with 2 KiB compressible observations."""
    rng = np.random.default_rng(3)
    obs = rng.integers(0, 3, (n, 512)).astype(np.float32)
    return dict(obs=obs, next_obs=np.roll(obs, -1, axis=0), actions=np.zeros((n, 1), np.float32),
                rewards=rng.random(n).astype(np.float32), terminated=rng.random(n) < 0.05,
                truncated=np.zeros(n, bool))


NEXT_LZ4 = dict(next_of={"next_obs": "obs"}, compression="lz4")


def windows(*samples):
    """Windows of two buffers without their episode ids (each buffer's handle makes its
    own)."""
    return [{k: v for k, v in sample.items() if k != "episode_ids"} for sample in samples]


@pytest.mark.daemon
@pytest.mark.parametrize("shm", [False, True], ids=["grpc", "shm"])
def test_a_daemon_returns_the_arrays_of_a_plain_buffer(served, shm):
    server, local = served
    with millpond.connect(server.address, shm=shm) as client:
        plain = client.buffer("plain")  # (its episodes: the handle's, not DATA's)
        for name in COMBOS:
            buffer = client.buffer(name)
            for seed in range(2):
                same(local.sample(4, seed), buffer.sample(4, seed))  # a message on a stream
                # (after the first, on a stream too where the stored form came small)
                same(local.sample(200, seed), buffer.sample(200, seed))
                same(*windows(plain.sample_sequences(4, 8, seed), buffer.sample_sequences(4, 8, seed)))


@pytest.mark.daemon
@pytest.mark.parametrize("shm", [False, True], ids=["grpc", "shm"])
def test_prioritized_and_n_step_samples_from_a_daemon(served, shm):
    server, _ = served
    with millpond.connect(server.address, shm=shm) as client:
        plain, packed = client.buffer("prio-plain"), client.buffer("prio-frames-zstd")
        nplain, npacked = client.buffer("nstep-plain"), client.buffer("nstep-lz4")
        for seed in range(2):
            same(plain.sample(32, seed), packed.sample(32, seed))
            same(*windows(plain.sample_sequences(4, 8, seed), packed.sample_sequences(4, 8, seed)))
            same(nplain.sample(16, seed, n_step=3, gamma=0.9),
                 npacked.sample(16, seed, n_step=3, gamma=0.9))
            same(nplain.sample(16, seed), npacked.sample(16, seed))


@pytest.mark.daemon
def test_the_asyncio_client_rebuilds_stored_samples(served):
    import millpond.aio as aio
    server, local = served

    async def main():
        async with aio.connect(server.address) as client:
            plain = await client.buffer("plain")
            for name in COMBOS:
                buffer = await client.buffer(name)
                for seed in range(2):
                    same(local.sample(4, seed), await buffer.sample(4, seed=seed))
                    same(local.sample(100, seed), await buffer.sample(100, seed=seed))
                    same(*windows(await plain.sample_sequences(4, 8, seed=seed),
                                  await buffer.sample_sequences(4, 8, seed=seed)))
            nplain, npacked = await client.buffer("nstep-plain"), await client.buffer("nstep-lz4")
            same(await nplain.sample(16, seed=1, n_step=3, gamma=0.9),
                 await npacked.sample(16, seed=1, n_step=3, gamma=0.9))
            pplain = await client.buffer("prio-plain")
            ppacked = await client.buffer("prio-frames-zstd")
            same(await pplain.sample(32, seed=1), await ppacked.sample(32, seed=1))

    asyncio.run(asyncio.wait_for(main(), 60))


def raw_sample(address: str, name: str, stored_form: bool) -> dict[str, np.ndarray]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/millpond.v1.Replay/Sample",
                                   request_serializer=pb.SampleRequest.SerializeToString,
                                   response_deserializer=None)
        reply = call(pb.SampleRequest(name=name, batch_size=32, seed=1, stored_form=stored_form),
                     timeout=30)
    return {k: np.array(v) for k, v in decode_batch_field(reply, SAMPLE_BATCH_FIELD).items()}


@pytest.mark.daemon
@pytest.mark.parametrize("combo", ["frames", "frames-zstd"])
def test_a_client_that_does_not_ask_gets_plain_arrays(served, combo):
    server, local = served
    plain = raw_sample(server.address, combo, stored_form=False)  # an older client's request
    assert not any(name.startswith("@") for name in plain)
    same(local.sample(32, 1), plain)
    stored = raw_sample(server.address, combo, stored_form=True)
    assert any(name.startswith("@") for name in stored)
    assert sum(a.nbytes for a in stored.values()) * 2 < sum(a.nbytes for a in plain.values())
    batch = StoredBatch.from_columns(stored)
    assert batch is not None
    same(local.sample(32, 1), batch.rebuild(local.schema))
    # a buffer without frame groups replies plainly to a client that asks
    assert not any(name.startswith("@") for name in raw_sample(server.address, "plain", True))


# ---- a daemon that lies ---------------------------------------------------------------------

@pytest.mark.daemon
@pytest.mark.parametrize("lie", ["stored-index", "stored-length", "stored-codec", "stored-size"])
def test_a_stored_form_reply_that_cannot_be_is_refused(tmp_path, lie):
    with ServerProcess(tmp_path / "data", env={"MILLPOND_LIE": lie}, script=LYING) as server:
        with millpond.connect(server.address, shm=False) as client:
            buffer = client.create_buffer("px", capacity=300, fields=fields_of(DATA, NAMES),
                                          episodes=True, **COMBOS["frames-lz4"])
            push(buffer)
            buffer.flush()
            for call in (lambda: buffer.sample(4), lambda: buffer.sample(300),
                         lambda: buffer.sample_sequences(4, 8)):
                with pytest.raises(ProtocolError, match=server.address):
                    call()


# ---- the rebuild trusts nothing ----------------------------------------------------------

def wire_forms() -> dict[str, tuple]:
    """A small stored-form sample of each combination, as the daemon sends it."""
    forms = {}
    config = dict(capacity=300, fields=fields_of(DATA, NAMES), episodes=True)
    for combo, options in COMBOS.items():
        buffer = TieredBuffer(BufferConfig.build(**config, **options))
        push(buffer)
        forms[combo] = (buffer.schema, buffer.sample_stored(6, 0).to_columns(),
                        buffer.sample(6, 0))
    return forms


FORMS = wire_forms()


def mangle(columns: dict, how: str, rng: np.random.Generator) -> dict:
    columns = dict(columns)
    reserved = sorted(name for name in columns if name.startswith("@"))
    name = reserved[int(rng.integers(len(reserved)))]
    column = columns[name].copy()
    if how == "value" and column.size:
        flat = column.reshape(-1).view(np.uint8)
        flat[int(rng.integers(len(flat)))] ^= np.uint8(1 << int(rng.integers(8)))
    elif how == "big value" and column.size:
        column.reshape(-1)[int(rng.integers(column.size))] = np.iinfo(column.dtype).max \
            if column.dtype.kind in "iu" else 0
    elif how == "negative" and column.dtype.kind == "i" and column.size:
        column.reshape(-1)[int(rng.integers(column.size))] = -int(rng.integers(2, 1 << 20))
    elif how == "dtype":
        column = column.astype(np.int64 if column.dtype != np.int64 else np.int32)
    elif how == "short":
        column = column[:-1]
    elif how == "shape":
        column = column.reshape(-1)
    elif how == "drop":
        del columns[name]
        return columns
    elif how == "rename":
        del columns[name]
        columns[name.replace(":", "::", 1) if rng.random() < 0.5 else "@zip" + name[4:]] = column
        return columns
    columns[name] = column
    return columns


MANGLINGS = ["value", "big value", "negative", "dtype", "short", "shape", "drop", "rename"]


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("how", MANGLINGS)
def test_a_mangled_stored_form_is_refused_or_rebuilt_to_the_shapes_asked(combo, how):
    """Never another exception, never a wrong dtype or shape: a StoredFormError (the client
    turns it into ProtocolError), or arrays that fit (a flipped pixel is data, and passes)."""
    schema, columns, plain = FORMS[combo]
    for seed in range(40):
        mangled = mangle(columns, how, np.random.default_rng(seed))
        try:
            batch = StoredBatch.from_columns(mangled)
            assert batch is not None
            rebuilt = batch.rebuild(schema)
        except StoredFormError:
            continue
        for name, array in rebuilt.items():
            if name in schema.names and name in plain:
                assert array.dtype == plain[name].dtype, (how, name)
                assert array.shape[1:] == plain[name].shape[1:], (how, name)


def test_a_zstd_blob_claiming_more_than_a_frame_is_refused_before_it_is_decompressed():
    import zstandard
    schema, columns, _ = FORMS["frames-zstd"]
    bomb = np.frombuffer(zstandard.ZstdCompressor().compress(bytes(16 << 20)), np.uint8)
    assert len(bomb) < 1280  # 16 MB from a blob shorter than a frame
    lens = columns["@lens:obs"].copy()
    data = columns["@zstd:obs"]
    columns = {**columns, "@zstd:obs": np.concatenate([bomb, data[int(lens[0]):]]),
               "@lens:obs": np.concatenate([[len(bomb)], lens[1:]]).astype(lens.dtype)}
    batch = StoredBatch.from_columns(columns)
    assert batch is not None
    with pytest.raises(StoredFormError, match="header"):
        batch.rebuild(schema)


@pytest.mark.parametrize("combo", ["frames-lz4", "frames-zstd", "lz4"])
def test_tables_decompressed_on_threads_rebuild_the_same(monkeypatch, combo):
    import millpond.core.stored as stored
    schema, columns, plain = FORMS[combo]
    monkeypatch.setattr(stored, "PARALLEL_FRAMES", 1)  # every table on two threads
    batch = StoredBatch.from_columns(columns)
    assert batch is not None
    same(plain, batch.rebuild(schema))


@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 70_000), level=st.integers(-5, 5), checksum=st.booleans(),
       content_size=st.booleans(), cut=st.integers(0, 20),
       flips=st.lists(st.tuples(st.integers(0, 17), st.integers(0, 255)), max_size=3))
def test_zstd_header_sizes_read_at_once_agree_with_zstandard(size, level, checksum,
                                                            content_size, cut, flips):
    """zstd_content_sizes (every blob's header at once, for the check before decompressing)
    says what zstandard.frame_content_size says of each blob (-1 for its errors), on
    frames of any size and settings, with bytes of their headers changed and cut short."""
    import zstandard

    from millpond.core.stored import zstd_content_sizes
    blob = bytearray(zstandard.ZstdCompressor(
        level=level, write_checksum=checksum, write_content_size=content_size,
        write_dict_id=False).compress(bytes(range(256)) * (size // 256) + bytes(size % 256)))
    for at, value in flips:
        if at < len(blob):
            blob[at] = value
    blobs = [bytes(blob), bytes(blob[:cut]) or b"\x00", bytes(blob[:len(blob) - cut]) or b"\x00"]

    def reference(b: bytes) -> int:
        try:
            size = zstandard.frame_content_size(b)
            return size if size < 1 << 63 else -1  # (no frame holds that much)
        except zstandard.ZstdError:
            return -1
    data = np.frombuffer(b"junk" + b"".join(blobs), np.uint8)
    lens = np.array([len(b) for b in blobs], np.int64)
    starts = 4 + np.cumsum(lens) - lens
    expected = [reference(b) for b in blobs]
    found = zstd_content_sizes(data, starts, lens).tolist()
    for b, want, got in zip(blobs, expected, found):
        if int.from_bytes(b[:4], "little") & 0xFFFFFFF0 == 0x184D2A50:  # skippable: no size
            assert got == -1
        else:
            assert got == want, (b[:18].hex(), want, got)
