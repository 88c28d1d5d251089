"""TorchRL's replay-buffer parts over millpond: a ``Storage`` and samplers that draw on it.

The records live in a millpond buffer, in this process or on a daemon. The
samplers ask millpond for a sample (one call: the draw and the data together)
instead of drawing indices here and reading them, so TorchRL's buffers sample
at millpond's own speed::

    from torchrl.data import TensorDictReplayBuffer
    from millpond.integrations.torchrl import (
        MillpondStorage, MillpondSampler, MillpondPrioritizedSampler, MillpondSliceSampler)

    rb = TensorDictReplayBuffer(
        storage=MillpondStorage(1_000_000, address="host:50051", name="sac"),
        sampler=MillpondPrioritizedSampler(alpha=0.7, beta=0.5), batch_size=256)
    rb.extend(collected)                      # TensorDicts in
    batch = rb.sample()                       # TensorDicts out: "index", "priority_weight"
    batch["td_error"] = loss.detach()
    rb.update_tensordict_priority(batch)      # or rb.update_priority(batch["index"], prios)

Without ``address``/``name`` (or ``client=``/``name``) the buffer is an in-process
millpond buffer; ``buffer=`` takes a millpond handle made elsewhere.

Contract:

* **Records and keys.** A TensorDict's leaves become millpond fields, nested keys
  joined by ``__`` (``("next", "observation")`` is the field
  ``next__observation``; samples are nested again). Keys must be identifiers
  without ``__``; leaves must be bool, int, uint or float tensors (not bfloat16,
  complex, strings or other non-tensor data). A plain tensor (a ``ReplayBuffer``
  of tensors) is the one field ``_tensor``. The schema is the first write's (or
  ``fields={name: (dtype, shape)}``, flattened names); the millpond buffer is
  created then, of ``max_size`` records (``hot_capacity``: the newest in RAM, the
  rest in the buffer's file), of the kind the attached buffers' samplers need
  (prioritized with the sampler's ``alpha``/``beta``; episodic for slices: an
  actor writing to a learner's buffer should use the learner's sampler class).
  On a server, a buffer of that name that exists is attached to at construction
  (its kind, schema and capacity win over ``max_size``). The ``"index"`` key
  TorchRL's writers add is not stored, nor is the priority key (below). ``len``
  asks the buffer (a round trip on a server: other writers' records count).
* **Writes append.** TorchRL's round-robin writers (the default
  ``RoundRobinWriter`` and ``TensorDictRoundRobinWriter``) keep their cursors and
  the millpond buffer evicts its oldest records first, as a ring of ``max_size``
  does. Writes at chosen indices (``storage[i] = x``, ``write_at``,
  ``TensorDictMaxValueWriter``, consuming samplers reusing slots) raise
  ``NotImplementedError``.
* **Indices are millpond's record indices** (seqs): a prioritized sample's
  ``index`` counts the records ever written to the buffer, so it never names a
  newer record once the buffer wraps, and ``update_priority`` of a record
  evicted since is ignored (with ring slots the priority went to whatever
  record took the slot). The indices ``extend`` returns are the writer's ring
  slots (a millpond push does not say which seqs it took). Uniform samples and
  slices do not say which records they drew (millpond's do not): their
  ``index`` is ``-1``. ``get`` (``storage[i]``, ``rb[i]``, ``rb[:]``) reads by
  *position*: 0 is the oldest record held, ``len - 1`` the newest.
* :class:`MillpondSampler`: uniform with replacement.
* :class:`MillpondPrioritizedSampler`: proportional, ``P(i) ~ (p_i + eps) **
  alpha``, importance weights ``(p_i / p_min) ** -beta`` under TorchRL's key
  ``"priority_weight"``, as TorchRL's ``PrioritizedSampler``. Records written
  without a priority get the largest one seen. A priority key (``td_error``) in
  written TensorDicts goes with the records as their priorities instead of being
  stored (TorchRL stores it; here writes with and without it mix), and TorchRL's
  ``update_priority`` right after that write is skipped, its work done.
  ``sampler.beta = b`` sets beta on the buffer (annealing); ``alpha`` is fixed
  once the buffer exists.
* :class:`MillpondSliceSampler` (TorchRL's ``SliceSampler`` arguments
  ``num_slices``/``slice_len``, ``traj_key``, ``end_key``/``end_keys``,
  ``truncated_key``, ``init_key``, ``strict_length``): windows of consecutive
  steps of one trajectory each, flat ``[num_slices * slice_len]``, with
  TorchRL's ``("next", "truncated")``/``done``/``terminated`` markers at each
  slice's last step and ``is_init`` at its first (when stored). Trajectories are
  millpond episodes, told at write time by ``traj_key`` (by default, as
  TorchRL's, whichever of ``("collector", "traj_ids")`` and ``"episode"`` is
  written; ids of different storages never mix), else by the end flags
  (``("next", "done")`` by default: a trajectory runs to its flag, so write one
  environment's steps in order, or a trajectory key). With ``strict_length``
  (the default) every slice is full and its start is uniform among the records
  that begin a full slice (TorchRL draws a trajectory, then a start in it);
  ``strict_length=False`` also returns whole trajectories shorter than a slice,
  as TorchRL's ragged output.
* Batches larger than the buffer are drawn with replacement, as TorchRL's. A
  ``generator`` on the replay buffer seeds millpond's draws (reproducible); without
  one draws use fresh entropy, not torch's global seed.
* **TorchRL's own samplers** that draw on the client (``RandomSampler``,
  ``SamplerWithoutReplacement``) work over this storage, reading the positions
  they draw: two round trips per sample on a server (the length, then the read).
  Its ``PrioritizedSampler`` and slice samplers are refused (TypeError): they keep
  priorities or trajectory boundaries by ring slot on this client, which do not
  follow a shared buffer (priorities reached the wrong records once it wrapped),
  and would read the whole storage to find trajectories.

Not supported: pytrees other than TensorDicts and tensors, tensorclasses,
storages with ``ndim > 1``, writers other than round-robin, prioritized slices,
TorchRL's slice options ``span``, ``pad_output``, ``fragmented``,
``cache_values`` and ``compile``, ``TensorDictPrioritizedReplayBuffer`` (it makes
TorchRL's own ``PrioritizedSampler``: use ``TensorDictReplayBuffer`` with
:class:`MillpondPrioritizedSampler`), ``torch.compile`` of sampling, and TorchRL
checkpoints (``dumps``/``loads`` raise: a daemon's buffers persist by themselves,
and ``storage.buffer.export(path)`` writes the records). A server storage's
``state_dict`` names its buffer and ``load_state_dict`` attaches to it; it
pickles by address and name.
"""

from __future__ import annotations

import math
import random
import threading
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from torchrl.data.replay_buffers.samplers import (
    PrioritizedSampler,
    Sampler,
    SliceSampler,
    SliceSamplerWithoutReplacement,
)
from torchrl.data.replay_buffers.storages import Storage, StoreStorage

import millpond
from millpond.errors import BufferNotFoundError, InvalidArgumentError, NotEnoughDataError
from millpond.handle.devices import to_device
from millpond.handle.episode_writer import EpisodeStream

SEP = "__"  # ("next", "obs") <-> "next__obs"
TENSOR_FIELD = "_tensor"  # the field of a storage of plain tensors
INDEX_KEY = "index"  # added by TorchRL's writers and samples; never stored
EMPTY = "Cannot sample from an empty storage."  # TorchRL's words
# Trajectory keys tried when a slice sampler names none, as TorchRL's SliceSampler tries them.
AUTO_TRAJ_KEYS = (("collector", "traj_ids"), "episode")
_SEED_RANGE = 2**31 - 1
_EPISODE_MASK = (1 << 63) - 1
_MAX_SLICE_DRAWS = 32  # rounds of drawing before a strict slice sample gives up
# TensorDict's constructor without its checks (a third of a sample's time in-process), where
# this tensordict has it; sampled columns are [n, *shape] on the storage's device already.
_new_unsafe = getattr(TensorDict, "_new_unsafe", None)


def _names(key: Any) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def _field_name(key: Any) -> str:
    parts = _names(key)
    for part in parts:
        if not part.isidentifier() or SEP in part:
            raise InvalidArgumentError(
                f"key {key!r}: millpond stores keys that are identifiers without {SEP!r}")
    return SEP.join(parts)


def _same(stashed: torch.Tensor, index: Any) -> bool:
    """Whether ``index`` is a copy of the index a sampler just returned."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    return (isinstance(index, torch.Tensor) and index.shape == stashed.shape
            and torch.equal(index.to(stashed.device), stashed))


def _replace_last(key: Any, name: str) -> Any:
    """``key`` with its last part ``name`` (a string stays a string), as TorchRL's."""
    return name if isinstance(key, str) else (*key[:-1], name)


def _reduce(values: torch.Tensor, n: int, reduction: str) -> torch.Tensor:
    """One value per record (TorchRL's reductions of a multi-element priority)."""
    flat = values.reshape(n, -1).double()
    if flat.shape[1] == 1:
        return flat[:, 0]
    if reduction == "max":
        return flat.max(dim=1).values
    if reduction == "min":
        return flat.min(dim=1).values
    if reduction == "mean":
        return flat.mean(dim=1)
    if reduction == "median":
        return flat.median(dim=1).values
    if reduction == "sum":
        return flat.sum(dim=1)
    raise NotImplementedError(f"Unknown reduction method {reduction}")


class MillpondStorage(StoreStorage):
    """A TorchRL storage whose records live in a millpond buffer; see the module docstring.

    (A ``StoreStorage``, TorchRL's storage over a key-value server, so that TorchRL
    takes its samples as they come, already batched; none of its Redis code runs.)

    ``max_size``: records kept (the oldest evicted first). ``address`` and
    ``name`` (or ``client`` and ``name``: a :func:`millpond.connect` client, for
    its settings) put the buffer on a daemon; ``token`` is ``connect``'s.
    ``buffer``: a millpond handle to use as it is. ``hot_capacity``: records kept
    in RAM, the rest in the buffer's file (``cold_path`` in-process; default a
    temporary file). ``fields``: the schema (flattened names), instead of the
    first write's. ``device``: where sampled tensors go.
    """

    def __init__(self, max_size: int | None = None, *, address: str | Sequence[str] | None = None,
                 name: str | None = None, client: Any = None, buffer: Any = None,
                 token: str | None = None, hot_capacity: int | None = None,
                 cold_path: str | None = None, fields: Mapping[str, Any] | None = None,
                 device: torch.device | str = "cpu"):
        remote = address is not None or client is not None
        if buffer is not None and (remote or name is not None):
            raise InvalidArgumentError("give buffer= or a server's address=/client= and name=")
        if remote and name is None:
            raise InvalidArgumentError("a server's buffer needs name= as well as address=")
        if name is not None and not remote:
            raise InvalidArgumentError("name= names a server's buffer: give address= as well")
        if buffer is None and max_size is None:
            raise InvalidArgumentError("max_size is required (or buffer=)")
        if max_size is None:
            max_size = buffer.total_capacity
        Storage.__init__(self, int(max_size))  # not StoreStorage's: no Redis
        self._device = torch.device(device)
        self.name, self.hot_capacity, self.cold_path = name, hot_capacity, cold_path
        self._fields = fields
        self._client = client
        self._own_client = False
        if address is not None and client is None:
            self._client, self._own_client = millpond.connect(address, token=token), True
        self.buffer: Any = None
        self._last_cursor = None
        self._init_local()
        if buffer is not None:
            self._adopt(buffer)
        elif self._client is not None:
            try:
                self._adopt(self._client.buffer(name))
            except BufferNotFoundError:
                pass  # created by the first write

    def _init_local(self) -> None:
        self._local = threading.local()  # this thread's sample in flight and write token
        self._lock = threading.Lock()
        self._next_cursor: int | None = None
        self._keys: dict[str, tuple[str, ...]] = {}
        self._stream = EpisodeStream()
        self._salt = random.getrandbits(62)
        self._bound: list[Any] = []
        self._checked = 0  # attached entities whose samplers were checked
        self._batch_dims = torch.Size([])  # a written record's own batch dims (trajectories)

    # ---- the millpond buffer --------------------------------------------------------------

    def _adopt(self, buffer: Any) -> None:
        self.buffer = buffer
        self.max_size = int(buffer.total_capacity)
        self._keys = {n: tuple(n.split(SEP)) for n in buffer.schema.names}

    @property
    def device(self) -> torch.device | None:
        """Where sampled tensors go; None for the CPU (TorchRL then moves nothing)."""
        return None if self._device.type == "cpu" else self._device

    @property
    def initialized(self) -> bool:  # (StoreStorage's attribute)
        return self.buffer is not None

    @initialized.setter
    def initialized(self, value: bool) -> None:
        pass

    def _samplers(self) -> list[Any]:
        """The millpond samplers that read this storage: bound ones, and attached buffers'."""
        found = list(self._bound)
        for entity in self._attached_entities:
            sampler = getattr(entity, "_sampler", None)
            if isinstance(sampler, _MillpondSampler) and sampler not in found:
                found.append(sampler)
        return found

    def _check_attached(self) -> None:
        """Refuse TorchRL samplers that would keep per-slot state on this client."""
        entities = self._attached_entities
        if self._checked == len(entities):
            return
        for entity in entities:
            sampler = getattr(entity, "_sampler", None)
            if isinstance(sampler, _MillpondSampler):
                continue
            if isinstance(sampler, (PrioritizedSampler, SliceSampler,
                                    SliceSamplerWithoutReplacement)):
                raise TypeError(
                    f"{type(sampler).__name__} keeps priorities or trajectory boundaries by ring "
                    "slot on this client, which do not follow millpond's buffer: use "
                    "MillpondPrioritizedSampler or MillpondSliceSampler")
        self._checked = len(entities)

    def _bind(self, sampler: Any) -> None:
        if sampler not in self._bound:
            self._bound.append(sampler)

    def _create(self, columns: Mapping[str, np.ndarray]) -> Any:
        fields = self._fields or {name: (col.dtype, col.shape[1:]) for name, col in columns.items()}
        prioritized: tuple[float, float] | None = None
        episodes = False
        for sampler in self._samplers():
            prioritized = sampler._prioritized() or prioritized
            episodes = episodes or sampler._episodic()
        options: dict[str, Any] = {"fields": fields, "episodes": episodes}
        if prioritized is not None:
            options.update(prioritized=True, alpha=prioritized[0], beta=prioritized[1])
        if self.hot_capacity is None:
            sizes: dict[str, Any] = {"capacity": self.max_size}
        else:
            sizes = {"hot_capacity": self.hot_capacity, "total_capacity": self.max_size}
        if self._client is not None:
            buffer = self._client.create_buffer(self.name, **sizes, **options)
        else:
            buffer = _in_process(sizes, self.cold_path, options)
        self._adopt(buffer)
        return buffer

    def _require(self) -> Any:
        if self.buffer is None:
            raise RuntimeError(EMPTY)
        return self.buffer

    def close(self) -> None:
        """Close the millpond handle: an in-process buffer, or a server buffer this storage
        created, is deleted; one it attached to stays. A client made from ``address`` is
        closed too (one given as ``client=`` is the caller's)."""
        if self.buffer is not None:
            self.buffer.close()
        if self._own_client:
            self._client.close()

    # ---- writes ---------------------------------------------------------------------------

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        if not set_cursor:
            raise NotImplementedError(
                "MillpondStorage appends: writes at chosen indices (storage[i] = x, write_at, "
                "consuming samplers) are not supported")
        self._check_attached()
        single = isinstance(cursor, (int, np.integer)) or (
            isinstance(cursor, torch.Tensor) and cursor.ndim == 0)
        slots = (np.array([int(cursor)]) if single else
                 np.asarray(cursor.cpu() if isinstance(cursor, torch.Tensor) else cursor).reshape(-1))
        td = self._as_tensordict(data, single)
        n = len(slots)
        if td.batch_size[:1] != torch.Size([n]):
            raise InvalidArgumentError(f"{n} slots for data of batch size {list(td.batch_size)}")
        with self._lock:
            self._check_cursor(slots)
            self._set_last_cursor(cursor)
            self._write(td, n, cursor)
        self._bump_mutation_revision()

    def _check_cursor(self, slots: np.ndarray) -> None:
        """Round-robin writes only: each continues the last, modulo ``max_size``."""
        size = self.max_size
        first = int(slots[0]) % size
        expected = self._next_cursor
        steps = np.diff(slots) % size
        if (expected is not None and first != expected) or (len(steps) and (steps != 1).any()):
            raise NotImplementedError(
                f"MillpondStorage appends, so it takes round-robin writes only (got slots from "
                f"{first}, the next is {expected}): use TorchRL's RoundRobinWriter or "
                "TensorDictRoundRobinWriter")
        self._next_cursor = (int(slots[-1]) + 1) % size

    def _as_tensordict(self, data: Any, single: bool) -> TensorDictBase:
        if isinstance(data, list):
            data = torch.stack(data) if data else data
        if isinstance(data, torch.Tensor) and not is_tensor_collection(data):
            data = TensorDict({TENSOR_FIELD: data}, batch_size=data.shape[:1] if not single else [])
        elif not isinstance(data, TensorDictBase):
            raise TypeError(f"MillpondStorage stores TensorDicts and tensors, not {type(data)}")
        return data.unsqueeze(0) if single else data

    def _priority_key(self) -> tuple[Any, Any] | None:
        """(priority key, prioritized sampler) of a buffer attached with one, if any."""
        for entity in self._attached_entities:
            sampler = getattr(entity, "_sampler", None)
            key = getattr(entity, "priority_key", None)
            if key is not None and isinstance(sampler, MillpondPrioritizedSampler):
                return key, sampler
        return None

    def _write(self, td: TensorDictBase, n: int, cursor: Any) -> None:
        priorities = None
        prioritized = self._priority_key()
        if prioritized is not None and td.get(prioritized[0], None) is not None:
            key, sampler = prioritized
            priorities = sampler._priorities(td.get(key), n)
            td = td.exclude(key)  # (not stored: later writes without it would not fit)
        columns = self._columns(td, n)
        episodic = (self.buffer.config.episodes if self.buffer is not None
                    else any(s._episodic() for s in self._samplers()))
        episodes = self._episodes(td, n) if episodic else {}  # (checked before creating)
        stream_ends = episodes.pop("stream", None)
        if self.buffer is None:
            self._batch_dims = td.batch_size[1:]
            self._create(columns)
        buffer = self.buffer
        if buffer.config.prioritized is None:
            priorities = None
        if episodic:
            n, columns = buffer.schema.coerce_batch(columns)
        buffer.backend.push_batch(columns, priorities, **episodes)
        if stream_ends is not None:
            self._stream.advance(episodes["episodes"], stream_ends)
        self._local.token = cursor if priorities is not None else None

    def _columns(self, td: TensorDictBase, n: int) -> dict[str, np.ndarray]:
        columns = {}
        for key, value in td.items(include_nested=True, leaves_only=True):
            if key == INDEX_KEY:
                continue
            if not isinstance(value, torch.Tensor) or value.dtype == torch.bfloat16 or (
                    value.is_complex()):
                raise InvalidArgumentError(
                    f"key {key!r}: millpond stores bool, int and float tensors only")
            name = self._keys_name(key)
            columns[name] = value.detach().cpu().reshape(n, *value.shape[1:]).numpy()
        return columns

    def _keys_name(self, key: Any) -> str:
        name = _field_name(key)
        if name not in self._keys:
            self._keys[name] = _names(key)
        return name

    def _episode_keys(self) -> tuple[list[Any], list[Any]]:
        """(trajectory keys to try in turn, end keys), from the slice sampler if any."""
        for sampler in self._samplers():
            if isinstance(sampler, MillpondSliceSampler):
                return sampler._traj_keys(), sampler.end_keys
        return list(AUTO_TRAJ_KEYS), [("next", "done")]

    def _episodes(self, td: TensorDictBase, n: int) -> dict[str, Any]:
        """Each record's millpond episode: from the trajectory key, else from end flags."""
        traj_keys, end_keys = self._episode_keys()
        ends = np.zeros(n, bool)
        found = False
        for key in end_keys:
            flag = td.get(key, None)
            if flag is not None:
                ends |= flag.detach().cpu().reshape(n, -1).numpy().any(axis=1)
                found = True
        traj = next((t for t in (td.get(k, None) for k in traj_keys) if t is not None), None)
        out: dict[str, Any] = {}
        if traj is not None:
            values = traj.detach().cpu().reshape(n, -1)[:, 0].numpy().astype(np.int64)
            ids = (values + self._salt) & _EPISODE_MASK
        elif found:
            ids = self._stream.ids(ends)
            out["stream"] = ends
        else:
            raise InvalidArgumentError(
                f"an episodic buffer needs each record's trajectory: write one of "
                f"{traj_keys + end_keys} (MillpondSliceSampler's traj_key / end_key)")
        out["episodes"] = ids
        ended = list(dict.fromkeys(int(e) for e in ids[ends]))
        if ended:
            out["updates"] = [(e, None, True) for e in ended]
        return out

    def _take_write_token(self, index: Any) -> bool:
        """Whether ``index`` is the cursor of this thread's last write, whose priorities went
        with the records (TorchRL updates them right after: nothing left to do)."""
        token = getattr(self._local, "token", None)
        self._local.token = None
        if token is None:
            return False
        if token is index:
            return True
        if isinstance(token, (int, np.integer)) and isinstance(index, (int, torch.Tensor)):
            return torch.as_tensor(index).numel() == 1 and int(index) == int(token)
        return False

    # ---- reads ----------------------------------------------------------------------------

    def _tensordict(self, columns: Mapping[str, torch.Tensor], n: int) -> Any:
        """Sampled columns as the TensorDict (or tensor) that was written."""
        if TENSOR_FIELD in columns and len(columns) == 1:
            return columns[TENSOR_FIELD]
        nested: dict[str, Any] = {}
        keys = self._keys
        for name, value in columns.items():
            parts = keys.get(name) or tuple(name.split(SEP))
            node = nested
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        batch = torch.Size([n, *self._batch_dims])
        if _new_unsafe is not None:  # the columns are checked: [n, *shape] on self._device
            return _new_unsafe(nested, batch_size=batch, device=self._device)
        return TensorDict(nested, batch_size=batch, device=self._device)

    def _stash(self, index: torch.Tensor, data: Any) -> None:
        """Hand ``data`` to the ``get(index)`` TorchRL makes next (same thread, same object)."""
        self._local.token = None
        self._local.stash = (index, data)

    def _tensors(self, columns: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """A sample's numpy columns as tensors on the storage's device (on the CPU sharing
        their memory, as the handle's ``device="cpu"`` does, without its checks)."""
        if self._device.type != "cpu":
            return to_device(columns, self._device)
        out = {}
        for name, array in columns.items():
            if not array.flags.writeable:
                array = array.copy()  # torch shares memory only with writable arrays
            out[name] = torch.from_numpy(array)
        return out

    def _draw(self, batch_size: int, seed: int | None) -> dict[str, torch.Tensor]:
        """``batch_size`` records drawn by millpond, with replacement (in parts when the
        buffer holds fewer: millpond draws at most ``len`` at once)."""
        buffer = self._require()
        try:
            return self._tensors(buffer.sample(batch_size, seed))
        except NotEnoughDataError:
            held = len(buffer)
            if held == 0:
                raise RuntimeError(EMPTY) from None
        parts = [buffer.sample(min(held, batch_size - start),
                               None if seed is None else (seed + i) % _SEED_RANGE)
                 for i, start in enumerate(range(0, batch_size, held))]
        return self._tensors({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})

    def get(self, index: Any) -> Any:
        stash = getattr(self._local, "stash", None)
        if stash is not None:
            self._local.stash = None
            if stash[0] is index or _same(stash[0], index):  # (a copy: moved to a device)
                return stash[1]
        self._check_attached()
        buffer = self._require()
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        single = isinstance(index, (int, np.integer)) or (
            isinstance(index, torch.Tensor) and index.ndim == 0)
        if isinstance(index, slice):
            if index == slice(None):
                columns = buffer.sample_all(device=self._device)
                return self._tensordict(columns, len(next(iter(columns.values()))))
            positions = np.arange(len(buffer))[index]
        else:
            if isinstance(index, torch.Tensor):
                index = index.cpu()
            positions = np.asarray(index, dtype=np.int64).reshape(-1)
            if (positions < 0).any():
                positions = np.where(positions < 0, positions + len(buffer), positions)
        data = self._tensordict(buffer.sample_by_index(positions, device=self._device),
                                len(positions))
        return data[0] if single else data

    def __len__(self) -> int:
        return 0 if self.buffer is None else len(self.buffer)

    def contains(self, item: Any) -> Any:
        held = len(self)
        if isinstance(item, (int, np.integer)):
            item = item + held if item < 0 else item
            return 0 <= item < held
        if isinstance(item, torch.Tensor):
            item = torch.where(item < 0, item + held, item)
            return (item >= 0) & (item < held)
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    def _empty(self) -> None:
        with self._lock:
            if self.buffer is not None:
                self.buffer.reset()
            self._next_cursor = None
            self._stream = EpisodeStream()
        self._bump_mutation_revision()

    # ---- checkpoints, pickling ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self._client is None:
            raise NotImplementedError(
                "an in-process MillpondStorage has no state dict: its records are in the "
                "millpond buffer (storage.buffer.export(path) writes them)")
        return {"address": self._client.address, "name": self.name, "max_size": self.max_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._client is None or state_dict.get("name") != self.name:
            if self._own_client:
                self._client.close()
            self._client, self._own_client = millpond.connect(state_dict["address"]), True
            self.name = state_dict["name"]
        self._adopt(self._client.buffer(self.name))
        self._next_cursor = None

    def dumps(self, path: Any) -> None:
        raise NotImplementedError(
            "MillpondStorage does not checkpoint through TorchRL: a daemon's buffers persist "
            "by themselves, and storage.buffer.export(path) writes the records")

    def loads(self, path: Any) -> None:
        raise NotImplementedError("MillpondStorage does not load TorchRL checkpoints")

    def __getstate__(self) -> dict[str, Any]:
        state = Storage.__getstate__(self)
        for key in ("_local", "_lock", "_stream", "_bound"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        keys, buffer = state.get("_keys", {}), state.get("buffer")
        dims = state.get("_batch_dims", torch.Size([]))
        Storage.__setstate__(self, state)
        self._init_local()
        self._keys, self._batch_dims = keys, dims
        if buffer is not None:
            self._adopt(buffer)

    def __repr__(self) -> str:
        where = ("in-process" if self._client is None
                 else f"{getattr(self._client, 'address', self._client)!r}, name={self.name!r}")
        held = "not created" if self.buffer is None else f"len={len(self)}"
        return f"{type(self).__name__}(max_size={self.max_size}, {where}, {held})"


def _in_process(sizes: dict[str, Any], cold_path: str | None, options: dict[str, Any]) -> Any:
    """An in-process millpond buffer of ``sizes`` and ``options`` (create_buffer's)."""
    prioritized = options.pop("prioritized", False)
    if prioritized:
        return millpond.PrioritizedReplayBuffer(**sizes, cold_path=cold_path, **options)
    options.pop("alpha", None), options.pop("beta", None)
    if "capacity" in sizes:
        return millpond.ReplayBuffer(sizes["capacity"], **options)
    return millpond.MmapReplayBuffer(sizes["hot_capacity"], sizes["total_capacity"],
                                     cold_path=cold_path, **options)


class _MillpondSampler:
    """What the samplers share: their storage, seeds, and what they need of the buffer."""

    _rng: torch.Generator | None = None
    _store: MillpondStorage | None = None

    def _storage_of(self, storage: Any) -> MillpondStorage:
        if not isinstance(storage, MillpondStorage):
            raise TypeError(f"{type(self).__name__} draws on a MillpondStorage, not on "
                            f"{type(storage).__name__}")
        if self._store is not storage:
            self._store = storage
            storage._bind(self)
        return storage

    def _seed(self) -> int | None:
        """A seed from the replay buffer's generator, if it has one (else fresh entropy)."""
        if self._rng is None:
            return None
        return int(torch.randint(0, _SEED_RANGE, (), generator=self._rng))

    def _prioritized(self) -> tuple[float, float] | None:
        return None

    def _episodic(self) -> bool:
        return False

    def _empty(self) -> None:
        pass  # the storage's reset empties the buffer

    def dumps(self, path: Any) -> None:
        pass  # nothing here: the draws' state is the buffer's

    def loads(self, path: Any) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_rng"] = None
        state.pop("_store", None)
        return state


class MillpondSampler(_MillpondSampler, Sampler):
    """Uniform sampling with replacement, drawn by millpond (one call per sample)."""

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        store = self._storage_of(storage)
        buffer = store._require()
        if buffer.config.prioritized is not None:
            raise InvalidArgumentError(
                "this millpond buffer is prioritized: sample it with MillpondPrioritizedSampler")
        data = store._tensordict(store._draw(batch_size, self._seed()), batch_size)
        index = torch.full((batch_size,), -1, dtype=torch.long, device=store._device)
        store._stash(index, data)
        return index, {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MillpondPrioritizedSampler(_MillpondSampler, PrioritizedSampler):
    """Proportional prioritized sampling by millpond; see the module docstring.

    ``alpha`` (fixed when the buffer is created), ``beta`` (settable), ``eps``
    (added to every priority sent) and ``reduction`` (of a multi-element
    priority, as TorchRL's) mean what they mean for TorchRL's
    ``PrioritizedSampler``; ``max_capacity`` is accepted and unused (the
    storage's ``max_size`` is the capacity).
    """

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-8,
                 reduction: str = "max", max_capacity: int | None = None):
        if alpha < 0:
            raise ValueError(f"alpha must be greater or equal than 0, got alpha={alpha}")
        if beta < 0:
            raise ValueError(f"beta must be greater or equal to 0, got beta={beta}")
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self.reduction = reduction
        self._max_capacity = max_capacity

    def _prioritized(self) -> tuple[float, float] | None:
        return self._alpha, self._beta

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        if value != self._alpha and self._store is not None and self._store.buffer is not None:
            raise NotImplementedError("alpha is fixed once the millpond buffer exists")
        self._alpha = float(value)

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)
        if self._store is not None and self._store.buffer is not None:
            self._store.buffer.set_beta(self._beta)

    @property
    def max_size(self) -> int | None:
        return None if self._store is None else self._store.max_size

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self._store is None else self._store._device

    @property
    def default_priority(self) -> float:
        """NaN: "the buffer's default" (the largest priority seen), which the records got
        when written; an update to NaN leaves a record's priority as it is."""
        return math.nan

    def _priorities(self, values: torch.Tensor, n: int) -> np.ndarray:
        return (_reduce(values.detach().cpu(), n, self.reduction) + self._eps).numpy()

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        store = self._storage_of(storage)
        buffer = store._require()
        if buffer.config.prioritized is None:
            raise InvalidArgumentError(
                "this millpond buffer is uniform: it was created without a prioritized sampler")
        columns = store._draw(batch_size, self._seed())
        weights, index = columns.pop("weights"), columns.pop("indices")
        data = store._tensordict(columns, batch_size)
        store._stash(index, data)
        return index, {"priority_weight": weights}

    def add(self, index: Any) -> None:
        pass  # new records get the buffer's largest priority when written

    def extend(self, index: Any) -> None:
        pass

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        pass

    @torch.no_grad()
    def update_priority(self, index: Any, priority: Any, *,
                        storage: Storage | None = None) -> None:
        """New priorities for the records ``index`` (a sample's ``"index"``); records evicted
        since, indices ``-1`` and NaN priorities are left out."""
        store = self._storage_of(storage) if storage is not None else self._store
        if store is None:
            raise RuntimeError("this sampler has no storage yet: sample first, or pass storage=")
        if store._take_write_token(index):
            return  # the write that just happened sent these priorities with its records
        if isinstance(index, tuple):
            index = index[0]
        seqs = torch.as_tensor(index).reshape(-1).cpu().long()
        values = torch.as_tensor(priority, dtype=torch.float64).cpu()
        values = values.expand(seqs.shape) if values.numel() == 1 else values.reshape(-1)
        if values.shape != seqs.shape:
            raise ValueError(f"{values.numel()} priorities for {seqs.numel()} indices")
        keep = (seqs >= 0) & ~torch.isnan(values)
        if not bool(keep.any()):
            return
        store._require().update_priorities(seqs[keep].numpy(),
                                           (values[keep] + self._eps).numpy())

    def _empty(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self._alpha, "beta": self._beta}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "beta" in state_dict:
            self.beta = state_dict["beta"]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, "
                f"eps={self._eps}, reduction={self.reduction})")


class MillpondSliceSampler(_MillpondSampler, Sampler):
    """Slices of consecutive steps of one trajectory each, drawn by millpond's
    ``sample_sequences``; TorchRL's ``SliceSampler`` arguments, see the module docstring."""

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None,
                 end_key: Any = None, end_keys: Sequence[Any] | None = None,
                 traj_key: Any = None, truncated_key: Any = ("next", "truncated"),
                 init_key: Any = "is_init", strict_length: bool = True):
        if (num_slices is None) == (slice_len is None):
            raise TypeError("Either num_slices or slice_len must be not None, and not both")
        if end_key is not None and end_keys is not None:
            raise ValueError("end_key and end_keys are exclusive")
        self.num_slices, self.slice_len = num_slices, slice_len
        self.end_keys = list(end_keys) if end_keys is not None else [end_key or ("next", "done")]
        self.traj_key = traj_key  # None: AUTO_TRAJ_KEYS
        self.truncated_key, self.init_key = truncated_key, init_key
        self.strict_length = strict_length
        self._accepted = 1.0  # full windows per window drawn, lately

    def _episodic(self) -> bool:
        return True

    def _traj_keys(self) -> list[Any]:
        return list(AUTO_TRAJ_KEYS) if self.traj_key is None else [self.traj_key]

    def _shape(self, batch_size: int) -> tuple[int, int]:
        """(slice length, slices) for ``batch_size`` records, as TorchRL's."""
        if self.num_slices is not None:
            if batch_size % self.num_slices:
                raise RuntimeError(
                    f"The batch-size must be divisible by the number of slices, got "
                    f"batch_size={batch_size} and num_slices={self.num_slices}.")
            return batch_size // self.num_slices, self.num_slices
        assert self.slice_len is not None
        if batch_size % self.slice_len:
            raise RuntimeError(
                f"The batch-size must be divisible by the slice length, got "
                f"batch_size={batch_size} and slice_len={self.slice_len}.")
        return self.slice_len, batch_size // self.slice_len

    def _windows(self, buffer: Any, length: int, count: int) -> dict[str, np.ndarray]:
        """``count`` windows of ``length`` steps as numpy columns: full ones, and with
        ``strict_length=False`` also whole trajectories shorter than ``length`` (as
        TorchRL's). millpond draws starts among all records: windows that start too
        late in their trajectory are drawn again."""
        if not buffer.config.episodes:
            raise InvalidArgumentError(
                "this millpond buffer is not episodic: it was created without a slice sampler")
        if buffer.config.prioritized is not None:
            raise InvalidArgumentError("prioritized slices are not supported")
        seed = self._seed()
        # How many to ask for: from the share kept lately (only unseeded: a seeded sample
        # depends on its seed and the contents alone), then from this sample's own draws.
        rate = self._accepted if seed is None else 1.0
        kept: list[dict[str, np.ndarray]] = []
        have = 0
        for attempt in range(_MAX_SLICE_DRAWS):
            ask = min(math.ceil((count - have) / rate * 1.2) + 1, 16 * count + 16)
            draw = buffer.sample_sequences(
                ask, length, None if seed is None else (seed + attempt) % _SEED_RANGE)
            good = draw["lens"] == length
            if not self.strict_length:
                good |= draw["start_steps"] == 0
            rate = max(0.01, 0.5 * rate + 0.5 * float(good.mean()))
            if good.any():
                kept.append({k: v[good] for k, v in draw.items()})
                have += int(good.sum())
            if have >= count:
                break
        else:
            raise RuntimeError(
                f"Did not find enough trajectories of sufficient length (required={length}) "
                f"in {_MAX_SLICE_DRAWS} draws; consider strict_length=False")
        if seed is None:
            self._accepted = rate
        return {k: np.concatenate([p[k] for p in kept])[:count] for k in kept[0]}

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        store = self._storage_of(storage)
        buffer = store._require()
        length, count = self._shape(batch_size)
        try:
            draw = self._windows(buffer, length, count)
        except NotEnoughDataError:
            raise RuntimeError(EMPTY) from None
        mask = draw.pop("mask")
        lens = draw.pop("lens")
        for extra in ("episode_ids", "start_steps", "weights", "indices"):
            draw.pop(extra, None)
        flat = mask.reshape(-1)
        n = int(flat.sum())
        columns = {name: torch.from_numpy(np.ascontiguousarray(
            col.reshape(-1, *col.shape[2:])[flat])).to(store._device) for name, col in draw.items()}
        data = store._tensordict(columns, n)
        ends = np.cumsum(lens) - 1  # each slice's last step in the flat batch
        info = self._markers(data, ends, n)
        index = torch.full((n,), -1, dtype=torch.long, device=store._device)
        store._stash(index, data)
        return index, info

    def _markers(self, data: Any, ends: np.ndarray, n: int) -> dict[Any, torch.Tensor]:
        """TorchRL's slice markers: truncated (and done) at each slice's last step,
        ``init_key`` at each first step (when stored)."""
        info: dict[Any, torch.Tensor] = {}
        if not isinstance(data, TensorDictBase):
            return info
        device = data.device
        if self.truncated_key is not None:
            done_key = _replace_last(self.truncated_key, "done")
            terminated_key = _replace_last(self.truncated_key, "terminated")
            done = data.get(done_key, None)
            shape = done.shape if done is not None else (n, 1)
            truncated = torch.zeros(shape, dtype=torch.bool, device=device)
            truncated.reshape(n, -1)[torch.from_numpy(ends)] = True
            terminated = data.get(terminated_key, None)
            info[self.truncated_key] = truncated
            info[done_key] = truncated.clone() if done is None else done.bool() | truncated
            info[terminated_key] = (torch.zeros_like(truncated) if terminated is None
                                    else terminated)
        if self.init_key is not None:
            stored = data.get(self.init_key, None)
            if stored is not None:
                marker = torch.zeros_like(stored, dtype=torch.bool)
                starts = np.r_[0, ends[:-1] + 1]
                marker.reshape(n, -1)[torch.from_numpy(starts)] = True
                info[self.init_key] = marker | stored.bool()
        return info

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_slices={self.num_slices}, slice_len="
                f"{self.slice_len}, traj_key={self.traj_key!r}, end_keys={self.end_keys!r}, "
                f"strict_length={self.strict_length})")

