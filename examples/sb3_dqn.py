"""Stable-Baselines3 DQN on CartPole-v1, its replay buffer on a millpond server.

    python examples/sb3_dqn.py                       # starts a server, 50k steps (~2 min)
    python examples/sb3_dqn.py --address HOST:PORT   # a server you run (`millpond serve`)
    python examples/sb3_dqn.py --in-process          # no server: an in-process buffer
    python examples/sb3_dqn.py --short               # CI: a few thousand steps

The only change to an SB3 script is ``replay_buffer_class`` and
``replay_buffer_kwargs``. Hyperparameters are RL Zoo's for CartPole-v1. Prints
the greedy policy's mean return before and after training; the last line is
``before=<float> after=<float>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gymnasium as gym  # noqa: E402
import torch  # noqa: E402
from _server import millpond_server  # noqa: E402
from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402

from millpond.integrations.sb3 import ReplayBuffer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", help="a running millpond server (default: start one)")
    parser.add_argument("--in-process", action="store_true", help="no server at all")
    parser.add_argument("--timesteps", type=int, default=50_000)
    parser.add_argument("--short", action="store_true", help="CI run: 6,000 steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    timesteps = 6_000 if args.short else args.timesteps
    torch.set_num_threads(1)

    with millpond_server(None if args.in_process else args.address) as address:
        kwargs = {} if args.in_process else {"address": address, "name": f"sb3-dqn-{os.getpid()}"}
        model = DQN(
            "MlpPolicy", "CartPole-v1",
            replay_buffer_class=ReplayBuffer, replay_buffer_kwargs=kwargs,
            learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1_000,
            gamma=0.99, target_update_interval=10, train_freq=256, gradient_steps=128,
            exploration_fraction=0.16, exploration_final_eps=0.04,
            policy_kwargs={"net_arch": [256, 256]}, seed=args.seed, device="cpu",
        )
        eval_env = Monitor(gym.make("CartPole-v1"))
        before, _ = evaluate_policy(model, eval_env, n_eval_episodes=10, deterministic=True)
        print(f"buffer on {'this process' if args.in_process else address}; "
              f"mean return before training: {before:.1f}", flush=True)
        start = time.monotonic()
        model.learn(timesteps)
        elapsed = time.monotonic() - start
        after, std = evaluate_policy(model, eval_env, n_eval_episodes=10, deterministic=True)
        info = model.replay_buffer.millpond_buffer.info()
        print(f"{timesteps} steps in {elapsed:.0f} s; buffer holds {info['size']} transitions; "
              f"mean return after: {after:.1f} +/- {std:.1f}")
        model.replay_buffer.close()  # this handle created the server's buffer: deletes it
        print(f"before={before:.1f} after={after:.1f}")


if __name__ == "__main__":
    main()
