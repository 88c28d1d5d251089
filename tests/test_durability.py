"""Buffers outlive the daemon: restarts, SIGKILL crashes, reopening files, one daemon per directory."""

from __future__ import annotations

import json
import os
import random
import signal
import socket as socketlib
import struct
import subprocess
import sys
import threading
import time
import zlib

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerProcess, engine
from test_contract import transitions

import millpond
from millpond.core import BufferConfig, Schema, TieredBuffer

# Records that carry their own identity and checksum, so a crash test can tell
# a record that is present, missing, duplicated or torn.
CRASH_FIELDS = {"actor": ("int32", ()), "seq": ("int64", ()),
                "payload": ("uint8", (64,)), "crc": ("uint32", ())}
TRIALS = int(os.environ.get("MILLPOND_CRASH_TRIALS", "20"))


def crash_records(actor: int, start: int, n: int) -> dict[str, np.ndarray]:
    seqs = np.arange(start, start + n, dtype=np.int64)
    payload = ((seqs[:, None] * 31 + np.arange(64) + actor) % 251).astype(np.uint8)
    crc = np.array([zlib.crc32(struct.pack("<iq", actor, s) + p.tobytes())
                    for s, p in zip(seqs.tolist(), payload)], np.uint32)
    return {"actor": np.full(n, actor, np.int32), "seq": seqs, "payload": payload, "crc": crc}


def valid(records: dict[str, np.ndarray]) -> np.ndarray:
    return np.array([zlib.crc32(struct.pack("<iq", int(a), int(s)) + p.tobytes()) == c
                     for a, s, p, c in zip(records["actor"], records["seq"], records["payload"],
                                           records["crc"])], bool)


def snapshot(buf) -> tuple:
    info = buf.info()
    sample = buf.sample(len(buf), seed=3)
    return (info["size"], info["pushed"], info["hot_size"], info["cold_size"],
            info["hot_capacity"], info["total_capacity"], info["fields"],
            {k: v.tobytes() for k, v in sample.items()})


@pytest.mark.daemon
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_buffers_survive_a_restart(tmp_path, sig):
    data = tmp_path / "data"
    with ServerProcess(data) as server:
        client = millpond.connect(server.address)
        kept = client.create_buffer("kept", hot_capacity=4, total_capacity=20, obs_dim=2, act_dim=1)
        kept.push_batch(**transitions(0, 13))
        gone = client.create_buffer("gone", capacity=8, obs_dim=2, act_dim=1)
        gone.push_batch(**transitions(0, 3))
        gone.close()  # Close is the only thing that deletes data
        before = snapshot(kept)
        server.stop(sig)
    with ServerProcess(data) as server:
        client = millpond.connect(server.address)
        assert [b["name"] for b in client.list_buffers()] == ["kept"]
        again = client.buffer("kept")
        assert snapshot(again) == before
        again.push_batch(**transitions(13, 10))  # and it carries on where it stopped
        assert again.info()["pushed"] == 23 and len(again) == 20


@pytest.mark.daemon
def test_a_second_daemon_on_the_same_directory_refuses(tmp_path):
    with ServerProcess(tmp_path / "data"):
        second = ServerProcess(tmp_path / "data")
        with pytest.raises(RuntimeError, match="in use by another millpond daemon"):
            second.start(timeout=30)
        assert second.proc.returncode == 1


@pytest.mark.daemon
def test_recovery_is_logged_with_progress(tmp_path):
    data = tmp_path / "data"
    with ServerProcess(data) as server:
        client = millpond.connect(server.address)
        for name in ("a", "b"):
            client.create_buffer(name, capacity=8, obs_dim=2, act_dim=1).push_batch(**transitions(0, 5))
    server = ServerProcess(data, "--log-level", "info").start()
    server.stop()
    log = server.proc.stderr.read()
    assert 'msg="recovering buffer" buffer=a progress=1/2' in log
    assert 'msg="recovering buffer" buffer=b progress=2/2' in log
    assert 'msg="buffer recovered" buffer=b records=5' in log


@pytest.mark.daemon
@pytest.mark.parametrize("sync", ["none", "interval", "always"])
def test_every_sync_policy_serves_and_persists(tmp_path, sync):
    data = tmp_path / "data"
    with ServerProcess(data, "--sync", sync, "--sync-interval", "0.05") as server:
        buf = millpond.connect(server.address).create_buffer("b", capacity=50, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 30))
    with ServerProcess(data) as server:
        assert len(millpond.connect(server.address).buffer("b")) == 30


@pytest.mark.slow
@pytest.mark.daemon
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "grpc"])
def test_sigkill_crash_trials_lose_no_acknowledged_record(tmp_path, shm):
    """The daemon is SIGKILLed at random moments while actors push.

    After every restart each acknowledged record is present exactly once with
    a valid checksum, and every record served is a valid one that some actor
    sent (a push in flight may be fully present, never torn).
    """
    data = tmp_path / "data"
    rng = random.Random(7)
    acknowledged: dict[int, list[int]] = {}
    checked, interrupted = 0, []
    for trial in range(TRIALS):
        server = ServerProcess(data).start()
        client = millpond.connect(server.address, timeout=5, shm=shm)
        buf = client.create_buffer("crash", hot_capacity=500, total_capacity=TRIALS * 8_000,
                                   fields=CRASH_FIELDS)

        def actor(actor_id: int, buf=buf) -> None:
            done, n = acknowledged.setdefault(actor_id, []), 0
            while n < 4_000:  # bounded, so nothing is ever evicted in this test
                try:
                    buf.push_batch(**crash_records(actor_id, n, 50))
                except millpond.ReplayError:
                    interrupted.append(actor_id)
                    return  # the daemon died under us: what was acked stays acked
                done.extend(range(n, n + 50))
                n += 50

        actors = [threading.Thread(target=actor, args=(trial * 10 + i,)) for i in range(2)]
        for thread in actors:
            thread.start()
        threading.Event().wait(rng.uniform(0.002, 0.04))  # a random moment, not a sync point
        server.stop(signal.SIGKILL)
        for thread in actors:
            thread.join(30)
        client.close()

        stored = TieredBuffer.open(data / "crash.buffer")  # what a restart will serve
        records = stored.contents()
        stored.release()
        assert valid(records).all(), "a torn or damaged record would be served"
        keys = list(zip(records["actor"].tolist(), records["seq"].tolist()))
        assert len(keys) == len(set(keys)), "a record is present twice"
        present = set(keys)
        for actor_id, seqs in acknowledged.items():
            missing = [s for s in seqs if (actor_id, s) not in present]
            assert not missing, f"trial {trial}: actor {actor_id} lost acknowledged {missing[:5]}"
        checked = len(keys)
    assert checked >= sum(len(s) for s in acknowledged.values()) > 0
    assert len(interrupted) >= TRIALS, "most kills must land while pushes are in flight"
    print(f"{TRIALS} SIGKILL trials ({len(interrupted)} pushes interrupted), "
          f"{checked} records checked")


def test_in_process_persistent_buffer_reopens_and_refuses_mismatches(tmp_path):
    path = tmp_path / "mine.buffer"
    buf = millpond.MmapReplayBuffer(3, 10, 2, 1, path, persistent=True)
    buf.push_batch(**transitions(0, 8))
    before = buf.sample(8, seed=1)
    buf.release()
    assert path.exists()
    again = millpond.MmapReplayBuffer.open(path, hot_capacity=3, total_capacity=10,
                                           obs_dim=2, act_dim=1)
    assert len(again) == 8
    for key, value in again.sample(8, seed=1).items():
        np.testing.assert_array_equal(value, before[key])
    again.release()
    with pytest.raises(millpond.ConfigMismatchError, match="total_capacity"):
        millpond.MmapReplayBuffer.open(path, hot_capacity=3, total_capacity=11, obs_dim=2, act_dim=1)
    with pytest.raises(millpond.ConfigMismatchError, match="schema"):
        millpond.MmapReplayBuffer.open(path, obs_dim=3, act_dim=1)
    millpond.MmapReplayBuffer.open(path).close()  # close deletes
    assert not path.exists()


def test_damaged_files_are_refused_clearly(tmp_path):
    path = tmp_path / "b.buffer"
    engine(Schema.transition(2, 1), 3, 10, path, persistent=True).release()
    raw = bytearray(path.read_bytes())

    def reopen(data: bytes):
        path.write_bytes(data)
        TieredBuffer.open(path).release()

    reopen(bytes(raw[:32]) + bytes(36) + bytes(raw[68:]))  # one commit slot zeroed: the other serves
    with pytest.raises(millpond.CorruptFileError, match="both copies"):
        reopen(bytes(raw[:32]) + bytes(76) + bytes(raw[108:]))
    with pytest.raises(millpond.CorruptFileError, match="magic"):
        reopen(b"NOTMILLP" + bytes(raw[8:]))
    with pytest.raises(millpond.CorruptFileError, match="truncated"):
        reopen(bytes(raw[: len(raw) // 2]))
    not_persistent = tmp_path / "plain.cold"
    plain = engine(Schema.transition(2, 1), 3, 10, not_persistent)  # file exists while open
    with pytest.raises(millpond.CorruptFileError, match="non-persistent"):
        TieredBuffer.open(not_persistent)
    plain.release()  # not persistent: releasing deletes the useless file
    assert not not_persistent.exists()


@pytest.mark.daemon
def test_a_full_disk_refuses_new_buffers_and_never_kills_the_daemon(small_fs):
    with ServerProcess(small_fs / "data") as server:
        client = millpond.connect(server.address)
        buf = client.create_buffer("fits", hot_capacity=100, total_capacity=20_000,
                                   obs_dim=4, act_dim=1)  # about 1 MB, preallocated
        with pytest.raises(millpond.StorageFullError):  # RESOURCE_EXHAUSTED
            client.create_buffer("huge", hot_capacity=100, total_capacity=2_000_000,
                                 obs_dim=4, act_dim=1)
        assert not (small_fs / "data" / "huge.buffer").exists()  # no partial file
        filler = small_fs / "filler"
        with open(filler, "wb") as f:  # now use up every byte left
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        for start in range(0, 30_000, 3_000):  # the buffer keeps taking pushes and samples
            buf.push_batch(**transitions(start, 3_000, obs_dim=4))
            assert buf.sample(256)["obs"].shape == (256, 4)
        assert len(buf) == 20_000 and server.proc.poll() is None


def flip_byte(path, field: str, seq: int, hot: bool) -> None:
    """Flip one byte of record ``seq``'s ``field`` in a buffer file (a bad sector, a bit rot)."""
    raw = bytearray(path.read_bytes())
    length = struct.unpack_from("<I", raw, 16)[0]  # see core/bufferfile.py
    meta = json.loads(bytes(raw[128 : 128 + length]))
    offset, _ = meta["regions"][("hot:" if hot else "") + field]
    slot = seq % (meta["hot_capacity"] + meta.get("spare", 0) if hot else meta["cold_capacity"])
    nbytes = int(np.prod(meta["schema"][field][1] or [1])) * np.dtype(meta["schema"][field][0]).itemsize
    raw[offset + slot * nbytes] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("hot", [False, True], ids=["cold", "hot"])
def test_a_flipped_byte_is_found_and_can_be_skipped(tmp_path, hot):
    path = tmp_path / "b.buffer"
    buf = engine(Schema.from_spec(CRASH_FIELDS), 10, 60, path, persistent=True)
    buf.push_batch(crash_records(1, 0, 40))  # seqs 30..39 hot (slots 0..9), 0..29 cold
    buf.release()
    bad_seq = 33 if hot else 3
    flip_byte(path, "payload", bad_seq, hot=hot)
    with pytest.raises(millpond.CorruptFileError, match=rf"1 of 40 live records fail.*\[{bad_seq}\]"):
        TieredBuffer.open(path)
    survivor = TieredBuffer.open(path, skip_corrupt=True)
    assert survivor.info().damaged == 1 and len(survivor) == 39
    records = survivor.contents()
    assert valid(records).all() and bad_seq not in records["seq"].tolist()
    for seed in range(20):  # the damaged record is never served
        assert bad_seq not in survivor.sample(39, seed=seed)["seq"].tolist()
    survivor.push_batch(crash_records(1, 40, 60))  # pushing on evicts it with the others
    assert survivor.info().damaged == 0 and len(survivor) == 60
    survivor.release()


@pytest.mark.daemon
def test_the_daemon_names_damage_and_skip_corrupt_serves_the_rest(tmp_path):
    """(A damaged buffer used to stop the start; it is held out of service now, the
    others served: tests/test_operator.py.)"""
    data = tmp_path / "data"
    with ServerProcess(data) as server:
        buf = millpond.connect(server.address).create_buffer(
            "hurt", hot_capacity=10, total_capacity=60, fields=CRASH_FIELDS)
        buf.push_batch(**crash_records(1, 0, 40))
    flip_byte(data / "hurt.buffer", "actor", 5, hot=False)
    with ServerProcess(data) as server:
        client = millpond.connect(server.address)
        with pytest.raises(millpond.BufferDamagedError,
                           match=r"hurt\.buffer: 1 of 40 live records fail"):
            client.buffer("hurt")
    with ServerProcess(data, "--recover", "skip-corrupt") as server:
        buf = millpond.connect(server.address).buffer("hurt")
        assert len(buf) == 39
        assert valid(buf.sample(39, seed=1)).all()


def test_reopening_reports_progress_as_it_checks(tmp_path):
    path = tmp_path / "big.buffer"
    buf = engine(Schema.transition(4, 1), 1_000, 300_000, path, persistent=True)
    buf.push_batch(transitions(0, 300_000, obs_dim=4))
    buf.release()
    seen = []
    again = TieredBuffer.open(path, progress=lambda checked, live: seen.append((checked, live)))
    assert len(again) == 300_000
    assert len(seen) >= 4 and all(live == 300_000 for _, live in seen)
    assert [checked for checked, _ in seen] == sorted(checked for checked, _ in seen)
    again.release()


@pytest.mark.daemon
def test_health_is_not_serving_until_recovery_is_done_and_clients_wait_for_it(tmp_path):
    """Health says NOT_SERVING while a large buffer is recovered. A client started
    before the daemon, and one that calls during recovery, both complete their
    first call once the daemon is ready, within their timeout."""
    data = tmp_path / "data"
    data.mkdir()
    big = engine(Schema.transition(4, 1), 1_000, 8_000_000, data / "big.buffer",
                 persistent=True)
    for i in range(40):  # 8M records: checking them takes a noticeable moment
        big.push_batch(transitions(i * 200_000, 200_000, obs_dim=4))
    expected = big.sample(4, seed=0)
    big.release()
    # Out of the page cache: recovery then reads the disk, for a window of NOT_SERVING
    # long enough to be seen on a loaded machine (4M records from the cache: about 0.1 s).
    fd = os.open(data / "big.buffer", os.O_RDONLY)
    try:
        os.fsync(fd)  # (dirty pages cannot be dropped)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    with socketlib.socket() as probe:  # a free port, known before the daemon is ready
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    calls: dict[str, tuple] = {}

    def client_call(label: str, max_message_mb: int = 512) -> None:
        started = time.monotonic()
        try:
            client = millpond.connect(address, timeout=60, max_message_mb=max_message_mb)
            batch = client.buffer("big").sample(4, seed=0)
            calls[label] = (started, time.monotonic(), batch)
        except Exception as exc:
            calls[label] = (started, time.monotonic(), exc)

    early = threading.Thread(target=client_call, args=("before the daemon",))
    early.start()  # no daemon on that port yet
    proc = subprocess.Popen([sys.executable, "-m", "millpond_server", "serve", "--port", str(port),
                             "--data-dir", str(data)], stdout=subprocess.PIPE, text=True)
    seen, during = [], None
    try:
        fast_retry = [("grpc.initial_reconnect_backoff_ms", 10),
                      ("grpc.min_reconnect_backoff_ms", 10), ("grpc.max_reconnect_backoff_ms", 50)]
        with grpc.insecure_channel(address, options=fast_retry) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and "SERVING" not in seen:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1,
                                          wait_for_ready=True).status  # sent once connected
                    seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
                except grpc.RpcError:
                    continue  # not listening yet
                if seen[-1] == "NOT_SERVING" and during is None:
                    # Other channel options: gRPC shares a connection between channels
                    # with the same options, and the early one may be in its backoff.
                    during = threading.Thread(target=client_call, args=("during recovery", 256))
                    during.start()
        ready = time.monotonic()
        assert seen and seen[-1] == "SERVING"
        assert "NOT_SERVING" in seen, seen[:3]
        assert proc.stdout.readline().startswith("serving on")
        for thread in (early, during):
            thread.join(60)
        for label, (started, _, result) in calls.items():
            assert started < ready, label  # it really called before the daemon was ready
            assert not isinstance(result, Exception), (label, result)
            for key in expected:
                np.testing.assert_array_equal(result[key], expected[key], err_msg=label)
        assert set(calls) == {"before the daemon", "during recovery"}
    finally:
        proc.terminate()
        proc.wait(30)


def dirty_buffer(path):
    """A persistent buffer with 256 MiB of pages not yet written to disk."""
    schema = Schema.from_spec({"frame": ("uint8", (1 << 16,))})
    buf = TieredBuffer(BufferConfig(schema, 64, 4096), path, persistent=True)
    rows = np.ones((256, 1 << 16), np.uint8)
    for _ in range(16):
        buf.push_batch({"frame": rows})
    return buf


def syncing(buf, work):
    """Run ``buf.sync()`` in a thread and ``work()`` here until it ends; return the sync's
    seconds and ``work``'s longest call. Skip if the disk is too fast to tell."""
    synced = threading.Event()
    syncer = threading.Thread(target=lambda: (buf.sync(), synced.set()))
    start = time.perf_counter()
    longest = 0.0
    syncer.start()
    while not synced.is_set():
        before = time.perf_counter()
        work()
        longest = max(longest, time.perf_counter() - before)
    took = time.perf_counter() - start
    syncer.join()
    if took < 0.02:
        pytest.skip(f"the disk took 256 MiB in {took:.3f} s: too fast to tell a stall")
    return took, longest


def test_a_sync_writes_to_disk_while_other_threads_run(tmp_path):
    """The periodic sync (``--sync interval``) must not stop the daemon: while one buffer's
    dirty pages go to disk, the event loop and every other call keep running. (CPython's
    ``mmap.flush`` held the GIL through the whole write.)"""
    buf = dirty_buffer(tmp_path / "b.buffer")
    took, stall = syncing(buf, lambda: None)
    buf.close()
    assert stall < took / 2, (stall, took)


def test_pushes_to_the_buffer_being_synced_go_on(tmp_path):
    """The sync writes outside the buffer's lock: its own pushes and samples are not held
    up by the disk, and what was acknowledged before it is what a reopen finds."""
    buf = dirty_buffer(tmp_path / "b.buffer")
    frame = np.full((1, 1 << 16), 7, np.uint8)
    took, longest = syncing(buf, lambda: (buf.push_batch({"frame": frame}), buf.sample(1)))
    assert longest < took / 2, (longest, took)
    pushed = buf.info()["pushed"]
    buf.release()
    reopened = TieredBuffer.open(tmp_path / "b.buffer")
    assert reopened.info()["pushed"] == pushed
    reopened.close()
