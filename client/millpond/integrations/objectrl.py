"""objectrl's ``ReplayBuffer`` (TensorDicts in and out), its records stored in millpond.

A drop-in for ``objectrl.replay_buffers.experience_memory.ReplayBuffer``::

    from millpond.integrations.objectrl import ReplayBuffer
    memory = ReplayBuffer(torch.device("cpu"), torch.device("cpu"), 100_000)
    # or on a server, shared with other processes:
    memory = ReplayBuffer(device, storing_device, 100_000, address="host:50051", name="sac")

objectrl's agents build their own buffer (0.2.1 has no hook): ``use_millpond(agent,
address=None, name=None)`` replaces ``agent.experience_memory`` with this one, built
from the agent's config. Contract (objectrl 0.2.1's, checked call by call against it
by tests/test_objectrl_real.py, ``make test-objectrl``):

* The schema is taken from the first ``add``/``add_batch`` after a reset, as TorchRL's
  lazy storages do: ``add(td)`` stores one record of batch size ``td.batch_size``;
  ``add_batch(td)`` stores ``td.batch_size[0]`` records of batch size
  ``td.batch_size[1:]`` (2-D batches: records of batch ``[T]``). The millpond buffer
  (``buffer_size`` records, oldest evicted first) is created then; with
  ``address``/``name`` on that server, and a buffer that already exists there is
  attached to at construction (a learner process may sample what actors add). Nested
  keys are stored as ``outer__inner`` fields; keys must be identifiers without ``__``;
  dtypes: bool, ints, float16/32/64 and bfloat16 (stored as its bits, exact); not
  complex (objectrl refuses it too). Non-tensor keys (strings) are kept as objectrl's
  storage keeps them: one value per key, the first written since the reset.
* Until the next reset the schema stays, as objectrl's storage keeps it: a key not in
  it is dropped, a value is broadcast to the stored shape, ``add`` casts to the stored
  dtype (``add_batch`` refuses another dtype), and a key the record lacks keeps what
  its slot held (zeros if never written).
* Every read returns a ``TensorDict`` of batch size ``[n, *record batch]`` on ``device``,
  with the keys and dtypes added (a Python float added becomes float32, an int int64,
  as TensorDict makes them) and objectrl's ``index`` key: each record's slot (int64; an
  ``index`` key added is overwritten by it). ``sample_batch`` / ``sample_random`` draw
  objectrl's slots, ``torch.randint(len(self), (batch_size,))`` from torch's global
  generator, so one ``torch.manual_seed`` gives objectrl's batch, in-process or on a
  server. ``sample_batch(0)`` is an empty batch (refused, as objectrl's, when the buffer
  has non-tensor keys); every read of an empty buffer raises.
* Indices are objectrl's storage slots: the ``k``-th record added since the last
  reset (from 0) sits in slot ``k % buffer_size``, so until the buffer first
  fills slot ``i`` is the ``i``-th oldest record, and after that ``pointer``
  (the next slot written) is the oldest; ``-k`` is slot ``size - k``. Slots are
  counted by this object's adds: with other writers on a shared server buffer they
  are positions (oldest = 0) rotated by this object's ``pointer``. An index outside
  ``[-size, size)`` raises ``millpond.IndexOutOfRangeError`` (an ``IndexError``).
  ``sample_all`` returns slots ``0 .. size-1``; ``create_epoch_iterator`` yields
  them in that order in batches (each record once per epoch, the last batch
  smaller), or, with ``shuffle=True`` (an extension), a permutation per epoch.
* ``reset(buffer_size=None)`` drops every record; the next add may bring a new
  schema (objectrl's PPO adds advantages after a reset), which then replaces
  the millpond buffer. A new ``buffer_size`` replaces it at the next add.
* ``save(path)`` writes objectrl's ``path.metadata`` (``buffer_size``,
  ``data_size``, ``pointer``) and, beyond objectrl, the records as
  ``path.npz`` (millpond's ``export``); ``load(path)`` restores the metadata
  and, when ``path.npz`` exists, the records (objectrl restores metadata only).
* ``storing_device`` is kept for objectrl's code to read; records are stored
  by millpond (host memory or the server), whatever it says. ``print_gc_warning``
  is accepted and has nothing to do. Held by this object only (not seen by another
  process attaching by name, nor saved): the record batch size and non-tensor keys.
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
BF16 = SEP + "bf16" + SEP  # a bfloat16 field is stored as its bits (uint16) under name + BF16
INDEX = "index"  # objectrl's (TorchRL's) reads carry each record's slot under this key
_SEED_RANGE = 2**31 - 1


def _is_leaf(cls: type) -> bool:
    """Tensors and non-tensor data (strings, ...) are leaves; TensorDicts are not."""
    from tensordict.base import _is_leaf_nontensor
    return bool(_is_leaf_nontensor(cls))


def _first(value: Any) -> Any:
    """A non-tensor leaf's first record's value (objectrl's storage keeps one per key)."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value


def _flat(td: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``({field: tensor}, {field: value})``: a TensorDict's tensor leaves and its non-tensor
    leaves (strings, ...: the first record's value), nested keys joined by ``__``."""
    if not isinstance(td, TensorDict):
        td = TensorDict(td)
    tensors, constants = {}, {}
    for key in td.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
        parts = (key,) if isinstance(key, str) else tuple(key)
        if any(not p.isidentifier() or SEP in p for p in parts):
            raise InvalidArgumentError(f"key {key!r}: keys must be identifiers without {SEP!r}")
        name = SEP.join(parts)
        if name == INDEX:
            continue  # objectrl's storage overwrites it with the slot
        value = td.get(key)
        if not isinstance(value, torch.Tensor):
            constants[name] = _first(value.tolist() if hasattr(value, "tolist") else
                                     td.get_non_tensor(key))
        elif value.is_complex():
            raise InvalidArgumentError(f"key {key!r}: complex tensors are not stored "
                                       "(objectrl's storage refuses them too)")
        else:
            tensors[name] = value
    return tensors, constants


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


def _encode(name: str, value: torch.Tensor) -> tuple[str, np.ndarray]:
    """A field's column: bfloat16 as its bits (uint16, exact) under ``name + BF16``."""
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        return name + BF16, value.contiguous().view(torch.int16).numpy().view(np.uint16)
    return name, value.numpy()


def _decode(name: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    if name.endswith(BF16):
        return name[:-len(BF16)], value.view(torch.int16).view(torch.bfloat16)
    return name, value


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
        self._record_batch: tuple[int, ...] = ()  # each record's own batch dims (2-D batches)
        self._constants: dict[str, Any] = {}  # non-tensor keys: one value each, as objectrl's
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
                return
            self.millpond_buffer.delete()
        self.millpond_buffer = millpond.ReplayBuffer(
            self.buffer_size, fields=fields, address=self.address, name=self.name,
            token=self.token)

    def _conform(self, flat: dict[str, torch.Tensor], n: int, cast: bool
                 ) -> dict[str, np.ndarray]:
        """The columns of the buffer's schema, as objectrl's storage writes a record into its
        slot: extra keys dropped, each value cast to the stored dtype and broadcast to the
        stored shape, and a missing key left as the slot held it (zeros if never written).
        ``cast=False`` (``add_batch``: TorchRL's index put): a dtype other than the stored
        one is refused."""
        buf = self.millpond_buffer
        columns: dict[str, np.ndarray] = {}
        missing = []
        for field in buf.schema.fields:
            name = field.name[:-len(BF16)] if field.name.endswith(BF16) else field.name
            if name not in flat:
                missing.append(field)
                continue
            value = flat[name].detach().cpu()
            dtype = (torch.bfloat16 if field.name.endswith(BF16)
                     else torch.from_numpy(np.zeros(0, field.dtype)).dtype)
            if not cast and value.dtype != dtype:
                raise InvalidArgumentError(f"key {name!r}: {value.dtype} in a batch; this "
                                           f"buffer stores {dtype} (objectrl's refuses it too)")
            value = value.to(dtype)
            value = torch.broadcast_to(value, (n, *field.shape))
            columns.update([_encode(name, value)])
        if missing:
            held = len(buf)
            slots = (self.pointer + np.arange(n)) % self.buffer_size
            written = slots < held  # those slots hold a record: it keeps its values
            old = (buf.sample_by_index(self._positions(slots[written]),
                                       [f.name for f in missing]) if written.any() else {})
            for field in missing:
                col = np.zeros((n, *field.shape), field.dtype)
                if written.any():
                    col[written] = np.asarray(old[field.name])
                columns[field.name] = col
        return columns

    def _push(self, flat: dict[str, torch.Tensor], constants: dict[str, Any], n: int,
              record_batch: tuple[int, ...], cast: bool) -> None:
        if self.millpond_buffer is None or self._replaceable:
            columns = dict(_encode(name, value.reshape(n, *value.shape[1:]))
                           for name, value in flat.items())
            self._create(columns)
            self._record_batch = record_batch
            self._constants = dict(constants)
            self._replaceable = False
        else:
            if record_batch != self._record_batch:
                raise InvalidArgumentError(
                    f"records of batch size {list(record_batch)}; this buffer holds "
                    f"{list(self._record_batch)} (reset() to change it)")
            columns = self._conform(flat, n, cast)  # as objectrl's: new non-tensor keys dropped too
        self.millpond_buffer.push_batch(**columns)
        self.pointer = (self.pointer + n) % self.buffer_size

    def add(self, experience: TensorDict) -> None:
        """Add one experience (a TensorDict of any batch size, or a dict of tensors)."""
        if not isinstance(experience, TensorDict):
            experience = TensorDict(experience)
        flat, constants = _flat(experience)
        self._push({name: value.unsqueeze(0) for name, value in flat.items()}, constants, 1,
                   tuple(experience.batch_size), cast=True)

    def add_batch(self, batch: TensorDict) -> None:
        """Add ``batch.batch_size[0]`` experiences (each of batch size ``batch_size[1:]``)."""
        if not isinstance(batch, TensorDict) or batch.batch_dims < 1:
            raise InvalidArgumentError("add_batch takes a TensorDict with a batch dimension")
        flat, constants = _flat(batch)
        self._push(flat, constants, int(batch.batch_size[0]), tuple(batch.batch_size[1:]),
                   cast=False)

    # ---- reading ------------------------------------------------------------------------

    def _tensordict(self, flat: dict[str, Any], slots: np.ndarray,
                    wanted: list[str] | None = None) -> TensorDict:
        """A read's TensorDict: batch size ``[n, *record batch]``, objectrl's ``index`` key
        (each record's slot), the non-tensor keys."""
        from tensordict import NonTensorData, NonTensorStack

        n = len(slots)
        shape = (n, *self._record_batch)
        out: dict[str, Any] = dict(_decode(name, value) for name, value in flat.items())
        if wanted is None or INDEX in wanted:
            out[INDEX] = torch.as_tensor(slots, dtype=torch.int64).reshape(
                n, *([1] * len(self._record_batch))).expand(shape).to(self.device)
        for name, value in self._constants.items():
            if wanted is not None and not any(name == w or name.startswith(w + SEP)
                                              for w in wanted):
                continue
            stack: Any = value
            for size in reversed(shape):
                stack = [stack] * size
            out[name] = (NonTensorStack.from_list(stack) if n else
                         NonTensorData(value, batch_size=list(shape)))
        return TensorDict(_nested(out), batch_size=list(shape), device=self.device)

    def _require(self) -> Any:
        if self.millpond_buffer is None or len(self.millpond_buffer) == 0:
            raise NotEnoughDataError("the replay buffer is empty")
        return self.millpond_buffer

    def _read(self, slots: np.ndarray, fields: Any = None) -> TensorDict:
        buf = self._require()
        names, wanted = self._select(fields)
        flat = (buf.sample_by_index(self._positions(slots), names, device=self.device)
                if names is None or names else {})
        return self._tensordict(flat, slots, wanted)

    def sample_batch(self, batch_size: int) -> TensorDict:
        """``batch_size`` experiences drawn uniformly with replacement, on ``device``: the
        slots objectrl's sampler draws (``torch.randint(len(self), (batch_size,))`` from
        torch's global generator, so ``torch.manual_seed`` gives objectrl's batch)."""
        held = len(self._require())
        if batch_size == 0 and self._constants:
            raise InvalidArgumentError("an empty batch of a buffer with non-tensor keys "
                                       "(objectrl's refuses it too)")
        slots = torch.randint(0, held, (int(batch_size),)).numpy()
        return self._read(slots, None)

    def sample_random(self, batch_size: int) -> TensorDict:
        """Alias for :meth:`sample_batch`."""
        return self.sample_batch(batch_size)

    def _slots(self, indices: Any) -> np.ndarray:
        """objectrl's indices as slots in ``[0, size)``: a negative one counts from the end
        (``-1`` is slot ``size - 1``); outside ``[-size, size)`` raises ``IndexError``."""
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        slots = np.asarray(list(indices) if isinstance(indices, range) else indices)
        if slots.dtype.kind not in "iu":
            if slots.size:
                raise InvalidArgumentError("indices must be integers")
            slots = slots.astype(np.int64)
        slots = slots.astype(np.int64).reshape(-1)
        held = len(self._require())
        if ((slots < -held) | (slots >= held)).any():
            raise millpond.IndexOutOfRangeError(
                f"indices {slots[(slots < -held) | (slots >= held)][:5].tolist()} are outside "
                f"the {held} records held")
        return np.where(slots < 0, slots + held, slots)

    def _positions(self, slots: np.ndarray) -> np.ndarray:
        """objectrl's slots (in ``[0, size)``) to millpond's positions (oldest = 0)."""
        held = len(self.millpond_buffer)
        if held < self.buffer_size or self.pointer == 0:
            return slots
        return (slots - self.pointer) % self.buffer_size

    def _select(self, fields: Any) -> tuple[list[str] | None, list[str] | None]:
        """objectrl's ``fields``: one key (a string, or a nested key as a tuple); a list of
        keys too (an extension)."""
        if fields is None:
            return None, None
        if isinstance(fields, (str, tuple)):
            fields = [fields]
        names = self._require().schema.names
        wanted = [SEP.join((f,) if isinstance(f, str) else tuple(f)) for f in fields]
        unknown = [w for w in wanted if w != INDEX and w not in self._constants and not any(
            n == w or n == w + BF16 or n.startswith(w + SEP) for n in names)]
        if unknown:
            raise KeyError(f"keys {unknown} are not in this buffer")
        return [n for n in names if any(n == w or n == w + BF16 or (
            n.startswith(w + SEP) and not n[len(w):] == BF16) for w in wanted)], wanted

    def sample_by_index(self, indices: list | torch.Tensor | range) -> TensorDict:
        """The experiences in slots ``indices``, in that order, on ``device``."""
        return self._read(self._slots(indices))

    def sample_by_index_fields(self, indices: list | torch.Tensor | range,
                               fields: Any) -> TensorDict:
        """The key ``fields`` (a string, or a nested key as a tuple; a list of keys too) of
        slots ``indices``."""
        return self._read(self._slots(indices), fields)

    def sample_all(self) -> TensorDict:
        """Every experience held, in slot order (oldest first until the buffer wraps)."""
        return self._read(np.arange(len(self._require())))

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
                columns = dict(_decode(k, torch.from_numpy(data[k]))
                               for k in data.files if k != "episode_ids")
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
        order; ``shuffle=True``: a permutation of the slots per epoch, from ``seed``).
        Also becomes the iterator :meth:`get_next_batch` draws from."""
        total = self.size

        def in_order() -> Iterator[TensorDict]:
            for _ in range(n_epochs):
                for start in range(0, total, batch_size):
                    yield self.sample_by_index(range(start, min(start + batch_size, total)))

        def shuffled() -> Iterator[TensorDict]:
            rng = np.random.default_rng(seed)
            for _ in range(n_epochs):
                order = rng.permutation(total)
                for start in range(0, total, batch_size):
                    yield self._read(order[start:start + batch_size])

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


def use_millpond(agent: Any, *, address: str | Sequence[str] | None = None,
                 name: str | None = None, token: str | None = None) -> ReplayBuffer:
    """Give an objectrl agent a millpond buffer: objectrl 0.2.1 has no hook for one (its
    ``Agent.__init__`` builds ``objectrl.replay_buffers.experience_memory.ReplayBuffer``
    itself), so this replaces the agent's ``experience_memory`` attribute, which every
    agent reads its buffer from, with a :class:`ReplayBuffer` built from the agent's own
    config (``system.device``, ``system.storing_device``, ``training.buffer_size``), on a
    server's buffer ``name`` at ``address`` when given. Call it after building the agent
    and before training; the agent's old (empty) buffer is dropped. Returns the new one."""
    config = agent.config
    memory = ReplayBuffer(torch.device(config.system.device),
                          torch.device(config.system.storing_device),
                          config.training.buffer_size, address=address, name=name, token=token)
    agent.experience_memory = memory
    return memory
