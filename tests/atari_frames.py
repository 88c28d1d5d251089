"""Real Atari transitions for the pixel tests and `make bench` (extra `atari`: ale-py, which
ships its ROMs, opencv-python-headless and gymnasium).

ALE environments made with ``frameskip=1``, then gymnasium's ``AtariPreprocessing`` (84x84
grayscale, frame skip 4) and ``FrameStackObservation(4)`` (``padding_type="reset"``
repeats an episode's first frame, gymnasium's default; ``"zero"`` pads with zero frames,
as SB3's ``VecFrameStack`` does). Random actions; episodes are cut at ``max_steps`` so
that a few thousand steps hold several resets and truncations.
"""

from __future__ import annotations

import numpy as np

FIELDS = {"obs": ("uint8", (4, 84, 84)), "next_obs": ("uint8", (4, 84, 84)),
          "actions": ("int64", ()), "rewards": ("float32", ()), "terminated": ("bool", ()),
          "truncated": ("bool", ())}


def record(game: str, steps: int, seed: int = 0, padding: str = "reset",
           max_steps: int = 400) -> dict[str, np.ndarray]:
    """``steps`` transitions of ``game`` (e.g. "Pong"): the transition fields of
    :data:`FIELDS`, plus ``episode`` (an id per record)."""
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", frameskip=1, repeat_action_probability=0.0,
                   max_episode_steps=max_steps * 4)
    env = FrameStackObservation(AtariPreprocessing(env, frame_skip=4, screen_size=84,
                                                   grayscale_obs=True), 4,
                                padding_type=padding)
    rng = np.random.default_rng(seed)
    out: dict[str, list] = {name: [] for name in (*FIELDS, "episode")}
    obs, _ = env.reset(seed=seed)
    episode = 0
    for _ in range(steps):
        action = int(rng.integers(env.action_space.n))
        nxt, reward, terminated, truncated, _ = env.step(action)
        for name, value in (("obs", obs), ("next_obs", nxt), ("actions", action),
                            ("rewards", reward), ("terminated", terminated),
                            ("truncated", truncated), ("episode", episode)):
            out[name].append(np.asarray(value))
        obs = nxt
        if terminated or truncated:
            obs, _ = env.reset()
            episode += 1
    env.close()
    return {name: np.stack(values).astype(FIELDS[name][0] if name in FIELDS else np.int64)
            for name, values in out.items()}
