"""objectrl's ``ReplayBuffer`` (TensorDicts in and out), its records stored in millpond.

A drop-in for ``objectrl.replay_buffers.experience_memory.ReplayBuffer``::

    from millpond.integrations.objectrl import ReplayBuffer
    memory = ReplayBuffer(torch.device("cpu"), torch.device("cpu"), 100_000)
    # or on a server, shared with other processes:
    memory = ReplayBuffer(device, storing_device, 100_000, address="host:50051", name="sac")

Contract (objectrl's, from its documentation and source):

* The schema is taken from the first ``add``/``add_batch``, as TorchRL's lazy
  storages do: ``add(td)`` stores one record (per-record shapes are the
  tensors' shapes); ``add_batch(td)`` stores ``td.batch_size[0]`` records.
  The millpond buffer (``buffer_size`` records, oldest evicted first) is
  created then; with ``address``/``name`` on that server, and a buffer that
  already exists there is attached to at construction (a learner process may
  sample what actors add). Nested keys are stored as ``outer__inner`` fields;
  keys must be identifiers without ``__``; dtypes are torch's numeric ones
  (bool, ints, float16/32/64; not bfloat16, complex or non-tensor data).
* Every read returns a ``TensorDict`` of batch size ``[n]`` on ``device``, with
  the keys and dtypes added (a Python float added becomes float32, an int
  int64, as TensorDict makes them). ``sample_batch`` / ``sample_random`` draw
  uniformly with replacement (seeded from torch's global generator, so
  ``torch.manual_seed`` makes them reproducible in-process; a batch larger
  than the buffer is drawn in parts, as TorchRL's sampler allows).
* Indices are objectrl's storage slots: the ``k``-th record added since the last
  reset (from 0) sits in slot ``k % buffer_size``, so until the buffer first
  fills slot ``i`` is the ``i``-th oldest record, and after that ``pointer``
  (the next slot written) is the oldest. Slots are counted by this object's
  adds: with other writers on a shared server buffer they are positions
  (oldest = 0) rotated by this object's ``pointer``. An index outside
  ``[0, size)`` raises ``millpond.IndexOutOfRangeError`` (an ``IndexError``).
  ``sample_all`` returns slots ``0 .. size-1``; ``create_epoch_iterator`` yields
  them in that order in batches (each record once per epoch, the last batch
  smaller), or, with ``shuffle=True`` (an extension), millpond's shuffled
  ``epoch_iterator``.
* ``reset(buffer_size=None)`` drops every record; the next add may bring a new
  schema (objectrl's PPO adds advantages after a reset), which then replaces
  the millpond buffer. A new ``buffer_size`` replaces it at the next add.
* ``save(path)`` writes objectrl's ``path.metadata`` (``buffer_size``,
  ``data_size``, ``pointer``) and, beyond objectrl, the records as
  ``path.npz`` (millpond's ``export``); ``load(path)`` restores the metadata
  and, when ``path.npz`` exists, the records (objectrl restores metadata only).
* ``storing_device`` is kept for objectrl's code to read; records are stored
  by millpond (host memory or the server), whatever it says. ``print_gc_warning``
  is accepted and has nothing to do.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from tensordict import TensorDict

import millpond
from millpond.errors import BufferNotFoundError, InvalidArgumentError, NotEnoughDataError

SEP = "__"
_SEED_RANGE = 2**31 - 1


def _flat(td: Any) -> dict[str, torch.Tensor]:
    """``{field: tensor}`` of a TensorDict's (or dict's) leaves, nested keys joined by ``__``."""
    if not isinstance(td, TensorDict):
        td = TensorDict(td)
    out = {}
    for key in td.keys(include_nested=True, leaves_only=True):
        parts = (key,) if isinstance(key, str) else tuple(key)
        if any(not p.isidentifier() or SEP in p for p in parts):
            raise InvalidArgumentError(f"key {key!r}: keys must be identifiers without {SEP!r}")
        value = td.get(key)
        if not isinstance(value, torch.Tensor) or value.dtype in (torch.bfloat16,) or (
                value.is_complex()):
            raise InvalidArgumentError(f"key {key!r}: only bool, int and float tensors are stored")
        out[SEP.join(parts)] = value
    return out


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a__b": x}`` back to ``{"a": {"b": x}}``."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        *outer, leaf = name.split(SEP)
        node = out
        for part in outer:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


class ReplayBuffer:
    """objectrl's replay buffer over millpond; see the module docstring for the contract."""

    def __init__(self, device: torch.device | str, storing_device: torch.device | str,
                 buffer_size: int, print_gc_warning: bool = False, *,
                 address: str | Sequence[str] | None = None, name: str | None = None,
                 token: str | None = None):
        if (address is None) != (name is None):
            raise InvalidArgumentError("a server's buffer needs both address= and name=")
        self.device = torch.device(device)
        self.storing_device = torch.device(storing_device)
        self.buffer_size = int(buffer_size)
        self.print_gc_warning = print_gc_warning
        self.address, self.name, self.token = address, name, token
        self.millpond_buffer: Any = None
        self.epoch_iterator: Iterator[TensorDict] | None = None
        self._replaceable = False  # after a reset, the next add may bring a new schema
        self.pointer = 0
        if address is not None and name is not None:
            try:
                self.millpond_buffer = millpond.connect(address, token=token).buffer(name)
            except BufferNotFoundError:
                pass  # created by the first add
            else:
                self.buffer_size = self.millpond_buffer.total_capacity
                self.pointer = len(self.millpond_buffer) % self.buffer_size

    # ---- storage ------------------------------------------------------------------------

    def _create(self, columns: dict[str, np.ndarray]) -> None:
        fields = {name: (col.dtype, col.shape[1:]) for name, col in columns.items()}
        if self.millpond_buffer is not None:
            if self.millpond_buffer.schema == millpond.Schema.from_spec(fields) and (
                    self.millpond_buffer.total_capacity == self.buffer_size):
                self._replaceable = False
                return
            if not self._replaceable:
                return  # the push raises the mismatch, as TorchRL's storage would
            self.millpond_buffer.delete()
        self.millpond_buffer = millpond.ReplayBuffer(
            self.buffer_size, fields=fields, address=self.address, name=self.name,
            token=self.token)
        self._replaceable = False

    def _push(self, flat: dict[str, torch.Tensor], n: int) -> None:
        columns = {name: value.detach().cpu().numpy().reshape(n, *value.shape[1:])
                   for name, value in flat.items()}
        if self.millpond_buffer is None or self._replaceable:
            self._create(columns)
        self.millpond_buffer.push_batch(**columns)
        self.pointer = (self.pointer + n) % self.buffer_size

    def add(self, experience: TensorDict) -> None:
        """Add one experience (a TensorDict of batch size ``[]``, or a dict of tensors)."""
        flat = _flat(experience)
        self._push({name: value.unsqueeze(0) for name, value in flat.items()}, 1)

    def add_batch(self, batch: TensorDict) -> None:
        """Add ``batch.batch_size[0]`` experiences."""
        if not isinstance(batch, TensorDict) or batch.batch_dims < 1:
            raise InvalidArgumentError("add_batch takes a TensorDict with a batch dimension")
        self._push(_flat(batch), int(batch.batch_size[0]))

    # ---- reading ------------------------------------------------------------------------

    def _tensordict(self, flat: dict[str, Any]) -> TensorDict:
        n = len(next(iter(flat.values()))) if flat else 0
        return TensorDict(_nested(flat), batch_size=[n], device=self.device)

    def _require(self) -> Any:
        if self.millpond_buffer is None:
            raise NotEnoughDataError("the replay buffer is empty")
        return self.millpond_buffer

    def sample_batch(self, batch_size: int) -> TensorDict:
        """``batch_size`` experiences drawn uniformly with replacement, on ``device``."""
        buf = self._require()
        seed = int(torch.randint(0, _SEED_RANGE, ()).item())  # follows torch.manual_seed
        try:
            return self._tensordict(buf.sample(batch_size, seed, device=self.device))
        except NotEnoughDataError:
            held = len(buf)
            if held == 0:
                raise
        parts = [buf.sample(min(held, batch_size - start), (seed + i) % _SEED_RANGE,
                            device=self.device)
                 for i, start in enumerate(range(0, batch_size, held))]
        return self._tensordict({k: torch.cat([p[k] for p in parts]) for k in parts[0]})

    def sample_random(self, batch_size: int) -> TensorDict:
        """Alias for :meth:`sample_batch`."""
        return self.sample_batch(batch_size)

    def _positions(self, indices: Any) -> np.ndarray:
        """objectrl's slots to millpond's positions (oldest = 0); see the module docstring."""
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        slots = np.asarray(list(indices) if isinstance(indices, range) else indices)
        if slots.dtype.kind not in "iu":
            if slots.size:
                raise InvalidArgumentError("indices must be integers")
            slots = slots.astype(np.int64)
        held = len(self._require())
        if held < self.buffer_size or self.pointer == 0:
            return slots
        in_range = (slots >= 0) & (slots < held)  # out of range stays so: the read refuses it
        return np.where(in_range, (slots - self.pointer) % self.buffer_size, slots)

    def _select(self, fields: Sequence[Any] | None) -> list[str] | None:
        if fields is None:
            return None
        names = self._require().schema.names
        wanted = [SEP.join((f,) if isinstance(f, str) else tuple(f)) for f in fields]
        return [n for n in names if any(n == w or n.startswith(w + SEP) for w in wanted)]

    def sample_by_index(self, indices: list | torch.Tensor | range) -> TensorDict:
        """The experiences in slots ``indices``, in that order, on ``device``."""
        return self.sample_by_index_fields(indices, None)

    def sample_by_index_fields(self, indices: list | torch.Tensor | range,
                               fields: Sequence[Any] | None) -> TensorDict:
        """The keys ``fields`` (top-level keys, nested ones as tuples) of slots ``indices``."""
        positions = self._positions(indices)
        flat = self._require().sample_by_index(positions, self._select(fields),
                                               device=self.device)
        return self._tensordict(flat)

    def sample_all(self) -> TensorDict:
        """Every experience held, in slot order (oldest first until the buffer wraps)."""
        buf = self._require()
        flat = buf.sample_all(device=self.device)
        n = len(next(iter(flat.values())))
        if n == self.buffer_size and self.pointer:  # position p is slot (p + pointer) % size
            flat = {k: torch.roll(v, self.pointer, 0) for k, v in flat.items()}
        return self._tensordict(flat)

    def __len__(self) -> int:
        return 0 if self.millpond_buffer is None else len(self.millpond_buffer)

    @property
    def size(self) -> int:
        """Experiences held."""
        return len(self)

    @property
    def data_size(self) -> int:
        """objectrl's name for :attr:`size`."""
        return len(self)

    # ---- lifecycle ----------------------------------------------------------------------

    def reset(self, buffer_size: int | None = None) -> None:
        """Drop every experience (optionally resizing); the next add may bring a new schema."""
        if buffer_size is not None and int(buffer_size) != self.buffer_size:
            self.buffer_size = int(buffer_size)
        if self.millpond_buffer is not None:
            self.millpond_buffer.reset()
        self.pointer = 0
        self._replaceable = True

    def save(self, path: str) -> None:
        """objectrl's ``path.metadata``, and the records as ``path.npz``."""
        torch.save({"buffer_size": self.buffer_size, "data_size": self.data_size,
                    "pointer": self.pointer}, path + ".metadata")
        if self.millpond_buffer is not None:
            self.millpond_buffer.export(path + ".npz")

    def load(self, path: str) -> None:
        """Restore ``path.metadata``, and the records of ``path.npz`` if it exists."""
        metadata = torch.load(path + ".metadata")
        if os.path.exists(path + ".npz"):
            with np.load(path + ".npz") as data:
                columns = {k: torch.from_numpy(data[k]) for k in data.files if k != "episode_ids"}
            self.reset(metadata["buffer_size"])
            n = len(next(iter(columns.values()))) if columns else 0
            if n:
                self.add_batch(TensorDict(_nested(columns), batch_size=[n]))
        self.buffer_size = metadata["buffer_size"]
        self.pointer = metadata["pointer"]

    def close(self) -> None:
        """Close the millpond handle (deleting the buffer if this object created it)."""
        if self.millpond_buffer is not None:
            self.millpond_buffer.close()

    # ---- epochs -------------------------------------------------------------------------

    def create_epoch_iterator(self, batch_size: int, n_epochs: int = 1, *,
                              shuffle: bool = False, seed: int | None = None
                              ) -> Iterator[TensorDict]:
        """Batches covering every experience once per epoch, ``n_epochs`` times (in slot
        order; ``shuffle=True``: a permutation per epoch, millpond's ``epoch_iterator``).
        Also becomes the iterator :meth:`get_next_batch` draws from."""
        total = self.size

        def in_order() -> Iterator[TensorDict]:
            for _ in range(n_epochs):
                for start in range(0, total, batch_size):
                    yield self.sample_by_index(range(start, min(start + batch_size, total)))

        def shuffled() -> Iterator[TensorDict]:
            for flat in self._require().epoch_iterator(batch_size, n_epochs, shuffle=True,
                                                       seed=seed, device=self.device):
                yield self._tensordict(flat)

        self.epoch_iterator = shuffled() if shuffle else in_order()
        return self.epoch_iterator

    def get_next_batch(self, batch_size: int) -> TensorDict:
        """The epoch iterator's next batch, or a random one when there is no iterator."""
        if self.epoch_iterator is not None:
            return next(self.epoch_iterator)
        return self.sample_batch(batch_size)

    def calculate_num_batches(self, batch_size: int) -> int:
        """Batches of ``batch_size`` in one epoch: ``ceil(size / batch_size)``."""
        return (self.size + batch_size - 1) // batch_size

    def get_steps_and_iterator(self, n_epochs: int, max_iter: int, batch_size: int) -> int:
        """``n_epochs > 0``: ``n_epochs * calculate_num_batches`` steps over a fresh epoch
        iterator; else ``max_iter`` steps of random batches (no iterator)."""
        if n_epochs > 0:
            self.create_epoch_iterator(batch_size, n_epochs)
            return n_epochs * self.calculate_num_batches(batch_size)
        self.epoch_iterator = None
        return max_iter
