"""What the Stable-Baselines3 adapter costs a training run: ``make bench``'s "SB3" section.

DQN with SB3's defaults (``MlpPolicy``, buffer_size 1M, batch 32, train_freq 4, one gradient
step, learning_starts 100) on CartPole-v1, torch on one thread, ``STEPS`` environment steps of ``learn()``,
timed three ways in the same run, in turns (SB3's own ``ReplayBuffer``, then the adapter
in-process, then the adapter on a same-host daemon over shared memory, then again) so
that a noisy moment of a shared machine hits all three alike. Prints each one's median
steps per second and the adapter's as a ratio of SB3's (the targets: 0.9x in-process,
0.8x on the daemon), and steps per CPU second (the learner's, plus the daemon's for the
daemon rows: what the run costs, less sensitive to a loaded machine), then the same for
``NStepReplayBuffer`` (n_steps 3).

    make bench ARGS="--only sb3"
    python bench/bench_sb3.py [--steps 5000] [--turns 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import ServerProcess  # noqa: E402

STEPS = 5_000
TURNS = 5
_names = itertools.count()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(buffer_class: Any, kwargs: dict[str, Any], steps: int, seed: int,
         daemon_pid: int | None = None) -> tuple[float, float]:
    """Steps per second of ``DQN.learn(steps)`` (model construction not timed), by the
    clock and by CPU time (this process's, plus the daemon's)."""
    import gymnasium as gym
    from stable_baselines3 import DQN

    env = gym.make("CartPole-v1")
    model = DQN("MlpPolicy", env, replay_buffer_class=buffer_class,
                replay_buffer_kwargs=kwargs, seed=seed, device="cpu", verbose=0)
    start, cpu = time.perf_counter(), time.process_time()
    daemon = _cpu_seconds(daemon_pid) if daemon_pid else 0.0
    model.learn(total_timesteps=steps)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu + (_cpu_seconds(daemon_pid) - daemon if daemon_pid else 0.0)
    if daemon_pid:  # the figure is the shared-memory path's, or none
        transport = model.replay_buffer.millpond_buffer.transport
        assert transport == "shm", f"the daemon's buffer went over {transport}"
    close = getattr(model.replay_buffer, "close", None)
    if close is not None:
        close()
    env.close()
    return steps / elapsed, steps / cpu


def section(tmp: Path, steps: int = STEPS, turns: int = TURNS) -> None:
    import torch
    from stable_baselines3.common import buffers as sb3_buffers

    from millpond.integrations import sb3 as mp_sb3

    torch.set_num_threads(1)  # a tiny MLP: more threads only contend on a shared machine
    print(f"\nSB3: DQN (SB3's defaults) on CartPole-v1, {steps:,} steps of learn(), steps/s, "
          f"medians of {turns} turns; ratios against SB3's own buffer of the same run")
    with ServerProcess(tmp / "sb3-data") as server:
        for label, theirs, ours, extra in (
                ("ReplayBuffer", sb3_buffers.ReplayBuffer, mp_sb3.ReplayBuffer, {}),
                ("NStepReplayBuffer(n_steps=3)", sb3_buffers.NStepReplayBuffer,
                 mp_sb3.NStepReplayBuffer, {"n_steps": 3})):
            ways: dict[str, tuple[Any, Any]] = {
                "SB3's own": (theirs, lambda: dict(extra)),
                "millpond in-process": (ours, lambda: dict(extra)),
                "millpond daemon (shm)": (ours, lambda: {
                    **extra, "address": server.address, "name": f"sb3-{next(_names)}"}),
            }
            rates: dict[str, list[float]] = {way: [] for way in ways}
            cpu: dict[str, list[float]] = {way: [] for way in ways}
            _run(theirs, dict(extra), 500, 0)  # warm up (imports, torch)
            for turn in range(turns):
                for way, (cls, kwargs) in ways.items():
                    pid = server.proc.pid if "daemon" in way else None
                    wall, per_cpu = _run(cls, kwargs(), steps, turn, pid)
                    rates[way].append(wall)
                    cpu[way].append(per_cpu)
            base, cpu_base = statistics.median(rates["SB3's own"]), statistics.median(cpu["SB3's own"])
            print(f"  {label}")
            for way, runs in rates.items():
                rate, per_cpu = statistics.median(runs), statistics.median(cpu[way])
                shown = ", ".join(f"{r:,.0f}" for r in runs)
                print(f"    {way:22} {rate:7,.0f} steps/s = {rate / base:.2f}x  ({shown}); "
                      f"per CPU second {per_cpu:,.0f} = {per_cpu / cpu_base:.2f}x")
            ratios = {way: statistics.median(r / b for r, b in zip(runs, rates["SB3's own"]))
                      for way, runs in rates.items()}
            print(f"    per-turn ratio medians: in-process {ratios['millpond in-process']:.2f}x "
                  f"(target 0.9x), daemon {ratios['millpond daemon (shm)']:.2f}x (target 0.8x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--turns", type=int, default=TURNS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="millpond-bench-sb3-") as tmp:
        section(Path(tmp), args.steps, args.turns)


if __name__ == "__main__":
    main()
