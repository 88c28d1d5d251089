"""Ape-X DQN on Atari Pong from pixels, frames stored once: actors and a learner around a
millpond server (the pixel version of apex_dqn.py; extra `atari`: ale-py, opencv).

    python examples/apex_pong.py                      # starts a server; --max-seconds 600
    python examples/apex_pong.py --address HOST:PORT  # a server you run (`millpond serve`)
    python examples/apex_pong.py --short              # CI: 20 s of learning

* Actors (``--actors`` processes, each a Gymnasium vector env of ``--envs`` Pongs with
  ``AtariPreprocessing`` (84x84 grayscale, frame skip 4) and ``FrameStackObservation(4)``)
  act epsilon-greedily with Ape-X's spread of epsilons and write their steps with
  ``episode_writer``: observations ``uint8[4, 84, 84]``, as a DQN sees them.
* The server's buffer is prioritized and episodic, with ``frame_stack={"obs": 0}`` and
  ``next_of={"next_obs": "obs"}``: of the 56 KB of ``obs`` and ``next_obs`` a transition
  holds, about one new 84x84 frame (7 KB) is stored (see millpond.core.frames). The
  learner reads the stacks back whole.
* The learner (this process) draws prioritized transitions through a prefetching
  ``Sampler``, trains a double DQN (Nature CNN) with importance weights, sends new
  priorities and shares its weights through a file, as in apex_dqn.py (1-step targets:
  millpond's n-step samples are for the float transition schema).

Pong needs millions of frames to learn: on a laptop's CPU this shows the plumbing and the
bytes, not a trained agent. The last line is ``updates=<n> steps=<env steps stored>
stored=<bytes per transition> plain=<bytes per transition as plain arrays>
seconds=<s>``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _server import millpond_server  # noqa: E402
from apex_dqn import GAMMA, act, save, update  # noqa: E402
from torch import nn  # noqa: E402

import millpond  # noqa: E402

ACTIONS = 6  # Pong's action set


def q_network() -> nn.Module:
    """The Nature DQN's network, on uint8 stacks of 4 84x84 frames."""
    return nn.Sequential(nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, ACTIONS))


def q_values(net: nn.Module, frames: np.ndarray) -> torch.Tensor:
    return net(torch.from_numpy(frames).float().div_(255.0))


def vector_env(n: int, seed: int) -> gym.vector.VectorEnv:
    """``n`` preprocessed Pongs that reset in the step that ends an episode."""
    import ale_py
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    envs = gym.make_vec(
        "ALE/Pong-v5", num_envs=n, vectorization_mode="sync", frameskip=1,
        repeat_action_probability=0.0,
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        wrappers=[lambda env: FrameStackObservation(
            AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True), 4)])
    envs.reset(seed=seed)
    return envs


def actor(index: int, address: str, name: str, weights: str, epsilons: list[float],
          stop, returns) -> None:
    """Act until ``stop`` is set; send finished episodes' returns to ``returns``."""
    torch.set_num_threads(1)
    buf = millpond.connect(address).buffer(name)
    act(buf, vector_env(len(epsilons), 1000 * index), q_network(), q_values,
        lambda actions: actions.astype(np.int64), index, weights, epsilons, stop, returns)


def learn(buf, weights: str, returns, args) -> tuple[int, float]:
    """Train for ``args.max_seconds``; (updates, seconds)."""
    torch.set_num_threads(1)
    net, target = q_network(), q_network()
    target.load_state_dict(net.state_dict())
    opt = torch.optim.Adam(net.parameters(), lr=args.lr, eps=1.5e-4)
    start = last_report = time.monotonic()
    recent: list[float] = []
    updates = 0
    with buf.sampler(args.batch_size, prefetch=2) as sampler:
        for batch in sampler:
            actions = torch.from_numpy(batch["actions"].astype(np.int64))
            with torch.no_grad():  # double DQN: r + gamma Q'(s', argmax Q(s'))
                best_next = q_values(net, batch["next_obs"]).argmax(1, keepdim=True)
                bootstrap = q_values(target, batch["next_obs"]).gather(1, best_next)[:, 0]
                alive = 1.0 - torch.from_numpy(batch["terminated"]).float()
                y = torch.from_numpy(batch["rewards"]) + GAMMA * alive * bootstrap
            q = q_values(net, batch["obs"]).gather(1, actions[:, None])[:, 0]
            update(net, target, opt, buf, batch, q, y, args.tau)
            updates += 1
            if updates % 20 == 0:
                save(net, weights)
            while not returns.empty():
                recent = (recent + [returns.get()[1]])[-100:]
            now = time.monotonic()
            if now - last_report >= args.report_every:
                last_report = now
                info = buf.info()
                print(f"{now - start:6.1f}s  updates {updates:6d}  env steps {info['inserts']:7d}"
                      f"  actors' mean return {np.mean(recent) if recent else float('nan'):6.1f}"
                      f"  stored {info['stored_bytes'] / max(1, info['size']) / 1e3:5.1f} KB"
                      f"/transition (plain {info['logical_bytes'] / max(1, info['size']) / 1e3:.1f})",
                      flush=True)
                if now - start >= args.max_seconds:
                    break
    return updates, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", help="a running millpond server (default: start one)")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--envs", type=int, default=4, help="environments per actor")
    parser.add_argument("--capacity", type=int, default=50_000)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples-per-insert", type=float, default=4.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--tau", type=float, default=0.005)
    parser.add_argument("--report-every", type=float, default=10.0)
    parser.add_argument("--short", action="store_true", help="CI run: stop after ~20 s of learning")
    args = parser.parse_args()
    if args.short:
        args.max_seconds, args.report_every = min(args.max_seconds, 20.0), 5.0
        args.capacity = min(args.capacity, 5_000)
    torch.set_num_threads(1)
    n_envs = args.actors * args.envs
    epsilons = [0.4 ** (1 + 7 * i / max(1, n_envs - 1)) for i in range(n_envs)]
    ctx = mp.get_context("spawn")
    frames = ("uint8", (4, 84, 84))
    fields = {"obs": frames, "actions": ("int64", ()), "rewards": ("float32", ()),
              "terminated": ("bool", ()), "truncated": ("bool", ()), "next_obs": frames}
    with millpond_server(args.address) as address, tempfile.TemporaryDirectory() as tmp:
        limiter = millpond.SampleToInsertRatio(
            samples_per_insert=args.samples_per_insert, min_size_to_sample=1_000,
            error_buffer=max(2_000.0, 4 * args.batch_size * args.samples_per_insert))
        name = f"apex-pong-{os.getpid()}"
        buf = millpond.connect(address).create_buffer(
            name, capacity=args.capacity, fields=fields, prioritized=True, alpha=0.6, beta=0.4,
            episodes=True, rate_limiter=limiter, frame_stack={"obs": 0},
            next_of={"next_obs": "obs"})
        weights = os.path.join(tmp, "weights.pt")
        save(q_network(), weights)
        stop, returns = ctx.Event(), ctx.Queue()
        actors = [ctx.Process(target=actor, args=(
            i, address, name, weights,
            epsilons[i * args.envs:(i + 1) * args.envs], stop, returns), daemon=True)
            for i in range(args.actors)]
        for proc in actors:
            proc.start()
        print(f"{args.actors} actors x {args.envs} Pongs -> {address}", flush=True)
        try:
            updates, seconds = learn(buf, weights, returns, args)
            info = buf.info()
        finally:
            stop.set()
            for proc in actors:
                proc.join(5)
                if proc.is_alive():  # waiting on the rate limiter: nothing left to keep
                    proc.terminate()
            buf.close()
        size = max(1, info["size"])
        print(f"updates={updates} steps={info['inserts']} stored={info['stored_bytes'] / size:.0f} "
              f"plain={info['logical_bytes'] / size:.0f} seconds={seconds:.1f}")


if __name__ == "__main__":
    main()
