"""Prioritized replay (in-process): frequencies, weights, updates, across hot and cold."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from support import ServerProcess, engine

import millpond
from millpond.core import TieredBuffer
from millpond.core.bufferfile import BufferFile
from millpond.core.sumtree import SumTree


def tiered(tmp_path, alpha=1.0, beta=1.0, hot=5, total=20):
    return millpond.PrioritizedReplayBuffer(
        hot_capacity=hot, total_capacity=total, obs_dim=2, act_dim=1, alpha=alpha, beta=beta,
        cold_path=tmp_path / "prio.cold",
    )


def push_ids(buf, start, n, priorities=None):
    ids = np.arange(start, start + n, dtype=np.float32)
    buf.push_batch(np.repeat(ids[:, None], 2, 1), np.zeros((n, 2)), np.zeros((n, 1)), ids,
                   np.zeros(n), np.zeros(n), priorities=priorities)


def draws(buf, count: int, batch: int) -> np.ndarray:
    return np.concatenate([buf.sample(batch, seed=s)["rewards"] for s in range(count // batch)])


def test_frequencies_follow_priorities_across_hot_and_cold(tmp_path):
    buf = tiered(tmp_path, alpha=0.7)
    prios = np.arange(1, 31, dtype=float)
    push_ids(buf, 0, 30, prios)  # records 10..29 live: 10..24 cold, 25..29 hot
    assert buf.info()["cold_size"] == 15 and buf.info()["hot_size"] == 5
    got = np.bincount(draws(buf, 100_000, 20).astype(int), minlength=30)
    assert got[:10].sum() == 0  # evicted records are never drawn
    expected = prios[10:] ** 0.7 / (prios[10:] ** 0.7).sum()
    n = got.sum()
    sigma = np.sqrt(n * expected * (1 - expected))
    assert (np.abs(got[10:] - n * expected) < 5 * sigma).all()
    assert got[10:25].sum() > 0 and got[25:].sum() > 0  # both tiers take part


def test_importance_weights_match_the_formula(tmp_path):
    buf = tiered(tmp_path, alpha=0.5, beta=0.4)
    prios = np.linspace(0.5, 8.0, 20)
    push_ids(buf, 0, 20, prios)
    batch = buf.sample(20, seed=3)
    p = prios ** 0.5 / (prios ** 0.5).sum()
    ids = batch["rewards"].astype(int)
    expected = (20 * p[ids]) ** -0.4 / (20 * p.min()) ** -0.4
    np.testing.assert_allclose(batch["weights"], expected, rtol=1e-5)
    np.testing.assert_array_equal(batch["indices"], ids)  # no eviction yet: seq == id
    buf.set_beta(1.0)
    again = buf.sample(20, seed=3)
    np.testing.assert_allclose(again["weights"], (p[ids] / p.min()) ** -1.0, rtol=1e-5)


def test_new_records_get_the_largest_priority_seen(tmp_path):
    buf = tiered(tmp_path)
    push_ids(buf, 0, 4, [1.0, 1.0, 1.0, 9.0])
    push_ids(buf, 4, 1)  # default priority: 9
    got = np.bincount(draws(buf, 40_000, 5).astype(int), minlength=5)
    assert abs(got[4] / got[3] - 1) < 0.1 and got[4] > 5 * got[0]


def test_updates_to_evicted_records_are_ignored(tmp_path):
    buf = tiered(tmp_path, hot=2, total=4)
    push_ids(buf, 0, 4, [1.0, 1.0, 1.0, 1.0])
    sampled = buf.sample(4, seed=0)["indices"]
    push_ids(buf, 4, 2, [1.0, 1.0])  # records 0 and 1 are gone; 4 and 5 took their slots
    assert buf.update_priorities([0, 1, 2, 3], [100.0, 100.0, 1.0, 1.0]) == 2
    got = np.bincount(draws(buf, 20_000, 4).astype(int), minlength=6)
    assert got[:2].sum() == 0
    assert abs(got[4] / got[2] - 1) < 0.15  # the stale update did not land on record 4
    assert set(sampled.tolist()) <= {0, 1, 2, 3}


@pytest.mark.parametrize("bad", [[-1.0], [np.nan], [np.inf], [1.0, 2.0]])
def test_bad_priorities_are_rejected_and_change_nothing(tmp_path, bad):
    buf = tiered(tmp_path)
    push_ids(buf, 0, 3)
    before = (len(buf), buf.sample(3, seed=1)["weights"].tobytes())
    with pytest.raises(millpond.InvalidArgumentError):
        push_ids(buf, 3, 1, bad)
    with pytest.raises(millpond.InvalidArgumentError):
        buf.update_priorities([0], bad)
    assert (len(buf), buf.sample(3, seed=1)["weights"].tobytes()) == before


def test_alpha_zero_is_uniform_and_zero_priority_is_never_drawn(tmp_path):
    buf = tiered(tmp_path, alpha=0.0)
    push_ids(buf, 0, 10, np.arange(1, 11, dtype=float))
    got = np.bincount(draws(buf, 50_000, 10).astype(int), minlength=10)
    assert got.min() > 0.8 * got.max()
    zero = millpond.PrioritizedReplayBuffer(10, 2, 1, alpha=1.0, beta=1.0)  # RAM only
    push_ids(zero, 0, 5, [0.0, 1.0, 1.0, 0.0, 2.0])
    sample = zero.sample(5, seed=0)
    assert set(sample["rewards"].astype(int).tolist()) <= {1, 2, 4}
    assert np.isfinite(sample["weights"]).all() and sample["weights"].max() <= 1.0


def test_sum_tree_finds_leaves_in_proportion():
    tree = SumTree(7)
    tree.update(np.arange(7), np.array([1, 0, 2, 0, 3, 0, 4], float))
    assert tree.total == 10 and tree.min == 0  # zeros count for min unless unset
    prefixes = np.array([0.0, 0.99, 1.0, 2.99, 3.0, 5.99, 6.0, 9.99])
    np.testing.assert_array_equal(tree.find(prefixes), [0, 0, 2, 2, 4, 4, 6, 6])


# ---- persistent buffers: priorities in the file ----------------------------------------

ID_SCHEMA = millpond.Schema.from_spec({"id": ("float64", ())})


def persistent(path, alpha=1.0, beta=1.0, hot=4, total=12):
    return engine(ID_SCHEMA, hot, total, path, persistent=True, prioritized=True,
                  alpha=alpha, beta=beta)


def push_records(buf, start, n, priorities=None):
    columns = {"id": np.arange(start, start + n, dtype=np.float64)}
    if priorities is None:
        buf.push_batch(columns)
    else:
        buf.push_batch(columns, priorities)


def batches(buf, seeds=range(6), n=4):
    return [buf.sample(n, seed=s) for s in seeds]


def assert_equal_batches(got, expected):
    for here, there in zip(got, expected):
        assert here.keys() == there.keys()
        for key in here:
            np.testing.assert_array_equal(here[key], there[key])


def test_priorities_and_updates_survive_release_and_open(tmp_path):
    path = tmp_path / "prio.buf"
    buf = persistent(path, alpha=0.7, beta=0.5)
    push_records(buf, 0, 10, np.linspace(0.5, 5.0, 10))
    push_records(buf, 10, 9, np.linspace(7.0, 1.0, 9))  # 19 pushed: seqs 0..6 evicted
    sampled = buf.sample(8, seed=1)["indices"]
    assert buf.update_priorities(sampled, np.arange(8) * 2.5 + 0.1) == 8
    buf.push({"id": 99.0})  # no priority given: the largest seen so far
    expected, max_priority = batches(buf), buf.info().max_priority
    buf.release()

    again = TieredBuffer.open(path)
    assert again.config.prioritized == millpond.Prioritized(alpha=0.7)
    assert again.info().beta == 0.5 and again.info().max_priority == max_priority
    assert_equal_batches(batches(again), expected)  # records, weights and indices
    # updates after reopening are kept too, on the records they name
    live = np.arange(again.pushed - len(again), again.pushed)
    assert again.update_priorities(live, np.where(live == live[3], 50.0, 1.0)) == len(again)
    expected = batches(again)
    again.release()
    third = TieredBuffer.open(path)
    assert_equal_batches(batches(third), expected)
    assert third.info().max_priority == 50.0
    got = np.bincount(np.concatenate([b["indices"] for b in batches(third, range(200))]))
    assert got.argmax() == live[3]
    third.close()


def test_slots_of_evicted_records_carry_their_new_records_priorities(tmp_path):
    path = tmp_path / "prio.buf"
    buf = persistent(path, hot=2, total=4)
    push_records(buf, 0, 4, [100.0, 100.0, 1.0, 1.0])
    push_records(buf, 4, 2, [1.0, 3.0])  # seqs 4 and 5 take the slots of 0 and 1
    buf.release()
    again = TieredBuffer.open(path)
    batch = again.sample(4, seed=0)
    # alpha = beta = 1: the weight is p_min / p, whoever holds the slot
    np.testing.assert_allclose(batch["weights"], 1.0 / np.array([1.0, 1.0, 1.0, 3.0])[
        batch["indices"] - 2], rtol=1e-6)
    assert again.info().max_priority == 3.0  # the largest live one: the 100s are gone
    again.close()


def stored_priorities(path):
    """The file offsets of the priority and priority_seq slot arrays."""
    regions = BufferFile.peek(str(path))["regions"]
    return regions["slot:priority"][0], regions["slot:priority_seq"][0]


@pytest.mark.parametrize("damage", ["nan", "negative", "inf", "not its own"])
def test_a_damaged_stored_priority_comes_back_as_the_max_priority(tmp_path, damage):
    path = tmp_path / "prio.buf"
    buf = persistent(path)
    push_records(buf, 0, 6, [1.0, 2.0, 3.0, 4.0, 6.0, 5.0])
    buf.release()
    priority_at, owner_at = stored_priorities(path)
    with open(path, "r+b") as f:  # record 2 (slot 2)
        if damage == "not its own":  # its push's priority write never happened
            f.seek(owner_at + 8 * 2)
            f.write(struct.pack("<Q", 7))
        else:
            f.seek(priority_at + 8 * 2)
            f.write(struct.pack("<d", {"nan": np.nan, "negative": -3.0, "inf": np.inf}[damage]))
    again = TieredBuffer.open(path)
    assert again.info().max_priority == 6.0  # the largest sound live priority
    weights = {}
    for batch in batches(again, range(40), n=6):
        weights.update(zip(batch["indices"].tolist(), batch["weights"].tolist()))
    np.testing.assert_allclose(weights[2], 1.0 / 6.0, rtol=1e-6)  # p_min / max_priority
    np.testing.assert_allclose(weights[4], 1.0 / 6.0, rtol=1e-6)
    np.testing.assert_allclose(weights[1], 1.0 / 2.0, rtol=1e-6)
    again.release()
    with open(path, "rb") as f:  # the file was repaired to say what the tree does
        f.seek(priority_at + 8 * 2)
        assert struct.unpack("<d", f.read(8))[0] == 6.0
        f.seek(owner_at + 8 * 2)
        assert struct.unpack("<Q", f.read(8))[0] == 2


def test_damaged_records_stay_out_and_the_others_keep_their_priorities(tmp_path):
    path = tmp_path / "prio.buf"
    buf = persistent(path, hot=4, total=8)
    push_records(buf, 0, 6, [1.0, 2.0, 3.0, 4.0, 9.0, 6.0])  # 0, 1 cold; 2..5 hot
    buf.release()
    meta = BufferFile.peek(str(path))
    offset, slots = meta["regions"]["hot:id"][0], meta["hot_capacity"] + meta["spare"]
    with open(path, "r+b") as f:  # record 4 (hot): its checksum no longer matches
        f.seek(offset + 8 * (4 % slots))
        f.write(struct.pack("<d", 123.0))
    again = TieredBuffer.open(path, skip_corrupt=True)
    assert again.info().damaged == 1 and len(again) == 5
    assert again.info().max_priority == 6.0  # record 4's 9.0 is not live any more
    drawn = {}
    for batch in batches(again, range(60), n=5):
        drawn.update(zip(batch["indices"].tolist(), batch["weights"].tolist()))
    assert set(drawn) == {0, 1, 2, 3, 5}
    np.testing.assert_allclose([drawn[k] for k in (0, 1, 2, 3, 5)],
                               [1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 6], rtol=1e-6)
    again.close()


def test_zero_priorities_stay_zero_and_skipped_records_stay_out(tmp_path):
    path = tmp_path / "prio.buf"
    buf = persistent(path)
    push_records(buf, 0, 5, [0.0, 1.0, 0.0, 2.0, 0.5])
    buf.release()
    again = TieredBuffer.open(path)
    drawn = np.concatenate([b["indices"] for b in batches(again, range(50))])
    assert set(drawn.tolist()) == {1, 3, 4}
    assert again.info().max_priority == 2.0
    again.close()


def add_to_header(path, **meta):
    """Add keys to a buffer file's JSON metadata, in place (as an older version wrote it)."""
    BufferFile.write_meta(str(path), {**BufferFile.peek(str(path)), **meta})


def test_files_without_stored_priorities_still_open_at_priority_one(tmp_path):
    """A file written before priorities were persisted: no slot arrays."""
    path = tmp_path / "old.buf"
    old = engine(ID_SCHEMA, 4, 12, path, persistent=True)
    push_records(old, 0, 8)
    old.release()
    add_to_header(path, prioritized={"alpha": 0.6, "beta": 0.4})
    assert "slot_arrays" not in BufferFile.peek(str(path))
    buf = TieredBuffer.open(path)
    assert buf.config.prioritized == millpond.Prioritized(0.6) and len(buf) == 8
    np.testing.assert_allclose(buf.sample(8, seed=0)["weights"], 1.0)
    push_records(buf, 8, 2, [4.0, 4.0])  # works, kept in RAM only
    assert buf.update_priorities([0], [9.0]) == 1
    assert buf.info().max_priority == 9.0
    buf.release()
    np.testing.assert_allclose(TieredBuffer.open(path).sample(8, seed=0)["weights"], 1.0)


def test_non_persistent_buffers_keep_priorities_in_ram_only(tmp_path):
    buf = engine(ID_SCHEMA, 4, 12, tmp_path / "cold.buf", prioritized=True)
    assert "slot_arrays" not in BufferFile.peek(str(tmp_path / "cold.buf"))
    push_records(buf, 0, 12, np.arange(1.0, 13.0))
    assert buf.sample(4, seed=0)["weights"].max() <= 1.0
    buf.close()


# ---- on a server ---------------------------------------------------------------------


def test_remote_prioritized_buffer_matches_the_in_process_one(shared_server, tmp_path):
    local = tiered(tmp_path, alpha=0.6, beta=0.4)
    remote = millpond.PrioritizedReplayBuffer(
        hot_capacity=5, total_capacity=20, obs_dim=2, act_dim=1, alpha=0.6, beta=0.4,
        address=shared_server.address, name="prio-match")
    for buf in (local, remote):
        push_ids(buf, 0, 25, np.linspace(0.5, 5.0, 25))
        buf.push([99, 99], [0.0], 99.0, False, False, [99, 99], priority=7.0)
    for seed in range(5):  # same contents and seed: the same batch, weights and indices
        here, there = local.sample(16, seed=seed), remote.sample(16, seed=seed)
        assert here.keys() == there.keys()
        for key in here:
            np.testing.assert_array_equal(here[key], there[key])
    indices = remote.sample(8, seed=9)["indices"]
    assert remote.update_priorities(indices, np.full(8, 3.0)) == local.update_priorities(
        indices, np.full(8, 3.0))
    remote.set_beta(1.0)
    local.set_beta(1.0)
    np.testing.assert_array_equal(local.sample(16, seed=11)["weights"],
                                  remote.sample(16, seed=11)["weights"])
    again = millpond.connect(shared_server.address).buffer("prio-match")
    assert isinstance(again, millpond.PrioritizedBuffer) and len(again) == len(local)
    remote.close()


def test_priorities_on_a_uniform_remote_buffer_are_refused(shared_server):
    client = millpond.connect(shared_server.address)
    uniform = client.create_buffer("prio-uniform", capacity=10, obs_dim=2, act_dim=1)
    uniform.push_batch(np.zeros((3, 2)), np.zeros((3, 2)), np.zeros((3, 1)), np.zeros(3),
                       np.zeros(3), np.zeros(3))
    with pytest.raises(millpond.InvalidArgumentError, match="prioritized"):
        uniform.backend.update_priorities([0], [1.0])
    with pytest.raises(millpond.ConfigMismatchError):
        client.create_buffer("prio-uniform", capacity=10, obs_dim=2, act_dim=1, prioritized=True)


@pytest.mark.daemon
def test_a_prioritized_buffer_stays_prioritized_across_restarts(tmp_path):
    with ServerProcess(tmp_path / "data") as server:
        buf = millpond.PrioritizedReplayBuffer(20, 2, 1, alpha=0.5, beta=0.3,
                                               address=server.address, name="kept")
        push_ids(buf, 0, 10, np.arange(1, 11, dtype=float))
        before = buf.sample(10, seed=0)
    with ServerProcess(tmp_path / "data") as server:
        again = millpond.connect(server.address).buffer("kept")
        assert isinstance(again, millpond.PrioritizedBuffer) and len(again) == 10
        batch = again.sample(10, seed=0)
        assert {"weights", "indices"} <= batch.keys()
        # the priorities survived the restart: the same seed draws the same batch
        for key in before:
            np.testing.assert_array_equal(batch[key], before[key])
        ids = batch["rewards"].astype(int)
        np.testing.assert_allclose(batch["weights"], (np.sqrt(ids + 1.0) / 1.0) ** -0.3, rtol=1e-5)


# ---- over the shared-memory fast path ------------------------------------------------


def three_ways(tmp_path, address, name, alpha=0.6, beta=0.4, hot=5, total=20):
    """The same prioritized buffer in-process, on the server over shm, and over gRPC."""
    shm_client = millpond.connect(address, shm=True)
    grpc_client = millpond.connect(address, shm=False)
    config = dict(hot_capacity=hot, total_capacity=total, obs_dim=2, act_dim=1,
                  prioritized=True, alpha=alpha, beta=beta)
    return (tiered(tmp_path, alpha, beta, hot, total),
            shm_client.create_buffer(f"{name}-shm", **config),
            grpc_client.create_buffer(f"{name}-grpc", **config), shm_client)


def assert_same_batches(bufs, batch: int, seeds) -> None:
    for seed in seeds:
        first, *others = [buf.sample(batch, seed=seed) for buf in bufs]
        assert {"weights", "indices"} <= first.keys()
        for other in others:
            assert other.keys() == first.keys()
            for key in first:
                assert other[key].dtype == first[key].dtype, key
                np.testing.assert_array_equal(other[key], first[key], err_msg=key)


def test_prioritized_over_shm_equals_grpc_and_in_process(shared_server, tmp_path):
    local, shm, grpc, shm_client = three_ways(tmp_path, shared_server.address, "prio-3way")
    assert shm_client.transport == "shm"
    before = shm_client.calls
    rng = np.random.default_rng(7)
    for buf in (local, shm, grpc):
        push_ids(buf, 0, 25, np.linspace(0.5, 5.0, 25))  # 5 evicted, 15 cold, 5 hot
        push_ids(buf, 25, 3)  # default priority: the largest seen
        buf.push([99, 99], [0.0], 99.0, False, False, [99, 99], priority=7.0)
    assert_same_batches((local, shm, grpc), 16, range(6))
    for step in range(4):  # a learner's loop: sample, update, anneal
        batches = [buf.sample(16, seed=100 + step) for buf in (local, shm, grpc)]
        new = rng.random(16) * 4
        counts = [buf.update_priorities(b["indices"], new) for buf, b in zip((local, shm, grpc), batches)]
        assert counts[0] == counts[1] == counts[2] == 16
        for buf in (local, shm, grpc):
            buf.set_beta(0.4 + 0.2 * step)
    assert_same_batches((local, shm, grpc), 20, range(10, 16))
    calls = shm_client.calls - before  # the shm client really used the fast path
    assert calls["shm", "push_batch"] >= 3 and calls["shm", "update_priorities"] == 4
    assert calls["shm", "set_beta"] == 4 and calls["shm", "sample"] == 6 + 4 + 6
    assert not [key for key in calls if key[0] != "shm"]


def test_shm_weights_and_indices_are_views_like_the_columns(shared_server, tmp_path):
    _, shm, _, _ = three_ways(tmp_path, shared_server.address, "prio-views")
    push_ids(shm, 0, 20, np.arange(1, 21, dtype=float))
    kept = shm.sample(16, seed=1)
    snapshot = {k: v.copy() for k, v in kept.items()}
    base = kept["obs"].base  # one shared-memory block for the whole result: no copy
    assert not kept["weights"].flags.owndata and kept["weights"].base is base
    assert kept["indices"].base is base and kept["weights"].flags.writeable
    for _ in range(40):  # later samples and updates never change what the caller kept...
        batch = shm.sample(16)
        shm.update_priorities(batch["indices"], np.full(16, 2.0))
    for key in kept:
        np.testing.assert_array_equal(kept[key], snapshot[key])
    kept["weights"][:] = -1  # ...and private writes never reach the server
    assert (shm.sample(16, seed=1)["weights"] != -1).all()


def test_stale_updates_over_shm_are_ignored_like_in_process(shared_server, tmp_path):
    local, shm, grpc, _ = three_ways(tmp_path, shared_server.address, "prio-stale", alpha=1.0,
                                     beta=1.0, hot=2, total=4)
    for buf in (local, shm, grpc):
        push_ids(buf, 0, 4, [1.0, 1.0, 1.0, 1.0])
        push_ids(buf, 4, 2, [1.0, 1.0])  # records 0 and 1 are gone; 4 and 5 took their slots
        assert buf.update_priorities([0, 1, 2, 3], [100.0, 100.0, 1.0, 1.0]) == 2
        assert buf.update_priorities([], []) == 0
    assert_same_batches((local, shm, grpc), 4, range(20))
    assert (local.sample(4, seed=0)["weights"] == 1.0).all()  # the stale 100s landed nowhere


def test_prioritized_errors_over_shm_are_the_grpc_ones(shared_server, tmp_path):
    _, shm, grpc, _ = three_ways(tmp_path, shared_server.address, "prio-errors")
    uniforms = [millpond.connect(shared_server.address, shm=use_shm).create_buffer(
        "prio-errors-uniform", capacity=10, obs_dim=2, act_dim=1) for use_shm in (True, False)]
    assert uniforms[0].transport == "shm"
    for buf in (shm, grpc):
        push_ids(buf, 0, 3)
        with pytest.raises(millpond.InvalidConfigError, match="beta"):
            buf.set_beta(-1.0)
        with pytest.raises(millpond.InvalidConfigError, match="beta"):
            buf.set_beta(float("nan"))
        with pytest.raises(millpond.NotEnoughDataError):
            buf.sample(4)
    for uniform in uniforms:
        backend = uniform.backend
        with pytest.raises(millpond.InvalidArgumentError, match="prioritized"):
            backend.push_batch(zero_columns(uniform.schema, 2), priorities=[1.0, 2.0])
        with pytest.raises(millpond.InvalidArgumentError, match="prioritized"):
            backend.update_priorities([0], [1.0])
        with pytest.raises(millpond.InvalidArgumentError, match="prioritized"):
            backend.set_beta(0.5)
        backend.push_batch(zero_columns(uniform.schema, 2))
        assert uniform.sample(2, seed=0).keys() == set(uniform.schema.names)  # no extras
    assert len(uniforms[0]) == 4


def zero_columns(schema, n: int) -> dict:
    return {f.name: np.zeros((n, *f.shape), f.dtype) for f in schema}
