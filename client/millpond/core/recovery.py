"""Reopening a persistent buffer's file: its config, its live ranges, and every record checked.

The file's metadata and commit slots are checked as it is opened
(:meth:`.bufferfile.BufferFile.open`), and its committed counters say which
records are live. Each live record is checked (its slot's seq and checksum)
before anything is served. A damaged record stops the reopen with
:class:`CorruptFileError`, naming the file, the count and the seqs, unless
the caller chose to skip damaged records: then they become the FIFO's holes,
never served. So does a damaged commit slot of a format 4 file, whose other
slot may lack the last acknowledged push (format 5 writes every commit to
both: the other slot is used, and the damage reported in ``notes``).
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from millpond.core.bufferfile import BufferFile
from millpond.core.config import BufferConfig
from millpond.core.fifo import Fifo
from millpond.core.footprint import frames_for
from millpond.core.frames import Frames
from millpond.errors import CorruptFileError


def recover(path: str | os.PathLike, *, sync_every_push: bool = False, skip_corrupt: bool = False,
            progress: Callable[[int, int], None] | None = None) -> tuple[BufferConfig, Fifo]:
    """The config and the checked FIFO of the persistent buffer file at ``path``.

    Raises CorruptFileError for a file that is not a sound persistent
    millpond buffer file, or that holds damaged records (unless
    ``skip_corrupt``). ``progress(checked, live)`` reports the check as it
    goes: a large buffer takes a while, and an operator must tell that from
    a hang.
    """
    file = BufferFile.open(os.fspath(path))
    fifo: Fifo | None = None
    try:
        if not file.meta["persistent"]:
            raise CorruptFileError(
                f"{path} belonged to a non-persistent buffer: its hot records were never in it")
        state = file.commit_state
        if state is not None and state.doubt is not None and not skip_corrupt:
            raise CorruptFileError(f"{file.path}: {state.doubt}; --recover=skip-corrupt serves "
                                   f"what slot {state.used} commits")
        config = BufferConfig.from_file_meta(file.meta, file.schema)
        assert file.hot_tier is not None
        frames, wrong = _frames(config, file)
        if wrong is not None:  # (raised here: the failed attempt's views of the file are gone)
            raise CorruptFileError(f"{file.path}: {wrong}")
        fifo = Fifo(config.schema, file.hot_tier, file.tier, config.total_capacity, file,
                    durable=True, sync_every_push=sync_every_push, spare=file.spare,
                    frames=frames, stored=file.schema)
        fifo.pushed, fifo.first, fifo.hot_lo = file.pushed, file.first, file.hot_lo
        bad = fifo.damaged(progress)
        if fifo.frames is not None:
            bad = _check_frames(fifo, bad)
        live = fifo.pushed - fifo.first
        if len(bad) and not skip_corrupt:
            raise CorruptFileError(
                f"{file.path}: {len(bad):,} of {live:,} live records fail their checks "
                f"(seqs {bad[:5].tolist()}{'...' if len(bad) > 5 else ''}); "
                "--recover=skip-corrupt serves the intact ones")
    except BaseException:
        if fifo is not None and fifo.frames is not None:
            fifo.frames.release()  # its views of the mapping must go before it closes
        file.close(delete=False)
        raise
    fifo.holes = bad
    return config, fifo


def _frames(config: BufferConfig, file: BufferFile) -> tuple[Frames | None, str | None]:
    """The file's frame rings, or why they cannot be (a compressed ring whose stored size
    cannot be: ValueError from :class:`.arena.Arena`)."""
    try:
        return frames_for(config, file), None
    except ValueError as exc:
        return None, str(exc)


def _check_frames(fifo: Fifo, bad: np.ndarray) -> np.ndarray:
    """``bad`` and the live records whose frames fail their checks (see
    :meth:`.frames.Frames.damaged`); the frames' bookkeeping rebuilt from the others."""
    frames = fifo.frames
    assert frames is not None
    seqs = np.setdiff1d(np.arange(fifo.first, fifo.pushed), bad, assume_unique=True)
    names = list(frames.group_of)
    ids = fifo.stored_rows(seqs, names)
    wrong = frames.damaged(seqs, ids)
    keep = ~wrong
    frames.restore(seqs[keep], {name: column[keep] for name, column in ids.items()})
    return np.sort(np.concatenate([bad, seqs[wrong]]))
