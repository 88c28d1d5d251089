"""Buffers with frames stored once (``frame_stack``, ``next_of``) under the operators' tools:
checkpoints and restores (core/snapshot.py, the Checkpoint RPC, ``millpond restore``) and
``millpond inspect`` (core/inspect.py), with bytes corrupted on disk.

(The frames themselves: tests/test_pixels.py.)
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import ServerProcess
from test_pixels import columns, fields_of, same, synthetic

import millpond
from millpond.core.buffer import TieredBuffer
from millpond.core.config import BufferConfig
from millpond.core.snapshot import Snapshot

NAMES = ("obs", "next_obs", "terminated")
FRAMES = dict(frame_stack={"obs": 0}, next_of={"next_obs": "obs"}, frame_capacity=2_000)


@pytest.fixture(scope="module")
def data():
    """600 transitions of three interleaved writers' 4-frame stacks, with resets."""
    return synthetic(np.random.default_rng(11), 600, padding="zero")


def pair(tmp_path, data, persistent=True, pushed=600, **kw):
    """A plain buffer and a frame buffer with the same ``pushed`` records."""
    config = dict(hot_capacity=50, total_capacity=200, fields=fields_of(data, NAMES), **kw)
    plain = TieredBuffer(BufferConfig.build(**config), tmp_path / "plain.buffer",
                         persistent=persistent)
    framed = TieredBuffer(BufferConfig.build(**config, **FRAMES), tmp_path / "framed.buffer",
                          persistent=persistent)
    push(data, [plain, framed], 0, pushed)
    return plain, framed


def push(data, buffers, lo, hi, batch=17):
    for start in range(lo, hi, batch):
        end = min(hi, start + batch)
        for buf in buffers:
            if not isinstance(buf, TieredBuffer):  # a handle
                buf.push_batch(**columns(data, start, end, NAMES))
                continue
            kw = {"episodes": data["episode"][start:end]} if buf.config.episodes else {}
            buf.push_batch(columns(data, start, end, NAMES), **kw)


def same_buffers(a, b, seeds=range(3)):
    same(a.contents(), b.contents())
    for seed in seeds:
        same(a.sample(32, seed), b.sample(32, seed))


def records(buf, seqs):
    """Records ``seqs`` of ``buf``, all live."""
    found = buf.read(np.asarray(seqs))
    assert found.pop("live").all()
    return found


def region(path, name):
    """``(offset, nbytes)`` of a region of a buffer file (see core/bufferfile.py)."""
    raw = path.read_bytes()
    length = struct.unpack_from("<I", raw, 16)[0]
    meta = json.loads(raw[128:128 + length])
    return meta["regions"][name], meta


def corrupt_frame(path, frame_id: int, source="obs") -> None:
    """Flip a byte of frame ``frame_id`` in the ring of a buffer file (a bad sector)."""
    (offset, _), meta = region(path, "frames:" + source)
    dtype, shape = meta["frame_regions"]["frames:" + source]
    frame_nbytes = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
    raw = bytearray(path.read_bytes())
    raw[offset + (frame_id % shape[0]) * frame_nbytes + 3] ^= 0x40
    path.write_bytes(bytes(raw))


def frame_ids(buf, seqs, name="obs"):
    """The stored frame ids of records ``seqs`` (the engine's own view)."""
    return buf._fifo.stored_rows(np.asarray(seqs), [name])[name]


# ---- checkpoints -------------------------------------------------------------------------

@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "in-memory"])
@pytest.mark.parametrize("kw", [{}, {"prioritized": True}, {"episodes": True}],
                         ids=["uniform", "prioritized", "episodes"])
def test_a_checkpoint_of_a_frame_buffer_restores_with_the_same_samples(tmp_path, data, persistent,
                                                                       kw):
    plain, framed = pair(tmp_path, data, persistent, **kw)
    result = framed.checkpoint(tmp_path / "snap")
    assert (result.records, result.first, result.pushed, result.dropped) == (200, 400, 600, 0)
    copy = TieredBuffer.open(result.path)  # every record and every frame checked
    assert copy.config.frame_stack == (("obs", 0),) and copy.config.frame_capacity == 2_000
    same_buffers(framed, copy)
    same_buffers(plain, copy)
    assert copy.info().stored_bytes == framed.info().stored_bytes
    assert copy.info().stored_bytes < copy.info().logical_bytes
    # the restored buffer goes on like the original: pushes, eviction, samples
    push(data, [plain, copy], 0, 300)
    same_buffers(plain, copy)
    copy.release()
    again = TieredBuffer.open(result.path)
    same_buffers(plain, again)
    again.close()


def test_a_checkpoint_of_a_frame_buffer_while_pushes_go_on(tmp_path, data):
    """Steps of 30 records, 40 pushed between them (the oldest of the cut evicted before
    their turn): the frame buffer's copy holds what the plain buffer's holds."""
    plain, framed = pair(tmp_path, data, pushed=300)
    nbytes = 30 * plain.schema.record_nbytes
    snaps = [Snapshot(buf, tmp_path / f"snap-{i}", step_bytes=nbytes)
             for i, buf in enumerate((plain, framed))]
    for snap in snaps:
        snap.create()
        snap.begin()
    pushed = [300]
    results = [None, None]
    while not all(results):
        push(data, [plain, framed], pushed[0], pushed[0] + 40, batch=40)
        pushed[0] += 40
        for i, snap in enumerate(snaps):
            if results[i] is None:
                step = snap.read()
                if step is None:
                    results[i] = snap.finish()
                else:
                    snap.write(step)
    a, b = results
    assert (a.records, a.first, a.pushed, a.dropped) == (b.records, b.first, b.pushed, b.dropped)
    assert 0 < b.records < 200 and b.dropped > 0 and b.damaged == 0
    copies = [TieredBuffer.open(r.path) for r in results]
    same_buffers(*copies)
    same(copies[1].contents(), columns(data, b.first, b.pushed, NAMES))
    for copy in copies:
        copy.release()


def test_a_damaged_frame_is_found_at_restore_and_isolates_its_records(tmp_path, data):
    plain, framed = pair(tmp_path, data)
    path = framed.checkpoint(tmp_path / "snap").path
    victim = int(frame_ids(framed, [500])[0, 3])  # record 500's newest frame
    users = np.flatnonzero(np.isin(frame_ids(framed, np.arange(400, 600)), victim).any(axis=1)
                           | np.isin(frame_ids(framed, np.arange(400, 600), "next_obs"),
                                     victim).any(axis=1)) + 400
    assert 500 in users and 1 < len(users) < 20
    corrupt_frame(Path(path), victim)
    with pytest.raises(millpond.CorruptFileError, match="fail their checks"):
        TieredBuffer.open(path)
    survivor = TieredBuffer.open(path, skip_corrupt=True)
    assert survivor.damaged_seqs().tolist() == users.tolist()
    live = np.setdiff1d(np.arange(400, 600), users)
    same(records(survivor, live), records(plain, live))
    same(survivor.contents(), records(plain, live))
    # a checkpoint of the survivor (a repair) drops them for good: its copy checks whole
    repaired = TieredBuffer.open(survivor.checkpoint(tmp_path / "repaired").path)
    same(repaired.contents(), records(plain, live))
    repaired.release()
    survivor.release()


def test_a_frame_damaged_in_a_live_buffer_drops_its_records_from_the_checkpoint(tmp_path, data):
    plain, framed = pair(tmp_path, data)
    victim = int(frame_ids(framed, [450])[0, 3])
    ring = framed._fifo.frames.rings[0]
    ring.frames[victim % ring.capacity].reshape(-1)[0] ^= 0xFF  # bit rot in a served frame
    users = np.flatnonzero(np.isin(frame_ids(framed, np.arange(400, 600)), victim).any(axis=1)
                           | np.isin(frame_ids(framed, np.arange(400, 600), "next_obs"),
                                     victim).any(axis=1)) + 400
    result = framed.checkpoint(tmp_path / "snap")
    assert result.damaged == len(users) > 0 and result.records == 200 - len(users)
    copy = TieredBuffer.open(result.path)
    # the older records are renumbered to close the gaps; their values are the plain ones
    same(copy.contents(), records(plain, np.setdiff1d(np.arange(400, 600), users)))
    copy.release()


@pytest.mark.daemon
def test_a_daemon_checkpoints_and_restores_a_frame_buffer(tmp_path, data):
    from millpond_server.backups import restore

    backups = tmp_path / "backups"
    fields = fields_of(data, NAMES)
    with ServerProcess(tmp_path / "data", "--backup-dir", str(backups)) as server:
        client = millpond.connect(server.address)
        kw = dict(hot_capacity=50, total_capacity=200, fields=fields)
        plain = client.create_buffer("plain", **kw)
        framed = client.create_buffer("framed", **kw, **FRAMES)
        push(data, [plain, framed], 0, 600)
        result = client.checkpoint("framed", "nightly/framed")
        assert (result.records, result.pushed, result.damaged) == (200, 600, 0)
        expected = [plain.sample(32, seed) for seed in range(3)]
    restore(result.path, tmp_path / "restored")
    with ServerProcess(tmp_path / "restored") as server:
        client = millpond.connect(server.address)
        buf = client.buffer("framed")
        assert client.info("framed").config.next_of == (("next_obs", "obs"),)
        for seed, sample in enumerate(expected):
            same(buf.sample(32, seed), sample)


# ---- millpond inspect ----------------------------------------------------------------------

def inspect_cli(path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "millpond_server", "inspect", str(path)],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout


def frame_file(tmp_path, data):
    """A persistent frame buffer's file (seqs 400..599 live) and the buffer, released."""
    _, framed = pair(tmp_path, data)
    ids = {name: frame_ids(framed, np.arange(400, 600), name) for name in ("obs", "next_obs")}
    framed.release()
    return tmp_path / "framed.buffer", ids


def users_of(ids, victims) -> list[int]:
    hit = np.zeros(200, bool)
    for column in ids.values():
        hit |= np.isin(column, victims).any(axis=1)
    return (np.flatnonzero(hit) + 400).tolist()


def test_inspect_a_healthy_frame_file(tmp_path, data):
    path, ids = frame_file(tmp_path, data)
    before = path.read_bytes()
    code, out = inspect_cli(path)
    assert code == 0, out
    assert "format    version 6" in out
    assert "schema    obs:|u1[4,3,5] next_obs:|u1[4,3,5] terminated:|b1" in out  # as pushed
    referred = len(np.unique(np.concatenate([c.reshape(-1) for c in ids.values()])))
    assert ("frames    obs: stacks of 4 along axis 0 (and next_obs next_of it); "
            "ring of 2,000 frames |u1[3,5]") in out
    assert (f"checks    {referred:,} frames of obs the records refer to checked "
            "(id and checksum): all pass") in out
    assert out.rstrip().endswith("status    healthy")
    assert path.read_bytes() == before  # nothing written


def test_inspect_names_damaged_frames_and_the_records_they_isolate(tmp_path, data):
    path, ids = frame_file(tmp_path, data)
    rotten = int(ids["obs"][100, 3])  # record 500's newest frame: its bytes flipped
    (offset, _), meta = region(path, "frameid:obs")
    gone = int(ids["obs"][150, 3])  # record 550's: its slot names another frame
    assert gone != rotten
    raw = bytearray(path.read_bytes())
    raw[offset + 8 * (gone % 2_000):offset + 8 * (gone % 2_000) + 8] = \
        struct.pack("<q", gone + 2_000)
    path.write_bytes(bytes(raw))
    corrupt_frame(path, rotten)
    code, out = inspect_cli(path)
    assert code == 1, out
    assert "checks    200 records checked (seq and checksum): all pass" in out
    assert (f"fail their id and checksum check: frames {', '.join(map(str, sorted([rotten, gone])))}"
            in out)
    users = users_of(ids, [rotten, gone])
    assert 500 in users and 550 in users and len(users) < 20
    assert (f"DAMAGED   {len(users)} records refer to a damaged frame (a reopen with "
            f"skip-corrupt leaves them out): seqs {', '.join(map(str, users))}") in out
    assert out.rstrip().endswith("status    DAMAGED")
    survivor = TieredBuffer.open(path, skip_corrupt=True)  # the reopen agrees
    assert survivor.damaged_seqs().tolist() == users
    survivor.release()


# ---- sharded buffers -------------------------------------------------------------------------

def test_each_shard_gets_frames_for_its_share():
    from millpond.core.frames import default_frame_capacity
    from millpond.sharded.placement import global_config, same_but_capacities, shard_configs

    fields = {"obs": ("uint8", (4, 3, 5)), "next_obs": ("uint8", (4, 3, 5))}
    frames = {"frame_stack": {"obs": 0}, "next_of": {"next_obs": "obs"}}
    default = BufferConfig.build(hot_capacity=100, total_capacity=1_001, fields=fields, **frames)
    parts = shard_configs(default, 2)
    assert [c.total_capacity for c in parts] == [501, 500]
    assert [c.frame_capacity for c in parts] == [default_frame_capacity(501),
                                                 default_frame_capacity(500)]
    given = BufferConfig.build(hot_capacity=100, total_capacity=1_001, fields=fields,
                               frame_capacity=3_000, **frames)
    parts = shard_configs(given, 2)
    assert [c.frame_capacity for c in parts] == [1_502, 1_499]  # 3,000 x 501 / 1,001, rounded up
    whole = global_config(parts)
    assert (whole.total_capacity, whole.frame_capacity) == (1_001, 3_001)
    assert same_but_capacities(parts[0], given) == []
    plain = BufferConfig.build(hot_capacity=100, total_capacity=1_001, fields=fields)
    assert [c.frame_capacity for c in shard_configs(plain, 2)] == [None, None]
    assert same_but_capacities(plain, given) != []  # (a difference, not an error)


@pytest.mark.daemon
def test_a_sharded_frame_buffer_over_two_daemons(tmp_path, data):
    from support import start_all

    servers = start_all([ServerProcess(tmp_path / f"shard{i}") for i in range(2)])
    try:
        addresses = [s.address for s in servers]
        client = millpond.connect(addresses, timeout=10)
        kw = dict(hot_capacity=60, total_capacity=301, fields=fields_of(data, NAMES))
        frames = dict(frame_stack={"obs": 0}, next_of={"next_obs": "obs"})
        default = client.create_buffer("default", **kw, **frames)
        assert [s.info.config.frame_capacity for s in default.info().shards] == [
            151 + 151 // 4 + 64, 150 + 150 // 4 + 64]  # each shard's own default
        # frames that rarely repeat (random resets, 3 interleaved writers cut in batches of
        # 20 between the shards): 2 k (records + push) per shard suffices
        plain = client.create_buffer("plain", **kw)
        framed = client.create_buffer("framed", **kw, **frames, frame_capacity=3_000)
        assert [s.info.config.frame_capacity for s in framed.info().shards] == [
            -(-3_000 * 151 // 301), -(-3_000 * 150 // 301)] == [1_505, 1_496]
        assert framed.info().config.frame_capacity == 3_001  # (the shares, rounded up)
        # two writers each, one per shard
        writers = {name: sorted((client.buffer(name) for _ in range(2)),
                                key=lambda h: h.backend.shard) for name in ("plain", "framed")}
        for lo in range(0, 600, 20):
            for name in writers:
                writers[name][lo // 20 % 2].push_batch(**columns(data, lo, lo + 20, NAMES))
        for seed in range(3):
            same(plain.sample(32, seed), framed.sample(32, seed))
        info = framed.info()
        assert [s.info.size for s in info.shards] == [151, 150]
        for part in info.shards:
            assert part.info.stored_bytes < part.info.logical_bytes
        again = millpond.connect(addresses[::-1], timeout=10).create_buffer(
            "framed", **kw, **frames, frame_capacity=3_000)
        assert len(again) == 301
        with pytest.raises(millpond.ConfigMismatchError, match="frame_capacity"):
            client.create_buffer("framed", **kw, **frames, frame_capacity=5_000)
    finally:
        for server in servers:
            server.stop()


# ---- pushes: the predicted frames are checked, never trusted ----------------------------------

@pytest.mark.parametrize("pattern", ["steps", "chains"])
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_near_misses_of_the_predicted_frames_are_stored_apart(pattern, dtype):
    """Streams whose stacks line up but for one byte (or -0.0 for 0.0) here and there:
    pushed a step of 8 streams at a time, or 12 consecutive records of one stream at a
    time; every value reads back exactly, and equal frames are still shared."""
    rng = np.random.default_rng(5)
    k, shape, streams, steps = 4, (6, 7), 8, 60
    frames = rng.integers(0, 3, (streams, steps + k, *shape)).astype(dtype)
    obs = np.stack([frames[:, t:t + k] for t in range(steps)], axis=1)  # [streams, t, k, ...]
    nxt = np.stack([frames[:, t + 1:t + 1 + k] for t in range(steps)], axis=1)
    flip = rng.random((streams, steps)) < 0.2
    for s, t in zip(*np.nonzero(flip)):  # a near miss of one of the predictions
        which = rng.integers(3)
        target = (obs if which == 0 else nxt)[s, t]
        j = rng.integers(k)
        if dtype == "float32" and which == 2:
            target[j].reshape(-1)[:] = np.where(target[j].reshape(-1) == 0, -0.0, 1)
        else:
            target[j].reshape(-1)[-1] += 1
    fields = {"obs": (dtype, (k, *shape)), "next_obs": (dtype, (k, *shape))}
    plain = TieredBuffer(BufferConfig.build(capacity=300, fields=fields))
    framed = TieredBuffer(BufferConfig.build(capacity=300, fields=fields, frame_capacity=3_000,
                                             frame_stack={"obs": 0},
                                             next_of={"next_obs": "obs"}))
    if pattern == "steps":
        batches = [(obs[:, t], nxt[:, t]) for t in range(steps)]
    else:
        batches = [(obs[s, t:t + 12], nxt[s, t:t + 12]) for t in range(0, steps, 12)
                   for s in range(streams)]
    for o, x in batches:
        for buf in (plain, framed):
            buf.push_batch({"obs": o, "next_obs": x})
    got, want = framed.contents(), plain.contents()
    for name in want:  # bytes, not values: -0.0 is not 0.0
        assert got[name].tobytes() == want[name].tobytes(), name
    info = framed.info()
    assert info.stored_bytes < 0.6 * info.logical_bytes  # still shared where equal


def test_large_frames_are_shared_and_read_back_exactly():
    """Frames of more than 4,096 words (raw Atari RGB, 210x160x3): fingerprinted whole."""
    rng = np.random.default_rng(8)
    frames = rng.integers(0, 256, (12, 210, 160, 3), np.uint8)
    frames[5] = frames[4]
    frames[6].reshape(-1)[-1] ^= 1  # differs from 7 in its last byte only
    frames[7] = frames[6]
    frames[7].reshape(-1)[-1] ^= 1
    obs = np.stack([frames[t:t + 2] for t in range(10)])
    nxt = np.stack([frames[t + 1:t + 3] for t in range(10)])
    fields = {"obs": ("uint8", (2, 210, 160, 3)), "next_obs": ("uint8", (2, 210, 160, 3))}
    buf = TieredBuffer(BufferConfig.build(capacity=20, fields=fields, frame_stack={"obs": 0},
                                          next_of={"next_obs": "obs"}))
    buf.push_batch({"obs": obs[:4], "next_obs": nxt[:4]})
    for t in range(4, 10):
        buf.push_batch({"obs": obs[t:t + 1], "next_obs": nxt[t:t + 1]})
    got = buf.contents()
    assert got["obs"].tobytes() == obs.tobytes() and got["next_obs"].tobytes() == nxt.tobytes()
    assert buf.info().stored_bytes < 12 * frames[0].nbytes  # 11 distinct frames, ids aside
