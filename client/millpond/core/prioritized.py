"""Proportional prioritized replay over both tiers.

One :class:`SumTree` leaf per record slot of the whole FIFO: record ``seq``
owns leaf ``seq % total_capacity``, whichever tier holds it, so a record
spilled to the cold file keeps its priority and a record that is evicted
hands its leaf to the record that replaces it. A live seq is recovered from
its leaf as the one live seq congruent to it.

Sampling draws ``batch_size`` prefix sums and descends the tree for all at
once; importance weights are ``(N * P(i)) ** -beta`` divided by their
largest possible value ``(N * P_min) ** -beta``.

The tree lives in RAM. A *persistent* buffer also keeps each record's raw
priority (before ``** alpha``) in its file, in two slot arrays of the whole
FIFO: ``priority`` and ``priority_seq``, the seq whose priority it is
(written after it). :meth:`PrioritizedTieredBuffer.open` rebuilds the tree
from them; ``max_priority`` comes back as the largest live priority (at
least 1). Priority writes are not part of the crash-consistent commit of a
push: after a crash a record may come back with the priority it had before
its last update, never a corrupt one. A record whose stored priority is not
its own (its push's priority write was cut off: the slot still names the
record evicted before it), or not a finite number >= 0 (damage), comes back
at ``max_priority``, like a record pushed without one. Files created before
priorities were persisted have no such arrays: their records start at
priority 1, as they always did.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import numpy as np

from ..errors import InvalidArgumentError, InvalidConfigError
from .buffer import TieredBuffer
from .bufferfile import BufferFile
from .sumtree import SumTree


# The slot arrays of a persistent prioritized buffer's file.
PRIORITY_ARRAYS = {"priority": "<f8", "priority_seq": "<u8"}


def _check_exponent(label: str, value: Any) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 <= value < np.inf:
        raise InvalidConfigError(f"{label} must be a finite number >= 0, got {value!r}")
    return float(value)


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


class PrioritizedTieredBuffer(TieredBuffer):
    """A :class:`TieredBuffer` sampled in proportion to ``priority ** alpha``.

    ``sample`` adds ``weights`` (float32 importance weights, max 1) and
    ``indices`` (the records' seqs, for :meth:`update_priorities`).
    """

    def __init__(self, *args: Any, alpha: float = 0.6, beta: float = 0.4, **kwargs: Any):
        alpha, beta = _check_exponent("alpha", alpha), _check_exponent("beta", beta)
        if kwargs.get("mode", "replay") != "replay":
            raise InvalidConfigError("a prioritized buffer samples in mode='replay' only")
        kwargs["file_meta"] = {"prioritized": {"alpha": alpha, "beta": beta}}
        if kwargs.get("persistent"):
            kwargs["slot_arrays"] = {**(kwargs.get("slot_arrays") or {}), **PRIORITY_ARRAYS}
        super().__init__(*args, **kwargs)
        self._setup_priorities(alpha, beta)

    @classmethod
    def open(cls, path, *, alpha: float = 0.6, beta: float = 0.4, **kwargs: Any):
        buffer = super().open(path, **kwargs)
        buffer._setup_priorities(alpha, beta)
        buffer._restore_priorities()
        buffer._restore_counts()
        return buffer

    def _setup_priorities(self, alpha: float, beta: float) -> None:
        self.alpha = _check_exponent("alpha", alpha)
        self.beta = _check_exponent("beta", beta)
        self.max_priority = 1.0
        self._tree = SumTree(self.total_capacity)
        # Whether the file keeps the priorities (persistent, and not older).
        self._persisted = (self.persistent and self._file.slot_array("priority") is not None
                           and self._file.slot_array("priority_seq") is not None)

    def _stored(self) -> tuple[np.ndarray, np.ndarray]:
        """The file's priority and priority_seq arrays (lock held, buffer open).

        Looked up on each use rather than kept: the map cannot close while a
        view of it is alive.
        """
        return self._file.slot_array("priority"), self._file.slot_array("priority_seq")

    def _restore_priorities(self) -> None:
        """Rebuild the tree of a reopened buffer from the file's priorities (or all 1)."""
        live = np.arange(self._first, self._pushed)
        slots = live % self.total_capacity
        holes = np.isin(live, self._holes)
        if not self._persisted:
            values = np.ones(len(live))
        else:
            stored, owners = self._stored()
            values = stored[slots]  # a copy
            with np.errstate(invalid="ignore"):
                sound = (owners[slots] == live) & np.isfinite(values) & (values >= 0)
            if (sound & ~holes).any():
                self.max_priority = max(1.0, float(values[sound & ~holes].max()))
            values[~sound] = self.max_priority
            repair = ~sound & ~holes  # so that the file says what the tree does
            stored[slots[repair]] = self.max_priority
            owners[slots[repair]] = live[repair]
        self._tree.update(slots, values ** self.alpha, unset=holes | (values == 0))

    # ---- writes ---------------------------------------------------------------

    def push(self, record: Mapping[str, Any], priority: float | None = None, *,
             timeout: float | None = None) -> None:
        """Append one record with ``priority`` (default: the largest seen so far)."""
        self._check_open()
        batch = self.schema.coerce_record(record)
        self._store(1, batch, None if priority is None else check_priorities([priority], 1),
                    timeout)

    def push_batch(self, columns: Mapping[str, Any], priorities: Any = None, *,
                   timeout: float | None = None) -> int:
        """Append a batch with one priority per record (default: the largest seen so far)."""
        self._check_open()
        n, batch = self.schema.coerce_batch(columns)
        self._store(n, batch, None if priorities is None else check_priorities(priorities, n),
                    timeout)
        return n

    def _appended(self, old: int, new: int, prios: np.ndarray | None) -> None:
        start = max(old, self._first)
        if start >= new:
            return
        values = (np.full(new - start, self.max_priority) if prios is None
                  else prios[len(prios) - (new - start):])
        if prios is not None and len(values):
            self.max_priority = max(self.max_priority, float(values.max()))
        seqs = np.arange(start, new)
        slots = seqs % self.total_capacity
        if self._persisted:  # the priority, then whose it is
            stored, owners = self._stored()
            stored[slots] = values
            owners[slots] = seqs
        self._tree.update(slots, values ** self.alpha,
                          unset=values == 0)  # zero priority: never drawn, not the minimum

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Set new priorities for sampled records; returns how many were still live.

        ``indices`` are the ``indices`` a sample returned. Records evicted since
        then are ignored (their slot may hold a newer record by now).
        """
        seqs = np.asarray(indices, np.int64).reshape(-1)
        values = check_priorities(priorities, len(seqs))
        with self._lock:
            self._check_open()
            live = (seqs >= self._first) & (seqs < self._pushed)
            if len(self._holes):
                live &= ~np.isin(seqs, self._holes)
            if self._times is not None:  # used up: gone, like the evicted
                live &= self._times[seqs % self.total_capacity] < self.max_times_sampled
            if live.any():
                slots = seqs[live] % self.total_capacity
                if self._persisted:
                    self._stored()[0][slots] = values[live]
                self._tree.update(slots, values[live] ** self.alpha, unset=values[live] == 0)
                self.max_priority = max(self.max_priority, float(values[live].max()))
            return int(live.sum())

    def set_beta(self, beta: float) -> None:
        """Set the importance-sampling exponent (anneal it towards 1)."""
        self.beta = _check_exponent("beta", beta)

    # ---- reads ----------------------------------------------------------------

    def _draw(self, rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, dict]:
        tree, total = self._tree, self._tree.total
        if not total > 0:  # every priority is zero: nothing is more likely than anything
            seqs, _ = super()._draw(rng, batch_size)
            return seqs, {"weights": np.ones(batch_size, np.float32),
                          "indices": seqs.astype(np.int64)}
        prefix = rng.random(batch_size)
        prefix *= total
        leaves, values = tree.find_values(prefix)
        # The live seq of each leaf: the slots from first's onwards hold this
        # lap's seqs, the ones before it the next lap's.
        shift = self._first % self.total_capacity
        seqs = leaves + (self._first - shift)
        if shift:
            seqs += (leaves < shift) * self.total_capacity
        # (N * P(i)) ** -beta / (N * P_min) ** -beta with P = value / total,
        # that is (value / min) ** -beta.
        smallest = tree.min
        if smallest > 0:
            weights = values / smallest
            np.power(weights, -self.beta, out=weights)
        else:  # a priority so small that ** alpha underflowed: P_min is 0
            weights = np.full(batch_size, 1.0 if self.beta == 0 else 0.0)
        return seqs, {"weights": weights.astype(np.float32), "indices": seqs.copy()}


def as_prioritized(buffer: TieredBuffer) -> PrioritizedTieredBuffer:
    """``buffer`` if it is prioritized, else InvalidArgumentError (priorities on a uniform buffer)."""
    if not isinstance(buffer, PrioritizedTieredBuffer):
        raise InvalidArgumentError("priorities are for prioritized buffers; this one is uniform")
    return buffer


def open_buffer(path, **kwargs: Any) -> TieredBuffer:
    """Reopen a persistent buffer file as the kind of buffer it was created as."""
    prioritized = BufferFile.peek(str(path)).get("prioritized")
    if prioritized:
        return PrioritizedTieredBuffer.open(path, alpha=prioritized["alpha"],
                                            beta=prioritized["beta"], **kwargs)
    return TieredBuffer.open(path, **kwargs)
