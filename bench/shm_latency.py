"""A learner's shared-memory ``sample(256)`` p50 beside the same call in-process.

    .venv/bin/python bench/shm_latency.py

A 100k-record CartPole buffer (``ReplayBuffer(100_000, 4, 1)``), full, sampled in a loop
without a seed: in-process, and through a daemon on this host over shared memory. Five
alternating turns of one second each; prints the medians and each turn's difference.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import ServerProcess  # noqa: E402

import millpond  # noqa: E402

RECORDS = 100_000
TURNS = 5


def p50_us(call: Callable[[], object], seconds: float = 1.0) -> float:
    for _ in range(200):  # warm up
        call()
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - start)
    return statistics.median(latencies) * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    columns = dict(obs=rng.random((RECORDS, 4), dtype=np.float32),
                   next_obs=rng.random((RECORDS, 4), dtype=np.float32),
                   actions=rng.random((RECORDS, 1), dtype=np.float32),
                   rewards=rng.random(RECORDS, dtype=np.float32),
                   terminated=np.zeros(RECORDS, bool), truncated=np.zeros(RECORDS, bool))
    local = millpond.ReplayBuffer(RECORDS, 4, 1)
    local.push_batch(**columns)
    with ServerProcess(Path(tempfile.mkdtemp()) / "data") as server:
        remote = millpond.ReplayBuffer(RECORDS, 4, 1, address=server.address, name="cartpole")
        assert remote.transport == "shm", remote.transport
        for start in range(0, RECORDS, 10_000):
            remote.push_batch(**{k: v[start:start + 10_000] for k, v in columns.items()})
        turns = [(p50_us(lambda: local.sample(256)), p50_us(lambda: remote.sample(256)))
                 for _ in range(TURNS)]
        in_process, shm = (statistics.median(t) for t in zip(*turns))
        print(f"sample(256) p50: in-process {in_process:.0f} us, shared memory {shm:.0f} us: "
              f"+{shm - in_process:.0f} us (target <= +50 us; per turn: "
              f"{', '.join(f'+{b - a:.0f}' for a, b in turns)})")
        remote.close()


if __name__ == "__main__":
    main()
