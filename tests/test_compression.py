"""Large fields stored compressed (``compression=``: millpond.core.codecs, millpond.core.arena).

The same pushes into a plain buffer and into buffers with each combination of the options
(frame_stack/next_of x lz4/zstd) give the same samples, reads and contents: across
eviction, tiers, prioritized and episodic draws, reopen, SIGKILL and restart, and through
a real daemon on each transport. The byte ring is checked against a model.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import ServerProcess, wait_until
from test_pixels import KINDS, TRANSITION, columns, compare, fields_of, push_both, same, synthetic

import millpond
from millpond.core.arena import Arena, place
from millpond.core.buffer import TieredBuffer
from millpond.core.codecs import Codec
from millpond.core.config import BufferConfig
from millpond.wire.codec import config_from_proto, config_to_proto

FRAMES = {"frame_stack": {"obs": 0}, "next_of": {"next_obs": "obs"}}
COMBOS = {
    "lz4": dict(compression="lz4"),
    "zstd": dict(compression="zstd"),
    "frames+lz4": dict(FRAMES, compression="lz4"),
    "frames+zstd9": dict(FRAMES, compression={"obs": ("zstd", 9)}),
}


@pytest.fixture(scope="module")
def atari():
    """Real Atari steps, recorded once per module: Pong with gymnasium's padding (the
    first frame repeated), Breakout with SB3's (zero frames)."""
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    import atari_frames
    return {"Pong": atari_frames.record("Pong", 1200, seed=3, padding="reset", max_steps=300),
            "Breakout": atari_frames.record("Breakout", 1000, seed=4, padding="zero",
                                            max_steps=200)}


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("game", ["Pong", "Breakout"])
def test_atari_pushes_read_back_as_a_plain_buffer_does(atari, tmp_path, game, kind, combo):
    data = atari[game]
    config = dict(KINDS[kind], fields=fields_of(data))
    plain = TieredBuffer(BufferConfig.build(**config), tmp_path / "plain")
    packed = TieredBuffer(BufferConfig.build(**config, **COMBOS[combo]), tmp_path / "packed")
    push_both([plain, packed], data, episodes=kind == "episodes")
    compare(plain, packed, n_step=kind == "episodes")
    info = packed.info()
    assert info.logical_bytes == plain.info().stored_bytes
    if "frame_stack" in COMBOS[combo]:  # sharing and compression: at most 1/40
        assert info.stored_bytes * 40 <= info.logical_bytes, info.stored_bytes
    else:
        assert info.stored_bytes * 8 <= info.logical_bytes, info.stored_bytes
    plain.close()
    packed.close()


@pytest.mark.parametrize("combo", COMBOS)
def test_atari_reopen_and_eviction_after_it(atari, tmp_path, combo):
    data = atari["Pong"]
    config = dict(hot_capacity=150, total_capacity=500, fields=fields_of(data), episodes=True)
    plain = TieredBuffer(BufferConfig.build(**config), tmp_path / "p.buffer", persistent=True)
    packed = TieredBuffer(BufferConfig.build(**config, **COMBOS[combo]), tmp_path / "c.buffer",
                          persistent=True)
    half = {key: value[:700] for key, value in data.items()}
    rest = {key: value[700:] for key, value in data.items()}
    push_both([plain, packed], half, episodes=True)
    plain.release()
    packed.release()
    assert (tmp_path / "c.buffer").read_bytes()[8] == 7  # format 7: compressed rings
    plain, packed = TieredBuffer.open(tmp_path / "p.buffer"), TieredBuffer.open(tmp_path / "c.buffer")
    assert packed.config.compression == BufferConfig.build(**config, **COMBOS[combo]).compression
    compare(plain, packed, n_step=True)
    push_both([plain, packed], rest, batch=50, episodes=True)  # evicts what was reopened
    compare(plain, packed, n_step=True)
    plain.close()
    packed.close()


def test_the_file_grows_with_what_is_written_and_plain_files_keep_their_format(tmp_path):
    fields = {"obs": ("uint8", (4, 84, 84)), "next_obs": ("uint8", (4, 84, 84))}
    made = {}
    for label, options in (("plain", {}), ("frames", FRAMES),
                           ("zstd", dict(FRAMES, compression="zstd"))):
        made[label] = TieredBuffer(BufferConfig.build(
            hot_capacity=100, total_capacity=2000, fields=fields, **options),
            tmp_path / label, persistent=True)
        made[label].push_batch({"obs": np.zeros((10, 4, 84, 84), np.uint8),
                                "next_obs": np.zeros((10, 4, 84, 84), np.uint8)})
        made[label].release()
    versions = {label: (tmp_path / label).read_bytes()[8] for label in made}
    assert versions == {"plain": 5, "frames": 6, "zstd": 7}
    stat = os.stat(tmp_path / "zstd")
    ring = 2564 * 84 * 84  # the default: its frames' plain bytes (see frames.default_compressed_bytes)
    assert stat.st_size > ring
    if stat.st_blocks * 512 < stat.st_size:  # a file system with sparse files
        assert stat.st_blocks * 512 < ring / 10
    assert len(TieredBuffer.open(tmp_path / "zstd")) == 10


@pytest.mark.parametrize("padding", ["reset", "zero", "noise"])
@pytest.mark.parametrize("combo", COMBOS)
def test_misaligned_stacks_and_incompressible_values_come_back_exactly(tmp_path, padding, combo):
    rng = np.random.default_rng(11)
    data = synthetic(rng, 500, shape=(32, 40), padding=padding)
    if padding == "noise":  # values that do not shrink are stored raw
        data["obs"][::3] = rng.integers(0, 256, data["obs"][::3].shape, np.uint8)
    names = ("obs", "next_obs", "terminated")
    fields = fields_of(data, names)
    plain = TieredBuffer(BufferConfig.build(hot_capacity=50, total_capacity=200, fields=fields),
                         tmp_path / "p")
    packed = TieredBuffer(BufferConfig.build(hot_capacity=50, total_capacity=200, fields=fields,
                                             frame_capacity=(200 + 17) * 8, **COMBOS[combo]),
                          tmp_path / "c")
    for lo in range(0, 500, 17):
        for buf in (plain, packed):
            buf.push_batch(columns(data, lo, lo + 17, names))
        same(plain.contents(), packed.contents())
    compare(plain, packed)


def test_a_push_that_does_not_fit_the_compressed_ring_changes_nothing():
    rng = np.random.default_rng(0)
    fields = {"img": ("uint8", (32, 32)), "a": ("int64", ())}
    buf = TieredBuffer(BufferConfig.build(capacity=50, fields=fields, compression="lz4",
                                          compressed_bytes=8 * 1024))
    noise = rng.integers(0, 256, (8, 32, 32), np.uint8)  # stored raw: 1 KiB each
    buf.push_batch({"img": noise[:7], "a": np.arange(7)})
    before = buf.contents()
    with pytest.raises(millpond.StorageFullError, match="compressed_bytes"):
        buf.push_batch({"img": noise[:2], "a": np.arange(2)})
    same(before, buf.contents())
    assert buf.pushed == 7
    buf.push_batch({"img": np.zeros((1, 32, 32), np.uint8), "a": np.arange(1)})  # small: fits
    assert buf.pushed == 8


def test_a_checkpoint_of_a_compressed_buffer_copies_its_blobs_as_stored(tmp_path):
    """A checkpoint copies each blob as stored (not decompressed and compressed again), at
    its offset; the copy reads back the same values. (Checkpoints of compressed buffers
    in full: tests/test_compression_ops.py.)"""
    rng = np.random.default_rng(2)
    imgs = rng.integers(0, 3, (30, 32, 32), np.uint8)
    imgs[::4] = rng.integers(0, 256, (8, 32, 32), np.uint8)  # stored raw
    buf = TieredBuffer(BufferConfig.build(capacity=20, fields={"img": ("uint8", (32, 32))},
                                          compression="lz4"))
    buf.push_batch({"img": imgs})
    result = buf.checkpoint(tmp_path / "copy.mpb")
    assert (result.path, result.records, result.first, result.damaged) == (
        str(tmp_path / "copy.mpb.buffer"), 20, 10, 0)
    copy = TieredBuffer.open(result.path)
    ring, source = copy._fifo.frames.rings[0], buf._fifo.frames.rings[0]  # type: ignore[union-attr]
    for frame_id in range(10, 30):
        assert bytes(ring.blob(frame_id)) == bytes(source.blob(frame_id))
        assert ring.offs[frame_id % ring.capacity] == source.offs[frame_id % source.capacity]
    np.testing.assert_array_equal(copy.contents()["img"], imgs[10:])
    copy.close()


def test_config_checks_and_round_trips(tmp_path):
    fields = {"obs": ("uint8", (4, 32, 32)), "next_obs": ("uint8", (4, 32, 32)),
              "img": ("float32", (300,)), "a": ("int64", ())}
    for options in [dict(compression="zstd"), dict(FRAMES, compression="lz4"),
                    dict(FRAMES, compression={"obs": {"codec": "zstd", "level": 5},
                                              "img": "lz4"}, compressed_bytes=1 << 20)]:
        config = BufferConfig.build(capacity=10, fields=fields, **options)
        assert config_from_proto(config_to_proto(config)) == config
        assert BufferConfig.from_file_meta(
            {**config.sampling_meta(), "hot_capacity": 10, "total_capacity": 10},
            config.stored_schema) == config
    assert BufferConfig.build(capacity=10, fields=fields, **FRAMES, compression="zstd").compression \
        == (("img", "zstd", -1), ("obs", "zstd", -1))  # large units only: frames, img; not "a"
    assert BufferConfig.build(capacity=10, fields={"a": ("int64", ())},
                              compression="zstd").compression == ()
    bad = [dict(compression="gzip"), dict(compression=("zstd", 23)), dict(compression=("lz4", -1)),
           dict(compression=("zstd", True)), dict(compression={"a": "zstd"}),
           dict(compression={"nope": "zstd"}), dict(compression=5),
           dict(FRAMES, compression={"next_obs": "zstd"}),
           dict(compression={"img": {"codec": "zstd", "speed": 1}}),
           dict(compressed_bytes=1 << 20), dict(compression="zstd", compressed_bytes=100),
           dict(compression="zstd", compressed_bytes=True)]
    for options in bad:
        with pytest.raises(millpond.InvalidConfigError):
            BufferConfig.build(capacity=10, fields=fields, **options)


def test_toml_declares_compression(tmp_path):
    from millpond_server.declared import load_buffers

    path = tmp_path / "buffers.toml"
    path.write_text('[[buffers]]\nname = "px"\ncapacity = 100\nframe_stack = { obs = 0 }\n'
                    'next_of = { next_obs = "obs" }\ncompression = { obs = ["zstd", 7] }\n'
                    'compressed_bytes = 1048576\n'
                    '[buffers.fields]\nobs = { dtype = "uint8", shape = [4, 32, 32] }\n'
                    'next_obs = { dtype = "uint8", shape = [4, 32, 32] }\n')
    (spec,) = load_buffers(path)
    assert spec.config.compression == (("obs", "zstd", 7),)
    assert spec.config.compressed_bytes == 1 << 20


def test_a_damaged_blob_is_found_at_reopen_and_can_be_skipped(tmp_path):
    fields = {"img": ("uint8", (40, 40)), "a": ("int64", ())}
    path = tmp_path / "c.buffer"
    buf = TieredBuffer(BufferConfig.build(capacity=20, fields=fields, compression="zstd"), path,
                       persistent=True)
    imgs = np.stack([np.full((40, 40), i, np.uint8) for i in range(12)])
    imgs[:, ::7] = 200
    buf.push_batch({"img": imgs, "a": np.arange(12)})
    buf.release()
    raw = bytearray(path.read_bytes())
    at = raw.rfind(buf_blob := _blob_of(path, 5))
    assert at > 0
    raw[at + len(buf_blob) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(millpond.CorruptFileError, match="1 of 12 live records"):
        TieredBuffer.open(path)
    again = TieredBuffer.open(path, skip_corrupt=True)
    got = again.contents()
    assert got["a"].tolist() == [i for i in range(12) if i != 5]
    np.testing.assert_array_equal(got["img"], np.delete(imgs, 5, axis=0))
    again.close()


def _blob_of(path, frame_id: int) -> bytes:
    buf = TieredBuffer.open(path)
    try:
        ring = buf._fifo.frames.rings[0]  # type: ignore[union-attr]
        return bytes(ring.blob(frame_id))
    finally:
        buf.release()


# ---- the byte ring against a model ----------------------------------------------------------

@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limit=st.sampled_from([64, 128, 256, 512, 1024]), grow=st.booleans(),
       steps=st.lists(st.tuples(st.lists(st.integers(1, 48), max_size=6), st.integers(0, 5)),
                      min_size=1, max_size=40))
def test_the_byte_ring_keeps_every_live_blob_against_a_model(limit, grow, steps):
    """Pushes of blobs (ids in order) and frees from the head (in order), in a ring
    that starts at its limit or grows from 64 bytes: every live blob reads back as
    written; a push is refused only when the live bytes, the new ones and at most a
    blob's worth of skipped end per lap do not fit the limit."""
    size = 48  # the values' size: a blob of 48 bytes is a raw value
    capacity = 64
    arena = Arena.in_memory(capacity, limit, Codec("lz4", 0), size, lap=64 if grow else limit)
    model: dict[int, bytes] = {}  # live id -> its stored bytes
    head = tail = 0
    rng = np.random.default_rng(len(steps))
    for sizes, frees in steps:
        head = min(tail, head + frees)
        for i in [i for i in model if i < head]:
            del model[i]
        blobs = [rng.integers(0, 256, n, np.uint8).tobytes() for n in sizes]
        if tail + len(blobs) - head > capacity:
            continue
        lap = arena.lap
        try:
            prepared = arena.prepare(blobs, head, tail, "x")
        except millpond.StorageFullError:
            live = sum(len(b) for b in model.values())
            assert live + sum(sizes) + 2 * size > limit  # refused only when short
            continue
        assert arena.lap == lap  # prepare changes nothing
        arena.write(tail, prepared)
        for j, blob in enumerate(blobs):
            model[tail + j] = blob
        tail += len(blobs)
        for i, blob in model.items():
            assert bytes(arena.blob(i)) == blob
        assert arena.stored_nbytes(head, tail) >= sum(len(b) for b in model.values())
        assert arena.lap <= limit and len(arena.data) == arena.lap
    offsets, end = place(arena.end, limit, [limit])
    assert offsets[0] % limit == 0 and end == offsets[0] + limit  # a whole ring: from a lap's start


def test_a_ring_in_a_file_grows_and_reopens(tmp_path):
    rng = np.random.default_rng(3)
    fields = {"img": ("uint8", (64, 64)), "a": ("int64", ())}
    path = tmp_path / "g.buffer"
    buf = TieredBuffer(BufferConfig.build(capacity=400, fields=fields, compression="lz4"), path,
                       persistent=True)
    ring = buf._fifo.frames.rings[0]  # type: ignore[union-attr]
    first = ring.lap
    imgs = rng.integers(0, 256, (600, 64, 64), np.uint8)  # raw: 4 KiB each
    for lo in range(0, 600, 50):
        buf.push_batch({"img": imgs[lo:lo + 50], "a": np.arange(lo, lo + 50)})
    assert ring.lap > first  # 400 live raw values: more than its first MiB
    lap = ring.lap
    buf.release()
    again = TieredBuffer.open(path)
    assert again._fifo.frames.rings[0].lap == lap  # type: ignore[union-attr]
    got = again.contents()
    np.testing.assert_array_equal(got["img"], imgs[200:])
    again.push_batch({"img": imgs[:100], "a": np.arange(100)})
    np.testing.assert_array_equal(again.contents()["img"], np.concatenate([imgs[300:], imgs[:100]]))
    again.close()


def test_reads_decompress_on_threads_and_raw_values_pass_through():
    size = 64 << 10  # large values: (de)compressed on threads
    arena = Arena.in_memory(512, 512 * size, Codec("zstd", 3), size)
    rng = np.random.default_rng(1)
    values = rng.integers(0, 4, (300, size), np.uint8)
    values[::5] = rng.integers(0, 256, (60, size), np.uint8)  # raw
    blobs = arena.compress_many([v.tobytes() for v in values])  # on threads too
    assert sum(len(b) == size for b in blobs) == 60
    arena.write(0, arena.prepare(blobs, 0, 0, "x"))
    wanted = rng.permutation(300)[:200]
    out = arena.read(wanted)  # 200 >= PARALLEL_MIN values of PARALLEL_BYTES: on threads
    np.testing.assert_array_equal(out.reshape(200, size), values[wanted])


# ---- SIGKILL, restart, and every transport --------------------------------------------------

@pytest.mark.daemon
@pytest.mark.parametrize("combo", ["zstd", "frames+lz4"])
def test_a_daemon_serves_compressed_buffers_as_plain_ones_on_every_transport(atari, tmp_path,
                                                                             combo):
    data = {key: value[:800] for key, value in atari["Breakout"].items()}
    kw = dict(hot_capacity=150, total_capacity=500, fields=fields_of(data))
    local = TieredBuffer(BufferConfig.build(**kw))
    push_both([local], data)
    with ServerProcess(tmp_path / "data") as server:
        for shm in (False, True):
            with millpond.connect(server.address, shm=shm) as client:
                if not shm:
                    plain = client.create_buffer("plain", **kw)
                    packed = client.create_buffer("packed", **kw, **COMBOS[combo])
                    push_both([plain, packed], data)
                else:
                    plain, packed = client.buffer("plain"), client.buffer("packed")
                for seed in range(2):
                    same(local.sample(32, seed), packed.sample(32, seed))
                    same(plain.sample(32, seed), packed.sample(32, seed))
                seqs = np.arange(250, 520)
                same(local.read(seqs), packed.read(seqs))
                info = packed.info()
                assert info.config.compression == \
                    BufferConfig.build(**kw, **COMBOS[combo]).compression
                assert info.stored_bytes * 8 <= info.logical_bytes
                if shm:
                    assert client.transport == "shm" or os.environ.get("MILLPOND_NO_SHM")
        server.stop(signal.SIGKILL)
    with ServerProcess(tmp_path / "data") as server:  # recovery after SIGKILL
        with millpond.connect(server.address) as client:
            packed = client.buffer("packed")
            same(local.sample(32, 5), packed.sample(32, 5))
            more = {key: value[800:] for key, value in atari["Breakout"].items()}
            push_both([local, packed], more)  # evicts what was recovered
            same(local.sample(32, 6), packed.sample(32, 6))
    local.close()


def noise_records(n: int) -> dict[str, np.ndarray]:
    """Records whose 4 KiB images do not compress (stored raw: the ring grows as it fills)."""
    rng = np.random.default_rng(9)
    return {"img": rng.integers(0, 256, (n, 64, 64), np.uint8), "a": np.arange(n),
            "terminated": np.zeros(n, bool)}


@pytest.mark.daemon
@pytest.mark.parametrize("case", ["atari", "growing"])
def test_pushes_killed_mid_way_leave_exactly_the_records_pushed_before(atari, tmp_path, case):
    """The daemon is SIGKILLed while a thread pushes: Atari transitions into a buffer with
    frames and compression, or incompressible images whose ring grows meanwhile. After
    the restart its records are the first ``pushed`` ones (at least every acknowledged
    push), each exactly as pushed, and it carries on."""
    if case == "atari":
        data = {name: atari["Pong"][name] for name in TRANSITION}
        kw = dict(hot_capacity=100, total_capacity=400, fields=fields_of(data),
                  **COMBOS["frames+lz4"])
    else:
        data = noise_records(1200)
        kw = dict(hot_capacity=100, total_capacity=400, fields=fields_of(data, list(data)),
                  compression="lz4")
    names, total = list(data), len(data["a" if case == "growing" else "obs"])
    acked = [0]
    interrupted = 0
    for trial in range(3):
        with ServerProcess(tmp_path / "data") as server:
            client = millpond.connect(server.address, timeout=5)
            buf = client.create_buffer("px", **kw)
            start = buf.info().pushed
            acked[0] = start

            def pusher(buf=buf, start=start) -> None:
                for lo in range(start, total, 10):
                    try:
                        buf.push_batch(**columns(data, lo, lo + 10, names))
                    except millpond.ReplayError:
                        return
                    acked[0] = min(lo + 10, total)

            thread = threading.Thread(target=pusher)
            thread.start()
            # (capped: a fast machine may have pushed nearly everything before a kill)
            goal = min(total, start + (30 if case == "atari" else 100) * (trial + 1))
            wait_until(lambda goal=goal: acked[0] >= goal, timeout=60)
            server.stop(signal.SIGKILL)
            thread.join(30)
            client.close()
        stored = TieredBuffer.open(tmp_path / "data" / "px.buffer")
        pushed, got = stored.pushed, stored.contents()
        lap = stored._fifo.frames.rings[0].lap  # type: ignore[union-attr]
        stored.release()
        assert pushed >= acked[0]
        interrupted += pushed < total
        lo = max(0, pushed - 400)
        same(got, columns(data, lo, pushed, names))
    assert interrupted, "the kills must land while pushes go on"
    if case == "growing":
        assert lap >= 2 << 20  # 400 live images of 4 KiB: grown from its first MiB


@pytest.mark.daemon
def test_sharded_buffers_with_compression_sample_as_plain_ones(atari, shards):
    data = {key: value[:600] for key, value in atari["Pong"].items()}
    kw = dict(hot_capacity=90, total_capacity=300, fields=fields_of(data))
    with millpond.connect(shards, timeout=10) as client:
        plain = client.create_buffer("plain", **kw)
        packed = client.create_buffer("packed", **kw, **COMBOS["frames+zstd9"])
        # A handle writes to one shard, the next handle to the next: the same pushes
        # through three handles of each make every shard of both alike.
        writers = [plain, packed] + [client.buffer(name) for _ in range(2)
                                     for name in ("plain", "packed")]
        push_both(writers, data)
        assert len(plain) == len(packed) == 300
        for seed in range(2):
            same(plain.sample(32, seed), packed.sample(32, seed))
        info = packed.info()
        assert info.config.compression == (("obs", "zstd", 9),)
        assert info.stored_bytes * 40 <= info.logical_bytes
        plain.close()
        packed.close()


def test_the_public_classes_take_the_options_and_export_plain_arrays(tmp_path):
    rng = np.random.default_rng(2)
    data = synthetic(rng, 120, shape=(32, 40))
    fields = fields_of(data, ("obs", "next_obs", "terminated"))
    plain = millpond.ReplayBuffer(100, fields=fields)
    packed = millpond.MmapReplayBuffer(30, 100, fields=fields, cold_path=tmp_path / "c",
                                       compression={"obs": ("lz4", 3)},
                                       compressed_bytes=1 << 20, **FRAMES)
    for buf in (plain, packed):
        buf.push_batch(**columns(data, 0, 120, ("obs", "next_obs", "terminated")))
    assert packed.config.compression == (("obs", "lz4", 3),)
    a = np.load(plain.export(tmp_path / "p.npz"))
    b = np.load(packed.export(tmp_path / "c.npz"))
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name])
    plain.close()
    packed.close()


def test_float_fields_come_back_bit_for_bit():
    rng = np.random.default_rng(4)
    states = rng.normal(size=(200, 300)).astype(np.float32)
    states[::2, :150] = 0.0  # something to compress
    states[3, :5] = [-0.0, np.nan, np.inf, -np.inf, 1e-45]
    fields = {"state": ("<f4", (300,)), "big": (">f8", (2, 80))}
    big = rng.normal(size=(200, 2, 80)).astype(">f8")
    plain = TieredBuffer(BufferConfig.build(capacity=150, fields=fields))
    packed = TieredBuffer(BufferConfig.build(capacity=150, fields=fields,
                                             compression={"state": "zstd", "big": "lz4"}))
    for lo in range(0, 200, 23):
        for buf in (plain, packed):
            buf.push_batch({"state": states[lo:lo + 23], "big": big[lo:lo + 23]})
    got, want = packed.contents(), plain.contents()
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert got[name].tobytes() == want[name].tobytes()
    same(plain.sample(40, 1), packed.sample(40, 1))


@pytest.mark.daemon
def test_the_asyncio_client_creates_and_reads_compressed_buffers(tmp_path):
    import asyncio

    import millpond.aio as aio

    rng = np.random.default_rng(6)
    data = synthetic(rng, 150, shape=(32, 40))
    names = ("obs", "next_obs", "terminated")
    fields = fields_of(data, names)
    local = TieredBuffer(BufferConfig.build(capacity=100, fields=fields))
    local.push_batch(columns(data, 0, 150, names))

    async def main():
        async with aio.connect(server.address) as client:
            buf = await client.create_buffer("px", capacity=100, fields=fields,
                                             compression=("zstd", 1), **FRAMES)
            await buf.push_batch(**columns(data, 0, 150, names))
            assert (await buf.info()).config.compression == (("obs", "zstd", 1),)
            got = await buf.sample(16, seed=2)
            same(local.sample(16, 2), got)

    with ServerProcess(tmp_path / "data") as server:
        asyncio.run(asyncio.wait_for(main(), 60))
