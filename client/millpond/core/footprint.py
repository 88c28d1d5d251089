"""What a buffer with a given config costs, known before anything is made: its file and its RAM."""

from __future__ import annotations

from .bufferfile import BufferFile
from .config import BufferConfig
from .draw import slot_arrays_for
from .sumtree import tree_nbytes
from .tier import SEQ_DTYPE


def memory_needed(config: BufferConfig, persistent: bool) -> int:
    """Bytes of RAM a buffer with ``config`` allocates beside its file: the sum tree
    of a prioritized or use-limited buffer, RAM draw counts, a RAM hot tier."""
    total = config.total_capacity
    needed = 0
    if config.prioritized is not None or config.max_times_sampled:
        needed += tree_nbytes(total)
    if config.max_times_sampled and not persistent:
        needed += 4 * total
    if not persistent:
        needed += config.hot_capacity * (config.schema.record_nbytes + SEQ_DTYPE.itemsize)
    return needed


def file_nbytes(config: BufferConfig, persistent: bool) -> int:
    """The size of the file a buffer with ``config`` makes (0: it makes none)."""
    if not persistent and config.cold_capacity == 0:
        return 0
    return BufferFile.nbytes(config.schema, config.hot_capacity, config.total_capacity,
                             persistent, config.sampling_meta(),
                             slot_arrays_for(config) if persistent else None)
