"""Episodes: an index over the one FIFO, not a second storage.

Each record of an episodic buffer carries, in per-slot arrays beside it: its
episode's id, its step (counted from the episode's first record, evicted or
not), the seq of the episode's next record (its own seq while there is
none: a walk along the pointers then stays put, with no test) and, on the
episode's first and last records once it has ended, the episode's length
(0 while it runs). Meta fields (values per episode) are per-slot arrays too,
written on every record of the episode as they become known. A persistent
buffer keeps all of them in its file (slot arrays), so episodes survive
restarts like records do.

Writers interleave, so an episode's records are not adjacent in the FIFO:
windows follow the next pointers. A pointer always names a later seq, and
eviction is FIFO by seq, so every record a live record points to is live
(or not committed yet, after a crash: :meth:`EpisodeIndex.restore` drops
those pointers). An episode whose first record is live is live whole, and
*complete* once ended; one whose head was evicted keeps its live tail for
windows.

In memory, an index (``id -> first and last seq, last step``) of the
episodes being written and of the most recently ended ones (so that meta
given at an episode's end still finds it), ordered by last record:
eviction prunes it from the front. An episode not ended whose records were
all evicted becomes *dormant* (the most recent few thousand are kept): if
its writer comes back, its steps go on counting. The index is rebuilt from
the arrays at reopen (dormant episodes are not: their steps start again).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from millpond.core.bufferfile import BufferFile
from millpond.core.fifo import Fifo
from millpond.core.schema import Field, Schema, check_value
from millpond.errors import InvalidArgumentError, NotEnoughDataError

EPISODE_ARRAYS = {"episode": "<i8", "step": "<i8", "next": "<i8", "length": "<i8"}
META_PREFIX = "meta:"
RECENT_ENDED = 4096  # ended episodes remembered, for meta that comes after their end
END_FIELDS = ("terminated", "truncated")  # a record with either true ends its episode
# The column that carries each record's episode id beside its fields, on the wire and in
# the client's push batcher (not an identifier: no field can have this name).
EPISODE_COLUMN = "#episode"


def with_episode_column(schema: Schema) -> Schema:
    """``schema`` plus the :data:`EPISODE_COLUMN` (int64), for pushes of episodic buffers."""
    return Schema([*schema.fields, Field(EPISODE_COLUMN, np.dtype("<i8"), ())])


def episode_arrays(meta: Schema | None) -> dict[str, str]:
    """The slot arrays a persistent episodic buffer keeps in its file."""
    arrays = dict(EPISODE_ARRAYS)
    for f in meta or ():
        arrays[META_PREFIX + f.name] = f"|V{f.nbytes}"  # viewed as the field's dtype and shape
    return arrays


def record_ends(schema: Schema, batch: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """Which records of a validated batch end their episode (``terminated`` or
    ``truncated`` non-zero, for schemas that have them)."""
    ends = np.zeros(n, bool)
    for name in END_FIELDS:
        if name in schema.names:
            ends |= batch[name].reshape(n, -1).any(axis=1)
    return ends


def check_meta(schema: Schema | None, meta: Mapping[str, Any] | None,
               what: str = "meta") -> dict[str, np.ndarray]:
    """Meta values as the meta fields' dtypes and shapes; a typed error (nothing changed)
    for an unknown field or a value that does not fit."""
    if not meta:
        return {}
    if not isinstance(meta, Mapping):
        raise InvalidArgumentError(f"{what} must be a mapping of meta field -> value")
    names = () if schema is None else schema.names
    unknown = [name for name in meta if name not in names]
    if unknown:
        raise InvalidArgumentError(
            f"{what}: unknown meta fields {unknown}; this buffer's meta fields are {list(names)}")
    assert schema is not None
    return {name: check_value(schema[name], value) for name, value in meta.items()}


@dataclass
class _Episode:
    first: int  # its first record's seq in this index (-1: no record yet)
    last: int  # its last record's seq
    step: int  # the last record's step
    ended: bool = False
    meta: dict[str, np.ndarray] | None = None


class EpisodeIndex:
    """The episodes of one buffer. Every method runs with the buffer's lock held."""

    def __init__(self, fifo: Fifo, meta: Schema | None, file: BufferFile | None):
        self.fifo = fifo
        self.meta_schema = meta
        total = fifo.total_capacity

        def array(name: str, dtype: str) -> np.ndarray:
            stored = file.slot_array(name) if file is not None else None
            return stored if stored is not None else np.zeros(total, np.dtype(dtype))

        self.episode, self.step, self.next, self.length = (
            array(name, dtype) for name, dtype in EPISODE_ARRAYS.items())
        self.meta = {f.name: array(META_PREFIX + f.name, f"|V{f.nbytes}").view(f.dtype)
                     .reshape((total,) + f.shape) for f in meta or ()}
        self.index: OrderedDict[int, _Episode] = OrderedDict()  # by last record
        self.waiting: dict[int, dict[str, np.ndarray]] = {}  # meta of episodes with no record yet
        self.dormant: OrderedDict[int, _Episode] = OrderedDict()  # not ended, no live record
        self.ended = 0  # ended episodes in the index
        self.complete = 0  # live episodes whose first record is live, ended

    # ---- FIFO hooks ----------------------------------------------------------------------

    def evicting(self, lo: int, hi: int) -> None:
        """Records ``[lo, hi)`` leave: complete episodes whose head goes stop counting."""
        slots = np.arange(lo, hi) % self.fifo.total_capacity
        self.complete -= int(np.count_nonzero((self.step[slots] == 0) & (self.length[slots] > 0)))

    def reusing(self, lo: int, hi: int) -> None:
        """Slots of evicted records are about to be reused: nothing of theirs may remain."""
        slots = np.arange(lo, hi) % self.fifo.total_capacity
        self.next[slots] = -1
        self.length[slots] = 0
        for column in self.meta.values():
            column[slots] = 0

    def appended(self, lo: int, hi: int, episodes: np.ndarray, ends: np.ndarray) -> None:
        """Records ``[lo, hi)`` are being stored (before they are committed): ``episodes[i]``
        is record ``lo + i``'s episode, ``ends[i]`` whether it is the episode's last."""
        first = self.first_after(hi)
        self._prune(first)
        seqs = np.arange(lo, hi)
        if hi > lo and (episodes == episodes[0]).all() and not ends[:-1].any():  # one writer
            self._extend(int(episodes[0]), seqs, bool(ends[-1]), first)
            return
        _, first_pos = np.unique(episodes, return_index=True)
        for e in episodes[np.sort(first_pos)].tolist():  # in order of first appearance
            mine = np.flatnonzero(episodes == e)
            cuts = np.flatnonzero(ends[mine][:-1]) + 1
            for part in np.split(mine, cuts):
                self._extend(e, seqs[part], bool(ends[part[-1]]), first)

    def first_after(self, pushed: int) -> int:
        """The oldest live seq once a push up to ``pushed`` commits."""
        return max(self.fifo.first, pushed - self.fifo.total_capacity)

    def _extend(self, e: int, seqs: np.ndarray, ends: bool, first: int) -> None:
        """Records ``seqs`` continue episode ``e`` (and end it); those before ``first``
        (a batch larger than the buffer) are counted but not stored."""
        total = self.fifo.total_capacity
        entry = self.index.pop(e, None)
        if entry is not None and entry.ended:  # the id's ended episode leaves the index
            self.ended -= 1
        if entry is None:
            entry = self.dormant.pop(e, None)
        if entry is None or entry.ended:  # a new episode (an id reused after its end: another)
            entry = _Episode(int(seqs[0]), -1, -1, meta=self.waiting.pop(e, None))
        elif entry.last >= first:  # link the episode's previous record to this one
            self.next[entry.last % total] = seqs[0]
        self.index[e] = entry  # last in the index: it has the newest record
        steps = np.arange(entry.step + 1, entry.step + 1 + len(seqs))
        kept = seqs >= first
        slots = seqs[kept] % total
        self.episode[slots] = e
        self.step[slots] = steps[kept]
        self.next[slots] = np.r_[seqs[1:], seqs[-1]][kept]  # the last points at itself
        entry.last, entry.step = int(seqs[-1]), int(steps[-1])
        if entry.meta:
            self._write_meta(slots, entry.meta)
        if ends:
            self._end(entry, first)

    def _end(self, entry: _Episode, first: int) -> None:
        """End ``entry``: its length goes on its last record, and on its first if live
        (``first``: the oldest live seq)."""
        entry.ended = True
        self.ended += 1
        total, length = self.fifo.total_capacity, entry.step + 1
        if entry.last >= first:
            self.length[entry.last % total] = length
        if entry.first >= first and self.step[entry.first % total] == 0:
            self.length[entry.first % total] = length
            self.complete += 1
        while self.ended > RECENT_ENDED:  # forget the oldest ended episode
            e = next(e for e, old in self.index.items() if old.ended)
            del self.index[e]
            self.ended -= 1

    def _prune(self, first: int) -> None:
        """Take episodes with no live record (before ``first``) out of the index (ordered
        by last record): ended ones are forgotten, the others go dormant."""
        while self.index:
            e, entry = next(iter(self.index.items()))
            if entry.last >= first:
                return
            del self.index[e]
            if entry.ended:
                self.ended -= 1
            else:
                self.dormant[e] = entry
                _cap(self.dormant)

    # ---- meta and explicit ends ------------------------------------------------------------

    def update(self, e: int, meta: Mapping[str, np.ndarray], end: bool,
               first: int | None = None) -> None:
        """Give episode ``e`` meta values (checked by :func:`check_meta`) and/or end it.

        Meta reaches every live record of the episode and every record it
        gets later; meta for an episode with no record yet waits for its
        first (in memory only: send it with the first record, see
        :meth:`appended`). Ending an episode with no live record, or ended,
        does nothing. ``first``: the oldest live seq once the push being
        stored commits (updates that ride with a push), else the FIFO's.
        """
        first = self.fifo.first if first is None else first
        self._prune(first)
        entry = self.index.get(e)
        if entry is None:
            dormant = self.dormant.get(e)
            if end:  # nothing of it is live: ending it only stops it from going on
                self.dormant.pop(e, None)
            elif dormant is not None:
                dormant.meta = {**(dormant.meta or {}), **meta}
            elif meta:
                self.waiting[e] = {**self.waiting.get(e, {}), **meta}
                _cap(self.waiting)
            return
        if meta:
            entry.meta = {**(entry.meta or {}), **meta}
            seqs = np.arange(max(entry.first, first), entry.last + 1)
            slots = seqs % self.fifo.total_capacity
            self._write_meta(slots[self.episode[slots] == e], entry.meta)
        if end and not entry.ended:
            self._end(entry, first)

    def _write_meta(self, slots: np.ndarray, meta: Mapping[str, np.ndarray]) -> None:
        for name, value in meta.items():
            self.meta[name][slots] = value

    # ---- reads -----------------------------------------------------------------------------

    @property
    def in_progress(self) -> int:
        """Episodes not ended that have a live record."""
        self._prune(self.fifo.first)
        return len(self.index) - self.ended

    def matching(self, seqs: np.ndarray, filter_meta: Mapping[str, np.ndarray] | None
                 ) -> np.ndarray:
        """Which of the live ``seqs`` belong to episodes whose meta equals ``filter_meta``."""
        keep = np.ones(len(seqs), bool)
        slots = seqs % self.fifo.total_capacity
        for name, value in (filter_meta or {}).items():
            column = self.meta[name][slots]
            keep &= (column == value).reshape(len(seqs), -1).all(axis=1)
        return keep

    def candidates(self, filter_meta: Mapping[str, np.ndarray] | None) -> np.ndarray:
        """The live seqs whose episode matches ``filter_meta``; NotEnoughDataError if none."""
        live = self.fifo.live()
        found = live[self.matching(live, filter_meta)]
        if not len(found):
            raise NotEnoughDataError(_nothing("record", filter_meta))
        return found

    def heads(self, filter_meta: Mapping[str, np.ndarray] | None) -> np.ndarray:
        """The first records of the complete live episodes that match, in episode order."""
        live = self.fifo.live()
        slots = live % self.fifo.total_capacity
        heads = live[(self.step[slots] == 0) & (self.length[slots] > 0)]
        heads = heads[self.matching(heads, filter_meta)]
        if len(self.fifo.holes):  # an episode with a damaged record is not complete
            lengths = self.lengths(heads)
            damaged = np.isin(self.chains(heads, lengths), self.fifo.holes)
            owner = np.repeat(np.arange(len(heads)), lengths)
            heads = np.delete(heads, np.unique(owner[damaged]))
        return heads

    def lengths(self, heads: np.ndarray) -> np.ndarray:
        return self.length[heads % self.fifo.total_capacity].copy()

    def walk(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``length - 1`` steps along the next pointers from each start: seqs
        ``[len(starts), length]``, repeating an episode's last live record past it (a
        record with no next points at itself), and how many steps each row has before
        that. Damaged records are not left out (see :meth:`windows`)."""
        steps = np.empty((length, len(starts)), np.int64)  # one contiguous row per step
        steps[0] = starts
        slots = np.empty(len(starts), np.int64)
        total = self.fifo.total_capacity
        for j in range(1, length):
            # Not take(mode="wrap"): numpy wraps by repeated subtraction, seq // capacity
            # steps per index, which grows without bound as a buffer lives on.
            np.remainder(steps[j - 1], total, out=slots)
            self.next.take(slots, mode="clip", out=steps[j])
        # A walk stays on an episode's last record once there: its length is 1 + its moves.
        lens = (steps[1:] != steps[:-1]).sum(axis=0) + 1
        return steps.T, lens

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Up to ``length`` records of each start's episode from the start on: seqs
        ``[len(starts), length]``, -1 past the episode's last live record."""
        out, _ = self.walk(starts, length)
        inside = np.empty(out.shape, bool)
        inside[:, 0] = True
        np.greater(out[:, 1:], out[:, :-1], out=inside[:, 1:])
        if len(self.fifo.holes):  # a damaged record ends the window
            inside &= ~np.isin(out, self.fifo.holes)
        np.logical_and.accumulate(inside, axis=1, out=inside)
        out[~inside] = -1
        return out

    def chains(self, heads: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Every record of the episodes starting at ``heads`` (of ``lengths`` records),
        episode after episode, each in step order."""
        if not len(heads):
            return np.empty(0, np.int64)
        order = np.argsort(lengths, kind="stable")  # walk the long ones last, fewer at a time
        out = np.empty(int(lengths.sum()), np.int64)
        offsets = np.r_[0, np.cumsum(lengths)[:-1]]
        total = self.fifo.total_capacity
        current, where, left = heads[order], offsets[order], lengths[order]
        while len(current):
            out[where] = current
            keep = left > 1
            current, where, left = current[keep], where[keep] + 1, left[keep] - 1
            current = self.next[current % total]
        return out

    def describe(self, seqs: np.ndarray) -> dict[str, np.ndarray]:
        """``episode_ids``, ``start_steps`` and the meta fields of records ``seqs``."""
        slots = seqs % self.fifo.total_capacity
        return {"episode_ids": self.episode[slots], "start_steps": self.step[slots],
                **{name: column[slots] for name, column in self.meta.items()}}

    # ---- reopen ----------------------------------------------------------------------------

    def restore(self) -> None:
        """Rebuild the index of a reopened buffer from its arrays, repairing what a crash
        cut short: pointers to records never committed, and the length of an episode
        whose last record was never committed."""
        fifo, total = self.fifo, self.fifo.total_capacity
        live = fifo.live()
        if not len(live):
            return
        slots = live % total
        pointers = self.next[slots]
        broken = (pointers >= fifo.pushed) | (pointers < live)  # never committed, or garbage
        self.next[slots[broken]] = live[broken]
        ids = self.episode[slots]
        order = np.lexsort((live, ids))
        ids, ordered = ids[order], live[order]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        lasts = np.r_[starts[1:], len(ids)] - 1
        for e, a, b in zip(ids[starts].tolist(), ordered[starts].tolist(),
                           ordered[lasts].tolist()):
            first, last = a % total, b % total
            ended = bool(self.length[last] > 0 and self.length[last] == self.step[last] + 1)
            if self.step[first] == 0:
                self.length[first] = self.length[last] if ended else 0
                self.complete += ended
            meta = {name: column[first].copy() for name, column in self.meta.items()}
            self.index[e] = _Episode(a, b, int(self.step[last]), ended, meta or None)
            self.ended += ended
        self.index = OrderedDict(sorted(self.index.items(), key=lambda item: item[1].last))
        while self.ended > RECENT_ENDED:
            e = next(e for e, old in self.index.items() if old.ended)
            del self.index[e]
            self.ended -= 1

    def release(self) -> None:
        """Drop every view of the file (before it is unmapped)."""
        empty = np.zeros(0, np.int64)
        self.episode = self.step = self.next = self.length = empty
        self.meta = {}


def _cap(recent: dict) -> None:
    """Keep the :data:`RECENT_ENDED` newest entries of ``recent`` (insertion order)."""
    while len(recent) > RECENT_ENDED:
        del recent[next(iter(recent))]


def _nothing(what: str, filter_meta: Mapping[str, Any] | None) -> str:
    if filter_meta:
        shown = {name: np.asarray(value).tolist() for name, value in filter_meta.items()}
        return f"no live {what} belongs to an episode with meta {shown}"
    return f"no live {what} to sample"
