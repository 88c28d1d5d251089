"""Checks of call arguments, shared by every layer that takes them from users.

The engine, the remote client and the server all call these, so a bad
argument raises the same typed error wherever it is caught first.
"""

from __future__ import annotations

import numbers
from typing import Any, TypeGuard

import numpy as np

from millpond.errors import InvalidArgumentError, InvalidBatchSizeError


def is_integral(value: object) -> TypeGuard[int]:
    """``isinstance(value, numbers.Integral)`` (bool and numpy integers included).

    Typed as a guard for ``int`` (and :func:`is_real` for ``float``): mypy
    takes ``int`` and ``numbers.Integral`` for disjoint, so a plain
    ``isinstance`` on an ``int`` argument makes the code after it unreachable
    to the type checker, and the ``numbers`` stubs lack most comparisons.
    """
    return type(value) is int or isinstance(value, numbers.Integral)  # the usual case first


def is_real(value: object) -> TypeGuard[float]:
    """``isinstance(value, numbers.Real)`` (bool, ints and numpy numbers included)."""
    return type(value) is float or type(value) is int or isinstance(value, numbers.Real)


def check_batch_size(batch_size: Any) -> int:
    """Return ``batch_size`` as an int, or raise InvalidBatchSizeError."""
    if not is_integral(batch_size) or isinstance(batch_size, bool):
        raise InvalidBatchSizeError(f"batch_size must be an integer, got {batch_size!r}")
    if batch_size <= 0:
        raise InvalidBatchSizeError(f"batch_size must be > 0, got {batch_size}")
    return int(batch_size)


def check_seed(seed: Any) -> int | None:
    """Return ``seed`` (None, or an int in [0, 2**64)), or raise InvalidArgumentError."""
    if seed is None:
        return None
    if not is_integral(seed) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise InvalidArgumentError(f"seed must be None or an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def check_timeout(timeout: Any) -> float | None:
    """Return ``timeout`` (None, or finite seconds >= 0) as a float, or raise InvalidArgumentError."""
    if timeout is None:
        return None
    if (not is_real(timeout) or isinstance(timeout, bool)
            or not 0 <= timeout < float("inf")):
        raise InvalidArgumentError(
            f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def check_priorities(priorities: Any, n: int) -> np.ndarray:
    """``priorities`` as float64[n], or InvalidArgumentError (negative, NaN, inf, shape)."""
    try:
        values = np.asarray(priorities, np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"priorities must be numbers: {exc}") from exc
    if values.shape != (n,):
        raise InvalidArgumentError(f"expected {n} priorities, got {values.size}")
    if not np.isfinite(values).all() or (values < 0).any():
        raise InvalidArgumentError("priorities must be finite and >= 0 (no NaN, no negatives)")
    return values


def check_indices(indices: Any, label: str = "indices") -> np.ndarray:
    """``indices`` (the ``indices`` a sample returned) as int64[n], or InvalidArgumentError."""
    try:
        values = np.asarray(indices)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{label} must be integers: {exc}") from exc
    if values.size and values.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{label} must be integers, got dtype {values.dtype}")
    if values.dtype.kind == "u" and values.size and values.max() > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{label} out of range")
    return values.astype(np.int64).reshape(-1)


def check_count(label: str, value: Any, most: int) -> int:
    """``value`` as an int in ``[1, most]`` (seq_len, n_step, max_len), or InvalidArgumentError."""
    if not is_integral(value) or isinstance(value, bool) or not 0 < value <= most:
        raise InvalidArgumentError(f"{label} must be an integer in [1, {most:,}], got {value!r}")
    return int(value)


def check_gamma(gamma: Any) -> float:
    """The discount ``gamma`` as a float in [0, 1], or InvalidArgumentError."""
    if not is_real(gamma) or isinstance(gamma, bool) or not 0 <= gamma <= 1:
        raise InvalidArgumentError(f"gamma must be a number in [0, 1], got {gamma!r}")
    return float(gamma)


def check_episode_ids(episodes: Any, n: int) -> np.ndarray:
    """Episode ids for ``n`` records as int64[n] (one int: all of them), or InvalidArgumentError."""
    if is_integral(episodes) and not isinstance(episodes, bool):
        if not -(2**63) <= episodes < 2**63:
            raise InvalidArgumentError(f"episode ids are 64-bit integers, got {episodes!r}")
        return np.full(n, int(episodes), np.int64)
    values = check_indices(episodes, "episode ids") if episodes is not None else None
    if values is None or values.shape != (n,):
        raise InvalidArgumentError(
            f"an episodic buffer needs one episode id per record ({n}), got "
            f"{'none' if values is None else values.size}")
    return values
