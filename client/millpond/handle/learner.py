"""The handle's learner-side calls: records by position, all of them, epochs, reset, export.

A mixin of :class:`millpond.handle.buffer.Buffer` (objectrl's access patterns), the
same on every backend. Positions index the buffer's *contents*: the records
``len(buf)`` counts, oldest first (0 = the oldest, ``len - 1`` the newest).
The backend resolves positions to records under the buffer's lock, in the
call that reads them (the engine in-process, the server remotely), so a
read never mixes two states of a buffer that pushes are changing.

``device=`` (a torch device: ``"cpu"``, ``"cuda:0"``...) returns
``torch.Tensor`` s instead of numpy arrays (see :mod:`millpond.handle.devices`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterator, Sequence

import numpy as np

from millpond.core.checks import check_batch_size, check_count, check_seed
from millpond.core.config import BufferConfig
from millpond.core.episode_checks import check_fields
from millpond.handle.devices import check_device, to_device
from millpond.errors import InvalidArgumentError
from millpond.handle.export import export, read_chunks

# One epoch_iterator covers at most this many epochs (a bound on one call, not a use).
MAX_EPOCHS = 1 << 30


class LearnerMethods:
    """See the module docstring; :class:`millpond.ReplayBuffer` documents the calls."""

    _backend: Any
    config: BufferConfig

    def __len__(self) -> int:
        raise NotImplementedError  # the handle's

    @property
    def size(self) -> int:
        """Records held: ``len(buf)`` (objectrl's ``size``)."""
        return len(self)

    def sample_by_index(self, indices: Any, fields: Sequence[str] | None = None, *,
                        device: Any = None) -> dict[str, Any]:
        """Records at positions ``indices`` (0 = oldest, ``len - 1`` = newest), in the
        order given: ``{field: array[len(indices), *shape]}`` for ``fields`` (default:
        all; in the order given). A position outside ``[0, len)`` raises
        IndexOutOfRangeError (an InvalidArgumentError and an IndexError) and reads
        nothing. Not a sample: it waits for no rate limiter and counts no use
        (``max_times_sampled``); a queue keeps its records."""
        check_device(device)  # before the read: a bad device costs no round trip
        batch = self._backend.read(indices, fields, positions=True)
        del batch["live"]  # every position names a live record
        return to_device(batch, device)

    def sample_all(self, fields: Sequence[str] | None = None, *,
                   device: Any = None) -> dict[str, Any]:
        """Every record held, oldest first: :meth:`sample_by_index` of ``range(len)``.

        In-process the records are read at once. Remotely they come in
        replies of at most the client's message size (``max_message_mb``),
        each read at once; with pushes going on meanwhile, records evicted
        between two replies shift the positions of the next one.
        """
        check_device(device)
        names = check_fields(self.config, fields)
        if not hasattr(self._backend, "read_chunk"):  # in-process: one read under the lock
            return to_device(self._backend.contents(names), device)
        n, chunks = read_chunks(self, names, max_bytes=sys.maxsize)
        out: dict[str, np.ndarray] | None = None
        for start, batch in chunks:
            rows = len(next(iter(batch.values())))
            if rows == n:  # one reply: its arrays as they came
                out = batch
                break
            if out is None:
                out = {k: np.empty((n, *v.shape[1:]), v.dtype) for k, v in batch.items()}
            for name, column in batch.items():
                out[name][start:start + rows] = column
        if out is None:  # empty
            schema = self.config.schema
            out = {name: np.empty((0, *schema[name].shape), schema[name].dtype)
                   for name in names or schema.names}
        return to_device(out, device)

    def epoch_iterator(self, batch_size: int, n_epochs: int = 1, shuffle: bool = True,
                       seed: int | None = None, drop_last: bool = False, *,
                       fields: Sequence[str] | None = None,
                       device: Any = None) -> Iterator[dict[str, Any]]:
        """Batches that cover the records held once per epoch, ``n_epochs`` times.

        Each epoch takes ``len(buf)`` when it starts and yields
        ``sample_by_index`` batches of ``batch_size`` positions of
        ``range(len)``: a permutation if ``shuffle`` (the same for the same
        ``seed`` and sizes), else in order; the last batch is smaller unless
        ``drop_last``. Arguments are checked now; batches are read as the
        iteration goes (a record pushed during an epoch waits for the next).
        """
        batch_size = check_batch_size(batch_size)
        n_epochs = check_count("n_epochs", n_epochs, MAX_EPOCHS)
        rng = np.random.default_rng(check_seed(seed))
        names = check_fields(self.config, fields)
        check_device(device)
        if not isinstance(shuffle, bool) or not isinstance(drop_last, bool):
            raise InvalidArgumentError("shuffle and drop_last must be True or False")

        def batches() -> Iterator[dict[str, Any]]:
            for _ in range(n_epochs):
                n = len(self)
                order = rng.permutation(n) if shuffle else np.arange(n)
                stop = n - n % batch_size if drop_last else n
                for start in range(0, stop, batch_size):
                    yield self.sample_by_index(order[start:start + batch_size], names,
                                               device=device)

        return batches()

    def calculate_num_batches(self, batch_size: int) -> int:
        """Batches of ``batch_size`` per epoch: ``ceil(len / batch_size)``, as objectrl
        counts them (with ``drop_last`` an epoch yields ``len // batch_size``)."""
        return -(-len(self) // check_batch_size(batch_size))

    def reset(self) -> None:
        """Drop every record; keep the buffer, its config (and file, if persistent).

        Priorities (``max_priority`` back to 1), use counts, the episode
        index and the rate limiter's balance start again as for a new
        buffer; ``beta`` and the ``inserts``/``samples``/``pushed`` totals
        do not. A persistent buffer reset then reopened (even after a crash)
        is empty. Remote: pushes queued on this handle are stored first,
        then dropped with the rest; needs the ``learner`` or ``admin`` role.
        """
        self._backend.reset()

    def export(self, path: str | os.PathLike) -> str:
        """Write the records, oldest first, to the ``.npz`` at ``path`` (one array per
        field, ``episode_ids`` if episodic); return its path. See
        :func:`millpond.handle.export.export`."""
        return export(self, path)
