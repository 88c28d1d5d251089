"""What a buffer with a given config costs, known before anything is made: its file and its RAM."""

from __future__ import annotations

import numpy as np

from millpond.core.arena import INDEX_NBYTES, first_lap
from millpond.core.bufferfile import BufferFile, spare_slots
from millpond.core.checksum import CHECKSUM_DTYPE
from millpond.core.config import BufferConfig
from millpond.core.draw import COUNT_ARRAYS, strategy_arrays
from millpond.core.episodes import episode_arrays
from millpond.core.frames import Frames, arena_nbytes, frame_regions
from millpond.core.sumtree import tree_nbytes
from millpond.core.tier import SEQ_DTYPE


def memory_needed(config: BufferConfig, persistent: bool) -> int:
    """Bytes of RAM a buffer with ``config`` keeps resident: its hot tier (in RAM, or
    in its file and locked there), the sum tree of a prioritized or use-limited
    buffer, RAM draw counts. The cold tier lives on disk."""
    return hot_nbytes(config, persistent) + side_nbytes(config, persistent)


def hot_nbytes(config: BufferConfig, persistent: bool) -> int:
    """The hot tier's bytes: records, seqs and (persistent) checksums and spare slots."""
    per_record = config.stored_schema.record_nbytes + SEQ_DTYPE.itemsize
    if not persistent:
        return config.hot_capacity * per_record
    slots = config.hot_capacity + spare_slots(config.stored_schema, config.total_capacity)
    return slots * (per_record + CHECKSUM_DTYPE.itemsize)


def slot_arrays_for(config: BufferConfig) -> dict[str, str]:
    """The per-slot arrays of a buffer with ``config`` (``{name: dtype}``): in its file if
    it is persistent, in RAM otherwise. Priorities and draw counts, episodes."""
    arrays = strategy_arrays(config)
    if config.episodes:
        arrays.update(episode_arrays(config.meta_fields))
    return arrays


def frame_regions_for(config: BufferConfig, persistent: bool) -> dict | None:
    """The frame regions of a buffer's file (None: a plain buffer)."""
    if not config.frame_groups:
        return None
    assert config.frame_capacity is not None
    return frame_regions(config.frame_groups, config.frame_capacity, persistent,
                         config.compressed_bytes)


def frames_for(config: BufferConfig, file: BufferFile | None) -> Frames | None:
    """A buffer's frame rings: in its file if it has one, else in RAM (None: plain)."""
    if not config.frame_groups:
        return None
    if file is not None:
        return Frames.in_file(config.frame_groups, file.frame_region, file.region_writer)
    assert config.frame_capacity is not None
    return Frames.in_memory(config.frame_groups, config.frame_capacity, config.compressed_bytes)


def side_nbytes(config: BufferConfig, persistent: bool) -> int:
    """RAM beside the hot tier: sum trees, per-slot arrays not kept in a file, the frame
    rings of a buffer without a file."""
    needed = 0
    if config.frame_groups and not persistent and config.cold_capacity == 0:
        assert config.frame_capacity is not None
        # A compressed ring grows with what is stored (see .arena): its first size here.
        needed += sum(config.frame_capacity * (g.frame_nbytes + 8) if g.codec is None else
                      first_lap(arena_nbytes(g, config.frame_capacity, config.compressed_bytes),
                                g.frame_nbytes)
                      + config.frame_capacity * INDEX_NBYTES
                      for g in config.frame_groups)
    if config.prioritized is not None or config.max_times_sampled:
        needed += tree_nbytes(config.total_capacity)
    if not persistent:  # draw counts and episodes in RAM (priorities: only in the tree)
        arrays = dict(COUNT_ARRAYS) if config.max_times_sampled else {}
        arrays.update(episode_arrays(config.meta_fields) if config.episodes else {})
        needed += config.total_capacity * sum(np.dtype(dt).itemsize for dt in arrays.values())
    return needed


def disk_nbytes(config: BufferConfig, persistent: bool) -> int:
    """The disk the file a buffer with ``config`` makes takes once made (0: it makes none):
    all of it allocated at creation but its compressed rings, which are sparse and grow with
    what is stored (see :mod:`.arena`), counted at their first size."""
    if not persistent and config.cold_capacity == 0:
        return 0
    dense = BufferFile.allocated_nbytes(config.stored_schema, config.hot_capacity,
                                        config.total_capacity, persistent,
                                        config.sampling_meta(),
                                        slot_arrays_for(config) if persistent else None,
                                        frame_regions_for(config, persistent))
    assert config.frame_capacity is not None or not config.frame_groups
    return dense + sum(first_lap(arena_nbytes(g, config.frame_capacity or 0,
                                              config.compressed_bytes), g.frame_nbytes)
                       for g in config.frame_groups if g.codec is not None)
