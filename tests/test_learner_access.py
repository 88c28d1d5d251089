"""Learner-side access (issue 13) on every transport: positions, everything, epochs, reset,
torch devices and export, against real daemons.

The contract matrix (``tests/test_contract_kinds.py``) runs these calls on every kind of
buffer; here: what needs more than equal outcomes (atomic reads under concurrent pushes,
epochs covering every record, reset surviving a crash and a restart, the .npz files).
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import test_contract_kinds as kinds
from support import ServerProcess, wait_for_ready, without_stats
from test_contract_kinds import FIELDS, TRANSPORTS, records

import millpond
from millpond.handle.export import export

three = kinds.three  # the fixture: three(kind) -> {transport: buffer}

OBS_DIM, ACT_DIM = 3, 2
_names = itertools.count()


def transitions(start: int, n: int, done_every: int = 0) -> dict[str, np.ndarray]:
    """Transitions whose every field says which step it is (``rewards`` = the step)."""
    steps = np.arange(start, start + n)
    ends = (steps % done_every == done_every - 1) if done_every else np.zeros(n, bool)
    return {"obs": np.repeat(steps[:, None], OBS_DIM, 1).astype(np.float32),
            "next_obs": np.repeat(steps[:, None] + 1, OBS_DIM, 1).astype(np.float32),
            "actions": np.repeat(steps[:, None] % 7, ACT_DIM, 1).astype(np.float32),
            "rewards": steps.astype(np.float32), "terminated": ends,
            "truncated": np.zeros(n, bool)}


@pytest.fixture
def transition_buffers(shared_server, tmp_path):
    """transition_buffers(**config) -> {transport: transition buffer}, empty."""
    made = []

    def factory(**config):
        name = f"learner-{next(_names)}"
        if "hot_capacity" in config:  # tiered
            local = millpond.MmapReplayBuffer(config["hot_capacity"], config["total_capacity"],
                                              cold_path=tmp_path / f"{name}.buffer",
                                              obs_dim=OBS_DIM, act_dim=ACT_DIM)
        else:
            local = millpond.ReplayBuffer(obs_dim=OBS_DIM, act_dim=ACT_DIM, **config)
        bufs = {"local": local}
        for transport in ("grpc", "shm"):
            client = millpond.connect(shared_server.address, shm=transport == "shm")
            bufs[transport] = client.create_buffer(f"{name}-{transport}", obs_dim=OBS_DIM,
                                                   act_dim=ACT_DIM, **config)
        made.extend(bufs.values())
        return bufs

    yield factory
    for buf in made:
        buf.close()


# ---- positions -----------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sample_by_index_counts_from_the_oldest_record(three, transport):
    buf = three("tiered")[transport]  # total capacity 12: the first 8 of 20 are evicted
    buf.push_batch(**records(0, 20))
    assert buf.size == len(buf) == 12
    got = buf.sample_by_index([0, 11, 5, 5], fields=["obs", "id"])
    assert list(got) == ["obs", "id"]  # the order asked for
    assert got["id"].tolist() == [8, 19, 13, 13]
    np.testing.assert_array_equal(got["obs"][:, 0], got["id"] * 0.5)
    assert buf.sample_by_index(np.array([], np.int64))["id"].shape == (0,)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("bad", [[12], [-1], [0, 3, 400], [2**62]])
def test_out_of_range_positions_are_a_typed_error_and_change_nothing(three, transport, bad):
    buf = three("max_times_sampled")[transport]
    buf.push_batch(**records(0, 12))
    buf.sample(6, seed=1)  # some records are drawn: their use counts must not move
    before = (without_stats(buf.info()), buf.sample_all())
    with pytest.raises(millpond.IndexOutOfRangeError) as caught:
        buf.sample_by_index(bad)
    assert isinstance(caught.value, millpond.InvalidArgumentError)
    assert isinstance(caught.value, IndexError)
    after = (without_stats(buf.info()), buf.sample_all())
    assert after[0] == before[0]
    np.testing.assert_array_equal(after[1]["id"], before[1]["id"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_positions_skip_records_used_up(three, transport):
    """A used-up record (max_times_sampled) is not held: positions count the others."""
    buf = three("max_times_sampled")[transport]
    buf.push_batch(**records(0, 4))
    for seed in range(3):
        buf.sample(2, seed=seed)  # 6 of the 8 draws: at least one record is used up
    held = buf.sample_all()["id"]
    assert len(held) == len(buf) < 4
    np.testing.assert_array_equal(buf.sample_by_index(np.arange(len(buf)))["id"], held)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sample_by_index_is_atomic_under_concurrent_pushes(three, transport):
    """Positions are resolved with the read: the rows always are the consecutive records
    at those positions in one state of the buffer, whatever a pusher does meanwhile."""
    buf = three("tiered")[transport]
    buf.push_batch(**records(0, 12))
    stop, errors = threading.Event(), []

    def pusher():
        i = 12
        try:
            while not stop.is_set():
                buf.push_batch(**records(i, 3))
                i += 3
        except Exception as exc:
            errors.append(repr(exc))

    thread = threading.Thread(target=pusher)
    thread.start()
    try:
        reads = 0
        before = buf.info()["pushed"]
        while reads < 300 or buf.info()["pushed"] < before + 300:
            got = buf.sample_by_index(np.arange(12), fields=["id", "obs"])
            ids = got["id"]
            assert (np.diff(ids) == 1).all(), ids  # 12 consecutive records: one state
            np.testing.assert_array_equal(got["obs"][:, 2], ids * 0.5)
            reads += 1
    finally:
        stop.set()
        thread.join(30)
    assert not errors


# ---- everything, epochs ----------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_sample_all_comes_in_chunks_under_a_small_message_limit(shared_server, transport):
    """6,000 records of 8 KB (48 MB) with a 4 MB message limit: several replies, in order."""
    client = millpond.connect(shared_server.address, shm=transport == "shm", max_message_mb=4)
    buf = client.create_buffer(f"chunks-{transport}", capacity=6000,
                               fields={"id": ("int64", ()), "pad": ("float64", (1023,))})
    try:
        for start in range(0, 6000, 400):
            ids = np.arange(start, start + 400)
            buf.push_batch(id=ids, pad=np.repeat(ids[:, None], 1023, 1).astype(np.float64))
        everything = buf.sample_all()
        np.testing.assert_array_equal(everything["id"], np.arange(6000))
        np.testing.assert_array_equal(everything["pad"][:, -1], np.arange(6000))
        assert buf.sample_all(fields=["id"])["id"].tolist() == list(range(6000))
    finally:
        buf.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_epoch_iterator_covers_every_record_once_per_epoch(three, transport):
    buf = three("ram")[transport]
    buf.push_batch(**records(100, 11))
    held = sorted(range(100, 111))
    epochs = list(buf.epoch_iterator(4, n_epochs=3, seed=7))
    assert [len(b["id"]) for b in epochs] == [4, 4, 3] * 3
    orders = [np.concatenate([b["id"] for b in epochs[i:i + 3]]) for i in (0, 3, 6)]
    for order in orders:
        assert sorted(order.tolist()) == held
    assert len({tuple(order.tolist()) for order in orders}) > 1  # shuffled anew each epoch
    again = [b["id"].tolist() for b in buf.epoch_iterator(4, n_epochs=3, seed=7)]
    assert again == [b["id"].tolist() for b in epochs]  # the same seed, the same batches
    in_order = list(buf.epoch_iterator(4, shuffle=False, drop_last=True))
    assert [b["id"].tolist() for b in in_order] == [held[:4], held[4:8]]
    assert buf.calculate_num_batches(4) == 3 and buf.calculate_num_batches(11) == 1
    with pytest.raises(millpond.InvalidBatchSizeError):
        buf.epoch_iterator(0)  # checked at once, not when iterated
    with pytest.raises(millpond.InvalidArgumentError):
        buf.epoch_iterator(4, n_epochs=0)


# ---- torch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_device_cpu_gives_tensors_equal_to_the_numpy_results(three, transport):
    torch = pytest.importorskip("torch")
    buf = three("prioritized")[transport]
    buf.push_batch(**records(0, 12))

    def same(tensors, arrays):
        assert list(tensors) == list(arrays)
        for name, array in arrays.items():
            tensor = tensors[name]
            assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
            np.testing.assert_array_equal(tensor.numpy(), array)
            assert tensor.numpy().dtype == array.dtype

    same(buf.sample(5, seed=3, device="cpu"), buf.sample(5, seed=3))
    same(buf.sample_by_index([3, 1], device="cpu"), buf.sample_by_index([3, 1]))
    same(buf.sample_all(device=torch.device("cpu")), buf.sample_all())
    for t, a in zip(buf.epoch_iterator(5, seed=2, device="cpu"), buf.epoch_iterator(5, seed=2)):
        same(t, a)
    with buf.sampler(4, seed=9, max_batches=2, device="cpu") as sampler:
        for i, batch in enumerate(sampler):
            same(batch, buf.sample(4, seed=9 + i))
    with pytest.raises(millpond.InvalidArgumentError):
        buf.sample_by_index([0], device="no-such-device")


# ---- reset -----------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reset_drops_every_record_and_keeps_the_config(three, transport):
    buf = three("prioritized")[transport]
    buf.push_batch(**records(0, 12))
    drawn = buf.sample(4, seed=1)
    buf.update_priorities(drawn["indices"], [9.0, 9.0, 9.0, 9.0])
    buf.set_beta(0.9)
    buf.reset()
    info = buf.info()
    assert len(buf) == 0 and info["size"] == 0 and info["pushed"] == 12
    assert info["max_priority"] == 1.0 and info["priority_total"] == 0.0
    assert info["beta"] == pytest.approx(0.9)  # the learner's schedule stays
    assert buf.update_priorities(drawn["indices"], [1.0] * 4) == 0  # old indices: gone
    with pytest.raises(millpond.NotEnoughDataError):
        buf.sample(1)
    buf.push_batch(**records(50, 3))
    assert buf.sample_all()["id"].tolist() == [50, 51, 52]
    assert buf.sample(3, seed=2)["weights"].tolist() == [1.0, 1.0, 1.0]  # all at priority 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reset_restores_use_counts_and_the_rate_limiter(three, transport):
    used = three("max_times_sampled")[transport]

    def draws_left() -> int:
        draws = 0
        while len(used):
            used.sample(1, seed=draws)
            draws += 1
        return draws

    used.push_batch(**records(0, 4))
    assert draws_left() == 8  # 4 records, 2 draws each: all used up
    used.reset()
    used.push_batch(**records(10, 4))
    assert len(used) == 4 and used.sample_all()["id"].tolist() == [10, 11, 12, 13]
    assert draws_left() == 8
    limited = three("rate_limited")[transport]  # 2 samples per insert, min size 4
    limited.push_batch(**records(0, 9))  # the band is full: more pushes would wait
    with pytest.raises(millpond.RateLimitTimeoutError):
        limited.push_batch(**records(9, 1), timeout=0)
    limited.reset()  # the balance restarts: pushes may go on; samples wait for 4 records
    limited.push_batch(**records(20, 3), timeout=0)
    with pytest.raises(millpond.RateLimitTimeoutError):
        limited.sample(1, timeout=0)
    limited.push_batch(**records(23, 6), timeout=0)  # the whole band again, from 0
    assert len(limited.sample(2, seed=0, timeout=0)["id"]) == 2
    assert limited.info()["inserts"] == 18  # the totals go on counting


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reset_of_an_episodic_buffer(transition_buffers, transport):
    buf = transition_buffers(capacity=64, episodes=True)[transport]
    buf.push_batch(**transitions(0, 10, done_every=5))
    buf.push_batch(**transitions(10, 2))  # an episode under way
    assert buf.info()["episodes"] == 2 and buf.info()["episodes_in_progress"] == 1
    buf.reset()
    info = buf.info()
    assert (len(buf), info["episodes"], info["episodes_in_progress"]) == (0, 0, 0)
    with pytest.raises(millpond.NotEnoughDataError):
        buf.sample_episodes(1)
    buf.push_batch(**transitions(20, 4, done_every=4))  # the thread's episode goes on anew
    catalog = buf.episode_catalog()
    assert catalog["lens"].tolist() == [4]
    assert buf.sample_episodes(1, seed=0)["rewards"].tolist() == [[20, 21, 22, 23]]


def test_reset_survives_a_crash_of_the_process(tmp_path):
    """A persistent in-process buffer reset (and pushed to after), then SIGKILLed,
    reopens with exactly the records pushed after the reset."""
    path = tmp_path / "reset.buffer"
    script = f"""
import numpy as np, millpond, sys
buf = millpond.MmapReplayBuffer(4, 16, cold_path={str(path)!r}, persistent=True,
                                fields={{"id": ("int64", ())}})
buf.push_batch(id=np.arange(10))
buf.reset()
buf.push_batch(id=np.arange(100, 103))
print("serving on done", flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_ready(proc, 60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    reopened = millpond.MmapReplayBuffer.open(path)
    try:
        assert reopened.sample_all()["id"].tolist() == [100, 101, 102]
        reopened.reset()
        reopened.release()
        again = millpond.MmapReplayBuffer.open(path)
        assert len(again) == 0 and again.info()["pushed"] == 13
        again.close()
    finally:
        reopened.close()


@pytest.mark.daemon
def test_reset_on_a_server_survives_a_restart(tmp_path):
    data = tmp_path / "data"
    with ServerProcess(data) as server:
        buf = millpond.connect(server.address).create_buffer(
            "to-reset", hot_capacity=4, total_capacity=16, fields=FIELDS)
        buf.push_batch(**records(0, 14))
        buf.reset()
        buf.push_batch(**records(40, 2))
        server.stop(signal.SIGKILL)
    with ServerProcess(data) as server:
        buf = millpond.connect(server.address).buffer("to-reset")
        assert buf.sample_all()["id"].tolist() == [40, 41]
        buf.reset()
        server.stop(signal.SIGKILL)
    with ServerProcess(data) as server:
        buf = millpond.connect(server.address).buffer("to-reset")
        assert len(buf) == 0 and buf.info()["pushed"] == 16


# ---- export ----------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", TRANSPORTS)
def test_export_round_trips_through_np_load(transition_buffers, transport, tmp_path):
    buf = transition_buffers(hot_capacity=8, total_capacity=40)[transport]
    buf.push_batch(**transitions(0, 50))  # 10 evicted: the export starts at step 10
    path = buf.export(tmp_path / f"run-{transport}")
    assert path.endswith(".npz")
    with np.load(path) as data:
        assert sorted(data.files) == sorted(["obs", "next_obs", "actions", "rewards",
                                             "terminated", "truncated"])
        expected = transitions(10, 40)
        for name, array in expected.items():
            np.testing.assert_array_equal(data[name], array.astype(data[name].dtype))
            assert data[name].dtype == buf.schema[name].dtype
    # In chunks of a few records, the same file.
    small = export(buf, tmp_path / f"small-{transport}.npz", chunk_bytes=200)
    with np.load(path) as whole, np.load(small) as chunked:
        for name in whole.files:
            np.testing.assert_array_equal(whole[name], chunked[name])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_export_of_an_episodic_buffer_has_episode_ids(transition_buffers, transport, tmp_path):
    buf = transition_buffers(capacity=30, episodes=True)[transport]
    buf.push_batch(**transitions(0, 12, done_every=4))
    path = buf.export(tmp_path / "episodes.npz")
    with np.load(path) as data:
        ids = data["episode_ids"]
        assert ids.dtype == np.int64 and len(ids) == 12
        assert [len(set(ids[i:i + 4].tolist())) for i in (0, 4, 8)] == [1, 1, 1]
        assert len(set(ids.tolist())) == 3
        np.testing.assert_array_equal(data["rewards"], np.arange(12))


def test_exported_transitions_load_as_a_dataset(tmp_path):
    datasets = pytest.importorskip("millpond.datasets")
    buf = millpond.ReplayBuffer(100, obs_dim=OBS_DIM, act_dim=ACT_DIM)
    buf.push_batch(**transitions(0, 20, done_every=5))
    loaded = datasets.load(buf.export(tmp_path / "run.npz"))
    data = dict(loaded) if isinstance(loaded, dict) else {
        name: getattr(loaded, name) for name in ("obs", "rewards")}
    np.testing.assert_array_equal(np.asarray(data["obs"]).reshape(20, OBS_DIM),
                                  transitions(0, 20)["obs"])
    np.testing.assert_array_equal(np.asarray(data["rewards"]).reshape(-1), np.arange(20))
