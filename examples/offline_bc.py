"""Behaviour cloning on CartPole-v1 from an offline dataset millpond wrote and loads.

    python examples/offline_bc.py                    # record, export, load, train (~30 s)
    python examples/offline_bc.py --dataset FILE     # train on a CartPole dataset you have
                                                     # (.npz, D4RL-style HDF5, Minari folder)
    python examples/offline_bc.py --short            # CI: fewer episodes and updates

1. An online run: a scripted controller (with 20% random actions) plays CartPole
   and writes its episodes to an episodic buffer on a millpond server
   (``--in-process``: no server).
2. ``buf.export("cartpole.npz")`` turns that buffer into an offline dataset
   (oldest record first, with ``episode_ids``).
3. ``millpond.datasets.load`` reads it back and ``millpond.OfflineDatasetBuffer``
   serves it, read-only, with normalized observations and rlox's ``stats()``.
4. A PyTorch policy learns the logged actions (cross-entropy on uniform batches,
   ``device="cpu"`` gives tensors), then plays greedily.

The last line is ``loss_before=<float> loss_after=<float> return=<mean over 10 episodes>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _server import millpond_server  # noqa: E402
from torch import nn  # noqa: E402

import millpond  # noqa: E402
import millpond.datasets  # noqa: E402


def controller(obs: np.ndarray) -> int:
    """A scripted CartPole policy (returns 500 on its own)."""
    x, x_dot, theta, theta_dot = obs
    return int(theta + 0.5 * theta_dot + 0.02 * x + 0.1 * x_dot > 0)


def record(buf, episodes: int, noise: float, seed: int) -> None:
    """Play ``episodes`` episodes into ``buf`` (its episodes end on the flags)."""
    env, rng = gym.make("CartPole-v1"), np.random.default_rng(seed)
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        rows: dict[str, list] = {k: [] for k in ("obs", "next_obs", "actions", "rewards",
                                                 "terminated", "truncated")}
        done = False
        while not done:
            action = int(rng.integers(2)) if rng.random() < noise else controller(obs)
            next_obs, reward, terminated, truncated, _ = env.step(action)
            for key, value in zip(rows, (obs, next_obs, [action], reward, terminated,
                                         truncated)):
                rows[key].append(value)
            obs, done = next_obs, terminated or truncated
        buf.push_batch(**{k: np.asarray(v, np.float32) for k, v in rows.items()})
    env.close()


def play(policy: nn.Module, mean: np.ndarray, std: np.ndarray, episodes: int = 10) -> float:
    """Mean return of the greedy policy (observations normalized as in training)."""
    env, total = gym.make("CartPole-v1"), 0.0
    for episode in range(episodes):
        obs, _ = env.reset(seed=10_000 + episode)
        done = False
        while not done:
            with torch.no_grad():
                x = torch.as_tensor((obs - mean) / std, dtype=torch.float32)
                action = int(policy(x[None]).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
    env.close()
    return total / episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", help="a CartPole dataset file or Minari folder to load")
    parser.add_argument("--address", help="a running millpond server (default: start one)")
    parser.add_argument("--in-process", action="store_true", help="record without a server")
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--updates", type=int, default=3_000)
    parser.add_argument("--short", action="store_true", help="CI run: 8 episodes, 400 updates")
    args = parser.parse_args()
    if args.short:
        args.episodes, args.updates = 8, 400
    torch.manual_seed(0)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.dataset
        if path is None:
            path = os.path.join(tmp, "cartpole.npz")
            with millpond_server(None if args.in_process else args.address) as address:
                where = {} if args.in_process else {"address": address,
                                                     "name": f"bc-{os.getpid()}"}
                buf = millpond.ReplayBuffer(100_000, obs_dim=4, act_dim=1, episodes=True,
                                            **where)
                record(buf, args.episodes, noise=0.2, seed=0)
                buf.export(path)
                print(f"recorded {len(buf)} steps of {buf.info()['episodes']} episodes; "
                      f"exported to {os.path.basename(path)}", flush=True)
                buf.close()
        data = millpond.datasets.load(path)
        dataset = millpond.OfflineDatasetBuffer(**data, normalize=True)
        stats = dataset.stats()
        print("dataset:", {k: round(v, 1) if isinstance(v, float) else v
                           for k, v in stats.items() if k not in ("obs_mean", "obs_std")}, flush=True)
        mean, std = np.asarray(stats["obs_mean"]), np.asarray(stats["obs_std"])

        policy = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                               nn.Linear(64, 2))
        opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
        losses = []
        for step in range(args.updates):
            batch = dataset.sample(256, seed=step, device="cpu")
            logits = policy(batch["obs"])
            loss = nn.functional.cross_entropy(logits, batch["actions"][:, 0].long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step % max(1, args.updates // 5) == 0:
                print(f"update {step:5d}  loss {np.mean(losses[-50:]):.3f}", flush=True)
        before, after = float(np.mean(losses[:20])), float(np.mean(losses[-20:]))
        score = play(policy, mean, std)
        dataset.close()
        print(f"BC loss {before:.3f} -> {after:.3f}; greedy return {score:.1f} "
              f"(the dataset's mean return: {stats['mean_return']:.1f})")
        print(f"loss_before={before:.4f} loss_after={after:.4f} return={score:.1f}")


if __name__ == "__main__":
    main()
