"""Ape-X DQN on CartPole-v1: actor processes and one learner around a millpond server.

    python examples/apex_dqn.py                      # starts a server; stops at mean return 450
    python examples/apex_dqn.py --address HOST:PORT  # a server you run (`millpond serve`)
    python examples/apex_dqn.py --short              # CI: 15 s of learning

* Actors (``--actors`` processes, each a Gymnasium vector env of ``--envs`` CartPoles)
  act epsilon-greedily with Ape-X's spread of epsilons (0.4 ** (1 + 7 i / (N - 1))
  over all N environments) and write their steps with ``episode_writer``.
* The server holds one prioritized, episodic buffer whose rate limiter
  (``SampleToInsertRatio``) keeps actors and learner in step: actors wait when
  they run ahead of the learner, so on a small machine the learner gets the CPU.
* The learner (this process) draws prioritized 3-step transitions
  (``sample(n_step=3)``) through a prefetching ``Sampler``, trains a double
  DQN with importance weights, sends new priorities (``update_priorities``)
  and saves its weights to a small file that actors reload when it changes.
* Every few seconds it evaluates the greedy policy on 10 episodes and prints
  progress; it stops once that mean reaches ``--target`` (or after
  ``--max-seconds``). The last line is ``first=<eval> best=<eval> seconds=<s>``.
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
from torch import nn  # noqa: E402

import millpond  # noqa: E402

N_STEP, GAMMA = 3, 0.99


def q_network() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 2))


def vector_env(n: int) -> gym.vector.VectorEnv:
    """``n`` CartPoles that reset in the step that ends an episode (final obs in info)."""
    return gym.make_vec("CartPole-v1", num_envs=n, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})


def actor(index: int, address: str, name: str, weights: str, epsilons: list[float],
          stop, returns) -> None:
    """Act until ``stop`` is set; send finished episodes' returns to ``returns``."""
    torch.set_num_threads(1)
    buf = millpond.connect(address).buffer(name)
    act(buf, vector_env(len(epsilons)), q_network(), lambda net, obs: net(torch.from_numpy(obs)),
        lambda actions: actions[:, None].astype(np.float32), index, weights, epsilons, stop,
        returns)


def act(buf, envs: gym.vector.VectorEnv, net: nn.Module, q, column, index: int, weights: str,
        epsilons: list[float], stop, returns) -> None:
    """An actor's loop: step ``envs`` (one per epsilon) epsilon-greedily on ``q(net, obs)``,
    reloading ``net`` from ``weights`` when the learner saves them, and append each step
    to ``buf`` as its episodes (``column(actions)``: the actions as stored), until
    ``stop`` is set; each finished episode's ``(epsilon, return)`` goes to ``returns``."""
    n = len(epsilons)
    eps, rng = np.array(epsilons), np.random.default_rng(index)
    n_actions, seen = int(envs.single_action_space.n), 0
    obs, _ = envs.reset(seed=1000 * index)
    episode_return = np.zeros(n)
    with buf.episode_writer(n_envs=n, max_records=16 * n) as writer:
        for step in range(10**12):
            if stop.is_set():
                break
            if step % 50 == 0 and os.stat(weights).st_mtime_ns != seen:  # the learner's latest
                seen = os.stat(weights).st_mtime_ns
                net.load_state_dict(torch.load(weights))
            with torch.no_grad():
                greedy = q(net, obs).argmax(1).numpy()
            actions = np.where(rng.random(n) < eps, rng.integers(0, n_actions, n), greedy)
            next_obs, rewards, terminated, truncated, info = envs.step(actions)
            done = terminated | truncated
            final = next_obs.copy()
            for i in np.flatnonzero(done):  # the true last observation, before the reset
                final[i] = info["final_obs"][i]
            writer.append(obs=obs, actions=column(actions), rewards=rewards.astype(np.float32),
                          terminated=terminated, truncated=truncated, next_obs=final)
            episode_return += rewards
            for i in np.flatnonzero(done):
                returns.put((eps[i], episode_return[i]))
                episode_return[i] = 0
            obs = next_obs
    envs.close()


def evaluate(net: nn.Module, episodes: int = 10) -> float:
    """Mean return of the greedy policy over ``episodes`` CartPole episodes."""
    envs = gym.make_vec("CartPole-v1", num_envs=episodes, vectorization_mode="sync")
    obs, _ = envs.reset(seed=int(time.time()))
    total, alive = np.zeros(episodes), np.ones(episodes, bool)
    while alive.any():
        with torch.no_grad():
            actions = net(torch.from_numpy(obs)).argmax(1).numpy()
        obs, rewards, terminated, truncated, _ = envs.step(actions)
        total += rewards * alive
        alive &= ~(terminated | truncated)
    envs.close()
    return float(total.mean())


def save(net: nn.Module, path: str) -> None:
    """Replace the weights file atomically (actors never read half a file)."""
    torch.save(net.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)


def update(net: nn.Module, target: nn.Module, opt: torch.optim.Optimizer, buf,
           batch: dict, q: torch.Tensor, y: torch.Tensor, tau: float) -> None:
    """One prioritized step: the importance-weighted Huber loss of ``q`` against the
    targets ``y``, a clipped gradient step, the sampled records' new priorities (|TD
    error|), and Polyak averaging of the target network."""
    td = y - q
    loss = (torch.from_numpy(batch["weights"])
            * nn.functional.smooth_l1_loss(q, y, reduction="none")).mean()
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(net.parameters(), 10.0)
    opt.step()
    buf.update_priorities(batch["indices"], td.abs().detach().numpy() + 1e-3)
    for p, tp in zip(net.parameters(), target.parameters()):  # Polyak averaging
        tp.data.mul_(1 - tau).add_(tau * p.data)


def learn(buf, weights: str, returns, args) -> tuple[float, float, float]:
    """Train until the greedy mean return reaches ``args.target``; (first, best, seconds)."""
    net, target = q_network(), q_network()
    target.load_state_dict(net.state_dict())
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    start = time.monotonic()
    first = best = evaluate(net)
    print(f"greedy mean return before training: {first:.1f}", flush=True)
    recent: list[float] = []
    sampler = buf.sampler(args.batch_size, prefetch=2, n_step=N_STEP, gamma=GAMMA)
    last_report, updates = time.monotonic(), 0
    with sampler:
        for batch in sampler:
            obs, next_obs = torch.from_numpy(batch["obs"]), torch.from_numpy(batch["next_obs"])
            actions = torch.from_numpy(batch["actions"][:, 0].astype(np.int64))
            with torch.no_grad():  # double DQN over n steps: r_n + gamma^n Q'(s_n, argmax Q)
                best_next = net(next_obs).argmax(1, keepdim=True)
                bootstrap = target(next_obs).gather(1, best_next)[:, 0]
                discount = GAMMA ** torch.from_numpy(batch["n_step_lens"]).float()
                alive = 1.0 - torch.from_numpy(batch["terminated"]).float()
                y = torch.from_numpy(batch["rewards"]) + discount * alive * bootstrap
            q = net(obs).gather(1, actions[:, None])[:, 0]
            update(net, target, opt, buf, batch, q, y, args.tau)
            updates += 1
            if updates % 20 == 0:
                save(net, weights)
            while not returns.empty():
                recent = (recent + [returns.get()[1]])[-100:]
            now = time.monotonic()
            if now - last_report >= args.report_every:
                last_report = now
                buf.set_beta(min(1.0, 0.4 + 0.6 * (now - start) / 300))
                score = evaluate(net)
                best = max(best, score)
                info = buf.info()
                print(f"{now - start:6.1f}s  updates {updates:6d}  env steps {info['inserts']:7d}"
                      f"  actors' mean return {np.mean(recent) if recent else 0:6.1f}"
                      f"  greedy eval {score:6.1f}", flush=True)
                if score >= args.target or now - start >= args.max_seconds:
                    break
    return first, best, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", help="a running millpond server (default: start one)")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--envs", type=int, default=4, help="environments per actor")
    parser.add_argument("--target", type=float, default=450.0)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--samples-per-insert", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tau", type=float, default=0.01)
    parser.add_argument("--report-every", type=float, default=5.0)
    parser.add_argument("--short", action="store_true", help="CI run: stop after ~15 s of learning")
    args = parser.parse_args()
    if args.short:
        args.max_seconds, args.report_every = min(args.max_seconds, 15.0), 5.0
    torch.set_num_threads(1)
    n_envs = args.actors * args.envs
    epsilons = [0.4 ** (1 + 7 * i / max(1, n_envs - 1)) for i in range(n_envs)]
    ctx = mp.get_context("spawn")
    with millpond_server(args.address) as address, tempfile.TemporaryDirectory() as tmp:
        limiter = millpond.SampleToInsertRatio(
            samples_per_insert=args.samples_per_insert, min_size_to_sample=2_000,
            error_buffer=max(4_000.0, 4 * args.batch_size * args.samples_per_insert))
        name = f"apex-{os.getpid()}"
        buf = millpond.connect(address).create_buffer(
            name, capacity=100_000, obs_dim=4, act_dim=1, prioritized=True,
            alpha=0.6, beta=0.4, episodes=True, rate_limiter=limiter)
        weights = os.path.join(tmp, "weights.pt")
        save(q_network(), weights)
        stop, returns = ctx.Event(), ctx.Queue()
        actors = [ctx.Process(target=actor, args=(
            i, address, name, weights,
            epsilons[i * args.envs:(i + 1) * args.envs], stop, returns), daemon=True)
            for i in range(args.actors)]
        for proc in actors:
            proc.start()
        print(f"{args.actors} actors x {args.envs} envs -> {address}", flush=True)
        try:
            first, best, seconds = learn(buf, weights, returns, args)
        finally:
            stop.set()
            for proc in actors:
                proc.join(5)
                if proc.is_alive():  # waiting on the rate limiter: nothing left to keep
                    proc.terminate()
            buf.close()
        print(f"reached {best:.1f} (target {args.target:.0f}) in {seconds:.0f} s"
              if best >= args.target else f"best greedy mean return {best:.1f} in {seconds:.0f} s")
        print(f"first={first:.1f} best={best:.1f} seconds={seconds:.1f}")


if __name__ == "__main__":
    main()
