"""A buffer file looked at offline (``millpond inspect FILE``): no daemon, nothing written.

:func:`inspect` opens a file read-only and checks what a reopen checks (the
header and its checksum, both commit slots, every live record's seq and
checksum), but reports instead of refusing: what it read, which commit slot
is used, what is damaged. It never changes the file (the page cache may
drop what it read).

A buffer with ``frame_stack`` or ``next_of`` (format 6, see :mod:`.frames`) also has
its frames checked: every frame a live record refers to must be in its ring (its slot
holds its id) and, in a persistent file, match its checksum (``framesum:``). Each ring's
damaged frames are reported (:class:`FrameRing`), and the live records that refer to
one are counted damaged too (``frame_damaged``): a reopen with ``skip_corrupt`` isolates
exactly them, the other records sharing no damaged frame stay served.

A compressed group (format 7: ``compression``, see :mod:`.arena`) keeps its frames as blobs
in a ring of bytes: each blob a live record refers to must be in its slot, have an offset
and a length that can be (within the ring's size now, at most a frame's bytes) and, in a
persistent file, match its checksum (crc32 of its stored bytes, id and offset; it is not
decompressed). Damaged blobs are reported and isolate their records the same way. A ring
whose stored size cannot be (its ``framelap:``) makes the file unreadable: a reopen
refuses it too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from millpond.core import bufferfile
from millpond.core.arena import Arena
from millpond.core.bufferfile import MAGIC, SLOT_NAMES, BufferFile
from millpond.core.config import BufferConfig
from millpond.core.fifo import Fifo
from millpond.core.frames import Frames
from millpond.core.tier import SEQ_DTYPE, Tier
from millpond.errors import CorruptFileError, InvalidConfigError

HEALTHY, DAMAGED, UNREADABLE = 0, 1, 2  # the exit codes of `millpond inspect`


@dataclass
class Slot:
    """One commit slot as stored."""

    name: str  # "A" or "B"
    generation: int
    pushed: int
    first: int
    hot_lo: int
    sound: bool  # its crc32 matches and its counters are in order
    used: bool = False  # the one a reopen takes


@dataclass
class FrameRing:
    """One frame ring of a format 6 file: the frames of ``source`` (and of the fields
    ``next_of`` it), ``capacity`` frames of ``frame_shape``, ``k`` per value;
    ``referred``: distinct frames the checked records refer to, ``damaged`` the ids of
    those missing from the ring or failing their checksum (``checksummed``: the ring
    keeps checksums, a persistent file's)."""

    source: str
    fields: tuple[str, ...]
    k: int
    axis: int | None
    capacity: int
    frame_shape: tuple[int, ...]
    dtype: str
    checksummed: bool
    referred: int = 0
    damaged: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # a compressed ring's (format 7): its codec and level, its size now and its limit
    codec: tuple[str, int] | None = None
    nbytes: int = 0
    limit: int = 0


@dataclass
class Inspection:
    """What :func:`inspect` found; ``status`` is :data:`HEALTHY`, :data:`DAMAGED` or
    :data:`UNREADABLE` (``error`` says why)."""

    path: str
    status: int = HEALTHY
    error: str | None = None
    version: int | None = None
    meta: dict | None = None
    slots: list[Slot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # a damaged commit slot, ...
    pushed: int = 0
    first: int = 0
    hot_lo: int = 0
    checked: int = 0  # live records checked
    damaged: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # their seqs
    checksummed: bool = False  # records have checksums (a persistent file), not only seqs
    frames: list[FrameRing] = field(default_factory=list)  # a format 6 file's rings
    # seqs of records that pass their own checks but refer to a damaged frame
    frame_damaged: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


def inspect(path: str | os.PathLike, progress: Callable[[int, int], None] | None = None
            ) -> Inspection:
    """Look at the buffer file at ``path`` (see the module doc); never raises for a
    damaged or unreadable file: the result says what is wrong."""
    path = os.fspath(path)
    found = Inspection(path)
    try:
        file = BufferFile.open(path, readonly=True)
    except (CorruptFileError, InvalidConfigError) as exc:
        found.status, found.error = UNREADABLE, str(exc)
        found.version, found.slots = _raw_look(path)
        return found
    try:
        found.version, found.meta = file.format.version, file.meta
        state = file.commit_state
        assert state is not None
        found.slots = [Slot(name, *counters, sound, used=name == state.used)
                       for name, (counters, sound) in zip(SLOT_NAMES, state.slots)]
        found.notes = list(state.notes)
        found.pushed, found.first, found.hot_lo = file.pushed, file.first, file.hot_lo
        fifo = _fifo(file)
        found.damaged = fifo.damaged(progress)
        found.checksummed = file.meta["persistent"]
        found.checked = (file.pushed if found.checksummed else file.hot_lo) - file.first
        if file.meta.get("frame_regions"):
            try:
                found.frames, found.frame_damaged = _check_frames(file, fifo, found.damaged)
            except ValueError as exc:  # a compressed ring's stored size that cannot be
                found.status, found.error = UNREADABLE, f"{path}: {exc}"
                return found
        if len(found.damaged) or len(found.frame_damaged) or found.notes:
            found.status = DAMAGED
    finally:
        file.close(delete=False)
    return found


def _fifo(file: BufferFile) -> Fifo:
    """The live records of ``file`` as its tiers hold them (a non-persistent file: its
    cold records only; its hot records were never in it)."""
    hot = file.hot_tier
    if hot is None:  # a tier that holds nothing: only the cold records are looked at
        hot = Tier(0, {}, np.empty(0, SEQ_DTYPE))
    fifo = Fifo(file.schema, hot, file.tier, file.meta["total_capacity"], file, durable=False,
                spare=file.spare)
    fifo.pushed, fifo.first, fifo.hot_lo = file.pushed, file.first, file.hot_lo
    if file.hot_tier is None:
        fifo.pushed = fifo.hot_lo  # (the hot records: in RAM, never in the file)
    return fifo


def _check_frames(file: BufferFile, fifo: Fifo, damaged: np.ndarray
                  ) -> tuple[list[FrameRing], np.ndarray]:
    """The frame rings of a format 6 file, each frame the records that pass their own
    checks refer to checked, and the seqs of those records that refer to a damaged one."""
    config = BufferConfig.from_file_meta(file.meta, file.schema)
    groups = config.frame_groups
    frames = Frames.in_file(groups, file.frame_region)
    try:
        seqs = np.setdiff1d(np.arange(fifo.first, fifo.pushed), damaged, assume_unique=True)
        ids = fifo.stored_rows(seqs, list(frames.group_of))
        bad = np.zeros(len(seqs), bool)
        rings = []
        for i, group in enumerate(groups):
            ring = frames.rings[i]
            wanted = np.unique(np.concatenate([ids[name].reshape(-1) for name in group.fields]))
            wrong = frames.failing(i, wanted)
            lost = wanted[wrong]
            if len(lost):
                for name in group.fields:
                    bad |= np.isin(ids[name], lost).any(axis=1)
            sizes = (ring.lap, ring.limit) if isinstance(ring, Arena) else (0, 0)
            rings.append(FrameRing(group.source, group.fields, group.k, group.axis,
                                   ring.capacity, group.frame_shape, group.dtype.str,
                                   ring.sums is not None, len(wanted), lost, group.codec,
                                   *sizes))
        return rings, seqs[bad]
    finally:
        frames.release()


def _raw_look(path: str) -> tuple[int | None, list[Slot]]:
    """The format version and commit slots of a file that cannot be opened, if it has them."""
    try:
        with open(path, "rb") as f:
            raw = f.read(bufferfile.PAGE)
    except OSError:
        return None, []
    if len(raw) < 128 or raw[:8] != MAGIC:
        return None, []
    version = int.from_bytes(raw[8:12], "little")
    return version, [Slot(name, *counters, sound) for name, (counters, sound)
                     in zip(SLOT_NAMES, bufferfile.read_slots(raw))]
