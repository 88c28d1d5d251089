"""TorchRL over millpond: ``TensorDictReplayBuffer.sample(256)`` beside millpond's own sample.

CartPole-size transitions as a TorchRL collector writes them (``observation``,
``action``, ``("next", "observation")``, ``("next", "reward")``, ``("next",
"done")``, ``("next", "terminated")``) in a buffer on the daemon, written through
``MillpondStorage``. For each transport (shared memory, gRPC) and each sampler it
prints the TorchRL buffer's ``sample()`` rate beside the handle's own
``sample(256)`` on the same buffer (numpy out), measured in alternating short turns in
the same run (the machine is shared: read the ratios, each the median of the turns'
ratios; target >= 0.8x). The reference row is
TorchRL's own ``RandomSampler`` over the same storage: indices drawn here, then
read (a length and a read per sample), as a storage without millpond's samplers
does. Needs torchrl (``pip install 'millpond[torchrl]'``).
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Callable

BATCH = 256
_names = itertools.count()


def _data(n: int):
    import torch
    from tensordict import TensorDict

    return TensorDict({
        "observation": torch.rand(n, 4), "action": torch.randint(2, (n, 1)),
        "next": {"observation": torch.rand(n, 4), "reward": torch.ones(n, 1),
                 "done": torch.rand(n, 1) < 0.02, "terminated": torch.zeros(n, 1, dtype=bool)},
    }, batch_size=[n])


def _rate(fn: Callable[[], object], seconds: float) -> float:
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return calls / (time.perf_counter() - start)


def _paired(own: Callable[[], object], theirs: Callable[[], object], seconds: float,
            turns: int = 15) -> tuple[float, float, float]:
    """Both rates in alternating short turns (``seconds`` each in all): their medians, and
    the median of the turns' ratios, so that a busy moment of this shared machine hits both
    alike."""
    own(), theirs()
    pairs = [(_rate(own, seconds / turns), _rate(theirs, seconds / turns)) for _ in range(turns)]
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(b / a for a, b in pairs))


def section(address: str, quick: bool, seconds: float, timed_rate: Callable) -> None:
    try:
        from torchrl.data import RandomSampler, TensorDictReplayBuffer

        from millpond.integrations.torchrl import (
            MillpondPrioritizedSampler,
            MillpondSampler,
            MillpondStorage,
        )
    except ImportError:
        print("\nTorchRL: torchrl is not installed here (pip install 'millpond[torchrl]')")
        return
    import millpond

    n = 10_000 if quick else 100_000
    data = _data(n)
    print(f"\nTorchRL: TensorDictReplayBuffer.sample({BATCH}) over MillpondStorage on the daemon, "
          f"beside the handle's own sample({BATCH}) of the same buffer ({n:,} CartPole "
          "transitions; median of 3 turns; target >= 0.8x)")
    for shm in (True, False):
        client = millpond.connect(address, shm=shm)
        rows = []
        for label, sampler in (("MillpondSampler", MillpondSampler),
                               ("MillpondPrioritizedSampler", MillpondPrioritizedSampler)):
            storage = MillpondStorage(n, client=client, name=f"bench-torchrl-{next(_names)}")
            rb = TensorDictReplayBuffer(storage=storage, sampler=sampler(), batch_size=BATCH)
            for start in range(0, n, 10_000):
                rb.extend(data[start:start + 10_000])
            rows.append((label, storage, rb))
            if label == "MillpondSampler":  # the reference: TorchRL draws, then reads
                rows.append(("RandomSampler (TorchRL's)", storage, TensorDictReplayBuffer(
                    storage=storage, sampler=RandomSampler(), batch_size=BATCH)))
        for label, storage, rb in rows:
            own, theirs, ratio = _paired(lambda s=storage: s.buffer.sample(BATCH), rb.sample,
                                         seconds)
            print(f"  {client.transport:4} {label:27} {theirs:8,.0f} samples/s vs millpond's "
                  f"{own:8,.0f} = {ratio:.2f}x")
        for _, storage, _ in rows:
            if storage.buffer is not None and not storage.buffer.closed:
                storage.close()
