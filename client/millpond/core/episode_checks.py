"""The argument checks of episodic calls, made alike by every backend (in-process,
remote, sharded) before anything is sent or changed."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from millpond.core.checks import check_count, check_episode_ids, check_gamma, check_indices
from millpond.core.config import BufferConfig
from millpond.core.episodes import check_meta
from millpond.errors import InvalidArgumentError

# Longest n-step return, window or episode cut: far beyond any use, and bounds on one call's work.
MAX_N_STEP = 1 << 16
MAX_WINDOW = 1 << 20


def require_episodes(config: BufferConfig) -> None:
    if not config.episodes:
        raise InvalidArgumentError("this buffer is not episodic: create it with episodes=True")


def check_push_episodes(config: BufferConfig, episodes: Any, n: int) -> np.ndarray | None:
    """The episode ids of a push of ``n`` records: required for an episodic buffer,
    refused for another."""
    if not config.episodes:
        if episodes is not None:
            raise InvalidArgumentError("episode ids are for episodic buffers (episodes=True)")
        return None
    return check_episode_ids(episodes, n)


def check_n_step(config: BufferConfig, n_step: Any, gamma: Any) -> tuple[int, float]:
    """``(n_step, gamma)`` of an n-step sample, which needs the transition schema."""
    require_episodes(config)
    if not config.schema.is_transition:
        raise InvalidArgumentError("n-step samples are for the transition schema (obs_dim/act_dim)")
    return check_count("n_step", n_step, MAX_N_STEP), check_gamma(gamma)


def check_filter(config: BufferConfig, filter_meta: Mapping[str, Any] | None
                 ) -> dict[str, np.ndarray] | None:
    """``filter_meta`` checked against the meta fields (None: no filter)."""
    if not filter_meta:
        return None
    require_episodes(config)
    return check_meta(config.meta_fields, filter_meta, "filter_meta")


def check_fields(config: BufferConfig, fields: Sequence[str] | None) -> list[str] | None:
    """Field names to read (None: all), each one of the schema's."""
    if fields is None:
        return None
    names = [fields] if isinstance(fields, str) else fields
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"fields must be field names, got {fields!r}")
    names = list(names)
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"fields must name each field once, got {names}")
    unknown = [name for name in names if name not in config.schema.names]
    if unknown:
        raise InvalidArgumentError(f"unknown fields {unknown}; the buffer has "
                                   f"{list(config.schema.names)}")
    return names


def check_updates(config: BufferConfig, updates: Any
                  ) -> list[tuple[int, dict[str, np.ndarray], bool]]:
    """Episode updates ``(episode id, meta or None, end)``, checked."""
    require_episodes(config)
    checked = []
    for update in updates:
        try:
            episode, meta, end = update
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"an episode update is (episode id, meta, end), got {update!r}") from None
        ids = check_indices([episode], "episode ids")
        checked.append((int(ids[0]), check_meta(config.meta_fields, meta), bool(end)))
    return checked
