"""Learner-side access: epochs over the whole buffer, and torch output, beside their baselines.

* ``epoch_iterator(256)`` (a shuffled pass over every record, batches read by position)
  in-process, over shared memory and over gRPC, beside a numpy permutation-gather of the
  same arrays (``np.take`` of 256 permuted rows per field) in the same run;
* ``device="cpu"`` (torch tensors) beside numpy output, for ``sample(256)`` and for the
  epoch iterator, in-process and over shared memory.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

import millpond

BATCH = 256
_names = itertools.count()


def _transitions(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"obs": rng.random((n, 4), np.float32), "next_obs": rng.random((n, 4), np.float32),
            "actions": rng.random((n, 1), np.float32), "rewards": rng.random(n, np.float32),
            "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool)}


def _permutation_gather(columns: dict[str, np.ndarray], n: int) -> Callable[[], None]:
    """The baseline: one shuffled pass over plain arrays, 256 rows per field at a time."""
    rng = np.random.default_rng(1)

    def epoch() -> None:
        order = rng.permutation(n)
        for start in range(0, n, BATCH):
            rows = order[start:start + BATCH]
            {name: np.take(column, rows, axis=0) for name, column in columns.items()}
    return epoch


def _epoch(buf, device=None) -> Callable[[], None]:
    def run() -> None:
        for _ in buf.epoch_iterator(BATCH, device=device):
            pass
    return run


def section(address: str, quick: bool, seconds: float, timed_rate: Callable) -> None:
    n = 20_000 if quick else 200_000
    data = _transitions(n)
    print(f"\nLearner-side access: CartPole transitions, {n:,} records, batches of {BATCH}")
    baseline = timed_rate(_permutation_gather(data, n), n, seconds)
    bufs = {"in-process": millpond.ReplayBuffer(n, 4, 1)}
    for shm in (True, False):
        client = millpond.connect(address, shm=shm)
        bufs[f"over {client.transport}"] = client.create_buffer(
            f"bench-learner-{next(_names)}", capacity=n, obs_dim=4, act_dim=1)
    for buf in bufs.values():
        for start in range(0, n, 10_000):
            buf.push_batch(**{k: v[start:start + 10_000] for k, v in data.items()})
    print(f"  epoch_iterator({BATCH}), shuffled; numpy permutation-gather of the same arrays: "
          f"{baseline / 1e6:.2f}M rec/s")
    for label, buf in bufs.items():
        rate = timed_rate(_epoch(buf), n, seconds)
        print(f"    {label:<12} {rate / 1e6:6.2f}M rec/s = {rate / baseline:.2f}x numpy")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("  device='cpu': torch is not installed here (pip install 'millpond[torch]')")
    else:
        print("  device='cpu' (torch tensors) beside numpy output")
        for label, buf in bufs.items():
            if label == "over grpc":
                continue
            plain = timed_rate(lambda b=buf: b.sample(BATCH), BATCH, seconds)
            tensors = timed_rate(lambda b=buf: b.sample(BATCH, device="cpu"), BATCH, seconds)
            epoch_np = timed_rate(_epoch(buf), n, seconds)
            epoch_torch = timed_rate(_epoch(buf, "cpu"), n, seconds)
            print(f"    {label:<12} sample({BATCH}) {tensors / 1e3:6.0f}k rec/s = "
                  f"{tensors / plain:.2f}x numpy; epoch {epoch_torch / 1e6:.2f}M rec/s = "
                  f"{epoch_torch / epoch_np:.2f}x numpy")
    for buf in bufs.values():
        buf.close()
