"""Consistent copies of a live buffer, written while it goes on: checkpoints and repairs.

A :class:`Snapshot` writes a new persistent buffer file (the format of a daemon's data
directory) holding one buffer's records as of one moment, its *cut*: the live records
``[first, pushed)`` when it began. It copies them in steps, newest first: each
:meth:`Snapshot.read` copies a few MiB of records out under the buffer's lock (and checks
that each slot still holds its record), and :meth:`Snapshot.write` checks their checksums
and stores them in the new file outside it, so pushes and samples go on between steps (a
daemon runs each read through the buffer's owner, as any operation).

**What a snapshot holds** (the guarantee): exactly the records of the cut that were still
live when their step copied them, each checked as it is copied. Nothing pushed after the
cut is in it. Records leave a FIFO oldest first (evicted by later pushes, sampled off a
queue, dropped by a reset), and the copy goes newest first, so the records of the cut
that left before their step are its oldest ones: a snapshot holds the newest
``records`` of the cut, and says how many it ``dropped``. A record that fails its checks
(its seq, and its checksum where the tier keeps one), a record damaged at recovery (a
hole) and, on a stack, the newest records a sample took off after the cut (their seqs
may since name newer records) are dropped too; since a file cannot mark a record
missing, the records older than such a gap are renumbered to close it (seqs shift up by
the gaps above them: ``pushed`` stays the cut's, a sample's old ``indices`` do not apply).

Beside its records a buffer keeps per-slot state that is not part of the commit:
priorities, draw counts (``max_times_sampled``), episode meta and ends. A snapshot
copies each record's as it was when its step ran (as after a crash: see
docs/operations.md, Durability). An episode that loses a record to a gap is no longer
complete (its length is cleared); one whose first records were dropped keeps its tail,
as after eviction. An in-process buffer that is not persistent keeps no raw priorities
(only its sum tree): its records come back with priority 1 (a new buffer's
``max_priority``).

A buffer with ``frame_stack`` or ``next_of`` (see :mod:`.frames`) stores its records as
frame ids beside frame rings. Its snapshot copies the records as stored (the ids) and,
in the same step, the frames they refer to (still in their ring while the records are
live), each checked against its own checksum where the ring keeps one (a persistent
buffer's); a record referring to a frame that fails is dropped as a damaged one. The new
file has rings of the same ``frame_capacity``, each frame at its id's slot with its
checksum: the ids of a cut's records span at most a ring, so no two share a slot, and
the reopen (:func:`.recovery.recover`) checks every frame a live record refers to.

A compressed group (``compression``: an :class:`.arena.Arena`, a ring of bytes) is copied
the same way, its blobs as stored (never decompressed and compressed again), each
checked against its checksum (a persistent buffer's: crc32 of the blob, its id and
offset) and for an offset and length that can be; a record referring to a blob that
fails is dropped as a damaged one. Each blob keeps its logical offset (and so its
checksum) in the new file's ring, which takes the size the source's had at the cut:
the blobs live at the cut lay within one lap of it, so none overlap there.

numpy and the standard library only, like the rest of the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np

from millpond.core.arena import Arena, blob_sum
from millpond.core.bufferfile import BufferFile
from millpond.core.checksum import CHECKSUM_DTYPE, record_checksums
from millpond.core.fifo import Fifo
from millpond.core.footprint import frame_regions_for, slot_arrays_for
from millpond.core.frames import Frames, Ring
from millpond.core.ring import ring_chunks
from millpond.core.tier import SEQ_DTYPE, Tier
from millpond.errors import BufferClosedError, FileConflictError, StorageIOError

if TYPE_CHECKING:
    from millpond.core.buffer import TieredBuffer

SUFFIX = ".buffer"
# Record bytes one step copies under the buffer's lock (and at most this many records): a
# few milliseconds, which a push to the buffer may wait.
STEP_BYTES = 4 << 20
STEP_RECORDS = 1 << 14
# A priority_seq no record has: its priority is unknown (restored at max_priority).
_NO_OWNER = np.uint64(2**64 - 1)


def snapshot_path(path: str | os.PathLike) -> str:
    """``path`` with :data:`SUFFIX` appended unless it has it (a buffer file's name)."""
    target = os.fspath(path)
    return target if target.endswith(SUFFIX) else target + SUFFIX


@dataclass(frozen=True)
class CheckpointResult:
    """What a checkpoint wrote: the snapshot file at ``path`` (``nbytes`` bytes) holding
    ``records`` records, seqs ``[first, pushed)``; ``dropped`` records of its cut are not
    in it (gone before they were copied, or failing their checks: ``damaged`` of them).
    ``shards``: a sharded buffer's, one result per shard (``first``/``pushed`` are then
    0; the counts are sums)."""

    path: str
    records: int
    first: int
    pushed: int
    dropped: int = 0
    damaged: int = 0
    nbytes: int = 0
    shards: tuple["CheckpointResult", ...] = ()


@dataclass
class _Chunk:
    """Records of one step: ``new`` seqs (ascending, consecutive) and their rows."""

    new: np.ndarray
    rows: dict[str, np.ndarray]
    slots: dict[str, np.ndarray]  # slot-array values, one per record
    checksums: np.ndarray | None = None


@dataclass
class Step:
    """What one :meth:`Snapshot.read` copied out: the live records ``kept`` (ascending) of
    its seqs, with their rows, stored checksums (``checked``: those whose tier keeps one),
    whether their slot names another record (``wrong``), their slot-array values; and the
    seqs of the step that are ``gone`` from inside the cut, with their episodes."""

    kept: np.ndarray
    rows: dict[str, np.ndarray]
    stored: np.ndarray
    checked: np.ndarray
    wrong: np.ndarray
    slots: dict[str, np.ndarray]
    gone: np.ndarray
    gone_episodes: np.ndarray
    # A frame buffer's: per ring, the frames ``kept`` refer to.
    frames: list["FrameCopy"] = field(default_factory=list)


@dataclass
class FrameCopy:
    """The frames of one ring that a step's records refer to, as copied under the lock:
    their ``ids``, the ids their slots ``held``, their stored checksums (``sums``; None: the
    ring keeps none), and the ``frames`` (a plain ring) or, for a compressed ring, the
    blobs as stored: ``data`` (one after the other), logical offsets ``offs``, ``lens``."""

    ids: np.ndarray
    held: np.ndarray
    sums: np.ndarray | None
    frames: np.ndarray | None = None
    data: np.ndarray | None = None
    offs: np.ndarray | None = None
    lens: np.ndarray | None = None


class Snapshot:
    """One snapshot of ``buffer`` being written to ``path``; see the module docstring.

    The steps: :meth:`create` (the new file, allocated in full beside ``path`` under a
    temporary name), :meth:`begin` (the cut; under the buffer's lock), then :meth:`read`
    (under the lock) and :meth:`write` (outside) until read returns None, then
    :meth:`finish` (synced, given its name). :meth:`abort` removes the partial file.
    :meth:`run` does all of them on this thread. ``replace``: ``path`` may exist and is
    replaced (a repair rewriting a buffer's own file); else FileConflictError.
    """

    def __init__(self, buffer: "TieredBuffer", path: str | os.PathLike, *,
                 replace: bool = False, step_bytes: int = STEP_BYTES):
        self.buffer = buffer
        self._checksums = buffer._fifo.hot.checksums  # the buffer file's format's
        self.path = snapshot_path(path) if not replace else os.fspath(path)
        self.replace = replace
        config = buffer.config
        self.total_capacity = config.total_capacity
        self.hot_capacity = config.hot_capacity
        self.step = max(1, min(STEP_RECORDS, step_bytes // max(1, config.schema.record_nbytes)))
        self._file: BufferFile | None = None
        self._frames = buffer._fifo.frames  # the buffer's frame rings (None: a plain buffer)
        self._rings: Frames | None = None  # the new file's
        self.first = self.pushed = 0  # the cut
        self._next = self._low = 0  # still to look at: [_low, _next), newest first
        self._samples = 0  # a stack's samples at the cut (see _reusable)
        self._gaps: list[np.ndarray] = []  # seqs of the cut dropped inside it (descending)
        self._gap_count = 0
        self._gap_sorted: np.ndarray | None = None
        self._broken: set[int] = set()  # episodes that lost a record to a gap
        self.kept = 0
        self.damaged = 0

    # ---- the steps ---------------------------------------------------------------------

    def begin(self) -> None:
        """Take the cut (the buffer's lock held)."""
        with self.buffer._lock:
            self.buffer._check_open()
            fifo = self.buffer._fifo
            self.first, self.pushed = fifo.first, fifo.pushed
            self._next, self._low = fifo.pushed, fifo.first
            self._samples = self.buffer._rate.samples
            if self._frames is not None and self._rings is not None:
                for ring, copy in zip(self._frames.rings, self._rings.rings):
                    if isinstance(ring, Arena):  # its size at the cut (see the module doc)
                        assert isinstance(copy, Arena)
                        copy.adopt(ring.lap)

    def create(self) -> None:
        """Allocate the new file (outside the lock: it may take a while; before the cut)."""
        if not self.replace and os.path.lexists(self.path):
            raise FileConflictError(f"{self.path} exists; a snapshot never replaces a file: "
                                    "name another, or move that one away")
        config = self.buffer.config
        self._file = BufferFile.create(self.path, config.stored_schema, config.hot_capacity,
                                       config.total_capacity, persistent=True,
                                       extra_meta=config.sampling_meta(),
                                       slot_arrays=slot_arrays_for(config),
                                       frame_regions=frame_regions_for(config, True))
        if config.frame_groups:
            self._rings = Frames.in_file(config.frame_groups, self._file.frame_region,
                                         self._file.region_writer)

    @property
    def progress(self) -> tuple[int, int]:
        """``(records of the cut looked at, records in the cut)``."""
        total = self.pushed - self.first
        return (total if self.done else self.pushed - self._next), total

    @property
    def done(self) -> bool:
        return self._next <= self._low

    def read(self) -> Step | None:
        """Copy out the next step's records (the buffer's lock held), or None once all are
        read: the little that must see the buffer as it is now. BufferClosedError if the
        buffer was closed (deleted) meanwhile."""
        buffer = self.buffer
        with buffer._lock:
            if buffer.closed:
                raise BufferClosedError("the buffer was closed while a snapshot of it was "
                                        "being written")
            if self.done:
                return None
            fifo = buffer._fifo
            hi = self._next
            lo = max(self._low, hi - self.step)
            seqs = np.arange(lo, hi, dtype=np.int64)
            if fifo.first > lo:  # the oldest are gone (evicted, taken, reset): so is the rest
                self._low = max(self._low, min(fifo.first, hi))
                seqs = seqs[seqs >= fifo.first]
            gone = seqs >= fifo.pushed  # a stack's samples took them
            if len(fifo.holes):
                gone |= np.isin(seqs, fifo.holes)
            if buffer.config.mode == "stack":
                gone |= self._reusable(seqs)
            kept = seqs[~gone]
            rows, stored, checked, wrong = self._gather(kept, fifo)
            frames = self._copy_frames(rows)
            state = buffer._slot_state()
            slots = self._slot_values(kept, state)
            lost = seqs[gone]
            episodes = (state["episode"][lost % self.total_capacity].copy()
                        if "episode" in state and len(lost) else np.empty(0, np.int64))
            self._next = lo
        return Step(kept, rows, stored, checked, wrong, slots, lost, episodes, frames)

    def write(self, step: Step) -> None:
        """Check a step's records (their checksums) and store those that pass in the new
        file (outside the buffer's lock). Steps are written in the order read."""
        bad = step.wrong.copy()
        if step.checked.any():  # with the checksum of the buffer file's own format
            rows = {name: column[step.checked] for name, column in step.rows.items()}
            bad[step.checked] |= step.stored[step.checked] != self._checksums(
                rows, step.kept[step.checked].astype(np.uint64))
        if step.frames:
            bad |= self._store_frames(step)
        self.damaged += int(bad.sum())
        gaps = np.concatenate([step.gone, step.kept[bad]])
        if len(gaps) and "episode" in step.slots:
            self._broken.update(step.gone_episodes.tolist())
            self._broken.update(step.slots["episode"][bad].view("<i8")[:, 0].tolist())
        good = ~bad
        kept = step.kept[good]
        rows = {name: column[good] for name, column in step.rows.items()}
        chunk = self._renumber(kept, gaps, rows,
                               {name: values[good] for name, values in step.slots.items()})
        # A checksum covers the record's seq: the stored one (checked above) serves a
        # record that kept its seq; the others' are computed.
        checksums = step.stored[good]
        fresh = ~step.checked[good] | (chunk.new != kept)
        if self._checksums is not record_checksums:  # (a file of an older format)
            fresh[:] = True
        if fresh.any():
            checksums[fresh] = record_checksums({name: column[fresh] for name, column in
                                                 rows.items()}, chunk.new[fresh].astype(np.uint64))
        chunk.checksums = checksums
        self._store(chunk)

    def _copy_frames(self, rows: Mapping[str, np.ndarray]) -> list[FrameCopy]:
        """The frames records ``rows`` (stored: frame ids) refer to, per ring (lock held)."""
        frames = self._frames
        if frames is None:
            return []
        copied = []
        for group, ring in zip(frames.groups, frames.rings):
            ids = np.unique(np.concatenate([rows[name].reshape(-1) for name in group.fields]))
            if isinstance(ring, Arena):
                data, offs, lens, held, sums = ring.copy_out(ids)
                copied.append(FrameCopy(ids, held, sums, data=data, offs=offs, lens=lens))
            else:
                frame_copies, held, sums = ring.copy_out(ids)
                copied.append(FrameCopy(ids, held, sums, frames=frame_copies))
        return copied

    def _store_frames(self, step: Step) -> np.ndarray:
        """Check the frames a step copied and store those that pass in the new file's rings;
        which of the step's records refer to one that failed (gone from its slot, not
        matching its checksum, or a compressed ring's blob with an offset or length that
        cannot be)."""
        assert self._frames is not None and self._rings is not None
        bad = np.zeros(len(step.kept), bool)
        for group, ring, copy in zip(self._frames.groups, self._rings.rings, step.frames):
            ids = copy.ids
            if copy.frames is not None:
                fresh = record_checksums({"frame": copy.frames}, ids.astype(np.uint64))
            else:
                fresh = _blob_sums(copy)
            wrong = (copy.held != ids) | (ids < 0)
            if copy.sums is not None:
                wrong |= copy.sums != fresh
            if wrong.any():
                for name in group.fields:
                    bad |= np.isin(step.rows[name], ids[wrong]).any(axis=1)
            good = ~wrong
            if isinstance(ring, Arena):
                assert copy.data is not None and copy.offs is not None and copy.lens is not None
                keep = np.repeat(good, copy.lens.astype(np.int64))  # the bytes of those that pass
                try:  # (written with pwrite: see .bufferfile)
                    ring.put(ids[good], copy.offs[good], copy.data[keep], copy.lens[good],
                             fresh[good])
                except StorageIOError as exc:  # the snapshot's own file: never the buffer's
                    raise OSError(f"writing snapshot {self.path} failed: {exc}") from exc
            else:
                assert isinstance(ring, Ring) and copy.frames is not None
                ring.put(ids[good], copy.frames[good], fresh[good])
        return bad

    def _store(self, chunk: _Chunk) -> None:
        file = self._file
        assert file is not None and file.hot_tier is not None and chunk.checksums is not None
        new = chunk.new
        if not len(new):
            return
        bound = self.pushed - self.hot_capacity  # seqs from here on go to the hot tier
        for tier, lo, hi in ((file.tier, int(new[0]), min(int(new[-1]) + 1, bound)),
                             (file.hot_tier, max(int(new[0]), bound), int(new[-1]) + 1)):
            if lo < hi:
                assert tier is not None  # cold records only where there is a cold tier
                self._put(tier, lo, hi, int(new[0]), chunk)
        positions = new % self.total_capacity
        for name, values in chunk.slots.items():
            _raw(file.slot_array(name))[positions] = values

    @staticmethod
    def _put(tier: Tier, lo: int, hi: int, first: int, chunk: _Chunk) -> None:
        """Records ``[lo, hi)`` of ``chunk`` (whose first is ``first``) into ``tier``: payload,
        then seq, then checksum, as a tier stores them."""
        assert tier.checksum is not None and chunk.checksums is not None
        for a, b in ring_chunks(lo, hi, tier.capacity):
            slot, i, k = a % tier.capacity, a - first, b - a
            for name, column in tier.columns.items():
                rows = chunk.rows[name][i:i + k]
                if tier.file is not None and tier.file.direct(name):
                    tier.file.write_rows(name, slot, rows)  # no page of the new file read in
                else:
                    column[slot:slot + k] = rows
            tier.seq[slot:slot + k] = (chunk.new[i:i + k] & 0xFFFFFFFF).astype(SEQ_DTYPE)
            tier.checksum[slot:slot + k] = chunk.checksums[i:i + k]

    def finish(self) -> CheckpointResult:
        """Commit the snapshot's counters, sync it, give it its name (atomically); close it."""
        file = self._file
        assert file is not None and self.done
        first = self.pushed - self.kept
        hot_lo = max(first, self.pushed - self.hot_capacity)
        if self._broken:
            self._clear_lengths(file, first)
        file.commit(self.pushed, first, hot_lo)
        try:
            file.sync()
        except StorageIOError as exc:  # the snapshot's own file: never the buffer's data
            raise OSError(f"syncing snapshot {self.path} failed: {exc}") from exc
        file.publish(replace=self.replace)
        self._release_rings()
        file.close(delete=False)
        self._file = None
        cut = self.pushed - self.first
        return CheckpointResult(self.path, self.kept, first, self.pushed, cut - self.kept,
                                self.damaged, os.path.getsize(self.path))

    def abort(self) -> None:
        """Remove the partial file (nothing was published). Idempotent."""
        if self._file is not None:
            self._release_rings()
            self._file.close(delete=True)
            self._file = None

    def _release_rings(self) -> None:
        """Drop the views of the new file's frame regions (before it is unmapped)."""
        if self._rings is not None:
            self._rings.release()
            self._rings = None

    def run(self, progress: Callable[[int, int], None] | None = None) -> CheckpointResult:
        """Every step on this thread (each read under the buffer's lock); ``progress(copied,
        total)`` after each."""
        try:
            self.create()  # before the cut: allocating the file may take a while
            self.begin()
            while (step := self.read()) is not None:
                self.write(step)
                if progress is not None:
                    progress(*self.progress)
            return self.finish()
        except BaseException:
            self.abort()
            raise

    # ---- helpers -------------------------------------------------------------------------

    def _reusable(self, seqs: np.ndarray) -> np.ndarray:
        """A stack's samples take its newest records, lowering ``pushed``; later pushes then
        reuse their seqs. After ``k`` records sampled since the cut, no seq below
        ``pushed - k`` of the cut can have been taken: the others are treated as gone."""
        taken = self.buffer._rate.samples - self._samples
        return seqs >= self.pushed - taken

    def _gather(self, seqs: np.ndarray, fifo: Fifo
                ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """The rows of live records ``seqs`` (ascending), their stored checksums (and which
        have one: a tier in a persistent file keeps them), and which slots name another
        record than theirs."""
        schema = fifo.stored  # frame fields as frame ids
        rows = {f.name: np.empty((len(seqs),) + f.shape, f.dtype) for f in schema}
        stored = np.zeros(len(seqs), CHECKSUM_DTYPE)
        checked = np.zeros(len(seqs), bool)
        wrong = np.zeros(len(seqs), bool)
        for tier, where in ((fifo.cold, seqs < fifo.hot_lo), (fifo.hot, seqs >= fifo.hot_lo)):
            if not where.any():
                continue
            assert tier is not None
            part = seqs[where]
            rows_of = np.flatnonzero(where)
            out = {name: np.empty((len(part),) + column.shape[1:], column.dtype)
                   for name, column in rows.items()}
            tier.gather(part, out, 0)
            slots = part % tier.capacity
            wrong[rows_of] = tier.seq[slots] != (part & 0xFFFFFFFF).astype(SEQ_DTYPE)
            if tier.checksum is not None:
                stored[rows_of] = tier.checksum[slots]
                checked[rows_of] = True
            for name, column in out.items():
                rows[name][rows_of] = column
        return rows, stored, checked, wrong

    def _slot_values(self, seqs: np.ndarray, arrays: Mapping[str, np.ndarray]
                     ) -> dict[str, np.ndarray]:
        """The slot-array values of records ``seqs`` (raw rows), by the new file's names."""
        assert self._file is not None
        positions = seqs % self.total_capacity
        values = {}
        for name in self._file.meta.get("slot_arrays", {}):
            source = arrays.get(name)
            if source is not None:
                values[name] = _raw(source)[positions].copy()
        if "priority_seq" in self._file.meta.get("slot_arrays", {}):
            owners = arrays.get("priority_seq")
            known = (np.zeros(len(seqs), bool) if owners is None
                     else owners[positions] == seqs.astype(np.uint64))
            values["priority_seq"] = np.where(known, seqs.astype(np.uint64), _NO_OWNER
                                              ).view(np.uint8).reshape(len(seqs), -1)
        return values

    def _renumber(self, kept: np.ndarray, gaps: np.ndarray, rows: dict[str, np.ndarray],
                  slots: dict[str, np.ndarray]) -> _Chunk:
        """Close the gaps: each kept seq moves up by the gaps above it (all known: the
        copy goes newest first). Episode pointers and priority owners follow."""
        gaps = np.sort(gaps)
        above = self._gap_count + len(gaps) - np.searchsorted(gaps, kept, side="right")
        new = kept + above
        if len(gaps):
            self._gaps.append(gaps)
            self._gap_count += len(gaps)
            self._gap_sorted = None
        if self._gap_count:
            if "priority_seq" in slots:
                owners = slots["priority_seq"].view(np.uint64)[:, 0]
                known = owners != _NO_OWNER
                owners[known] = new[known].astype(np.uint64)
            if "next" in slots:
                pointers = slots["next"].view(np.int64)[:, 0]
                pointers[:] = self._moved(pointers, kept, new)
        self.kept += len(new)
        return _Chunk(new, rows, slots)

    def _moved(self, pointers: np.ndarray, seqs: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Episode pointers of records ``seqs`` (now ``new``) in the new numbering: a pointer
        names a later seq, whose move is known; one to a gap, or past the cut, ends the
        episode's chain there (the record points at itself)."""
        if self._gap_sorted is None:
            self._gap_sorted = np.sort(np.concatenate(self._gaps)) if self._gaps else \
                np.empty(0, np.int64)
        gaps = self._gap_sorted
        at = np.searchsorted(gaps, pointers, side="left")
        hits_gap = (at < len(gaps)) & (gaps[np.minimum(at, len(gaps) - 1)] == pointers) \
            if len(gaps) else np.zeros(len(pointers), bool)
        moved = pointers + (len(gaps) - np.searchsorted(gaps, pointers, side="right"))
        ends = (pointers == seqs) | hits_gap | (pointers >= self.pushed) | (pointers < seqs)
        return np.where(ends, new, moved)

    def _clear_lengths(self, file: BufferFile, first: int) -> None:
        """Episodes that lost a record to a gap are not complete: clear their lengths."""
        episode, length = file.slot_array("episode"), file.slot_array("length")
        if episode is None or length is None or first >= self.pushed:
            return
        positions = np.arange(first, self.pushed) % self.total_capacity
        hit = np.isin(episode[positions], np.fromiter(self._broken, np.int64))
        length[positions[hit]] = 0


def _blob_sums(copy: FrameCopy) -> np.ndarray:
    """The checksums of a compressed ring's copied blobs, computed from their bytes (an
    empty blob: one that could not be copied, failing its check anyway)."""
    assert copy.data is not None and copy.offs is not None and copy.lens is not None
    data = memoryview(copy.data.data)
    sums = np.empty(len(copy.ids), CHECKSUM_DTYPE)
    at = 0
    for j, (frame_id, offset, n) in enumerate(zip(copy.ids.tolist(), copy.offs.tolist(),
                                                  copy.lens.tolist())):
        sums[j] = blob_sum(frame_id, offset, data[at:at + n])
        at += n
    return sums


def _raw(array: np.ndarray | None) -> np.ndarray:
    """``array`` (one element per slot, any dtype or shape) as raw bytes ``[slots, nbytes]``."""
    assert array is not None
    return array.reshape(len(array), -1).view(np.uint8)
