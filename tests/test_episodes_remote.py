"""Episodic buffers on every transport: in-process, gRPC and shared memory, and across crashes.

The same session of episodic calls runs on the three (writes through push,
``one_episode``/``store``, ``end_episode`` and an episode writer; seeded
sequence, n-step, filtered and episode samples; the catalog, reads and the
dataloader at all three levels; bad input) and every outcome must agree.
Episode ids are random per writer, so they are compared by the order in
which they appear. The crash test SIGKILLs the daemon while actors write
self-checking episodes and checks every acknowledged episode after restart.
"""

from __future__ import annotations

import itertools
import signal
import threading

import numpy as np
import pytest
from support import ServerProcess, run_everywhere

import millpond

pytestmark = pytest.mark.daemon

META = {"task": ("int64", ())}
KINDS = {
    "ram": dict(capacity=40),
    "tiered": dict(hot_capacity=8, total_capacity=40),
    "prioritized": dict(hot_capacity=8, total_capacity=40, prioritized=True),
}
_names = itertools.count()


@pytest.fixture
def three(shared_server, tmp_path):
    """three(kind) -> {transport: an empty episodic transition buffer of that kind}."""
    made = []

    def factory(kind: str) -> dict:
        spec = dict(KINDS[kind])
        local_spec = dict(spec)
        prioritized = local_spec.pop("prioritized", False)
        hot = local_spec.pop("hot_capacity", local_spec.get("capacity"))
        total = local_spec.pop("total_capacity", local_spec.pop("capacity", None))
        path = tmp_path / f"local-{next(_names)}.buffer"
        cls = millpond.PrioritizedReplayBuffer if prioritized else None
        if cls is not None:
            local = cls(hot_capacity=hot, total_capacity=total, cold_path=path, obs_dim=2,
                        act_dim=1, episodes=True, meta_fields=META)
        else:
            local = millpond.MmapReplayBuffer(hot, total, 2, 1, path, episodes=True,
                                              meta_fields=META)
        bufs = {"local": local}
        for transport in ("grpc", "shm"):
            client = millpond.connect(shared_server.address, shm=transport == "shm")
            assert client.transport == transport
            bufs[transport] = client.create_buffer(
                f"episodes-{kind}-{next(_names)}", obs_dim=2, act_dim=1, episodes=True,
                meta_fields=META, **spec)
        made.extend(bufs.values())
        return bufs

    yield factory
    for buf in made:
        buf.close()


def step(t: float, done: bool = False) -> dict:
    return {"obs": np.array([t, -t], np.float32), "actions": np.array([0.0], np.float32),
            "rewards": float(t) % 7, "terminated": done, "truncated": False,
            "next_obs": np.array([t + 1, 0], np.float32)}


def ranked(result: dict) -> dict:
    """``result`` with episode ids replaced by the order of their first appearance."""
    out = dict(result)
    if "episode_ids" in out:
        ids = out["episode_ids"]
        _, first = np.unique(ids, return_index=True)
        order = {int(e): rank for rank, e in enumerate(ids[np.sort(first)])}
        out["episode_ids"] = np.array([order[int(e)] for e in ids])
    return out


def loaded(loader) -> list:
    return [ranked(batch) for batch in loader]


def session() -> list:
    def writer(b):
        with b.episode_writer(n_envs=3) as w:
            for t in range(5):
                w.append(**{k: np.stack([v] * 3) for k, v in step(100 + t).items()}
                         | {"terminated": np.array([t == 1, False, t == 3])})
            w.end_episode(1, task=7)

    def episode(b):
        with b.one_episode(task=2):
            for t in range(4):
                b.store(**step(50 + t))

    return [
        lambda b: [b.push(**step(t, t in (3, 8))) for t in range(10)] and None,
        lambda b: b.end_episode(task=1),  # the episode the flag at t=8 ended
        episode,
        writer,
        lambda b: [b.push(**step(200 + t)) for t in range(3)] and None,  # running
        lambda b: {k: v for k, v in b.info().items() if k.startswith("episodes")},
        lambda b: ranked(b.sample_sequences(6, 4, seed=1)),
        lambda b: ranked(b.sample_sequences(5, 3, seed=2, filter_meta={"task": 2})),
        lambda b: b.sample(6, seed=3, n_step=3, gamma=0.9),
        lambda b: b.sample(4, seed=4, filter_meta={"task": 7}),
        lambda b: ranked(b.sample_episodes(3, seed=5)),
        lambda b: ranked(b.sample_episodes(3, seed=6, max_len=2, filter_meta={"task": 1})),
        lambda b: ranked(b.episode_catalog()),
        lambda b: b.read(b.episode_catalog()["seqs"][::2], ["obs", "rewards"]),
        lambda b: b.read([0, 10_000], None),
        lambda b: loaded(b.dataloader(batch_size=2, return_mask=True)),
        lambda b: loaded(b.dataloader(batch_size=4, timestep_level=True, shuffle=True, seed=1)),
        lambda b: loaded(b.dataloader(batch_size=3, n_steps=2, sequence_fields=("rewards",),
                                      filter_meta={"task": 0})),
        # bad input: the same typed error everywhere, nothing changed
        lambda b: b.sample_sequences(2, 0),
        lambda b: b.sample(2, n_step=-1),
        lambda b: b.sample(2, n_step=2, gamma=2.0),
        lambda b: b.sample(2, filter_meta={"nope": 1}),
        lambda b: b.sample(2, filter_meta={"task": 1.5}),
        lambda b: b.sample_sequences(2, 3, filter_meta={"task": 99}),
        lambda b: b.sample_episodes(2, filter_meta={"task": 99}),
        lambda b: b.end_episode(task="x"),
        lambda b: b.read([0], ["nope"]),
        lambda b: b.push(**step(0)) or b.flush(),
        lambda b: {k: v for k, v in b.info().items() if k.startswith("episodes")},
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_episodic_calls_behave_the_same_on_every_transport(three, kind):
    run_everywhere(three(kind), session())


def test_sequences_travel_over_shared_memory_and_episodes_over_grpc(three):
    buf = three("ram")["shm"]
    for t in range(12):
        buf.push(**step(t, t == 5))
    buf.sample_sequences(4, 3)
    buf.sample(4, n_step=2)
    buf.read([0, 1])
    buf.sample_episodes(2)
    calls = buf.client.calls  # this process's calls, by (transport, op)
    assert calls["shm", "sample_sequences"] == calls["shm", "sample_n_step"] == 1
    assert calls["shm", "read"] == 1 and calls["grpc", "sample_episodes"] == 1


def test_prioritized_sequence_indices_update_priorities_remotely(three):
    for transport, buf in three("prioritized").items():
        for t in range(20):
            buf.push(**step(t, t % 6 == 5))
        out = buf.sample_sequences(8, 4, seed=0)
        assert buf.update_priorities(out["indices"], np.arange(1.0, 9.0)) == 8, transport
        again = buf.sample_sequences(8, 4, seed=0)
        assert again["weights"].max() == pytest.approx(1.0), transport


# ---- crashes --------------------------------------------------------------------------------

def episode_steps(actor: int, number: int, length: int) -> dict:
    """Self-checking steps: obs = (actor, episode number, step), reward = step."""
    t = np.arange(length)
    return {"obs": np.stack([np.full(length, actor), np.full(length, number), t], 1)
            .astype(np.float32),
            "next_obs": np.zeros((length, 3), np.float32), "actions": np.zeros((length, 1)),
            "rewards": t.astype(np.float32), "terminated": t == length - 1,
            "truncated": np.zeros(length, bool)}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_acknowledged_episodes_survive_a_crash_of_the_daemon(tmp_path, sig):
    data = tmp_path / "data"
    acknowledged: dict[int, list[tuple[int, int]]] = {}
    server = ServerProcess(data).start()
    client = millpond.connect(server.address, timeout=5)
    client.create_buffer("crash", hot_capacity=64, total_capacity=100_000, obs_dim=3, act_dim=1,
                         episodes=True, meta_fields={"number": "int64"})
    stop = threading.Event()

    def actor(actor_id: int) -> None:
        done = acknowledged.setdefault(actor_id, [])
        try:
            buf = millpond.connect(server.address, timeout=5).buffer("crash")
        except millpond.ReplayError:
            return  # the daemon died before this actor (slow to start) got in
        for number in itertools.count():
            length = 3 + (number * 7 + actor_id) % 11
            try:
                with buf.one_episode(number=number):  # its end is acknowledged on leaving
                    buf.push_batch(**episode_steps(actor_id, number, length))
            except millpond.ReplayError:
                return  # the daemon died under us: what was acknowledged stays so
            done.append((number, length))
            if stop.is_set() and number > 5:
                return

    actors = [threading.Thread(target=actor, args=(i,)) for i in range(3)]
    for thread in actors:
        thread.start()
    deadline = threading.Event()
    while sum(len(v) for v in acknowledged.values()) < 30:
        deadline.wait(0.01)
    server.stop(sig)
    stop.set()
    for thread in actors:
        thread.join(30)

    with ServerProcess(data) as server:
        buf = millpond.connect(server.address).buffer("crash")
        catalog = buf.episode_catalog()
        rows = buf.read(catalog["seqs"], ["obs", "rewards"])
        assert rows["live"].all()
        found = {}
        start = 0
        for number, length in zip(catalog["number"].tolist(), catalog["lens"].tolist()):
            obs = rows["obs"][start:start + length]
            start += length
            actor_id = int(obs[0, 0])
            assert (obs[:, 0] == actor_id).all() and (obs[:, 1] == number).all()
            assert obs[:, 2].tolist() == list(range(length))  # in order, whole, not torn
            found[(actor_id, number)] = length
        for actor_id, episodes in acknowledged.items():
            for number, length in episodes:
                assert found.get((actor_id, number)) == length, (actor_id, number)
        out = buf.sample_sequences(16, 5, seed=0)
        assert (out["lens"] >= 1).all()
        assert buf.info()["episodes"] >= sum(len(v) for v in acknowledged.values())


def test_the_toml_file_declares_episodic_buffers(tmp_path):
    toml = tmp_path / "buffers.toml"
    toml.write_text('[[buffers]]\nname = "r2d2"\ncapacity = 100\nobs_dim = 2\nact_dim = 1\n'
                    'episodes = true\n[buffers.meta_fields]\ntask = { dtype = "int32" }\n')
    with ServerProcess(tmp_path / "data", "--config", str(toml)) as server:
        buf = millpond.connect(server.address).buffer("r2d2")
        assert buf.config.episodes and buf.info()["meta_fields"] == {"task": ("<i4", ())}
        with buf.one_episode(task=3):
            for t in range(4):
                buf.push(**step(t))
        assert buf.sample_sequences(2, 4, seed=0)["task"].tolist() == [3, 3]
    toml.write_text('[[buffers]]\nname = "bad"\ncapacity = 10\nobs_dim = 2\nact_dim = 1\n'
                    'episodes = "yes"\n')
    bad = ServerProcess(tmp_path / "data2", "--config", str(toml))
    with pytest.raises(RuntimeError, match="episodes must be True or False"):
        bad.start(timeout=30)
