"""`make bench` section 'Pixels' (pushes): 16 environments' frame-stacked transitions pushed
into a buffer with frames stored once (frame_stack + next_of) and into a plain one, in turns.

A recorded Atari run (extra `atari`) is cut into 16 streams, one per environment; each push
is one step of the 16 environments (16 records, one per stream: interleaved writers, each
record sharing frames with the one 16 records before it), replayed until the time is up.
Three patterns of pushes: one transition per push (the environments in turn), 32
consecutive transitions of one environment per push (actors, in turn), a step of all 16
per push; in-process, with every record in RAM, tiered (a quarter in RAM, the rest in a
file: a buffer larger than RAM) and persistent (as the daemon keeps its buffers), and into
a daemon over gRPC (remote actors). The figure is the frame buffer's rate over the plain
buffer's with the same layout, measured in turns (issue 26's target: at least 0.7x).
Run alone: ``python bench/bench.py --only pixels``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from millpond.core.buffer import TieredBuffer
from millpond.core.config import BufferConfig

OPTIONS = {"frame_stack": {"obs": 0}, "next_of": {"next_obs": "obs"}}
NAMES = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")
ENVS = 16


def streams(data: dict[str, np.ndarray], envs: int = ENVS) -> dict[str, np.ndarray]:
    """The recorded transitions as ``envs`` streams: ``{name: [steps, envs, ...]}``,
    stream ``e`` the ``e``-th contiguous part of the run."""
    n = len(data["obs"]) // envs
    order = np.arange(envs)[None, :] * n + np.arange(n)[:, None]  # [t, e]
    return {name: np.ascontiguousarray(data[name][order]) for name in NAMES}


def pushes(data: dict[str, np.ndarray], pattern: str) -> list[dict[str, np.ndarray]]:
    """The batches of a pattern, in push order: "steps" (a step of the 16 environments
    per push, 16 records), "single" (one transition per push, the environments in turn)
    or "actors" (32 consecutive transitions of one environment per push, the
    environments in turn)."""
    s = streams(data)
    steps = len(s["obs"])
    if pattern == "steps":
        return [{name: column[t] for name, column in s.items()} for t in range(steps)]
    if pattern == "single":
        return [{name: column[t, e:e + 1] for name, column in s.items()}
                for t in range(steps) for e in range(ENVS)]
    assert pattern == "actors", pattern
    return [{name: np.ascontiguousarray(column[t:t + 32, e]) for name, column in s.items()}
            for t in range(0, steps - 31, 32) for e in range(ENVS)]


def push_rates(data: dict[str, np.ndarray], pattern: str, capacity: int, seconds: float,
               timed_rate: Callable, address: str | None = None, layout: str = "ram",
               directory: Path | None = None, rounds: int = 3) -> dict[str, float]:
    """Transitions/s pushed into each buffer (median of ``rounds`` turns): in-process, or
    into a daemon's buffers at ``address`` over gRPC. In-process ``layout``: "ram" (every
    record in RAM), "tiered" (a quarter in RAM, the rest in a file in ``directory``: how a
    buffer larger than RAM is kept) or "persistent" (that file also recoverable: how the
    daemon keeps its buffers)."""
    fields = {name: (data[name].dtype.str, data[name].shape[1:]) for name in NAMES}
    batches = pushes(data, pattern)
    size = len(batches[0]["obs"])
    if address is None:
        sizes = (dict(capacity=capacity) if layout == "ram" else
                 dict(hot_capacity=capacity // 4, total_capacity=capacity))
        buffers = {label: TieredBuffer(
            BufferConfig.build(fields=fields, **sizes, **options),
            None if directory is None else directory / f"{pattern}-{layout}-{label}.buffer",
            persistent=layout == "persistent")
            for label, options in (("plain", {}), ("shared", OPTIONS))}
    else:
        import millpond

        client = millpond.connect(address, shm=False)
        buffers = {label: client.create_buffer(f"push-{pattern}-{label}",
                                               capacity=capacity, fields=fields, **options)
                   for label, options in (("plain", {}), ("shared", OPTIONS))}
    cursor = {label: 0 for label in buffers}

    def push(label: str) -> None:
        batch = batches[cursor[label] % len(batches)]
        if address is None:
            buffers[label].push_batch(batch)
        else:
            buffers[label].push_batch(**batch)
            buffers[label].flush()  # acknowledged: stored
        cursor[label] += 1

    for label in buffers:  # fill twice: the rates include eviction, and every page of the
        while cursor[label] * size < 2 * capacity:  # frame store has been written once
            push(label)
    rates: dict[str, list[float]] = {label: [] for label in buffers}
    for _ in range(rounds):  # in turns: a noisy moment hits both alike
        for label in buffers:
            rates[label].append(timed_rate(lambda lb=label: push(lb), size, seconds / rounds,
                                           repeats=1))
    for buf in buffers.values():
        buf.close()
    return {label: float(np.median(values)) for label, values in rates.items()}


PATTERNS = (("single", "one transition per push, environments in turn"),
            ("actors", "32 of one environment per push, environments in turn"),
            ("steps", "a step of all 16 per push"))


def section(game: str, data: dict[str, np.ndarray], seconds: float, timed_rate: Callable) -> None:
    """The figures of one game: in-process, then into a daemon over gRPC (as remote actors
    push; the daemon started here, on a temporary data directory)."""
    import shutil
    import tempfile

    from support import ServerProcess

    capacity = 4_000
    tmp = Path(tempfile.mkdtemp(prefix="millpond-pushes-"))
    try:
        with ServerProcess(tmp / "data") as server:
            for where, address, layout in (("in-process, in RAM", None, "ram"),
                                           ("in-process, tiered", None, "tiered"),
                                           ("in-process, persistent", None, "persistent"),
                                           ("gRPC", server.address, "daemon")):
                for pattern, what in PATTERNS:
                    rate = push_rates(data, pattern, capacity, seconds, timed_rate, address,
                                      layout, None if layout == "ram" else tmp)
                    print(f"  {game:9} pushes from {ENVS} environments, {where} ({what}): "
                          f"{rate['shared']:,.0f} transitions/s vs plain "
                          f"{rate['plain']:,.0f}/s = {rate['shared'] / rate['plain']:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
