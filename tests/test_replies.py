"""A client trusts no reply: a daemon that lies (tests/lying_daemon.py) gets a typed
ProtocolError naming it, never wrong arrays, a raw KeyError or a draw that skips the data.

Each lie is told by a real daemon (one per lie, started once for the module); the
same calls go to it alone and, as one shard among honest daemons, through the sharded
client. Without its check each lie gets through (wrong rows, dtypes or columns handed
out, a raw KeyError or ValueError from a merge, draws placed by a size no shard can
hold, a result changed under the caller's feet); the stack's test is the other side, an
honest reply a check must not refuse."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np
import pytest
from support import ServerProcess
from test_contract import transitions

import millpond
import millpond.aio

pytestmark = pytest.mark.daemon
LYING = str(Path(__file__).with_name("lying_daemon.py"))
META = {"task": ("int64", ()), "score": ("float32", ())}
EPISODES, LENGTH = 10, 4  # each writer's complete episodes, and their length
CAPACITY = 60  # per shard: the episodes written fill 40 of it
_names = itertools.count()


@pytest.fixture(scope="module")
def liars(tmp_path_factory):
    """liars(lie) -> a daemon telling ``lie`` (started on first use, once per module)."""
    started: dict[str, ServerProcess] = {}

    def liar(lie: str) -> ServerProcess:
        if lie not in started:
            root = tmp_path_factory.mktemp(f"lie-{lie}")
            started[lie] = ServerProcess(root / "data", env={"MILLPOND_LIE": lie},
                                         script=LYING).start()
        return started[lie]

    yield liar
    for server in started.values():
        server.stop()


def connect(shards: list[str] | None, liar: ServerProcess, **settings):
    """A client of the liar alone (``shards`` None), or of two honest shards and it."""
    if shards is None:
        return millpond.connect(liar.address, **settings)
    return millpond.connect([*shards[:2], liar.address], **settings)


def steps(episode: int) -> dict:
    t = np.arange(LENGTH)
    obs = np.stack([np.full(LENGTH, episode), t, t], axis=1).astype(np.float32)
    return dict(obs=obs, next_obs=obs + 1, actions=np.zeros((LENGTH, 1), np.float32),
                rewards=t.astype(np.float32), terminated=t == LENGTH - 1,
                truncated=np.zeros(LENGTH, bool))


def episodic(client, shards: int = 1, **config):
    """A new episodic buffer holding, on every shard, EPISODES complete episodes."""
    name = f"replies-{next(_names)}"
    client.create_buffer(name, capacity=CAPACITY * shards, obs_dim=3, act_dim=1,
                         episodes=True, meta_fields=META, **config).release()
    handles = [client.buffer(name) for _ in range(shards)]  # they take the shards in turn
    for handle in handles:
        for episode in range(EPISODES):
            with handle.one_episode(task=episode % 2, score=0.5):
                handle.push_batch(**steps(episode))
        handle.flush()
    return handles[0]


# Every call whose reply carries columns, as a learner makes it (32 draws: over three
# shards, some are the liar's but with odds of 2e-6).
CALLS = {
    "sample": lambda b: b.sample(32),
    "filtered sample": lambda b: b.sample(32, filter_meta={"task": 1}),
    "n-step sample": lambda b: b.sample(32, n_step=3),
    "sequences": lambda b: b.sample_sequences(32, 3),
    "episodes": lambda b: b.sample_episodes(32),
    "episodes max_len": lambda b: b.sample_episodes(32, max_len=2),
    "read": lambda b: b.sample_by_index(np.arange(len(b))),
    "catalog": lambda b: b.episode_catalog(),
}
SHARDED = [pytest.param(False, id="alone"), pytest.param(True, id="sharded")]


@pytest.mark.parametrize("sharded", SHARDED)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("lie", ["rows", "dtype", "extra", "missing"])
def test_a_reply_of_columns_unlike_the_request_is_refused(liars, shards, sharded, lie, call):
    liar = liars(lie)
    buf = episodic(connect(shards if sharded else None, liar, shm=False), 3 if sharded else 1)
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        CALLS[call](buf)


@pytest.mark.parametrize("sharded", SHARDED)
@pytest.mark.parametrize("lie", ["rows", "dtype", "extra", "missing"])
def test_a_prioritized_sample_unlike_the_request_is_refused(liars, shards, sharded, lie):
    liar = liars(lie)
    client = connect(shards if sharded else None, liar, shm=False)
    buf = client.create_buffer(f"prio-{next(_names)}", capacity=300, obs_dim=2, act_dim=1,
                               prioritized=True)
    for _ in range(3):  # the client's handles take the shards in turn
        client.buffer(buf.backend.name).push_batch(**transitions(0, 40))
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        buf.sample(64)


@pytest.mark.parametrize("sharded", SHARDED)
@pytest.mark.parametrize("call", ["sequences", "episodes", "episodes max_len"])
def test_windows_and_episodes_wider_than_asked_or_than_the_buffer_are_refused(
        liars, shards, sharded, call):
    liar = liars("width")
    buf = episodic(connect(shards if sharded else None, liar, shm=False), 3 if sharded else 1)
    assert len(buf.sample(32)["obs"]) == 32  # (replies without windows are honest)
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        CALLS[call](buf)


@pytest.mark.parametrize("sharded", SHARDED)
def test_a_catalog_whose_seqs_are_not_its_episodes_is_refused(liars, shards, sharded):
    liar = liars("seqs")
    buf = episodic(connect(shards if sharded else None, liar, shm=False), 3 if sharded else 1)
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        buf.episode_catalog()


def test_a_shards_indices_that_name_another_shard_are_refused(liars, shards):
    """Alone, an index is the daemon's to give; over shards, one past 2**48 would route
    update_priorities to another shard."""
    liar = liars("indices")
    client = connect(shards, liar, shm=False)
    buf = client.create_buffer("indices", capacity=300, obs_dim=2, act_dim=1, prioritized=True)
    for _ in range(3):
        client.buffer("indices").push_batch(**transitions(0, 40))
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        buf.sample(64)


# ---- counts: pushes and update_priorities, on both transports -----------------------------

TRANSPORTS = [pytest.param(False, id="grpc"), pytest.param(True, id="shm")]


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_a_push_answered_with_a_size_beyond_the_capacity_is_refused(liars, shm):
    liar = liars("push")
    client = millpond.connect(liar.address, shm=shm)
    assert client.transport == ("shm" if shm else "grpc")
    buf = client.create_buffer(f"push-{next(_names)}", capacity=30, obs_dim=2, act_dim=1)
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        buf.push_batch(**transitions(0, 10))


def test_pushes_in_flight_answered_with_a_size_beyond_the_capacity_are_refused(liars):
    liar = liars("push")
    buf = millpond.connect(liar.address, shm=False, max_in_flight=4).create_buffer(
        f"push-{next(_names)}", capacity=30, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 10))  # on its way: answered later
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        buf.flush()


def test_pushes_in_flight_whose_count_stops_growing_are_refused(liars):
    """Replies on one stream come in order: each push's ``pushed`` is at least the one
    before plus its records. Each of these replies is possible alone."""
    liar = liars("pushed")
    buf = millpond.connect(liar.address, shm=False, max_in_flight=4).create_buffer(
        f"pushed-{next(_names)}", capacity=30, obs_dim=2, act_dim=1)
    with pytest.raises(millpond.ProtocolError, match="after 30 in the reply before it"):
        for i in range(6):  # the fourth fills the buffer: then "pushed" stays at 30
            buf.push_batch(**transitions(10 * i, 10))
        buf.flush()


def test_a_stacks_pushed_count_may_fall_between_pushes_in_flight(server):
    """An honest daemon: a stack's pops lower ``pushed``, so the window's replies are
    not held to growing there (they are for every other buffer)."""
    client = millpond.connect(server.address, shm=False, max_in_flight=4)
    stack = client.create_buffer("stack", capacity=30, obs_dim=2, act_dim=1, mode="stack")
    for i in range(3):
        stack.push_batch(**transitions(10 * i, 10))
        assert len(stack.sample(10)["obs"]) == 10  # after its pushes: "pushed" falls by 10
    stack.flush()


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_update_priorities_counting_more_records_than_given_is_refused(liars, shm):
    liar = liars("updated")
    client = millpond.connect(liar.address, shm=shm)
    buf = client.create_buffer(f"updated-{next(_names)}", capacity=30, obs_dim=2, act_dim=1,
                               prioritized=True)
    buf.push_batch(**transitions(0, 20))
    indices = buf.sample(8)["indices"]
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        buf.update_priorities(indices, np.ones(8))


# ---- infos ---------------------------------------------------------------------------------

def test_a_shard_that_claims_an_impossible_size_is_refused(liars, shards):
    liar = liars("size")
    client = connect(shards, liar, shm=False)
    with pytest.raises(millpond.ProtocolError, match=liar.address):  # its Create's info
        buf = client.create_buffer("sizes", capacity=100, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 20))
        buf.sample(8)


def test_a_shard_that_claims_more_than_its_share_of_the_capacity_is_refused(liars, shards):
    """Its Create was honest; its Info then claims a thousand times the capacity, and
    as many records, which would take every draw: possible for a buffer of that
    capacity, not for its share of this one."""
    liar = liars("capacity")
    client = connect(shards, liar, shm=False)
    buf = client.create_buffer(f"share-{next(_names)}", capacity=90, obs_dim=2, act_dim=1)
    for _ in range(3):
        client.buffer(buf.backend.name).push_batch(**transitions(0, 20))
    with pytest.raises(millpond.ProtocolError, match=f"shard 2 \\({liar.address}\\)"):
        buf.sample(64)
    alone = millpond.connect(liar.address, shm=False).buffer(buf.backend.name)
    assert alone.info().size == 30_000  # alone, the client cannot know


@pytest.mark.parametrize("sharded", SHARDED)
def test_more_episodes_than_the_capacity_are_refused(liars, shards, sharded):
    liar = liars("episodes")
    client = connect(shards if sharded else None, liar, shm=False)
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        episodic(client, 3 if sharded else 1).sample_episodes(8)


def test_a_priority_mass_that_is_not_a_number_is_refused(liars, shards):
    liar = liars("priority")
    client = connect(shards, liar, shm=False)
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        client.create_buffer("nan", capacity=90, obs_dim=2, act_dim=1, prioritized=True)


@pytest.mark.parametrize("sharded", SHARDED)
def test_a_create_answered_with_another_config_is_refused(liars, shards, sharded):
    liar = liars("config")
    client = connect(shards if sharded else None, liar, shm=False)
    with pytest.raises(millpond.ProtocolError, match=f"{liar.address}.*total_capacity"):
        client.create_buffer(f"config-{next(_names)}", capacity=90, obs_dim=2, act_dim=1)


def test_attaching_to_shards_whose_buffers_differ_is_refused(shards):
    """Honest daemons, one buffer name made differently on one shard: its samples would
    merge with the others' (float64 beside float32), so attaching is refused."""
    name = f"differs-{next(_names)}"
    for address in shards[:2]:
        millpond.connect(address).create_buffer(name, capacity=30, obs_dim=2, act_dim=1)
    millpond.connect(shards[2]).create_buffer(
        name, capacity=30, fields={"obs": ("float64", (2,))})
    with pytest.raises(millpond.ConfigMismatchError, match=f"shard 2 \\({shards[2]}\\)"):
        millpond.connect(shards).buffer(name)


def test_a_shard_holding_a_buffer_larger_than_the_whole_is_refused(shards):
    """The buffer exists on one shard only, with more capacity than the sharded buffer
    asked for: its size could then be beyond any share."""
    name = f"larger-{next(_names)}"
    millpond.connect(shards[2]).create_buffer(name, capacity=1000, obs_dim=2, act_dim=1)
    with pytest.raises(millpond.ConfigMismatchError, match="total_capacity: has 1000"):
        millpond.connect(shards).create_buffer(name, capacity=90, obs_dim=2, act_dim=1)


# ---- the fast path -------------------------------------------------------------------------

def test_a_fast_path_sample_that_claims_extras_it_was_not_asked_for_is_refused(liars):
    liar = liars("shm-extras")
    buf = millpond.connect(liar.address, shm=True).create_buffer(
        f"extras-{next(_names)}", capacity=30, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 20))
    with pytest.raises(millpond.ProtocolError, match=liar.address):
        buf.sample(8)


def test_a_result_segment_smaller_than_asked_is_refused(liars):
    liar = liars("shm-segment")
    buf = millpond.connect(liar.address, shm=True).create_buffer(
        f"segment-{next(_names)}", capacity=30, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 20))
    with pytest.raises(millpond.ProtocolError, match="not the segment asked for"):
        buf.sample(8)


def test_a_result_segment_with_the_id_of_one_in_use_is_refused(liars):
    """The server would write the next sample into a result the caller still holds."""
    liar = liars("shm-segment-id")
    obs_dim = 4096  # 8 records of 2 x 16 KiB: results too large to be copied out
    buf = millpond.connect(liar.address, shm=True).create_buffer(
        f"segment-id-{next(_names)}", capacity=30, obs_dim=obs_dim, act_dim=1)
    buf.push_batch(**transitions(0, 20, obs_dim))
    kept = buf.sample(8, seed=1)  # holds the first result segment
    snapshot = kept["obs"].copy()
    with pytest.raises(millpond.ProtocolError, match="segment id"):
        buf.sample(8, seed=2)
    np.testing.assert_array_equal(kept["obs"], snapshot)


# ---- the asyncio client: the same checks (millpond.aio, over gRPC) ------------------------

AIO_CALLS = {
    "sample": lambda b: b.sample(32),
    "filtered sample": lambda b: b.sample(32, filter_meta={"task": 1}),
    "n-step sample": lambda b: b.sample(32, n_step=3),
    "sequences": lambda b: b.sample_sequences(32, 3),
    "episodes": lambda b: b.sample_episodes(32),
    "read": lambda b: b.sample_by_index(np.arange(EPISODES * LENGTH)),
    "catalog": lambda b: b.episode_catalog(),
}


def aio_refuses(liar: ServerProcess, call, name: str | None = None) -> None:
    """``await call(handle of name)`` (``call(client)`` if no name) raises ProtocolError
    naming the liar."""
    async def main():
        async with millpond.aio.connect(liar.address) as client:
            target = client if name is None else await client.buffer(name)
            with pytest.raises(millpond.ProtocolError, match=liar.address):
                await call(target)

    asyncio.run(main())


@pytest.mark.parametrize("call", AIO_CALLS)
@pytest.mark.parametrize("lie", ["rows", "dtype", "extra", "missing"])
def test_the_asyncio_client_refuses_columns_unlike_the_request(liars, lie, call):
    liar = liars(lie)
    written = episodic(millpond.connect(liar.address, shm=False))  # (aio writes no episodes)
    aio_refuses(liar, AIO_CALLS[call], written.backend.name)


@pytest.mark.parametrize("lie, call", [
    ("width", "sequences"), ("width", "episodes"), ("seqs", "catalog")])
def test_the_asyncio_client_refuses_windows_and_catalogs_that_cannot_be(liars, lie, call):
    liar = liars(lie)
    written = episodic(millpond.connect(liar.address, shm=False))
    aio_refuses(liar, AIO_CALLS[call], written.backend.name)


def test_the_asyncio_client_refuses_impossible_counts_and_infos(liars):
    config = dict(capacity=30, obs_dim=2, act_dim=1)
    aio_refuses(liars("push"), lambda c: _created_and(c, config, lambda b: b.push_batch(
        **transitions(0, 10))))
    aio_refuses(liars("updated"), lambda c: _created_and(
        c, {**config, "prioritized": True}, _update_priorities))
    aio_refuses(liars("config"), lambda c: c.create_buffer(f"config-{next(_names)}", **config))
    aio_refuses(liars("priority"), lambda c: c.create_buffer(f"nan-{next(_names)}",
                                                             prioritized=True, **config))
    aio_refuses(liars("size"), lambda c: c.create_buffer(f"size-{next(_names)}", **config))


async def _created_and(client, config: dict, call):
    return await call(await client.create_buffer(f"aio-{next(_names)}", **config))


async def _update_priorities(buf):
    await buf.push_batch(**transitions(0, 20))
    await buf.update_priorities((await buf.sample(8))["indices"], np.ones(8))
