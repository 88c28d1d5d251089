"""The seam between a handle and the buffer behind it: the :class:`Backend` protocol.

Three classes implement it, each with the same results and exceptions:

* :class:`millpond.core.TieredBuffer`: the engine, in-process;
* :class:`millpond.remote.buffer.RemoteBuffer`: a buffer on one daemon;
* :class:`millpond.sharded.buffer.ShardedBuffer`: a buffer spread over daemons.

A handle (:class:`millpond.handle.buffer.Buffer`) binds the reference API's
arguments to field names, checks them once, and calls these methods. The
remote and sharded backends rely on that (a sharded buffer's shards do not
check again); writes are validated where they are encoded
(:mod:`millpond.remote.writes`). The engine checks everything itself: a daemon
serves untrusted callers with it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.core.snapshot import CheckpointResult

Columns = dict[str, np.ndarray]


class Backend(Protocol):
    """What a handle asks of the buffer behind it; see the module docstring and the
    engine's :class:`~millpond.core.TieredBuffer` for each call's contract."""

    config: BufferConfig

    @property
    def closed(self) -> bool: ...

    def __len__(self) -> int: ...

    def info(self) -> BufferInfo: ...

    # ---- writes -------------------------------------------------------------------------

    def push(self, record: Mapping[str, Any], priority: float | None = None, *,
             episode: int | None = None, updates: Any = None,
             timeout: float | None = None) -> None: ...

    def push_batch(self, columns: Mapping[str, Any], priorities: Any = None, *,
                   episodes: Any = None, updates: Any = None,
                   timeout: float | None = None) -> int: ...

    def flush(self) -> None:
        """Return once every push made before is stored (in-process: at once)."""

    def update_episodes(self, updates: Any) -> None: ...

    def update_priorities(self, indices: Any, priorities: Any) -> int: ...

    def set_beta(self, beta: float) -> None: ...

    def reset(self) -> None: ...

    # ---- reads --------------------------------------------------------------------------

    def sample(self, batch_size: int, seed: int | None = None, *,
               timeout: float | None = None,
               filter_meta: Mapping[str, Any] | None = None) -> Columns: ...

    def sample_n_step(self, batch_size: int, n_step: int, gamma: float = 0.99,
                      seed: int | None = None, *, filter_meta: Mapping[str, Any] | None = None,
                      timeout: float | None = None) -> Columns: ...

    def sample_sequences(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                         filter_meta: Mapping[str, Any] | None = None,
                         timeout: float | None = None) -> Columns: ...

    def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                        max_len: int | None = None, filter_meta: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> Columns: ...

    def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None) -> Columns: ...

    def read(self, seqs: Any, fields: Sequence[str] | None = None, *, positions: bool = False,
             episode_ids: bool = False) -> Columns: ...

    def read_chunk(self, record_nbytes: int) -> int | None:
        """How many records of ``record_nbytes`` one :meth:`read` may return (what one
        reply may carry); None: any number (in-process)."""

    def contents(self, fields: Sequence[str] | None = None) -> Columns:
        """Every record held, oldest first (in-process in one read; remotely in reads of
        at most :meth:`read_chunk` records each)."""

    def checkpoint(self, path: str | os.PathLike, *,
                   progress: Callable[[int, int], None] | None = None) -> CheckpointResult:
        """A consistent copy of the buffer as a buffer file: in-process at ``path``;
        remotely written by the daemon under its --backup-dir; sharded, one file per
        shard (see :meth:`millpond.handle.buffer.Buffer.checkpoint`)."""

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None: ...

    def delete(self) -> None: ...

    def release(self) -> None: ...
