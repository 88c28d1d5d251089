"""What the daemon's gRPC edge (server/millpond_server/edge.py: authentication on the
headers, call slots, time to the request, bytes in flight) costs a call: two daemons
in this process, one behind the edge's Gate and one without it, called turn after
turn with the same small calls; p50 latency of each, and their ratio.

    PYTHONPATH=client:server python bench/edge_cost.py [--turns 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
from reply_checks import FIELDS, in_process_daemon, p50_us

import millpond
from millpond_server.auth import Auth
from millpond_server.edge import EdgeLimits, Gate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batch = {"obs": rng.random((32, 8), np.float32), "actions": rng.random((32, 2), np.float32),
             "rewards": rng.random(32, np.float32), "done": np.zeros(32, bool)}
    with tempfile.TemporaryDirectory() as tmp:
        buffers = {}
        for label, interceptors in (("gate", [Gate(Auth(), EdgeLimits())]), ("none", None)):
            address = in_process_daemon(Path(tmp) / label, interceptors)
            client = millpond.connect(address, shm=False)
            buffers[label] = (client, client.create_buffer("bench", capacity=100_000,
                                                           fields=FIELDS))
            buffers[label][1].push_batch(**{k: np.repeat(v, 100, 0) for k, v in batch.items()})
        calls = {
            "sample(256) on its stream": lambda c, b: b.sample(256),
            "push_batch(32) on its stream": lambda c, b: b.push_batch(**batch),
            "info() unary": lambda c, b: b.info(),
        }
        for name, call in calls.items():
            ratios = []
            for _ in range(args.turns):
                took = {label: p50_us(lambda: call(*buffers[label]), args.calls // 4)
                        for label in buffers}
                ratios.append(took["gate"] / took["none"])
            print(f"{name:32s} p50 with the edge / without: {statistics.median(ratios):.3f} "
                  f"(turns {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
