"""Every record checked: what a client does to its memory, a flipped bit in the metadata or a
commit slot, and a crash at any step of a push never make the daemon serve a wrong record,
lose an acknowledged one, or refuse to start for want of a check."""

from __future__ import annotations

import gzip
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ServerProcess, engine, wait_until

import millpond
from millpond.core import Schema, TieredBuffer, bufferfile, checksum_v4
from millpond.core.bufferfile import BufferFile
from millpond.core.checksum import CHECKSUM_DTYPE, record_checksums
from millpond.core.tier import Tier

# ---- 1. a client rewriting its push segment ---------------------------------------------

PUSHES = 600

REWRITER = textwrap.dedent("""
    import os, subprocess, sys
    import numpy as np
    import millpond

    address, pushes = sys.argv[1], int(sys.argv[2])
    buf = millpond.connect(address, shm=True).buffer("torn")
    assert buf.transport == "shm", buf.transport
    n = 48  # more than the hot ring: the batch's head goes straight to the cold tier
    batch = {"frame": np.zeros((n, 8192), np.uint8), "id": np.arange(n, dtype=np.int64)}
    buf.push_batch(**batch)  # the push segment exists now

    def segment_fd():
        # This process's own push segment, found as any actor could.
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "millpond-push" in line:
                    return os.open(f"/proc/self/map_files/{line.split()[0]}", os.O_RDWR)
        raise SystemExit("no push segment mapped")

    # A helper process rewrites the segment in a tight loop (no GIL shared with the pushes).
    fd = segment_fd()
    helper = subprocess.Popen([sys.executable, "-c", HELPER, str(fd)], pass_fds=[fd],
                              stdout=subprocess.PIPE)
    os.close(fd)
    assert helper.stdout.readline() == b"rewriting\\n"
    try:
        for _ in range(pushes):
            buf.push_batch(**batch)
    finally:
        helper.kill()
        helper.wait()
    print(buf.info()["pushed"])
""").replace("HELPER", repr(textwrap.dedent("""
    import mmap, os, sys
    import numpy as np
    fd = int(sys.argv[1])
    view = np.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size), np.uint8)
    value = 0
    view[::4096] = value
    print("rewriting", flush=True)
    while True:
        view[::4096] = value  # a byte in every page, a pass every microsecond or so
        value = (value + 1) % 251
""")))


@pytest.mark.daemon
@pytest.mark.parametrize("cold_io", ["mapped", "direct"])
def test_a_client_rewriting_its_segment_cannot_make_records_fail_their_checks(tmp_path, cold_io):
    """The daemon checksums its own copy: whatever the client's memory held when it was
    copied (torn client data, maybe), the stored record passes its check, and the daemon
    starts again with every record."""
    data = tmp_path / "data"
    env = {"MILLPOND_COLD_IO": cold_io}
    with ServerProcess(data, env=env) as server:
        millpond.connect(server.address).create_buffer(
            "torn", hot_capacity=16, total_capacity=4096,
            fields={"frame": ("uint8", (8192,)), "id": ("int64", ())})
        # (The client waits for replies without spinning: its core is the helper's.)
        done = subprocess.run([sys.executable, "-c", REWRITER, server.address, str(PUSHES)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "MILLPOND_SHM_SPIN_US": "0"})
        assert done.returncode == 0, done.stderr
        pushed = int(done.stdout.split()[-1])
        assert pushed == (PUSHES + 1) * 48
    stored = TieredBuffer.open(data / "torn.buffer")  # raises if a record fails its check
    assert len(stored) == 4096 and stored.info().damaged == 0
    stored.release()
    with ServerProcess(data, env=env) as server:  # and the daemon starts with all of them
        buf = millpond.connect(server.address).buffer("torn")
        assert len(buf) == 4096 and buf.info()["damaged"] == 0


# ---- 4. the record checksum ---------------------------------------------------------------

MASK = (1 << 64) - 1


def splitmix64(j: int) -> int:
    z = (j + 1) * 0x9E3779B97F4A7C15 & MASK
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK
    return z ^ (z >> 31)


def reference_checksum(fields: list[bytes], seq: int) -> int:
    """The checksum as the module doc defines it, one record in plain Python."""
    words = []
    for raw in fields:
        raw = raw + bytes(-len(raw) % 8)
        words += [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
    words.append(seq)
    acc = 0
    for j, word in enumerate(words):
        x = word ^ splitmix64(j)
        acc = (acc + x * ((x >> 32) | 1)) & MASK
    h = acc
    h ^= h >> 33
    h = h * 0xFF51AFD7ED558CCD & MASK
    h ^= h >> 33
    h = h * 0xC4CEB9FE1A85EC53 & MASK
    h ^= h >> 33
    return h >> 32


FIELD_SHAPES = st.lists(st.tuples(st.sampled_from(["u1", "<u2", "<f4", "<i8", "<f8", "V3"]),
                                  st.lists(st.integers(0, 40), max_size=2)),
                        min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(FIELD_SHAPES, st.integers(0, 9), st.integers(0, 2**40), st.randoms(use_true_random=False))
def test_the_vectorized_checksum_is_the_one_documented(shapes, k, first_seq, rnd):
    rng = np.random.default_rng(rnd.getrandbits(32))
    columns = {}
    for i, (dtype, shape) in enumerate(shapes):
        nbytes = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        raw = rng.integers(0, 256, k * nbytes, dtype=np.uint8)
        columns[f"f{i}"] = raw.view(dtype).reshape((k, *shape))
        if shape and shape[0] > 1 and rnd.random() < 0.3:
            columns[f"f{i}"] = columns[f"f{i}"][:, ::-1]  # not contiguous
    seqs = np.arange(first_seq, first_seq + k, dtype=np.uint64)
    got = record_checksums(columns, seqs)
    assert got.dtype == CHECKSUM_DTYPE and got.shape == (k,)
    for r in range(k):
        expected = reference_checksum([np.ascontiguousarray(c[r]).tobytes()
                                       for c in columns.values()], int(seqs[r]))
        assert int(got[r]) == expected


def test_large_fields_are_hashed_in_blocks_the_same_way():
    rng = np.random.default_rng(1)
    columns = {"frame": rng.integers(0, 256, (5, 84 * 84 * 4 + 5), dtype=np.uint8),
               "small": rng.random((5, 3)).astype(np.float32)}
    seqs = np.arange(7, 12, dtype=np.uint64)
    got = record_checksums(columns, seqs)
    for r in range(5):
        assert int(got[r]) == reference_checksum([columns["frame"][r].tobytes(),
                                                  columns["small"][r].tobytes()], 7 + r)


def corruptions(record: np.ndarray, rng: np.random.Generator):
    """The damage the format 4 fold could not see, and random damage."""
    words = record.view("<u8")
    swapped = words.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    yield "two words swapped", swapped
    same_delta = words.copy()
    same_delta[[0, 2]] ^= np.uint64(0x0000_0100_0000_0004)
    yield "two words changed by one XOR delta", same_delta
    signs = words.view("<f8").copy()
    signs[[1, 3]] *= -1
    yield "two signs flipped", signs.view("<u8")
    for _ in range(20):
        bit = words.copy().view(np.uint8)
        bit[rng.integers(len(bit))] ^= np.uint8(1 << int(rng.integers(8)))
        yield "one bit flipped", bit.view("<u8")


def test_damage_the_old_fold_missed_is_seen():
    rng = np.random.default_rng(2)
    record = rng.random(8)  # one field of 8 float64 words
    seqs = np.array([5], np.uint64)

    def check(fn, words):
        return int(fn({"x": words.view("<f8")[None]}, seqs)[0])

    old_missed = 0
    for what, damaged in corruptions(record.view("<u8").copy(), rng):
        assert check(record_checksums, damaged) != check(record_checksums, record.view("<u8")), what
        old_missed += check(checksum_v4.record_checksums, damaged) == \
            check(checksum_v4.record_checksums, record.view("<u8"))
    assert old_missed >= 3  # swapped words, the same XOR delta, two signs


def test_random_damage_escapes_about_never():
    """1 in 2**32 in theory; 20,000 random records with random damage: none escapes
    (the format 4 fold: about 1 in 65,536 random changes escaped)."""
    rng = np.random.default_rng(3)
    records = rng.integers(0, 256, (20_000, 40), dtype=np.uint8)
    damaged = records.copy()
    damaged[:, rng.integers(40)] ^= rng.integers(1, 256, 20_000, dtype=np.uint8)
    damaged[np.arange(20_000), rng.integers(0, 40, 20_000)] ^= np.uint8(0x10)
    seqs = np.arange(20_000, dtype=np.uint64)
    changed = (damaged != records).any(axis=1)
    same = record_checksums({"r": records}, seqs) == record_checksums({"r": damaged}, seqs)
    assert not (same & changed).any()


# ---- 2. metadata and commit slots ---------------------------------------------------------

ID_FIELDS = {"id": ("int64", ()), "obs": ("float32", (3,))}


def ids(start: int, n: int) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n)
    return {"id": i, "obs": np.stack([i, 2 * i, 3 * i], axis=1).astype(np.float32)}


def state_of(path) -> tuple:
    """What a reopen serves: (pushed, first, the records' ids), or the CorruptFileError."""
    try:
        buf = TieredBuffer.open(path)
    except millpond.CorruptFileError as exc:
        return ("refused", str(exc))
    try:
        return (buf.pushed, buf.info().size, buf.contents()["id"].tolist())
    finally:
        buf.release()


def small_file(tmp_path, pushed: int = 13):
    path = tmp_path / "b.buffer"
    buf = engine(Schema.from_spec(ID_FIELDS), 4, 10, path, persistent=True, prioritized=True)
    buf.push_batch(ids(0, pushed), priorities=np.arange(1.0, pushed + 1))
    buf.release()
    return path


@pytest.mark.parametrize("edit", [(b'"<f4"', b'"<i4"'), (b'"total_capacity": 10', b'"total_capacity": 19'),
                                  (b'"mode": "replay"', b'"mode": "queue" '),
                                  (b'"alpha": 0.6', b'"alpha": 0.9')])
def test_same_length_edits_of_the_metadata_are_refused(tmp_path, edit):
    path = small_file(tmp_path)
    raw = path.read_bytes()
    old, new = edit
    assert len(old) == len(new) and raw.count(old) == 1, raw[:400]
    path.write_bytes(raw.replace(old, new))
    with pytest.raises(millpond.CorruptFileError, match=r"b\.buffer: damaged header.*checksum"):
        TieredBuffer.open(path)


def test_every_bit_of_the_header_is_checked_or_harmless(tmp_path):
    """Flip bits of the prefix, the commit slots and the metadata in turn: a reopen
    serves exactly what it served before, or refuses with CorruptFileError; never another
    state. A damaged commit slot is reported, and loses nothing."""
    path = small_file(tmp_path)
    raw = path.read_bytes()
    intact = state_of(path)
    assert intact[0] == 13 and intact[2] == list(range(3, 13))
    length = int.from_bytes(raw[16:20], "little")
    seen = {"same": 0, "refused": 0}
    for offset in range(128 + length):
        for bit in (offset % 8, (offset + 3) % 8):  # two bits of each byte
            damaged = bytearray(raw)
            damaged[offset] ^= 1 << bit
            path.write_bytes(bytes(damaged))
            got = state_of(path)
            kind = "refused" if got[0] == "refused" else "same"
            assert kind == "refused" or got == intact, (offset, bit, got)
            seen[kind] += 1
            if (32 <= offset < 68 or 72 <= offset < 108) and kind == "same":  # a commit slot
                buf = TieredBuffer.open(path)
                assert buf.recovery_notes and "no acknowledged push lost" in buf.recovery_notes[0]
                buf.release()
    assert seen["refused"] > 0 and seen["same"] > 0


@pytest.mark.parametrize("slot", ["A", "B"])
def test_a_flipped_bit_in_either_commit_slot_loses_no_acknowledged_push(tmp_path, slot):
    path = small_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[(32 if slot == "A" else 72) + 8] ^= 0x01  # its pushed counter
    path.write_bytes(bytes(raw))
    buf = TieredBuffer.open(path)
    assert buf.pushed == 13 and buf.contents()["id"].tolist() == list(range(3, 13))
    assert buf.recovery_notes == [f"commit slot {slot} is damaged; slot {'B' if slot == 'A' else 'A'}"
                                  f" (generation {buf._fifo.file.generation}) is used "
                                  "(no acknowledged push lost)"]
    buf.push_batch(ids(13, 2), priorities=[1.0, 1.0])  # and both slots are whole again
    buf.release()
    assert TieredBuffer.open(path).recovery_notes == []


def test_both_commit_slots_damaged_is_refused(tmp_path):
    path = small_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[40] ^= 1
    raw[80] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(millpond.CorruptFileError, match="both copies of the push counter"):
        TieredBuffer.open(path)


@pytest.mark.daemon
def test_the_daemon_starts_with_one_commit_slot_damaged_and_says_so(tmp_path):
    data = tmp_path / "data"
    with ServerProcess(data) as server:
        buf = millpond.connect(server.address).create_buffer("b", capacity=50, fields=ID_FIELDS)
        buf.push_batch(**ids(0, 30))
    raw = bytearray((data / "b.buffer").read_bytes())
    raw[32 + 8] ^= 0x04
    (data / "b.buffer").write_bytes(bytes(raw))
    server = ServerProcess(data, "--log-level", "info").start()
    try:
        buf = millpond.connect(server.address).buffer("b")
        assert buf.info()["pushed"] == 30 and len(buf) == 30
    finally:
        server.stop()
    assert "commit slot A is damaged" in server.proc.stderr.read()


# ---- format 4 files -----------------------------------------------------------------------

FORMAT4 = Path(__file__).with_name("data") / "format4-prioritized.buffer.gz"


def format4_file(tmp_path) -> Path:
    """A file millpond 0.1.0 made before format 5 (prioritized, 15 pushed, 12 live)."""
    path = tmp_path / "old.buffer"
    path.write_bytes(gzip.decompress(FORMAT4.read_bytes()))
    return path


def test_format_4_files_still_open_and_serve(tmp_path):
    path = format4_file(tmp_path)
    buf = TieredBuffer.open(path)
    assert buf.pushed == 15 and buf.contents()["id"].tolist() == list(range(3, 15))
    assert buf.info().max_priority == 15.0
    buf.push_batch(ids(15, 7), priorities=np.ones(7))  # written as format 4: its checksum
    buf.release()
    assert BufferFile.peek(str(path)).get("spare", 0) == 0
    again = TieredBuffer.open(path)
    assert again._fifo.file.format.version == 4
    assert again.contents()["id"].tolist() == list(range(10, 22))
    again.release()


def test_a_format_4_file_with_a_damaged_commit_slot_is_refused_unless_accepted(tmp_path):
    """Format 4 wrote each commit to one slot: the other may lack the last push."""
    path = format4_file(tmp_path)
    raw = bytearray(path.read_bytes())
    newer = 32 if struct.unpack_from("<Q", raw, 32)[0] > struct.unpack_from("<Q", raw, 72)[0] else 72
    raw[newer + 8] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(millpond.CorruptFileError, match="may lack the last acknowledged push"):
        TieredBuffer.open(path)
    TieredBuffer.open(path, skip_corrupt=True).release()


def test_a_file_of_an_unknown_format_names_the_versions_read(tmp_path):
    path = small_file(tmp_path)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 8, 8)
    path.write_bytes(bytes(raw))
    with pytest.raises(millpond.CorruptFileError,
                       match=r"format version 8; millpond \S+ reads versions 4 to 7 \(a newer"):
        TieredBuffer.open(path)


# ---- 3. eviction and append in one commit -------------------------------------------------

class CrashImages:
    """Copies of a buffer file taken at every step of its writes (before and after each
    store into a tier, each copy between tiers, each commit slot written): what a crash
    at that moment leaves on disk (the page cache outlives a killed process)."""

    def __init__(self, monkeypatch, path: Path):
        self.path, self.images = path, []
        take = self.take
        slot = bufferfile._SLOT

        class Slots:  # the commit slots' struct, with an image after each slot written
            size = slot.size

            def pack_into(self, *args):
                slot.pack_into(*args)
                take()

            def unpack_from(self, *args):
                return slot.unpack_from(*args)

        monkeypatch.setattr(bufferfile, "_SLOT", Slots())
        for name in ("_store", "copy_to"):
            original = getattr(Tier, name)

            def wrapped(*args, original=original, **kwargs):
                take()
                original(*args, **kwargs)
                take()

            monkeypatch.setattr(Tier, name, wrapped)

    def take(self) -> None:
        if self.path.exists():
            self.images.append(self.path.read_bytes())


@settings(max_examples=15, deadline=None)
@given(hot=st.integers(1, 6), cold=st.integers(0, 12), spare=st.integers(1, 5),
       pushes=st.lists(st.integers(1, 24), min_size=1, max_size=5))
def test_a_crash_at_any_step_of_a_push_loses_no_acknowledged_record(tmp_path_factory, hot, cold,
                                                                    spare, pushes):
    """At every step of every push, the file holds the records acknowledged before it that
    no committed chunk of it evicted, and each chunk of it (at most ``spare`` records)
    wholly or not at all: never a record evicted by a push that did not land."""
    tmp = tmp_path_factory.mktemp("crash")
    path, image = tmp / "b.buffer", tmp / "image.buffer"
    total = hot + cold
    with pytest.MonkeyPatch.context() as monkeypatch:
        per_record = Schema.from_spec(ID_FIELDS).record_nbytes + 8  # + seq and checksum
        monkeypatch.setattr(bufferfile, "SPARE_BYTES", per_record * spare)
        buf = engine(Schema.from_spec(ID_FIELDS), hot, total, path, persistent=True)
        chunk = buf._fifo.spare
        assert chunk == min(spare, total)
        images = CrashImages(monkeypatch, path)
        pushed = first = 0
        for n in pushes:
            images.images = []
            buf.push_batch(ids(pushed, n))
            for i, raw in enumerate(images.images):
                image.write_bytes(raw)
                try:
                    crashed = TieredBuffer.open(image)
                except millpond.CorruptFileError as exc:
                    raise AssertionError(f"push of {n} after {pushed}, image {i}: {exc}") from exc
                at = crashed.pushed
                assert at == pushed + n or (at - pushed) % chunk == 0 and pushed <= at, (i, at)
                assert crashed.info().damaged == 0
                assert crashed.contents()["id"].tolist() == list(range(max(first, at - total), at)), \
                    f"push of {n} after {pushed}, image {i}: records lost or torn"
                crashed.release()
            pushed += n
            first = max(first, pushed - total)
        assert buf.contents()["id"].tolist() == list(range(first, pushed))
        buf.release()


def test_without_spare_slots_a_crash_loses_records_a_push_evicted(tmp_path, monkeypatch):
    """What format 4's three commits (and format 5 without its spare slots) did: an image
    after the eviction step has fewer records than before the push, though it never landed."""
    monkeypatch.setattr(bufferfile, "spare_slots", lambda *args: 0)
    path = tmp_path / "b.buffer"
    buf = engine(Schema.from_spec(ID_FIELDS), 2, 6, path, persistent=True)
    buf.push_batch(ids(0, 6))
    images = CrashImages(monkeypatch, path)
    buf.push_batch(ids(6, 3))
    buf.release()
    lost = []
    for raw in images.images:
        (tmp_path / "image.buffer").write_bytes(raw)
        crashed = TieredBuffer.open(tmp_path / "image.buffer")
        if crashed.pushed == 6:
            lost.append(6 - len(crashed))
        crashed.release()
    assert max(lost) == 3  # the three records the push would evict, gone before it landed


# ---- 5. millpond inspect ------------------------------------------------------------------

def inspect_cli(path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "millpond_server", "inspect", str(path)],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout


def test_inspect_a_healthy_file(tmp_path):
    path = small_file(tmp_path)
    before = path.read_bytes()
    code, out = inspect_cli(path)
    assert code == 0, out
    assert "format    version 5" in out and "schema    id:<i8 obs:<f4[3]" in out
    assert "commit A  generation" in out and "sound, used" in out
    assert "records   10 live (seqs 3 to 12): 6 cold, 4 hot" in out
    assert "checks    10 records checked (seq and checksum): all pass" in out
    assert out.rstrip().endswith("status    healthy")
    assert path.read_bytes() == before  # nothing written


def test_inspect_names_damaged_records_and_slots(tmp_path):
    path = small_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[72 + 16] ^= 0x20  # slot B's first
    meta = BufferFile.peek(str(path))
    slots = meta["hot_capacity"] + meta["spare"]
    for seq in (11, 4):  # hot, cold
        region, where = ("hot:obs", seq % slots) if seq >= 9 else ("obs", seq % 6)
        raw[meta["regions"][region][0] + 12 * where + 1] ^= 0x01
    path.write_bytes(bytes(raw))
    code, out = inspect_cli(path)
    assert code == 1, out
    assert "DAMAGED   2 of 10 records fail their seq and checksum check: seqs 4, 11" in out
    assert "commit B  generation" in out and ": DAMAGED" in out
    assert "note      commit slot B is damaged; slot A" in out


def test_inspect_a_file_it_cannot_read(tmp_path):
    path = small_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[130] ^= 0x01  # the metadata
    path.write_bytes(bytes(raw))
    code, out = inspect_cli(path)
    assert code == 2 and "UNREADABLE" in out and "damaged header" in out, out
    assert "commit A  generation" in out  # what can be read is shown
    code, out = inspect_cli(tmp_path / "missing.buffer")
    assert code == 2 and "no buffer file" in out
    (tmp_path / "junk.buffer").write_bytes(b"x" * 8192)
    assert inspect_cli(tmp_path / "junk.buffer")[0] == 2


def test_inspect_a_format_4_file_and_a_cold_only_file(tmp_path):
    code, out = inspect_cli(format4_file(tmp_path))
    assert code == 0 and "format    version 4 (" in out and "12 records checked" in out, out
    cold = tmp_path / "cold.buffer"
    buf = engine(Schema.from_spec(ID_FIELDS), 4, 10, cold)  # not persistent: open while it lives
    buf.push_batch(ids(0, 13))
    code, out = inspect_cli(cold)
    buf.close()
    assert code == 0 and "6 records checked (seq; cold only, no checksums: not persistent)" in out, out


@pytest.mark.daemon
@pytest.mark.slow
def test_sigkill_during_pushes_that_evict_loses_no_acknowledged_record(tmp_path):
    """A daemon killed while an actor's pushes evict: the file holds every acknowledged
    record the landed pushes did not evict, and the push in flight wholly or not at all
    (format 4's three commits lost the records an unlanded push evicted)."""
    data = tmp_path / "data"
    rng = np.random.default_rng(11)
    total, n = 1_000, 50
    for trial in range(int(os.environ.get("MILLPOND_CRASH_TRIALS", "12"))):
        server = ServerProcess(data).start()
        buf = millpond.connect(server.address, timeout=5).create_buffer(
            f"evict{trial}", hot_capacity=100, total_capacity=total, fields=ID_FIELDS)
        acked = [0]

        def actor(buf=buf, acked=acked) -> None:
            while True:
                try:
                    buf.push_batch(**ids(acked[0], n))
                except millpond.ReplayError:
                    return  # the daemon died under us
                acked[0] += n

        thread = threading.Thread(target=actor)
        thread.start()
        wait_until(lambda acked=acked: acked[0] >= 2 * total, timeout=60)  # evicting by now
        threading.Event().wait(rng.uniform(0.0, 0.05))  # a random moment, not a sync point
        server.stop(signal.SIGKILL)
        thread.join(30)
        stored = TieredBuffer.open(data / f"evict{trial}.buffer")
        pushed, got = stored.pushed, stored.contents()["id"].tolist()
        stored.release()
        assert pushed in (acked[0], acked[0] + n), (trial, pushed, acked[0])
        assert got == list(range(pushed - total, pushed)), \
            f"trial {trial}: {total - len(got)} acknowledged records lost"
