"""Offline datasets from files: ``.npz``, D4RL-style HDF5 and local Minari datasets.

Every loader returns a plain dict of numpy arrays under rlox's names, one
row per transition::

    obs, next_obs, actions, rewards, terminated, truncated   (+ episode_ids)

which :class:`millpond.OfflineDatasetBuffer` takes as it is::

    buf = millpond.OfflineDatasetBuffer(**millpond.datasets.load("hopper.hdf5"),
                                        normalize=True)

``episode_ids`` is there when the source says which episode each row
belongs to (Minari, and the ``.npz`` of an episodic buffer's ``export``);
without it, episodes are cut at ``terminated``/``truncated`` (see
:mod:`millpond.core.dataset`).

Array names: rlox's (``obs``, ``next_obs``, ``actions``, ``rewards``,
``terminated``, ``truncated``) or D4RL's (``observations``,
``next_observations``, ``actions``, ``rewards``, ``terminals``,
``timeouts``); ``truncated``/``timeouts`` may be missing (all false). A file
with no next observations is turned into transitions as
``d4rl.qlearning_dataset`` does (see :func:`transitions`).

HDF5 needs ``h5py`` and Minari needs ``minari``: ``pip install
'millpond[datasets]'``; a missing one raises ImportError saying so. Reading
a large file draws a progress bar on stderr when it is a terminal.
Missing files raise FileNotFoundError; files without the arrays
InvalidArgumentError naming what is missing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from millpond.core.dataset import ReadOnlyBuffer, dataset_columns
from millpond.errors import InvalidArgumentError
from millpond.offline.progress import ProgressBar

# D4RL's name -> rlox's; rlox's names map to themselves.
NAMES = {"observations": "obs", "next_observations": "next_obs", "terminals": "terminated",
         "timeouts": "truncated", "obs": "obs", "next_obs": "next_obs", "actions": "actions",
         "rewards": "rewards", "terminated": "terminated", "truncated": "truncated",
         "episode_ids": "episode_ids"}
REQUIRED = ("obs", "actions", "rewards", "terminated")
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf")
HDF5_CHUNK = 1 << 16  # rows per read (a progress step)
INSTALL = "pip install 'millpond[datasets]'"


def load(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The transitions of the dataset at ``path``: a ``.npz`` file, an HDF5 file
    (``.h5``/``.hdf5``/``.hdf``, D4RL's layout: one dataset per array at the
    root) or a Minari dataset's folder (see :func:`from_minari`). Returns the
    dict described in the module docstring."""
    path = Path(path)
    if path.is_dir():
        return from_minari(path)
    if not path.exists():
        raise FileNotFoundError(f"no dataset at {path}")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            return transitions(_select(dict.fromkeys(npz.files), path, lambda k: npz[k]))
    if suffix in HDF5_SUFFIXES:
        return transitions(_read_hdf5(path))
    raise InvalidArgumentError(f"{path}: unknown dataset format {suffix!r}: expected .npz, "
                               f"{', '.join(HDF5_SUFFIXES)} or a Minari dataset folder")


def from_minari(dataset_id_or_path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The transitions of a Minari dataset stored locally: an id (``"D4RL/door/human-v2"``)
    under ``MINARI_DATASETS_PATH`` (Minari's default root otherwise), or the dataset's
    folder (the one holding ``data/``, or ``data/`` itself). Never downloads.

    Each episode's ``observations`` (one more than its steps) give ``obs`` and
    ``next_obs``; its ``terminations``/``truncations`` the flags; its id
    ``episode_ids``. Dict or tuple observation spaces are refused.
    """
    try:
        import minari
    except ImportError:
        raise ImportError(f"Minari datasets need the minari package: {INSTALL}") from None
    path = Path(dataset_id_or_path)
    if path.is_dir():
        data = path / "data" if (path / "data").is_dir() else path
        dataset = minari.MinariDataset(str(data))
    else:
        dataset = minari.load_dataset(str(dataset_id_or_path), download=False)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in (
        "obs", "next_obs", "actions", "rewards", "terminated", "truncated", "episode_ids")}
    with ProgressBar(dataset.total_episodes, f"reading {dataset_id_or_path}", "episodes") as bar:
        for i, episode in enumerate(dataset.iterate_episodes(), 1):
            observations = episode.observations
            if not isinstance(observations, np.ndarray):
                raise InvalidArgumentError(
                    f"Minari dataset {dataset_id_or_path}: observations of type "
                    f"{type(observations).__name__} (a Dict or Tuple space) are not supported; "
                    "flatten them into one array")
            steps = len(episode.rewards)
            parts["obs"].append(observations[:steps])
            parts["next_obs"].append(observations[1:steps + 1])
            parts["actions"].append(np.asarray(episode.actions).reshape(steps, -1))
            parts["rewards"].append(np.asarray(episode.rewards))
            parts["terminated"].append(np.asarray(episode.terminations))
            parts["truncated"].append(np.asarray(episode.truncations))
            parts["episode_ids"].append(np.full(steps, episode.id, np.int64))
            bar(i)
    if not parts["rewards"]:
        raise InvalidArgumentError(f"Minari dataset {dataset_id_or_path} has no episodes")
    return {name: np.concatenate(arrays) for name, arrays in parts.items()}


def transitions(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Arrays under rlox's or D4RL's names -> transitions under rlox's names.

    With next observations, rows are kept as they are (``truncated`` all false
    if missing). Without, as ``d4rl.qlearning_dataset`` builds them: row ``i``
    of the ``N`` observations gives the transition ``(obs[i], actions[i],
    rewards[i], obs[i+1], terminals[i])`` for ``i < N - 1`` (the last row has
    no next observation), and a row with ``timeouts[i]`` is dropped (its next
    observation belongs to the next episode). Unlike D4RL's output, which has
    no such flag, the transition before a dropped timeout row gets
    ``truncated = True`` (unless terminal), so that episodes still end where
    they did; without ``timeouts``, only terminals end episodes (D4RL would
    use the environment's step limit, which a file does not have).
    """
    renamed: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        name = NAMES.get(key)
        if name is None:
            continue
        if np.ndim(value) == 0:
            raise InvalidArgumentError(f"{key} is a scalar, not an array of rows")
        if name in renamed:
            raise InvalidArgumentError(f"the dataset has {name!r} under two names "
                                       f"(rlox's and D4RL's); keep one")
        renamed[name] = np.asarray(value)
    missing = [name for name in REQUIRED if name not in renamed]
    if missing:
        raise InvalidArgumentError(
            f"the dataset lacks {missing} (rlox's names: obs, next_obs, actions, rewards, "
            "terminated, truncated; or D4RL's: observations, next_observations, actions, "
            f"rewards, terminals, timeouts); it has {sorted(arrays)}")
    n = len(renamed["rewards"])
    for name, value in renamed.items():
        if len(value) != n:
            raise InvalidArgumentError(f"{name} has {len(value)} rows, rewards {n}")
    if "next_obs" in renamed:
        renamed.setdefault("truncated", np.zeros(n, bool))
        return renamed
    return _qlearning(renamed, n)


def _qlearning(arrays: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """See :func:`transitions` (no next observations)."""
    terminals = np.asarray(arrays["terminated"]).reshape(n) != 0
    timeouts = (np.asarray(arrays["truncated"]).reshape(n) != 0 if "truncated" in arrays
                else np.zeros(n, bool))
    keep = ~timeouts[:-1]
    out = {name: np.asarray(value)[:-1][keep] for name, value in arrays.items()
           if name not in ("obs", "truncated")}
    out["obs"] = arrays["obs"][:-1][keep]
    out["next_obs"] = arrays["obs"][1:][keep]
    out["terminated"] = terminals[:-1][keep]
    out["truncated"] = (timeouts[1:] & ~terminals[:-1])[keep]
    return out


def _select(keys: Mapping[str, Any], path: Path, read: Any) -> dict[str, np.ndarray]:
    """The arrays of ``keys`` a dataset uses, read with ``read(key)``, with a progress bar."""
    wanted = [key for key in keys if key in NAMES]
    out = {}
    with ProgressBar(len(wanted), f"reading {path.name}", "arrays") as bar:
        for i, key in enumerate(wanted, 1):
            out[key] = np.asarray(read(key))
            bar(i)
    return out


def _read_hdf5(path: Path) -> dict[str, np.ndarray]:
    try:
        import h5py
    except ImportError:
        raise ImportError(f"HDF5 datasets need the h5py package: {INSTALL}") from None
    with h5py.File(path, "r") as f:
        wanted = [key for key in f.keys() if key in NAMES and isinstance(f[key], h5py.Dataset)]
        rows = sum(f[key].shape[0] if f[key].shape else 1 for key in wanted)
        out: dict[str, np.ndarray] = {}
        done = 0
        with ProgressBar(rows, f"reading {path.name}", "rows") as bar:
            for key in wanted:
                source = f[key]
                if not source.shape:
                    raise InvalidArgumentError(f"{path}: {key} is a scalar, not an array")
                target = np.empty(source.shape, source.dtype)
                for start in range(0, source.shape[0], HDF5_CHUNK):
                    stop = min(start + HDF5_CHUNK, source.shape[0])
                    source.read_direct(target, np.s_[start:stop], np.s_[start:stop])
                    done += stop - start
                    bar(done)
                out[key] = target
    return out


def open_dataset(path: str | os.PathLike, label: str | None = None) -> ReadOnlyBuffer:
    """The dataset at ``path`` (anything :func:`load` reads) as a read-only engine
    buffer: what the server serves for ``--dataset NAME=PATH``."""
    arrays = load(path)
    columns = dataset_columns(arrays["obs"], arrays["next_obs"], arrays["actions"],
                              arrays["rewards"], arrays["terminated"], arrays.get("truncated"))
    n = len(columns["rewards"])
    with ProgressBar(n, f"storing {label or Path(path).name}") as bar:
        return ReadOnlyBuffer(columns, arrays.get("episode_ids"), source=os.fspath(path),
                              progress=bar)
