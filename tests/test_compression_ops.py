"""Compressed buffers (``compression=``) under the operators' tools: checkpoints and
restores (core/snapshot.py, the Checkpoint RPC, ``millpond backup``/``restore``), ``millpond
inspect`` (core/inspect.py) with blob bytes corrupted on disk, and ``--max-data-gb``
counting what the (sparse) files take.

(Frame buffers without compression: tests/test_frames_ops.py; the compressed buffers
themselves: tests/test_compression.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from support import ServerProcess
from test_frames_ops import push, records, region, same_buffers
from test_pixels import columns, fields_of, same, synthetic

import millpond
from millpond.core.buffer import TieredBuffer
from millpond.core.config import BufferConfig
from millpond.core.footprint import disk_nbytes
from millpond.core.snapshot import Snapshot

NAMES = ("obs", "next_obs", "terminated")
FRAMES = dict(frame_stack={"obs": 0}, next_of={"next_obs": "obs"}, frame_capacity=2_000)
COMBOS = {
    "lz4": dict(compression="lz4"),  # obs and next_obs each a compressed group of values
    "frames+zstd": dict(FRAMES, compression="zstd"),
}
STORES = {"persistent": dict(hot_capacity=50, total_capacity=200, persistent=True),
          "tiered": dict(hot_capacity=50, total_capacity=200, persistent=False),
          "ram": dict(capacity=200, persistent=False)}  # no file: the rings in RAM


@pytest.fixture(scope="module")
def data():
    """600 transitions of three interleaved writers' 4-frame stacks of 32x40 frames (large
    enough to be compressed), with resets."""
    return synthetic(np.random.default_rng(11), 600, shape=(32, 40), padding="zero")


def pair(tmp_path, data, combo="frames+zstd", store="persistent", pushed=600, **kw):
    """A plain buffer and a compressed one with the same ``pushed`` records."""
    options = dict(STORES[store])
    persistent = options.pop("persistent")
    config = dict(options, fields=fields_of(data, NAMES), **kw)
    plain = TieredBuffer(BufferConfig.build(**config), tmp_path / "plain.buffer",
                         persistent=persistent)
    packed = TieredBuffer(BufferConfig.build(**config, **COMBOS[combo]),
                          tmp_path / "packed.buffer", persistent=persistent)
    push(data, [plain, packed], 0, pushed)
    return plain, packed


def ring_of(buf, source="obs"):
    frames = buf._fifo.frames
    return frames.rings[frames.group_of[source]]


def users_of(buf, seqs, source, victims) -> np.ndarray:
    """The seqs among ``seqs`` whose values refer to a frame ``victims`` of ``source``'s ring."""
    frames = buf._fifo.frames
    group = frames.groups[frames.group_of[source]]
    ids = buf._fifo.stored_rows(np.asarray(seqs), list(group.fields))
    hit = np.zeros(len(seqs), bool)
    for name in group.fields:
        hit |= np.isin(ids[name], victims).any(axis=1)
    return np.asarray(seqs)[hit]


def frame_id(buf, seq, source="obs", column=-1) -> int:
    return int(buf._fifo.stored_rows(np.array([seq]), [source])[source][0, column])


def corrupt_blob(path: Path, buf, victim: int, source="obs") -> None:
    """Flip a byte in the middle of blob ``victim`` of ``source``'s ring in the file at
    ``path`` (``buf``: a buffer with the same ring, to find it)."""
    ring = ring_of(buf, source)
    slot = victim % ring.capacity
    at, length = int(ring.offs[slot]) % ring.lap, int(ring.lens[slot])
    (offset, _), _ = region(path, "framebytes:" + source)
    with open(path, "r+b") as f:  # (not a rewrite of the whole file: it stays sparse)
        f.seek(offset + at + length // 2)
        byte = f.read(1)[0]
        f.seek(offset + at + length // 2)
        f.write(bytes([byte ^ 0x40]))


def on_disk(path) -> tuple[int, int]:
    """``(blocks' bytes, size)`` of a file."""
    found = os.stat(path)
    return found.st_blocks * 512, found.st_size


# ---- checkpoints -------------------------------------------------------------------------

@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kw", [{}, {"prioritized": True}, {"episodes": True}],
                         ids=["uniform", "prioritized", "episodes"])
@pytest.mark.parametrize("combo", COMBOS)
def test_a_checkpoint_of_a_compressed_buffer_restores_with_the_same_samples(tmp_path, data,
                                                                            combo, store, kw):
    plain, packed = pair(tmp_path, data, combo, store, **kw)
    before = {name: ring_of(packed, name).lap for name in ("obs", "next_obs")
              if name in packed._fifo.frames.group_of}
    result = packed.checkpoint(tmp_path / "snap")
    assert (result.records, result.first, result.pushed, result.dropped) == (200, 400, 600, 0)
    copy = TieredBuffer.open(result.path)  # every record and every blob checked
    assert copy.config.compression == packed.config.compression
    for name, lap in before.items():  # the blobs at their offsets, in a ring of the same size
        assert ring_of(copy, name).lap == lap
    same_buffers(packed, copy)
    same_buffers(plain, copy)
    same(copy.read(np.arange(390, 605)), plain.read(np.arange(390, 605)))
    assert copy.info().stored_bytes == packed.info().stored_bytes
    assert copy.info().stored_bytes < copy.info().logical_bytes
    blocks, size = on_disk(result.path)
    if blocks < size:  # a file system with sparse files: the rings take what they store
        assert blocks < size / 2
    # the restored buffer goes on like the original: pushes, eviction, samples
    push(data, [plain, copy], 0, 300)
    same_buffers(plain, copy)
    copy.release()
    again = TieredBuffer.open(result.path)
    same_buffers(plain, again)
    again.close()


def noise(n: int, seed: int = 9) -> dict[str, np.ndarray]:
    """Records whose 4 KiB images do not compress (stored raw: a ring grows as it fills)."""
    rng = np.random.default_rng(seed)
    return {"img": rng.integers(0, 256, (n, 64, 64), np.uint8), "a": np.arange(n)}


def test_a_checkpoint_while_pushes_go_on_and_the_ring_grows(tmp_path):
    """Steps of 30 records, 40 pushed between them: the source's ring doubles meanwhile
    and the oldest records of the cut are evicted before their turn. The compressed
    buffer's copy holds exactly what the plain buffer's holds."""
    records_ = noise(700)
    fields = {"img": ("uint8", (64, 64)), "a": ("int64", ())}
    config = dict(hot_capacity=50, total_capacity=400, fields=fields)
    plain = TieredBuffer(BufferConfig.build(**config), tmp_path / "plain", persistent=True)
    packed = TieredBuffer(BufferConfig.build(**config, compression="lz4"), tmp_path / "packed",
                          persistent=True)
    for buf in (plain, packed):
        buf.push_batch({name: column[:250] for name, column in records_.items()})
    ring = ring_of(packed, "img")
    lap = ring.lap
    nbytes = 30 * plain.schema.record_nbytes
    snaps = [Snapshot(buf, tmp_path / f"snap-{i}", step_bytes=nbytes)
             for i, buf in enumerate((plain, packed))]
    for snap in snaps:
        snap.create()
        snap.begin()
    pushed = 250
    results: list = [None, None]
    while not all(results):
        for buf in (plain, packed):
            buf.push_batch({name: column[pushed:pushed + 40] for name, column in records_.items()})
        pushed += 40
        for i, snap in enumerate(snaps):
            if results[i] is None:
                step = snap.read()
                if step is None:
                    results[i] = snap.finish()
                else:
                    snap.write(step)
    assert ring.lap == 2 * lap  # it grew while the copy went on
    a, b = results
    assert (a.records, a.first, a.pushed, a.dropped) == (b.records, b.first, b.pushed, b.dropped)
    assert 0 < b.records < 250 and b.dropped > 0 and b.damaged == 0
    copies = [TieredBuffer.open(r.path) for r in results]
    assert ring_of(copies[1], "img").lap == lap  # its size at the cut
    same_buffers(*copies)
    np.testing.assert_array_equal(copies[1].contents()["img"], records_["img"][b.first:b.pushed])
    copies[1].push_batch({name: column[:300] for name, column in noise(300, 4).items()})
    np.testing.assert_array_equal(copies[1].contents()["img"][-300:], noise(300, 4)["img"])
    for copy in copies:
        copy.release()


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("damage", ["bytes", "length"])
def test_a_blob_damaged_in_a_live_buffer_drops_exactly_its_records_from_the_checkpoint(
        tmp_path, data, combo, damage):
    plain, packed = pair(tmp_path, data, combo)
    victim = frame_id(packed, 450)
    ring = ring_of(packed)
    slot = victim % ring.capacity
    if damage == "bytes":  # bit rot in a served blob: it fails its checksum
        ring.data[int(ring.offs[slot]) % ring.lap + int(ring.lens[slot]) // 2] ^= 0xFF
    else:  # its index: a length no blob can have
        ring.lens[slot] = ring.frame_nbytes + 1
    users = users_of(packed, np.arange(400, 600), "obs", [victim])
    assert 450 in users and len(users) < 20
    result = packed.checkpoint(tmp_path / "snap")
    assert result.damaged == len(users) and result.records == 200 - len(users)
    copy = TieredBuffer.open(result.path)  # what was copied checks whole
    # the older records are renumbered to close the gaps; their values are the plain ones
    same(copy.contents(), records(plain, np.setdiff1d(np.arange(400, 600), users)))
    copy.release()


@pytest.mark.parametrize("combo", COMBOS)
def test_a_damaged_blob_is_found_at_restore_and_isolates_exactly_its_records(tmp_path, data,
                                                                             combo):
    plain, packed = pair(tmp_path, data, combo)
    path = Path(packed.checkpoint(tmp_path / "snap").path)
    copy = TieredBuffer.open(path)
    victim = frame_id(copy, 500)  # record 500's newest frame (its whole value without frames)
    users = users_of(copy, np.arange(400, 600), "obs", [victim])
    copy.release()
    assert 500 in users and len(users) < 20
    corrupt_blob(path, packed, victim)  # (the copy's blobs lie where the source's do)
    with pytest.raises(millpond.CorruptFileError, match="fail their checks"):
        TieredBuffer.open(path)
    survivor = TieredBuffer.open(path, skip_corrupt=True)
    assert survivor.damaged_seqs().tolist() == users.tolist()
    live = np.setdiff1d(np.arange(400, 600), users)
    same(survivor.contents(), records(plain, live))
    # a checkpoint of the survivor (a repair) drops them for good: its copy checks whole
    repaired = TieredBuffer.open(survivor.checkpoint(tmp_path / "repaired").path)
    same(repaired.contents(), records(plain, live))
    repaired.release()
    survivor.release()


# ---- through a daemon --------------------------------------------------------------------------

def cli(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MILLPOND_")}
    return subprocess.run([sys.executable, "-m", "millpond_server", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})})


@pytest.mark.daemon
def test_a_daemon_backs_up_compressed_buffers_while_pushes_go_on_and_restores_them(tmp_path,
                                                                                  data):
    """``millpond backup`` (the Checkpoint RPC) of a compressed frame buffer while a writer
    pushes, ``client.checkpoint`` of a compressed one without frames; ``millpond restore``
    into a new data directory (the rings stay sparse); a daemon serves them with the
    samples of the plain buffer."""
    backups = tmp_path / "backups"
    fields = fields_of(data, NAMES)
    kw = dict(hot_capacity=50, total_capacity=200, fields=fields)
    with ServerProcess(tmp_path / "data", "--backup-dir", str(backups)) as server:
        client = millpond.connect(server.address)
        plain = client.create_buffer("plain", **kw)
        framed = client.create_buffer("framed", **kw, **COMBOS["frames+zstd"])
        values = client.create_buffer("values", **kw, **COMBOS["lz4"])
        push(data, [plain, framed, values], 0, 400)
        expected = {seed: plain.sample(32, seed) for seed in range(3)}
        stop, errors = threading.Event(), []

        def writer() -> None:  # pushes into the buffer being backed up, and the plain one
            handle = millpond.connect(server.address).buffer("framed")
            lo = 400
            try:
                while not stop.is_set() and lo < 600:
                    handle.push_batch(**columns(data, lo, lo + 10, NAMES))
                    lo += 10
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            backup = cli("backup", "framed", "nightly/framed", "--address", server.address)
        finally:
            stop.set()
            thread.join()
        assert not errors, errors
        assert backup.returncode == 0, backup.stderr
        snapshot = backups / "nightly" / "framed.buffer"
        assert backup.stdout.startswith(f"wrote {snapshot}: ")
        result = client.checkpoint("values", "nightly/values")
        assert (result.records, result.pushed, result.damaged) == (200, 400, 0)
    cut = TieredBuffer.open(snapshot)  # the framed snapshot: the plain records of its cut
    first, pushed = cut.pushed - len(cut), cut.pushed
    assert 400 <= pushed <= 600 and cut.info().damaged == 0
    same(cut.contents(), columns(data, first, pushed, NAMES))
    cut.release()
    restored = cli("restore", snapshot, "--data-dir", tmp_path / "restored")
    assert restored.returncode == 0, restored.stderr
    done = cli("restore", result.path, "--data-dir", tmp_path / "restored")
    assert done.returncode == 0, done.stderr
    for name in ("framed", "values"):
        blocks, size = on_disk(tmp_path / "restored" / f"{name}.buffer")
        if blocks < size:  # a file system with sparse files: the copy stays sparse
            assert blocks <= on_disk(backups / "nightly" / f"{name}.buffer")[0] + (64 << 10)
    with ServerProcess(tmp_path / "restored") as server:
        client = millpond.connect(server.address)
        assert client.info("framed").config.compression == (("obs", "zstd", -1),)
        values = client.buffer("values")
        for seed, sample in expected.items():
            same(values.sample(32, seed), sample)
        same(client.buffer("framed").sample_all(), columns(data, first, pushed, NAMES))


@pytest.mark.daemon
def test_a_daemon_rewrites_a_compressed_buffer_without_its_damaged_records_at_start(tmp_path,
                                                                                   data):
    (tmp_path / "local").mkdir()
    plain, packed = pair(tmp_path / "local", data)
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    path = Path(packed.checkpoint(data_dir / "hurt").path)
    victim = frame_id(packed, 520)
    users = users_of(packed, np.arange(400, 600), "obs", [victim])
    corrupt_blob(path, packed, victim)
    with ServerProcess(data_dir, "--recover", "skip-corrupt") as server:
        client = millpond.connect(server.address)
        info = client.info("hurt")
        assert (info.state, info.size, info.damaged) == ("ok", 200 - len(users), 0)
    with ServerProcess(data_dir) as server:  # rewritten: the default --recover fail serves it
        got = millpond.connect(server.address).buffer("hurt").sample_all()
    live = np.setdiff1d(np.arange(400, 600), users)
    for name in NAMES:
        np.testing.assert_array_equal(got[name], records(plain, live)[name])


# ---- millpond inspect --------------------------------------------------------------------------

def inspect_cli(path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "millpond_server", "inspect", str(path)],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout


@pytest.mark.parametrize("combo", COMBOS)
def test_inspect_checks_compressed_blobs_and_names_the_records_they_isolate(tmp_path, data,
                                                                            combo):
    _, packed = pair(tmp_path, data, combo)
    path = tmp_path / "packed.buffer"
    ring = ring_of(packed)
    seqs = np.arange(400, 600)
    group = packed._fifo.frames.groups[packed._fifo.frames.group_of["obs"]]
    referred = len(np.unique(np.concatenate([
        ids.reshape(-1) for ids in packed._fifo.stored_rows(seqs, list(group.fields)).values()])))
    code, out = inspect_cli(path)
    assert code == 0, out
    assert "format    version 7" in out
    codec = "zstd, level -1" if "zstd" in combo else "lz4, level 0"
    shape = "32,40" if "frames" in combo else "4,32,40"  # (without frames: a value is a frame)
    assert (f"; compressed ({codec}), {ring.capacity:,} frames |u1[{shape}] as blobs in a ring "
            f"of {ring.lap:,} bytes (up to {ring.limit:,})") in out, out
    assert (f"checks    {referred:,} blobs of obs the records refer to checked (id, offset, "
            "length and checksum): all pass") in out, out
    assert out.rstrip().endswith("status    healthy")

    rotten, wrong = frame_id(packed, 500), frame_id(packed, 550)  # bytes flipped; a bad length
    assert rotten != wrong
    users = users_of(packed, seqs, "obs", [rotten, wrong]).tolist()
    corrupt_blob(path, packed, rotten)
    (offset, _), _ = region(path, "framelen:obs")
    with open(path, "r+b") as f:  # a length past the ring's end
        f.seek(offset + 4 * (wrong % ring.capacity))
        f.write((ring.lap + 1).to_bytes(4, "little"))
    packed.release()
    before = path.read_bytes()
    code, out = inspect_cli(path)
    assert code == 1, out
    assert "checks    200 records checked (seq and checksum): all pass" in out
    assert (f"of obs fail their id, offset, length and checksum check: frames "
            f"{', '.join(map(str, sorted([rotten, wrong])))}") in out, out
    assert 500 in users and 550 in users and len(users) <= 20  # (listed in full)
    assert (f"DAMAGED   {len(users)} records refer to a damaged frame (a reopen with "
            f"skip-corrupt leaves them out): seqs {', '.join(map(str, users))}") in out
    assert out.rstrip().endswith("status    DAMAGED")
    assert path.read_bytes() == before  # nothing written
    survivor = TieredBuffer.open(path, skip_corrupt=True)  # the reopen agrees
    assert survivor.damaged_seqs().tolist() == users
    survivor.release()


def test_inspect_of_a_compressed_ring_whose_size_cannot_be_says_it_is_unreadable(tmp_path, data):
    _, packed = pair(tmp_path, data)
    packed.release()
    path = tmp_path / "packed.buffer"
    (offset, _), _ = region(path, "framelap:obs")
    with open(path, "r+b") as f:  # the ring's size now: not its first size doubled
        f.seek(offset)
        f.write((12_345).to_bytes(8, "little"))
    code, out = inspect_cli(path)
    assert code == 2, out
    assert "UNREADABLE" in out and "12345 bytes" in out, out
    with pytest.raises(millpond.CorruptFileError, match="12345 bytes"):  # so does a reopen
        TieredBuffer.open(path)


# ---- --max-data-gb -----------------------------------------------------------------------------

@pytest.mark.daemon
def test_max_data_gb_counts_what_compressed_files_take_not_their_ring_limits(tmp_path):
    """Five compressed buffers whose rings may each grow to 44 MB (their plain frames'
    bytes) under a 50 MB limit: created, since each file takes about 1.5 MB (its first
    ring). Filling one with incompressible images makes its file take what it stores,
    and then the limit refuses a buffer that fitted before."""
    fields = {"img": ("uint8", (84, 84)), "a": ("int64", ())}
    kw = dict(hot_capacity=100, total_capacity=5_000, fields=fields, compression="lz4")
    limit = 50_000_000
    config = BufferConfig.build(**kw)
    ring_limit = config.frame_capacity * 84 * 84
    assert 5 * ring_limit > limit
    data_dir = tmp_path / "data"
    with ServerProcess(data_dir, "--max-data-gb", str(limit / 1e9)) as server:
        client = millpond.connect(server.address)
        bufs = [client.create_buffer(f"c{i}", **kw) for i in range(5)]
        sizes = [on_disk(data_dir / f"c{i}.buffer") for i in range(5)]
        if sizes[0][0] >= sizes[0][1]:
            pytest.skip("no sparse files on this file system: each file takes its size")
        assert sum(size for _, size in sizes) > limit  # their sizes would not have fitted
        assert all(blocks < 3_000_000 for blocks, _ in sizes)
        zeros = np.zeros((500, 84, 84), np.uint8)
        zeros[:, ::5] = 7
        for buf in bufs:  # what compresses well stays small
            buf.push_batch(img=zeros, a=np.arange(500))
        plainish = dict(hot_capacity=100, total_capacity=1_800,
                        fields={"x": ("uint8", (10_000,))})  # 22 MB, allocated in full
        needed = disk_nbytes(BufferConfig.build(**plainish), persistent=True)
        assert 20_000_000 < needed < 25_000_000

        def used() -> int:
            return sum(on_disk(path)[0] for path in data_dir.glob("*.buffer"))

        assert used() + needed < limit - 10_000_000
        client.create_buffer("fits", **plainish)
        client.delete_buffer("fits")
        rng = np.random.default_rng(0)
        for lo in range(0, 4_000, 500):  # 4,000 incompressible images: 28 MB stored
            bufs[0].push_batch(img=rng.integers(0, 256, (500, 84, 84), np.uint8),
                               a=np.arange(lo, lo + 500))
        assert on_disk(data_dir / "c0.buffer")[0] > 28_000_000
        assert used() + needed > limit
        with pytest.raises(millpond.LimitExceededError, match="max-data-gb"):
            client.create_buffer("fits", **plainish)
        assert len(bufs[0]) == 4_500 and len(bufs[4]) == 500
