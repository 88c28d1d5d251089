"""Three real daemons as one buffer: splits, turns, uniform and prioritized draws over the
union, update routing, seeds, and a shard SIGKILLed and restarted mid-run."""

from __future__ import annotations

import ipaddress
import itertools
import math
import pickle
import signal
import socket

import numpy as np
import pytest
from support import ServerProcess, start_all, wait_until

import millpond
from millpond.core import TieredBuffer
from millpond.sharded.client import ShardedClient
from millpond.sharded.names import _natural, resolve, stable_names
from millpond.sharded.placement import SHARD_SHIFT, decode_indices, encode_indices, shard_configs, split

FIELDS = {"id": ("int64", ())}
_names = itertools.count()


def name() -> str:
    return f"sharded-{next(_names)}"


def writers(client, buffer_name: str, n: int = 3) -> list:
    """``n`` handles of one client: they take the shards in turn."""
    handles = [client.buffer(buffer_name) for _ in range(n)]
    assert sorted(h.backend.shard for h in handles) == list(range(n))
    return sorted(handles, key=lambda h: h.backend.shard)


def chi_square_z(counts: np.ndarray, expected: np.ndarray) -> float:
    """Wilson-Hilferty: the chi-square statistic as a standard normal deviate."""
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


# ---- the arithmetic ------------------------------------------------------------------------

def test_capacities_split_with_the_remainder_to_the_first_shards():
    assert split(100, 3) == [34, 33, 33] and split(101, 3) == [34, 34, 33] and split(3, 3) == [1] * 3
    config = millpond.BufferConfig.build(hot_capacity=10, total_capacity=100, fields=FIELDS,
                                         mode="queue")
    configs = shard_configs(config, 3)
    assert [(c.hot_capacity, c.total_capacity) for c in configs] == [(4, 34), (3, 33), (3, 33)]
    assert [c.rate_limiter.max_diff for c in configs] == [34, 33, 33]  # the default queue follows
    with pytest.raises(millpond.InvalidConfigError, match="at least one record"):
        shard_configs(millpond.BufferConfig.build(capacity=2, fields=FIELDS), 3)


def test_indices_carry_their_shard():
    seqs = np.array([0, 5, 2**40])
    assert (encode_indices(2, seqs) == seqs + (2 << SHARD_SHIFT)).all()
    shard, seq = decode_indices(encode_indices(2, seqs), 3)
    assert (shard == 2).all() and (seq == seqs).all()
    with pytest.raises(millpond.InvalidArgumentError, match="shard 3"):
        decode_indices(encode_indices(3, seqs), 3)
    with pytest.raises(millpond.InvalidArgumentError):
        decode_indices(np.array([-1]), 3)


def test_dns_targets_resolve_to_the_addresses_own_names_or_the_addresses_sorted():
    loopback = ipaddress.ip_address("127.0.0.1")
    named = stable_names([loopback])  # /etc/hosts: 127.0.0.1 is localhost, and back
    assert named == [socket.gethostbyaddr("127.0.0.1")[0]]
    assert resolve("dns:///127.0.0.1:5") == [f"{named[0]}:5"]  # a name gRPC re-resolves
    # An address with no name of its own (no reverse DNS): the addresses, sorted.
    assert stable_names([loopback, ipaddress.ip_address("10.255.1.7")]) is None
    assert sorted(["millpond-10", "millpond-9", "millpond-0"], key=_natural) == [
        "millpond-0", "millpond-9", "millpond-10"]  # StatefulSet ordinals in order
    with pytest.raises(millpond.InvalidConfigError):
        resolve("dns:///localhost")


# ---- three daemons -----------------------------------------------------------------------------

def test_create_splits_and_info_aggregates_with_a_breakdown(shards):
    client = millpond.connect(shards, timeout=10)
    assert isinstance(client, ShardedClient) and client.shards == 3
    buf = client.create_buffer(name(), hot_capacity=10, total_capacity=100, fields=FIELDS)
    assert (buf.hot_capacity, buf.total_capacity) == (10, 100)
    for i, handle in enumerate(writers(client, buf.backend.name)):
        handle.push_batch(id=np.arange(10 * (i + 1)) + 1000 * i)
    info = buf.info()
    assert len(buf) == info.size == info["size"] == 60 and not info.degraded
    assert [s.info.size for s in info.shards] == [10, 20, 30]
    assert [s.info.total_capacity for s in info.shards] == [34, 33, 33]
    assert set(dict(info)) == set(dict(millpond.ReplayBuffer(5, fields=FIELDS).info()))
    # another client (another first shard) attaches to the same buffer
    again = millpond.connect(list(shards), timeout=10).create_buffer(
        buf.backend.name, hot_capacity=10, total_capacity=100, fields=FIELDS)
    assert len(again) == 60 and not again.backend.owner
    with pytest.raises(millpond.ConfigMismatchError):
        client.create_buffer(buf.backend.name, capacity=99, fields=FIELDS)
    listed = {i.name: i for i in client.list_buffers()}
    assert listed[buf.backend.name].size == 60
    buf.close()  # its creator deletes it on every shard
    assert buf.backend.name not in {i.name for i in client.list_buffers()}


def test_handles_stick_to_their_shard_and_batches_stay_whole(shards):
    client = millpond.connect(shards, timeout=10, push_batch_size=4)
    buf = client.create_buffer(name(), capacity=300, fields=FIELDS)
    handles = writers(client, buf.backend.name)
    for step in range(3):
        for handle in handles:
            handle.push_batch(id=np.arange(5) + 100 * handle.backend.shard + 10 * step)
            for j in range(3):  # single pushes are batched on the handle, sent to its shard
                handle.push(id=50 + 100 * handle.backend.shard + 3 * step + j)
    for handle in handles:
        handle.flush()
    shards_info = buf.info().shards
    assert [s.info.size for s in shards_info] == [24, 24, 24]
    for shard in range(3):  # every record of shard s came through its handle
        single = millpond.connect(shards[shard]).buffer(buf.backend.name)
        assert set(single.sample(24, seed=0)["id"] // 100) == {shard}
    buf.close()


def test_samples_are_uniform_over_the_union_of_uneven_shards(shards):
    client = millpond.connect(shards, timeout=10)
    buf = client.create_buffer(name(), capacity=600, fields=FIELDS)
    counts = (150, 90, 60)
    start = 0
    for handle, n in zip(writers(client, buf.backend.name), counts):
        handle.push_batch(id=np.arange(start, start + n))
        start += n
    draws = np.concatenate([buf.sample(300, seed=seed)["id"] for seed in range(100)])
    hist = np.bincount(draws, minlength=300)
    assert chi_square_z(hist, np.full(300, len(draws) / 300)) < 4.0
    by_shard = np.array([hist[:150].sum(), hist[150:240].sum(), hist[240:].sum()]) / len(draws)
    np.testing.assert_allclose(by_shard, [0.5, 0.3, 0.2], atol=0.02)
    # the same seed and contents give the same batch, whichever client asks
    other = millpond.connect(list(shards), timeout=10).buffer(buf.backend.name)
    for seed in (1, 2):
        np.testing.assert_array_equal(buf.sample(64, seed=seed)["id"],
                                      other.sample(64, seed=seed)["id"])
    clone = pickle.loads(pickle.dumps(other))
    np.testing.assert_array_equal(clone.sample(64, seed=3)["id"], buf.sample(64, seed=3)["id"])
    with pytest.raises(millpond.NotEnoughDataError):
        buf.sample(301)
    buf.close()


def test_prioritized_draws_follow_each_shards_mass_with_global_weights(shards):
    client = millpond.connect(shards, timeout=10)
    buf = client.create_buffer(name(), capacity=900, fields=FIELDS, prioritized=True,
                               alpha=1.0, beta=0.5)
    for handle in writers(client, buf.backend.name):
        shard = handle.backend.shard
        handle.push_batch(id=np.arange(100) + 1000 * shard, priorities=np.full(100, shard + 1.0))
    info = buf.info()
    assert info.priority_total == pytest.approx(600.0) and info.priority_min == 1.0
    batches = [buf.sample(300, seed=seed) for seed in range(40)]
    ids = np.concatenate([b["id"] for b in batches])
    indices = np.concatenate([b["indices"] for b in batches])
    weights = np.concatenate([b["weights"] for b in batches])
    shard_of = indices >> SHARD_SHIFT
    assert (shard_of == ids // 1000).all()  # indices carry the shard that holds the record
    assert ((indices & (2**SHARD_SHIFT - 1)) == ids % 1000).all()  # and its seq there
    fractions = np.bincount(shard_of, minlength=3) / len(ids)
    np.testing.assert_allclose(fractions, [1 / 6, 2 / 6, 3 / 6], atol=0.02)
    # weights against the global minimum (1.0, on shard 0): (p / 1) ** -beta
    np.testing.assert_allclose(weights, (shard_of + 1.0) ** -0.5, rtol=1e-6)
    buf.set_beta(1.0)
    np.testing.assert_allclose(buf.sample(50, seed=0)["weights"].min(), 1 / 3, rtol=1e-6)
    buf.close()


def test_update_priorities_routes_each_index_to_its_shard(shards):
    client = millpond.connect(shards, timeout=10)
    buf = client.create_buffer(name(), capacity=300, fields=FIELDS, prioritized=True,
                               alpha=1.0, beta=0.4)
    for handle in writers(client, buf.backend.name):
        handle.push_batch(id=np.arange(50), priorities=np.ones(50))
    indices = encode_indices(1, np.arange(50))
    assert buf.update_priorities(indices, np.full(50, 4.0)) == 50
    totals = [s.info.priority_total for s in buf.info().shards]
    assert totals == pytest.approx([50.0, 200.0, 50.0])
    batch = buf.sample(100, seed=7)
    assert buf.update_priorities(batch["indices"], np.zeros(100)) == 100
    zeroed = np.unique(batch["indices"])
    lost = np.where(zeroed >> SHARD_SHIFT == 1, 4.0, 1.0).sum()
    assert buf.info().priority_total == pytest.approx(300.0 - lost)
    with pytest.raises(millpond.InvalidArgumentError):
        buf.update_priorities(encode_indices(3, [0]), [1.0])
    buf.close()


def test_queues_pop_from_the_fullest_shard_and_classes_take_address_lists(shards):
    client = millpond.connect(shards, timeout=10)
    queue = client.create_buffer(name(), capacity=30, fields=FIELDS, mode="queue")
    for i, handle in enumerate(writers(client, queue.backend.name)):
        handle.push_batch(id=np.arange(i + 2) + 10 * handle.backend.shard)
    assert queue.sample(4)["id"].tolist() == [20, 21, 22, 23] and len(queue) == 5
    queue.close()
    buf = millpond.ReplayBuffer(30, obs_dim=2, act_dim=1, address=shards, name=name())
    buf.push(np.zeros(2), np.zeros(1), 1.0, False, False, np.ones(2))
    buf.flush()
    assert len(buf) == 1 and buf.sample(1, seed=0)["rewards"].tolist() == [1.0]
    buf.close()
    one = millpond.connect(f"dns:///{shards[0]}", timeout=10)  # a name of one address
    port = shards[0].rsplit(":", 1)[1]  # 127.0.0.1's own name (localhost), or the address
    assert one.shards == 1 and one.addresses in ((shards[0],), (f"localhost:{port}",))
    via_name = one.create_buffer(name(), capacity=3, fields=FIELDS)
    via_name.push_batch(id=[7])
    assert len(via_name) == 1 and via_name.sample(1)["id"].tolist() == [7]
    via_name.close()


# ---- a shard dies and comes back -----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.daemon
def test_a_shard_killed_and_restarted_mid_run_loses_nothing_acknowledged(tmp_path):
    servers = start_all([ServerProcess(tmp_path / f"shard{i}") for i in range(3)])
    try:
        addresses = [s.address for s in servers]
        client = millpond.connect(addresses, timeout=2)
        buf = client.create_buffer("run", capacity=3_000, fields=FIELDS)
        handles = writers(client, "run")
        acked: list[int] = []
        next_id = itertools.count()

        def push_round() -> None:
            for handle in handles:
                ids = np.array([next(next_id) for _ in range(20)])
                handle.push_batch(id=ids)
                acked.extend(ids.tolist())  # acknowledged: push_batch returned

        for _ in range(5):
            push_round()
        before = buf.info().shards[1].info.size
        servers[1].proc.kill()
        servers[1].proc.wait()
        for _ in range(5):  # shard 1's writer moves on to shard 2
            push_round()
        assert handles[1].backend.shard == 2
        info = buf.info()
        assert info.degraded and not info.shards[1].live and info.shards[1].error
        assert info.size == len(acked) - before
        drawn = buf.sample(200, seed=1)["id"]
        assert np.isin(drawn, acked).all()
        port = addresses[1].rpartition(":")[2]
        servers[1] = ServerProcess(tmp_path / "shard1", "--port", port).start()
        wait_until(lambda: not buf.info().degraded, timeout=20)
        for _ in range(3):
            push_round()
        assert len(buf) == len(acked)
        on_shard_1 = set(millpond.connect(addresses[1]).buffer("run").sample(100, seed=0)["id"])
        drawn = set(np.concatenate([buf.sample(300, seed=s)["id"] for s in range(5)]).tolist())
        assert drawn & on_shard_1  # its durable records are drawn again
    finally:
        for server in servers:
            server.stop(signal.SIGTERM)
    held = []
    for i in range(3):
        buffer = TieredBuffer.open(tmp_path / f"shard{i}" / "run.buffer")
        held.extend(buffer.contents()["id"].tolist())
        buffer.release()
    assert set(acked) <= set(held)


def _actor(handle, start: int) -> int:
    handle.push_batch(id=np.arange(start, start + 10))
    return handle.backend.shard


def test_pickled_handles_work_in_spawned_actors(shards):
    import multiprocessing

    client = millpond.connect(shards, timeout=10)
    buf = client.create_buffer(name(), capacity=300, fields=FIELDS)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        homes = pool.starmap(_actor, [(client.buffer(buf.backend.name), 100 * i)
                                      for i in range(4)])
    assert len(buf) == 40 and set(homes) <= {0, 1, 2}
    buf.close()
