"""Which records a replay-mode sample draws: strategies composed over one FIFO.

* :class:`Uniform`: uniform with replacement over the live records;
* :class:`Proportional`: in proportion to ``priority ** alpha`` (a sum tree
  with one leaf per slot of the whole FIFO), adding importance ``weights``
  and ``indices`` to each sample;
* :class:`UniformTree`: uniform, but over a 0/1 sum tree, so that records
  can leave the draw before they are evicted;
* :class:`UseLimit` wraps either tree strategy: a record leaves the draw
  after its ``max_times_sampled``-th draw.

:func:`strategy_for` builds the one a config asks for; each is a
:class:`Strategy`. Strategies hear the FIFO's changes through the
:class:`~millpond.core.fifo.FifoListener` hooks (no-ops unless they keep
state per slot) plus :meth:`Strategy.appended`. The buffer holds its lock
around every call.

Persistent buffers keep per-slot state in the file's slot arrays (see
:mod:`.bufferfile`): priorities and their owners, draw counts. Writes there
are not part of the crash-consistent commit: after a crash a record may come
back with the priority or count it had before its last update, never a
corrupt one (see :meth:`Proportional.restore`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from millpond.core.bufferfile import BufferFile
from millpond.core.config import BufferConfig, Prioritized
from millpond.core.fifo import Fifo, FifoListener
from millpond.core.sumtree import SumTree
from millpond.errors import NotEnoughDataError

# Slot arrays a persistent buffer's file holds for its strategy.
PRIORITY_ARRAYS = {"priority": "<f8", "priority_seq": "<u8"}
COUNT_ARRAYS = {"times_sampled": "<u4"}
SAMPLE_EXTRAS = ("weights", "indices")


def strategy_arrays(config: BufferConfig) -> dict[str, str]:
    """The slot arrays a persistent buffer with ``config`` keeps for its strategy."""
    arrays = {}
    if config.prioritized is not None:
        arrays.update(PRIORITY_ARRAYS)
    if config.max_times_sampled:
        arrays.update(COUNT_ARRAYS)
    return arrays


class Strategy(FifoListener, Protocol):
    """What the buffer asks of a drawing strategy (lock held)."""

    fifo: Fifo
    extras: tuple[str, ...]  # keys a sample adds ("weights", "indices")
    removed: int  # live records that can no longer be drawn

    def appended(self, lo: int, hi: int, priorities: np.ndarray | None) -> None:
        """Records ``[lo, hi)`` are live (``priorities``: one per record, or None)."""

    def restore(self) -> None:
        """Rebuild per-slot state after the FIFO was reopened."""

    def drawable(self, seqs: np.ndarray) -> np.ndarray:
        """Which of the live ``seqs`` may still be drawn."""

    def draw(self, rng: np.random.Generator, k: int, among: np.ndarray | None = None
             ) -> tuple[np.ndarray, dict]:
        """``k`` seqs and the extra keys of the sample (``k`` records drawable);
        ``among``: draw only from these live seqs (sorted, no holes)."""


def strategy_for(config: BufferConfig, fifo: Fifo, file: BufferFile | None,
                 persistent: bool) -> Strategy:
    """The drawing strategy of a replay-mode buffer with ``config``."""
    keep = file if persistent else None
    if config.prioritized is not None:
        inner: UniformTree | Proportional = Proportional(fifo, config.prioritized, keep)
    elif config.max_times_sampled:
        inner = UniformTree(fifo)
    else:
        return Uniform(fifo)
    if config.max_times_sampled:
        return UseLimit(inner, config.max_times_sampled, keep)
    return inner


class Uniform:
    """Uniform draws with replacement over the live records (damaged ones redrawn)."""

    extras: tuple[str, ...] = ()
    removed = 0  # live records that can no longer be drawn

    def __init__(self, fifo: Fifo):
        self.fifo = fifo

    def evicting(self, lo: int, hi: int) -> None:
        pass

    def reusing(self, lo: int, hi: int) -> None:
        pass

    def appended(self, lo: int, hi: int, priorities: np.ndarray | None) -> None:
        """Records ``[lo, hi)`` are live (``priorities``: one per record, or None)."""

    def restore(self) -> None:
        """Rebuild per-slot state after the FIFO was reopened."""

    def release(self) -> None:
        """Drop every view of the file (before it is unmapped)."""

    def drawable(self, seqs: np.ndarray) -> np.ndarray:
        """Which of the live ``seqs`` may still be drawn."""
        return np.ones(len(seqs), bool)

    def draw(self, rng: np.random.Generator, k: int, among: np.ndarray | None = None
             ) -> tuple[np.ndarray, dict]:
        """``k`` seqs and the extra keys of the sample (lock held, ``k`` records drawable).

        ``among``: draw only from these live seqs (sorted, no holes; an
        episodic filter's candidates), in proportion to the same weights.
        """
        if among is not None:
            return among[rng.integers(0, len(among), size=k)], {}
        fifo = self.fifo
        seqs = rng.integers(fifo.first, fifo.pushed, size=k)
        if len(fifo.holes):  # redraw any damaged record: uniform over the intact
            hit = np.isin(seqs, fifo.holes)
            while hit.any():
                seqs[hit] = rng.integers(fifo.first, fifo.pushed, size=int(hit.sum()))
                hit = np.isin(seqs, fifo.holes)
        return seqs, {}


class _Tree(Uniform):
    """A strategy drawing through a sum tree with one leaf per slot of the whole FIFO.

    Record ``seq`` owns leaf ``seq % total_capacity`` whichever tier holds it,
    so a record spilled to cold keeps its weight and an evicted record hands
    its leaf to the record that replaces it.
    """

    def __init__(self, fifo: Fifo):
        super().__init__(fifo)
        self.tree = SumTree(fifo.total_capacity)

    def seqs_of(self, leaves: np.ndarray) -> np.ndarray:
        """The live seq of each leaf: the slots from ``first``'s on hold this lap's
        seqs, the ones before it the next lap's."""
        first, total = self.fifo.first, self.fifo.total_capacity
        shift = first % total
        seqs = leaves + (first - shift)
        if shift:
            seqs += (leaves < shift) * total
        return seqs

    def exclude(self, slots: np.ndarray) -> None:
        """Take ``slots`` out of the draw until a record is appended there."""
        self.tree.update(slots, np.zeros(len(slots)), unset=np.ones(len(slots), bool))

    def draw_among(self, rng: np.random.Generator, k: int, among: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``k`` of the seqs ``among`` drawn by their leaves' weights: the seqs, their
        weights, and the weights of all of ``among``. NotEnoughDataError if all are 0."""
        values = self.tree.get(among % self.fifo.total_capacity)
        mass = values.sum()
        if not mass > 0:
            raise NotEnoughDataError(
                "no record of the episodes asked for can be drawn (priority 0, or used up)")
        picked = rng.choice(len(among), size=k, p=values / mass)
        return among[picked], values[picked], values

    def _live_slots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """After a reopen: the live seqs, their slots, and which are holes."""
        fifo = self.fifo
        live = np.arange(fifo.first, fifo.pushed)
        return live, live % fifo.total_capacity, np.isin(live, fifo.holes)


class UniformTree(_Tree):
    """Uniform draws among the records still in the tree (see :class:`UseLimit`)."""

    def appended(self, lo: int, hi: int, priorities: np.ndarray | None) -> None:
        slots = np.arange(max(lo, self.fifo.first), hi) % self.fifo.total_capacity
        self.tree.update(slots, np.ones(len(slots)))

    def restore(self) -> None:
        _, slots, holes = self._live_slots()
        self.tree.update(slots, np.ones(len(slots)), unset=holes)

    def draw(self, rng: np.random.Generator, k: int, among: np.ndarray | None = None
             ) -> tuple[np.ndarray, dict]:
        if among is not None:
            return self.draw_among(rng, k, among)[0], {}
        return self.seqs_of(self.tree.find(rng.random(k) * self.tree.total)), {}


class Proportional(_Tree):
    """Draws in proportion to ``priority ** alpha``; samples add ``weights`` and ``indices``.

    Weights are ``(N * P(i)) ** -beta`` over their largest possible value
    ``(N * P_min) ** -beta``, that is ``(value / min) ** -beta``. New records
    get ``max_priority``, the largest priority seen, unless given one.

    With a ``file`` (persistent buffers) each record's raw priority (before
    ``** alpha``) is kept in two slot arrays: ``priority`` and
    ``priority_seq``, the seq whose priority it is (written after it).
    """

    extras: tuple[str, ...] = SAMPLE_EXTRAS

    def __init__(self, fifo: Fifo, prioritized: Prioritized, file: BufferFile | None):
        super().__init__(fifo)
        self.alpha = prioritized.alpha
        self.beta = prioritized.beta
        self.max_priority = 1.0
        self.file = file
        # Files created before priorities were persisted have no such arrays.
        self.persisted = (file is not None and file.slot_array("priority") is not None
                          and file.slot_array("priority_seq") is not None)

    def _stored(self) -> tuple[np.ndarray, np.ndarray]:
        """The file's priority and priority_seq arrays. Looked up on each use rather
        than kept: the map cannot close while a view of it is alive."""
        assert self.file is not None
        stored, owners = self.file.slot_array("priority"), self.file.slot_array("priority_seq")
        assert stored is not None and owners is not None  # checked once: ``persisted``
        return stored, owners

    def appended(self, lo: int, hi: int, priorities: np.ndarray | None) -> None:
        start = max(lo, self.fifo.first)
        if start >= hi:
            return
        if priorities is None:
            values = np.full(hi - start, self.max_priority)
        else:
            values = priorities[len(priorities) - (hi - start):]
            if len(values):
                self.max_priority = max(self.max_priority, float(values.max()))
        seqs = np.arange(start, hi)
        slots = seqs % self.fifo.total_capacity
        if self.persisted:  # the priority, then whose it is
            stored, owners = self._stored()
            stored[slots] = values
            owners[slots] = seqs
        # A zero priority is never drawn and is not the minimum.
        self.tree.update(slots, values ** self.alpha, unset=values == 0)

    def update(self, seqs: np.ndarray, values: np.ndarray) -> None:
        """Set the priorities of live, drawable records ``seqs``."""
        slots = seqs % self.fifo.total_capacity
        if self.persisted:
            self._stored()[0][slots] = values
        self.tree.update(slots, values ** self.alpha, unset=values == 0)
        if len(values):
            self.max_priority = max(self.max_priority, float(values.max()))

    def restore(self) -> None:
        """Rebuild the tree of a reopened buffer from the file's priorities (or all 1).

        A record whose stored priority is not its own (its push's priority
        write was cut off: the slot still names the record evicted before
        it), or not a finite number >= 0 (damage), comes back at
        ``max_priority``, like a record pushed without one; the file is
        repaired to say what the tree does.
        """
        live, slots, holes = self._live_slots()
        if not self.persisted:
            values = np.ones(len(live))
        else:
            stored, owners = self._stored()
            values = stored[slots]  # a copy
            with np.errstate(invalid="ignore"):
                sound = (owners[slots] == live) & np.isfinite(values) & (values >= 0)
            if (sound & ~holes).any():
                self.max_priority = max(1.0, float(values[sound & ~holes].max()))
            values[~sound] = self.max_priority
            repair = ~sound & ~holes
            stored[slots[repair]] = self.max_priority
            owners[slots[repair]] = live[repair]
        self.tree.update(slots, values ** self.alpha, unset=holes | (values == 0))

    def release(self) -> None:
        self.file = None
        self.persisted = False

    def mass(self) -> tuple[float, float]:
        """``(total, min)`` of ``priority ** alpha`` over the drawable records (min:
        the smallest non-zero, +inf if none): what the draw and the weights use."""
        return self.tree.total, self.tree.min

    def state(self) -> dict[str, Any]:
        """What a prioritized buffer's ``info()`` reports of its priorities."""
        total, smallest = self.mass()
        return {"beta": self.beta, "max_priority": self.max_priority,
                "priority_total": total, "priority_min": smallest}

    def draw(self, rng: np.random.Generator, k: int, among: np.ndarray | None = None
             ) -> tuple[np.ndarray, dict]:
        if among is not None:
            seqs, values, weighed = self.draw_among(rng, k, among)
            return seqs, self._extras(seqs, values, weighed[weighed > 0].min())
        tree = self.tree
        total = tree.total
        if not total > 0:  # every priority is zero: nothing is more likely than anything
            seqs, _ = Uniform.draw(self, rng, k)
            return seqs, {"weights": np.ones(k, np.float32), "indices": seqs.astype(np.int64)}
        prefix = rng.random(k)
        prefix *= total
        leaves, values = tree.find_values(prefix)
        seqs = self.seqs_of(leaves)
        return seqs, self._extras(seqs, values, tree.min)

    def _extras(self, seqs: np.ndarray, values: np.ndarray, smallest: float) -> dict:
        """``weights`` and ``indices`` of the records ``seqs`` drawn by ``values`` (their
        ``priority ** alpha``), ``smallest`` being the least non-zero one drawable."""
        if smallest > 0:
            weights = values / smallest
            np.power(weights, -self.beta, out=weights)
        else:  # a priority so small that ** alpha underflowed: P_min is 0
            weights = np.full(len(seqs), 1.0 if self.beta == 0 else 0.0)
        return {"weights": weights.astype(np.float32), "indices": seqs.copy()}


class UseLimit:
    """A record leaves the draw of ``inner`` after its ``limit``-th draw.

    Draw counts are kept per slot (in the file's ``times_sampled`` slot array
    when ``file`` is given), reset before a slot is reused. A used-up record
    stays in the FIFO until evicted but counts as ``removed``.
    """

    def __init__(self, inner: UniformTree | Proportional, limit: int, file: BufferFile | None):
        self.inner = inner
        self.fifo = inner.fifo
        self.limit = limit
        self.extras = inner.extras
        self.removed = 0
        stored = file.slot_array("times_sampled") if file is not None else None
        self.times = (stored if stored is not None
                      else np.zeros(self.fifo.total_capacity, np.uint32))

    def evicting(self, lo: int, hi: int) -> None:
        if self.removed:  # used-up records leave with the evicted
            gone = np.arange(lo, hi) % self.fifo.total_capacity
            self.removed -= int((self.times[gone] >= self.limit).sum())

    def reusing(self, lo: int, hi: int) -> None:
        self.times[np.arange(lo, hi) % self.fifo.total_capacity] = 0

    def appended(self, lo: int, hi: int, priorities: np.ndarray | None) -> None:
        self.inner.appended(lo, hi, priorities)

    def drawable(self, seqs: np.ndarray) -> np.ndarray:
        return self.times[seqs % self.fifo.total_capacity] < self.limit

    def restore(self) -> None:
        """After a reopen: live records used up before stay used up."""
        self.inner.restore()
        fifo = self.fifo
        self.times[fifo.holes % fifo.total_capacity] = 0  # damaged ones count as holes
        slots = np.arange(fifo.first, fifo.pushed) % fifo.total_capacity
        used = slots[self.times[slots] >= self.limit]
        self.removed = len(used)
        self.inner.exclude(used)

    def release(self) -> None:
        self.times = np.zeros(0, np.uint32)  # it may view the file's map, which must close
        self.inner.release()

    def draw(self, rng: np.random.Generator, k: int, among: np.ndarray | None = None
             ) -> tuple[np.ndarray, dict]:
        """Draw, then count the draws against the limit.

        Draws are with replacement, so one batch may draw a record more often
        than it has draws left: those surplus rows are redrawn among the
        records not used up. A record reaching the limit leaves the tree.
        """
        if among is not None:  # checked first: a draw that runs out changes nothing
            left = self.limit - self.times[among % self.fifo.total_capacity].astype(np.int64)
            if np.clip(left, 0, None).sum() < k:
                raise NotEnoughDataError(f"the records of the episodes asked for have fewer "
                                         f"than {k} draws left")
        seqs, extras = self.inner.draw(rng, k, among)
        limit, times = self.limit, self.times
        pending = np.arange(len(seqs))
        while len(pending):
            slots = seqs[pending] % self.fifo.total_capacity
            order = np.argsort(slots, kind="stable")
            ordered = slots[order]
            starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
            counts = np.diff(np.r_[starts, len(ordered)])
            unique = ordered[starts]
            left = (limit - times[unique]).astype(np.int64)
            rank = np.arange(len(ordered)) - np.repeat(starts, counts)  # nth draw of its slot
            surplus = np.empty(len(ordered), bool)
            surplus[order] = rank >= np.repeat(left, counts)
            times[unique] += np.minimum(counts, left).astype(np.uint32)
            done = unique[times[unique] >= limit]
            self.removed += len(done)
            self.inner.exclude(done)
            pending = pending[surplus]
            if len(pending):  # the size check before sampling leaves enough draws
                redrawn, more = self.inner.draw(rng, len(pending), among)
                seqs[pending] = redrawn
                for key, column in more.items():
                    extras[key][pending] = column
        return seqs, extras
