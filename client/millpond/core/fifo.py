"""One FIFO of records over two tiers: the live ranges, how a push moves them, the commit.

Every record gets a sequence number ``seq`` (0, 1, 2, ... in push order).
The live records are ``[first, pushed)``; those from ``hot_lo`` on sit in the
hot tier at ``seq % (hot_capacity + spare)``, the older ones in the cold tier
at ``seq % cold_capacity``. A push computes, per batch, which seq ranges move
hot -> cold and which go straight to each tier, and copies them as a few
slices per field: never a loop over records.

A durable FIFO's hot tier has ``spare`` slots beyond ``hot_capacity`` (see
:meth:`Fifo.append`): a push's records go into slots that hold no live
record, and the push commits them and the evictions they cause in one step.

Not thread-safe: the buffer holds its lock around every call.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from millpond.core.bufferfile import BufferFile
from millpond.core.frames import Frames
from millpond.core.schema import Schema
from millpond.core.stored import StoredBatch
from millpond.core.tier import Tier

# before_commit(lo, hi, row): records [lo, hi), batch rows from row on, are written, not yet live.
BeforeCommit = Callable[[int, int, int], None]


class FifoListener(Protocol):
    """What a drawing strategy hears of the FIFO's changes (lock held)."""

    def evicting(self, lo: int, hi: int) -> None:
        """Records ``[lo, hi)`` are about to leave (evicted, or taken by a queue)."""

    def reusing(self, lo: int, hi: int) -> None:
        """Records ``[lo, hi)`` are about to be written into the slots of evicted ones."""

    def release(self) -> None:
        """Drop every view of the file (it is about to be unmapped, or the listener replaced)."""


class Fifo:
    """The live ranges ``[first, pushed)`` (hot from ``hot_lo``) and the tiers holding them.

    A *durable* FIFO (a persistent buffer) records every change of its ranges
    in its file (:meth:`BufferFile.commit`); ``sync_every_push`` also syncs
    each one. ``holes`` are live seqs that failed their checks at reopen:
    never served, gone once evicted. ``spare``: the hot tier's slots beyond
    ``hot_capacity`` (its ``capacity`` counts them).
    """

    def __init__(self, schema: Schema, hot: Tier, cold: Tier | None, total_capacity: int,
                 file: BufferFile | None, durable: bool, sync_every_push: bool = False,
                 spare: int = 0, frames: Frames | None = None, stored: Schema | None = None):
        self.schema = schema  # the records as pushed and read
        # A buffer with frame_stack or next_of (see .frames): the tiers hold ``stored``
        # records (frame fields as frame ids); append takes and reads return ``schema``'s.
        self.frames = frames
        self.stored = schema if stored is None else stored
        self.hot = hot
        self.cold = cold
        self.spare = spare
        self.hot_capacity = hot.capacity - spare
        self.total_capacity = total_capacity
        self.file = file
        self.durable = durable
        self.sync_every_push = sync_every_push
        self.pushed = self.first = self.hot_lo = 0
        self.holes = np.empty(0, np.int64)
        self.listeners: Sequence[FifoListener] = ()
        self.refs = False  # reads return frame refs: see stored_reads

    @property
    def size(self) -> int:
        """Live records, less the holes."""
        return self.pushed - self.first - len(self.holes)

    def live(self) -> np.ndarray:
        """Every live seq that is not a hole, oldest first."""
        return np.setdiff1d(np.arange(self.first, self.pushed), self.holes, assume_unique=True)

    def is_live(self, seqs: np.ndarray) -> np.ndarray:
        """Which of ``seqs`` are live records (holes are not)."""
        live = (seqs >= self.first) & (seqs < self.pushed)
        if len(self.holes):
            live &= ~np.isin(seqs, self.holes)
        return live

    # ---- writes ----------------------------------------------------------------

    def append(self, n: int, batch: Mapping[str, np.ndarray],
               before_commit: BeforeCommit | None = None) -> tuple[int, int]:
        """Store a validated batch of ``n`` records; return its seqs ``(old, new)``.

        ``before_commit(lo, hi, row)`` runs before records ``[lo, hi)`` (batch rows
        from ``row`` on) are committed, once they are written: what it writes about
        them is in place whenever they are live.

        With spare slots (a durable FIFO of format 5), records go in chunks of at
        most ``spare``, each in one commit: (1) the chunk's records are written
        into hot slots that hold no live record (the hot tier then holds at most
        ``hot_capacity`` records, so the ``spare`` slots after them are free);
        (2) one commit makes them live and evicts what they push out of
        ``total_capacity``; (3) hot records beyond ``hot_capacity`` are copied to
        the cold slots of evicted records, and a commit says they are read from
        cold (it changes no record's presence). A crash before (2) leaves the
        chunk absent and every record it would have evicted present, intact: no
        live record's bytes are overwritten before the commit that evicts it. A
        push of more than ``spare`` records that a crash interrupts may leave its
        first chunks present (whole records, in order), never part of a chunk.
        (Slot arrays, one element per ``seq % total_capacity``, have no spare:
        the elements of records a chunk evicts are rewritten before its commit.)

        With ``frames``, the batch's new frames are written first (StorageFullError,
        nothing changed, if they do not fit: see :mod:`.frames`), then its records.
        """
        if self.frames is not None:
            batch = self.frames.encode(batch, n, self.first, self.pushed)
        if not self.spare:
            return self._append_in_place(n, batch, before_commit)
        old = self.pushed
        for lo in range(old, old + n, self.spare):
            hi = min(old + n, lo + self.spare)
            self.settle()  # the hot tier holds at most hot_capacity records: spare slots are free
            first = max(self.first, hi - self.total_capacity)
            for listener in self.listeners:  # (what they keep is in memory: told in order)
                if first > self.first:
                    listener.evicting(self.first, first)
                listener.reusing(max(lo, hi - self.total_capacity), hi)
            self.hot.write(lo, hi, batch, old)  # (1)
            if before_commit is not None:
                before_commit(lo, hi, lo - old)
            self._commit(hi, first, self.hot_lo, always=True, told=True)  # (2) the chunk is in
            self.settle()  # (3)
        return old, old + n

    def settle(self) -> None:
        """Move the hot records beyond ``hot_capacity`` to the cold tier (into the slots
        of evicted records), then commit that they are read from there. Nothing to do
        but after a push's commit (or a crash right after one)."""
        target = self.pushed - self.hot_capacity
        if self.hot_lo >= target:
            return
        start = max(self.first, self.hot_lo)
        if self.cold is not None and start < target:
            self.hot.copy_to(self.cold, start, target)
        self._commit(self.pushed, self.first, target)

    def _append_in_place(self, n: int, batch: Mapping[str, np.ndarray],
                         before_commit: BeforeCommit | None) -> tuple[int, int]:
        """:meth:`append` without spare slots: a FIFO that is not durable, or the file of
        a format 4 buffer. A durable one commits in three steps, so that a crash at any
        point leaves a consistent committed state: (1) the records this push evicts are
        declared gone before their slots are reused; (2) hot records moved to cold are
        declared cold before their hot slots are reused; (3) the new records become
        live. A crash before (3) leaves the push absent, and the records it evicted gone."""
        old, new = self.pushed, self.pushed + n
        first = max(self.first, new - self.total_capacity)
        hot_lo = max(self.hot_lo, new - self.hot_capacity)
        self._commit(old, first, self.hot_lo)  # (1) evictions
        for listener in self.listeners:
            listener.reusing(max(old, new - self.total_capacity), new)
        if self.cold is not None:
            # Hot records pushed out by this batch move to cold; a batch larger than
            # the hot ring sends its own head straight to cold.
            if max(first, self.hot_lo) < min(hot_lo, old):
                self.hot.copy_to(self.cold, max(first, self.hot_lo), min(hot_lo, old))
            if max(first, old) < hot_lo:
                self.cold.write(max(first, old), hot_lo, batch, old)
        self._commit(old, first, hot_lo)  # (2) spilled records now read from cold
        self.hot.write(max(old, hot_lo), new, batch, old)
        if before_commit is not None:
            before_commit(old, new, 0)
        self._commit(new, first, hot_lo, always=True)  # (3) the push is in
        return old, new

    def pop(self, k: int, newest: bool, out: Mapping[str, np.ndarray] | None = None
            ) -> dict[str, np.ndarray]:
        """Gather and remove the ``k`` oldest live records, oldest first (a queue), or
        with ``newest`` the ``k`` newest, newest first (a stack). ``k`` are held."""
        if newest:
            span = np.arange(max(self.first, self.pushed - k - len(self.holes)), self.pushed)
            seqs = np.setdiff1d(span, self.holes, assume_unique=True)[-k:][::-1]
            result = self.gather(seqs, out, hot_first=True)
            self._commit(int(seqs[-1]), self.first, self.hot_lo, always=True)
        else:
            span = np.arange(self.first, min(self.pushed, self.first + k + len(self.holes)))
            seqs = np.setdiff1d(span, self.holes, assume_unique=True)[:k]
            result = self.gather(seqs, out)
            self._commit(self.pushed, int(seqs[-1]) + 1, self.hot_lo, always=True)
        return result

    def clear(self) -> None:
        """Drop every live record (a reset) in one commit: a crash leaves all of them or none.
        Seqs go on counting from ``pushed``, so that no later record takes an old one's seq
        (a sample's ``indices`` never name a record pushed after the reset)."""
        self._commit(self.pushed, self.pushed, self.pushed, always=True)

    def _commit(self, pushed: int, first: int, hot_lo: int, always: bool = False,
                told: bool = False) -> None:
        """Adopt the live ranges; record them in the file if durable.

        ``always``: record them in the file of a non-durable FIFO too (the
        final step of each change keeps its header in step, for inspection).
        ``told``: the listeners already heard of the evictions.
        """
        first = min(first, pushed)
        hot_lo = min(max(hot_lo, first), pushed)
        if first > self.first and not told:
            for listener in self.listeners:
                listener.evicting(self.first, first)
        self.pushed, self.first, self.hot_lo = pushed, first, hot_lo
        if len(self.holes):  # damaged records leave with the evicted ones (or popped)
            self.holes = self.holes[(self.holes >= first) & (self.holes < pushed)]
        if self.file is not None and (self.durable or always):
            self.file.commit(pushed, first, hot_lo)
            if self.sync_every_push:
                self.file.sync()

    # ---- reads -----------------------------------------------------------------

    def stored_reads(self, read: Callable[[], dict[str, np.ndarray]]) -> StoredBatch:
        """``read()`` (a draw under the buffer's lock: any sample of ``sequences`` or the
        buffer) in the stored form (:class:`.stored.StoredBatch`): while it runs,
        :meth:`gather` and :meth:`gather_rows` return a group field as its frame *refs*
        (``id + 1``, ``[..., k]`` int64) instead of decoding it, so the draw, its order
        and its padding (a zeroed row: ref 0, a zero frame) are exactly the plain
        read's; then :meth:`.frames.Frames.stored_form` makes the tables. Without frame
        groups, the plain arrays."""
        if self.frames is None:
            return StoredBatch(read())
        self.refs = True
        try:
            result = read()
        finally:
            self.refs = False
        return self.frames.stored_form(result)

    def gather(self, seqs: np.ndarray, out: Mapping[str, np.ndarray] | None = None,
               hot_first: bool = False) -> dict[str, np.ndarray]:
        """Copy live records ``seqs`` into ``out`` (new arrays if None).

        Rows holding cold records come first, then hot ones, each group in
        the order given (hot first if ``hot_first``): one gather per tier.
        """
        frames = self.frames
        if frames is not None and self.refs:
            return self._refs(self._gather(seqs, {f.name: np.empty((len(seqs),) + f.shape, f.dtype)
                                                  for f in self.stored}, hot_first))
        if out is None:
            out = {f.name: np.empty((len(seqs),) + f.shape, f.dtype) for f in self.schema}
        if frames is None:
            return self._gather(seqs, out, hot_first)
        stored = {name: np.empty((len(seqs),) + self.stored[name].shape, self.stored[name].dtype)
                  if name in frames.group_of else array for name, array in out.items()}
        self._gather(seqs, stored, hot_first)
        frames.decode_fields({name: (stored[name], out[name]) for name in out
                              if name in frames.group_of})
        return dict(out)

    def _gather(self, seqs: np.ndarray, out: Mapping[str, np.ndarray],
                hot_first: bool) -> dict[str, np.ndarray]:
        """:meth:`gather` of the records as the tiers hold them."""
        is_hot = seqs >= self.hot_lo
        cold_seqs, hot_seqs = seqs[~is_hot], seqs[is_hot]
        if hot_first:
            self.hot.gather(hot_seqs, out, 0)
        if len(cold_seqs):
            assert self.cold is not None
            self.cold.gather(cold_seqs, out, len(hot_seqs) if hot_first else 0)
        if not hot_first:
            self.hot.gather(hot_seqs, out, len(cold_seqs))
        return dict(out)

    def gather_rows(self, seqs: np.ndarray, names: Sequence[str] | None = None,
                    out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Records ``seqs`` (live; any shape) as ``{name: array[*seqs.shape, *field shape]}``,
        row for row: fields ``names`` (default: all), into ``out``'s arrays if given
        (C-contiguous, e.g. shared memory). Records all in one tier (the usual case) are
        copied once; otherwise each tier's rows are gathered, then scattered."""
        frames = self.frames
        if frames is None:
            return self._gather_rows(seqs, names, out, self.schema)
        names = list(names or self.schema.names)
        if self.refs:
            return self._refs(self._gather_rows(seqs, names, None, self.stored))
        coded = [name for name in names if name in frames.group_of]
        stored = self._gather_rows(seqs, names, {name: array for name, array in (out or {}).items()
                                                 if name not in frames.group_of} or None,
                                   self.stored)
        decoding = {}
        for name in coded:
            field = self.schema[name]
            array = (np.empty(seqs.shape + field.shape, field.dtype) if out is None
                     else out[name])
            flat = stored[name].reshape(-1, self.stored[name].shape[0])
            decoding[name] = (flat, array.reshape((len(flat),) + field.shape))
            stored[name] = array
        frames.decode_fields(decoding)
        return {name: stored[name] for name in names}

    def _refs(self, stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``stored`` with each group field's frame ids as refs (``id + 1``)."""
        assert self.frames is not None
        for name in stored:
            if name in self.frames.group_of:
                stored[name] += 1
        return stored

    def stored_rows(self, seqs: np.ndarray, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Fields ``names`` of live records ``seqs`` as the tiers hold them (frame ids)."""
        return self._gather_rows(seqs, names, None, self.stored)

    def _gather_rows(self, seqs: np.ndarray, names: Sequence[str] | None,
                     out: Mapping[str, np.ndarray] | None, schema: Schema
                     ) -> dict[str, np.ndarray]:
        """:meth:`gather_rows` of fields as ``schema`` (the tiers') has them."""
        result = {}
        for name in names or schema.names:
            field = schema[name]
            result[name] = (np.empty(seqs.shape + field.shape, field.dtype)
                            if out is None or name not in out else out[name])
        flat, rows = seqs, result
        if seqs.ndim != 1:
            flat = seqs.reshape(-1)
            rows = {name: array.reshape((len(flat),) + array.shape[seqs.ndim:])
                    for name, array in result.items()}
        if not len(flat) or flat.min() >= self.hot_lo:  # the usual case: one check
            self.hot.gather(flat, rows, 0)
            return result
        is_hot = flat >= self.hot_lo
        if not is_hot.any():
            assert self.cold is not None
            self.cold.gather(flat, rows, 0)
        else:
            order = np.argsort(is_hot, kind="stable")
            gathered = self._gather(flat[order], {n: np.empty_like(a) for n, a in rows.items()},
                                    False)
            for name, column in gathered.items():
                rows[name][order] = column
        return result

    def take(self, seqs: np.ndarray, name: str) -> np.ndarray:
        """Field ``name`` of live records ``seqs`` (any shape): :meth:`gather_rows` for one
        small field, with a short path for records all in the hot tier."""
        if seqs.size and seqs.min() >= self.hot_lo and (
                self.frames is None or name not in self.frames.group_of):
            return self.hot.columns[name].take(seqs % self.hot.capacity, axis=0, mode="clip")
        return self.gather_rows(seqs, [name])[name]

    def tier_order(self, seqs: np.ndarray) -> np.ndarray:
        """The permutation that puts ``seqs`` in :meth:`gather`'s row order (cold first)."""
        return np.argsort(seqs >= self.hot_lo, kind="stable")

    # ---- recovery ----------------------------------------------------------------

    def damaged(self, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Live seqs whose slot fails its seq or checksum check, sorted.

        ``progress(checked, live)`` is called as the check goes.
        """
        live = self.pushed - self.first
        cold_live = self.hot_lo - self.first
        bad = []

        def from_(offset: int) -> Callable[[int], None] | None:
            if progress is None:
                return None
            return lambda done: progress(offset + done, live)

        if self.cold is not None:
            bad.append(self.cold.damaged(self.first, self.hot_lo, from_(0)))
        bad.append(self.hot.damaged(self.hot_lo, self.pushed, from_(cold_live)))
        return np.sort(np.concatenate(bad))
