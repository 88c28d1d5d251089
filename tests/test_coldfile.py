"""The cold file: self-describing, preallocated, page-aligned, removed on close."""

from __future__ import annotations

import gc
import json
import mmap
import os
import struct
import tempfile

import numpy as np
import pytest

import millpond
from millpond.core.bufferfile import FORMAT_VERSION, MAGIC
from millpond.core.bufferfile import BufferFile as ColdFile

PAGE = mmap.PAGESIZE
FIELDS = {"id": ("float64", ()), "frame": ("uint8", (5, 7)), "a": ("int32", (3,))}


def read_header(path) -> tuple[dict, int]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return ColdFile.read_meta(mm, str(path))


def records(start, n):
    i = np.arange(start, start + n)
    return {
        "id": i.astype(np.float64),
        "frame": (i[:, None, None] + np.zeros((5, 7), np.int64)).astype(np.uint8),
        "a": np.stack([i, i + 1, i + 2], axis=1).astype(np.int32),
    }


@pytest.fixture
def buf(tmp_path):
    b = millpond.MmapReplayBuffer(3, 13, cold_path=str(tmp_path / "cold.bin"), fields=FIELDS)
    yield b
    b.close()


def test_header_is_self_describing(buf, tmp_path):
    path = tmp_path / "cold.bin"
    raw = path.read_bytes()[:16]
    magic, version, header_size = struct.unpack("<8sII", raw)
    assert magic == MAGIC == b"MILLPOND"
    assert version == FORMAT_VERSION
    assert header_size % PAGE == 0 and header_size >= PAGE

    meta, pushed = read_header(path)
    assert pushed == 0
    assert meta["hot_capacity"] == 3
    assert meta["total_capacity"] == 13
    assert meta["cold_capacity"] == 10
    # The schema in the file rebuilds the buffer's schema exactly.
    schema = millpond.Schema.from_spec({k: (dt, tuple(shape)) for k, (dt, shape) in meta["schema"].items()})
    assert schema == buf.schema
    assert json.loads(json.dumps(meta)) == meta  # plain JSON, nothing pickled


def test_header_counts_pushed_records(buf, tmp_path):
    buf.push_batch(**records(0, 5))
    buf.push(**{k: v[0] for k, v in records(5, 1).items()})
    assert read_header(tmp_path / "cold.bin")[1] == 6
    buf.push_batch(**records(6, 20))
    assert read_header(tmp_path / "cold.bin")[1] == 26


def test_regions_page_aligned_and_sized(buf, tmp_path):
    path = tmp_path / "cold.bin"
    meta, _ = read_header(path)
    regions = meta["regions"]
    cold = meta["cold_capacity"]
    header_size = struct.unpack_from("<I", path.read_bytes(), 12)[0]
    # One region per field (native dtype, so uint8 frames take 1 byte per pixel) + seq.
    assert regions["id"][1] == cold * 8
    assert regions["frame"][1] == cold * 5 * 7
    assert regions["a"][1] == cold * 3 * 4
    assert len(regions) == len(FIELDS) + 1
    spans = sorted((off, off + n) for off, n in regions.values())
    assert spans[0][0] >= header_size
    for off, _ in spans:
        assert off % PAGE == 0, f"region at {off} is not page-aligned"
    for (_, end), (nxt, _) in zip(spans, spans[1:]):
        assert end <= nxt, "regions overlap"
    assert spans[-1][1] <= os.stat(path).st_size


def test_file_is_preallocated_at_creation(tmp_path):
    path = tmp_path / "big.cold"
    # ~32 MB of cold records: obs float32[1000] x 2 + small fields, 4000 cold slots.
    b = millpond.MmapReplayBuffer(10, 4010, 1000, 1, str(path))
    try:
        st = os.stat(path)
        meta, _ = read_header(path)
        end = max(off + n for off, n in meta["regions"].values())
        assert st.st_size >= end
        assert st.st_size >= 4000 * 2 * 1000 * 4
        # Blocks are really allocated, not a sparse file that may SIGBUS later.
        assert st.st_blocks * 512 >= st.st_size
    finally:
        b.close()


def test_cold_records_live_in_the_file(buf, tmp_path):
    """Spilled records are in the mapped file (read back with plain file I/O)."""
    path = tmp_path / "cold.bin"
    buf.push_batch(**records(0, 11))  # seqs 0..7 cold, 8..10 hot
    meta, _ = read_header(path)
    off, nbytes = meta["regions"]["id"]
    with open(path, "rb") as f:
        f.seek(off)
        ids = np.frombuffer(f.read(nbytes), "<f8")
    for seq in range(8):
        assert ids[seq % 10] == seq
    off, nbytes = meta["regions"]["frame"]
    with open(path, "rb") as f:
        f.seek(off)
        frames = np.frombuffer(f.read(nbytes), np.uint8).reshape(10, 5, 7)
    assert (frames[7] == 7).all()


def test_read_meta_rejects_foreign_file(tmp_path):
    path = tmp_path / "foreign.bin"
    path.write_bytes(b"NOTMILLP" + bytes(4096))
    with pytest.raises(millpond.CorruptFileError):
        read_header(path)
    path.write_bytes(MAGIC + struct.pack("<I", FORMAT_VERSION + 1) + bytes(4096))
    with pytest.raises(millpond.CorruptFileError):
        read_header(path)
    path.write_bytes(b"MILL")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        with pytest.raises(millpond.CorruptFileError):
            ColdFile.read_meta(mm, str(path))


def test_existing_file_at_cold_path_is_replaced(tmp_path):
    path = tmp_path / "cold.bin"
    path.write_bytes(b"stale data from a previous run" * 1000)
    b = millpond.MmapReplayBuffer(2, 5, 2, 1, str(path))
    try:
        meta, pushed = read_header(path)
        assert pushed == 0 and meta["cold_capacity"] == 3
    finally:
        b.close()
    assert not path.exists()


def test_close_removes_file(tmp_path):
    path = tmp_path / "cold.bin"
    b = millpond.MmapReplayBuffer(2, 5, 2, 1, str(path))
    assert path.exists()  # created (and allocated) up front, not on first spill
    b.push_batch(np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 1)), np.ones(4), np.zeros(4), np.zeros(4))
    b.close()
    assert not path.exists()
    b.close()  # idempotent, even with the file gone


def test_default_cold_path_is_a_temp_file_removed_on_close():
    b = millpond.MmapReplayBuffer(2, 5, 2, 1)
    path = b.info()["path"]
    assert path and os.path.isfile(path)
    assert os.path.dirname(os.path.abspath(path)) == os.path.abspath(tempfile.gettempdir())
    meta, _ = read_header(path)
    assert meta["cold_capacity"] == 3
    b.close()
    assert not os.path.exists(path)


def test_no_cold_tier_makes_no_file(tmp_path):
    path = tmp_path / "cold.bin"
    before = set(os.listdir(tempfile.gettempdir()))
    a = millpond.MmapReplayBuffer(4, 4, 2, 1, str(path))
    b = millpond.MmapReplayBuffer(4, 4, 2, 1)
    r = millpond.ReplayBuffer(4, 2, 1)
    try:
        assert not path.exists()
        assert a.info()["path"] is None and b.info()["path"] is None
        assert r.info()["path"] is None
        assert set(os.listdir(tempfile.gettempdir())) - before == set()
    finally:
        a.close()
        b.close()
        r.close()


def test_field_named_like_the_seq_region_keeps_its_values(tmp_path):
    """A field may be any identifier; one called ``__seq__`` must not share the seq region.

    Either the schema refuses the name up front, or the values round-trip.
    """
    fields = {"__seq__": ("int64", ()), "x": ("int64", ())}
    try:
        b = millpond.MmapReplayBuffer(2, 6, cold_path=str(tmp_path / "c.bin"), fields=fields)
    except millpond.InvalidConfigError:
        return
    try:
        b.push_batch(__seq__=np.arange(6) * 100, x=np.arange(6))
        for seed in range(5):
            s = b.sample(6, seed)
            np.testing.assert_array_equal(s["__seq__"], s["x"] * 100)
    finally:
        b.close()


def test_dropped_buffer_removes_its_cold_file(tmp_path):
    """The reference deletes the cold file when the buffer is dropped (``impl Drop``)."""
    path = tmp_path / "cold.bin"
    b = millpond.MmapReplayBuffer(2, 5, 2, 1, str(path))
    assert path.exists()
    del b
    gc.collect()
    assert not path.exists(), "a garbage-collected buffer leaked its cold file"


# ---- a full disk -------------------------------------------------------------


def test_too_large_capacity_fails_at_creation(small_fs):
    path = small_fs / "huge.cold"
    # 100k cold records of 2 x float32[100] = ~80 MB on an 8 MB filesystem.
    with pytest.raises(millpond.StorageFullError) as excinfo:
        millpond.MmapReplayBuffer(10, 100_010, 100, 1, str(path))
    assert isinstance(excinfo.value, OSError)
    assert str(path) in str(excinfo.value)
    assert not path.exists(), "the partial file must be removed"
    assert os.listdir(small_fs) == []
    # The filesystem is usable afterwards: a buffer that fits works.
    with millpond.MmapReplayBuffer(10, 1010, 100, 1, str(path)) as b:
        b.push_batch(np.ones((50, 100)), np.ones((50, 100)), np.ones(50), np.ones(50),
                     np.zeros(50), np.zeros(50))
        assert len(b) == 50
        assert os.stat(path).st_blocks * 512 >= os.stat(path).st_size
    assert not path.exists()


# ---- slot arrays ---------------------------------------------------------------------


def test_slot_arrays_are_page_aligned_zeroed_regions_that_survive_reopening(tmp_path):
    path = str(tmp_path / "slots.bin")
    schema = millpond.Schema.from_spec(FIELDS)
    file = ColdFile.create(path, schema, 3, 13, persistent=True,
                           slot_arrays={"priority": "<f8", "owner": "<u8", "flag": "u1"})
    file.publish()
    assert file.meta["slot_arrays"] == {"priority": "<f8", "owner": "<u8", "flag": "|u1"}
    regions = file.meta["regions"]
    for name, itemsize in (("priority", 8), ("owner", 8), ("flag", 1)):
        offset, nbytes = regions[f"slot:{name}"]
        assert offset % PAGE == 0 and nbytes == 13 * itemsize
        array = file.slot_array(name)
        assert array.shape == (13,) and array.itemsize == itemsize and not array.any()
    del array  # the map cannot close while a view of it is alive
    file.slot_array("priority")[:] = np.linspace(0.5, 6.5, 13)
    file.slot_array("owner")[4] = 2**64 - 1
    assert file.slot_array("missing") is None
    file.close(delete=False)

    again = ColdFile.open(path)
    np.testing.assert_array_equal(again.slot_array("priority"), np.linspace(0.5, 6.5, 13))
    assert again.slot_array("owner")[4] == 2**64 - 1 and again.slot_array("owner").dtype == "<u8"
    again.slot_array("flag")[12] = 7  # writable after reopening too
    again.close(delete=False)
    third = ColdFile.open(path)
    assert third.slot_array("flag")[12] == 7
    third.close(delete=True)


def test_slot_array_names_cannot_collide_with_fields(tmp_path):
    """A field may be called like a slot array: the regions stay apart."""
    fields = {"priority": ("float64", ())}
    schema = millpond.Schema.from_spec(fields)
    file = ColdFile.create(str(tmp_path / "f.bin"), schema, 2, 6, persistent=True,
                           slot_arrays={"priority": "<f8"})
    assert {"priority", "hot:priority", "slot:priority"} <= file.meta["regions"].keys()
    file.slot_array("priority")[:] = 9.0
    file.hot_tier.columns["priority"][:] = 1.0
    file.tier.columns["priority"][:] = 2.0
    assert (file.slot_array("priority") == 9.0).all()
    file.close(delete=True)


def test_files_without_slot_arrays_open_and_have_none(buf, tmp_path):
    meta, _ = read_header(tmp_path / "cold.bin")
    assert "slot_arrays" not in meta and not any(r.startswith("slot:") for r in meta["regions"])
    path = str(tmp_path / "plain.bin")
    created = ColdFile.create(path, millpond.Schema.from_spec(FIELDS), 3, 13, persistent=True)
    created.publish()
    created.close(False)
    file = ColdFile.open(path)
    assert file.slot_array("priority") is None
    file.close(delete=False)


@pytest.mark.parametrize("slot_arrays", [{"p": "object"}, {"p": "no-such-type"},
                                         {"p": [("a", "<f8")]}, {"": "<f8"}])
def test_bad_slot_arrays_are_refused(tmp_path, slot_arrays):
    with pytest.raises(millpond.InvalidConfigError):
        ColdFile.create(str(tmp_path / "bad.bin"), millpond.Schema.from_spec(FIELDS), 3, 13,
                        persistent=True, slot_arrays=slot_arrays)
    assert not (tmp_path / "bad.bin").exists()


def test_a_slot_array_region_of_the_wrong_size_is_a_damaged_header(tmp_path):
    path = tmp_path / "slots.bin"
    created = ColdFile.create(str(path), millpond.Schema.from_spec(FIELDS), 3, 13,
                              persistent=True, slot_arrays={"priority": "<f8"})
    created.publish()
    created.close(delete=False)
    meta = ColdFile.peek(str(path))
    meta["regions"]["slot:priority"][1] -= 8
    ColdFile.write_meta(str(path), meta)  # its checksum resealed: the sizes are checked too
    with pytest.raises(millpond.CorruptFileError, match="damaged header metadata"):
        ColdFile.open(str(path))
