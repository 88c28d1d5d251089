"""Episodic buffers: sequences, n-step transitions and the episode writer, beside their baselines.

* ``sample_sequences(32, 80)`` on Atari-size records (R2D2's shape), in-process and over
  shared memory, beside a numpy gather of the same number of rows in windows of 80
  consecutive rows of a plain ring, in the same run (goal >= 0.5x);
* n-step ``sample(256, n_step=5)`` beside plain ``sample(256)`` of the same buffer (goal >= 0.5x);
* episode writer steps/s with 16 environments, in-process and over shared memory.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

import millpond
from millpond.core import Schema

BATCH, SEQ_LEN, N_STEP, ENVS = 32, 80, 5, 16
R2D2 = {"obs": ("uint8", (84, 84, 4)), "actions": ("int64", ()), "rewards": ("float32", ()),
        "terminated": ("bool", ()), "truncated": ("bool", ())}
_names = itertools.count()


def _episodes(schema: Schema, total: int, length: int) -> dict[str, np.ndarray]:
    """``total`` records in episodes of ``length`` steps (random payloads)."""
    rng = np.random.default_rng(0)
    out = {}
    for f in schema:
        if f.dtype.kind == "u":
            out[f.name] = rng.integers(0, 255, (total, *f.shape), dtype=f.dtype)
        else:
            out[f.name] = np.zeros((total, *f.shape), f.dtype)
    out["terminated"] = np.arange(total) % length == length - 1
    return out


def _fill(buf, data: dict, chunk: int) -> None:
    total = len(data["terminated"])
    for start in range(0, total, chunk):
        buf.push_batch(**{k: v[start:start + chunk] for k, v in data.items()})


def _window_gather(columns: dict, size: int) -> Callable[[], dict]:
    """The baseline: windows of SEQ_LEN consecutive rows of a plain ring, gathered by numpy."""
    rng = np.random.default_rng(1)

    def gather() -> dict:
        starts = rng.integers(0, size - SEQ_LEN, BATCH)
        rows = (starts[:, None] + np.arange(SEQ_LEN)).reshape(-1)
        return {name: np.take(col, rows, axis=0, mode="clip") for name, col in columns.items()}
    return gather


def section(address: str, quick: bool, seconds: float, timed_rate: Callable) -> None:
    print("\nEpisodic buffers")
    total = 2_000 if quick else 8_000
    schema = Schema.from_spec(R2D2)
    data = _episodes(schema, total, 400)
    mb = BATCH * SEQ_LEN * schema.record_nbytes / 1e6
    baseline = timed_rate(_window_gather(data, total), 1, seconds)
    local = millpond.ReplayBuffer(total, fields=R2D2, episodes=True)
    _fill(local, data, 256)
    rows = {"in-process": local}
    client = millpond.connect(address, shm=True)
    remote = client.create_buffer(f"bench-seq-{next(_names)}", capacity=total, fields=R2D2,
                                  episodes=True)
    _fill(remote, data, 64)
    rows[f"over {client.transport}"] = remote
    print(f"  sample_sequences({BATCH}, {SEQ_LEN}), {mb:.0f} MB per call; numpy gather of "
          f"the same rows: {baseline * mb / 1e3:.2f} GB/s")
    for label, buf in rows.items():
        rate = timed_rate(lambda b=buf: b.sample_sequences(BATCH, SEQ_LEN), 1, seconds)
        print(f"    {label:<12} {rate * mb / 1e3:6.2f} GB/s = {rate / baseline:.2f}x numpy "
              "(goal >= 0.5x)")
    remote.close()
    local.close()
    _n_step_rows(address, quick, seconds, timed_rate)
    _writer_rows(address, seconds, timed_rate)


def _n_step_rows(address: str, quick: bool, seconds: float, timed_rate: Callable) -> None:
    total = 100_000 if quick else 1_000_000
    data = _episodes(Schema.transition(4, 1), total, 200)
    client = millpond.connect(address, shm=True)
    bufs = {"in-process": millpond.ReplayBuffer(total, 4, 1, episodes=True),
            f"over {client.transport}": client.create_buffer(
                f"bench-nstep-{next(_names)}", capacity=total, obs_dim=4, act_dim=1,
                episodes=True)}
    print(f"  CartPole sample(256, n_step={N_STEP}) beside sample(256), {total:,} records")
    for label, buf in bufs.items():
        _fill(buf, data, 10_000)
        plain = timed_rate(lambda b=buf: b.sample(256), 256, seconds)
        n_step = timed_rate(lambda b=buf: b.sample(256, n_step=N_STEP, gamma=0.99), 256, seconds)
        print(f"    {label:<12} {n_step / 1e3:7.0f}k rec/s vs {plain / 1e3:7.0f}k = "
              f"{n_step / plain:.2f}x (goal >= 0.5x)")
        buf.close()


def _writer_rows(address: str, seconds: float, timed_rate: Callable) -> None:
    client = millpond.connect(address, shm=True)
    bufs = {"in-process": millpond.ReplayBuffer(1_000_000, 4, 1, episodes=True),
            f"over {client.transport}": client.create_buffer(
                f"bench-writer-{next(_names)}", capacity=1_000_000, obs_dim=4, act_dim=1,
                episodes=True)}
    rng = np.random.default_rng(2)
    step = {"obs": rng.random((ENVS, 4), np.float32), "next_obs": rng.random((ENVS, 4), np.float32),
            "actions": np.zeros((ENVS, 1), np.float32), "rewards": np.ones(ENVS, np.float32),
            "terminated": np.zeros(ENVS, bool), "truncated": np.zeros(ENVS, bool)}
    done = dict(step, terminated=np.ones(ENVS, bool))
    print(f"  episode writer, {ENVS} environments, CartPole steps (episodes of 200 steps)")
    for label, buf in bufs.items():
        writer = buf.episode_writer(n_envs=ENVS)
        counter = itertools.count(1)

        def append(w=writer) -> None:
            w.append(**(done if next(counter) % 200 == 0 else step))

        rate = timed_rate(append, ENVS, seconds)
        writer.flush()
        print(f"    {label:<12} {rate / 1e3:7.0f}k steps/s")
        buf.close()
