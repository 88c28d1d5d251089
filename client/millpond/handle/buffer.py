"""The buffer handle users hold: the reference API, whatever backs it.

A :class:`Buffer` binds the reference's call signatures (positional
transition arguments, ``action``/``reward`` aliases) to field names and
delegates to its backend: the engine's :class:`~millpond.core.TieredBuffer`
in-process, a :class:`~millpond.remote.buffer.RemoteBuffer` on a server, or a
:class:`~millpond.sharded.buffer.ShardedBuffer` over several. All have the same
methods, results and exceptions.

Episodes: every handle has the episodic calls, and a buffer created without
``episodes=True`` answers them with InvalidArgumentError. The backend does the
work; the handle keeps, per thread, the
:class:`~millpond.handle.episode_writer.EpisodeStream` that says which episode the
thread's next record belongs to.

Learner-side reads (objectrl's access patterns) are the same on every backend.
Positions index the buffer's *contents*: the records ``len(buf)`` counts,
oldest first (0 = the oldest, ``len - 1`` the newest). The backend resolves
positions to records under the buffer's lock, in the call that reads them, so
a read never mixes two states of a buffer that pushes are changing.
``device=`` (a torch device) returns ``torch.Tensor`` s instead of numpy arrays
(:mod:`millpond.handle.devices`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from millpond.core.checks import (
    check_batch_size,
    check_count,
    check_indices,
    check_priorities,
    check_seed,
    check_timeout,
)
from millpond.core.config import BufferConfig, ConfigAccessors, check_exponent
from millpond.core.episode_checks import (
    MAX_WINDOW,
    check_fields,
    check_filter,
    check_n_step,
    require_episodes,
)
from millpond.core.episodes import check_meta, record_ends
from millpond.core.info import BufferInfo
from millpond.core.schema import Schema
from millpond.core.snapshot import CheckpointResult
from millpond.errors import FieldMismatchError, InvalidArgumentError, ReadOnlyBufferError
from millpond.handle.backend import Backend
from millpond.handle.dataloader import EpisodeLoader
from millpond.handle.devices import check_device, to_device
from millpond.handle.episode_writer import EpisodeStream, EpisodeWriter, record_ends_of
from millpond.handle.export import export
from millpond.handle.sampler import Sampler

# The reference's positional order for push and push_batch of transitions,
# and the argument names it uses for each field.
PUSH_ORDER = ("obs", "actions", "rewards", "terminated", "truncated", "next_obs")
PUSH_BATCH_ORDER = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")
_ALIASES = {
    "action": "actions",
    "reward": "rewards",
    "obs_batch": "obs",
    "next_obs_batch": "next_obs",
    "actions_batch": "actions",
}


class Buffer(ConfigAccessors):
    """A replay buffer handle; see :class:`millpond.ReplayBuffer` for the methods.

    What backs it, read-only: :attr:`backend` (the object calls go to), :attr:`client`
    (the server connection, None in-process) and :attr:`transport` (how the data moves).
    """

    def __init__(self, backend: Backend):
        self._backend = backend
        self.config: BufferConfig = backend.config  # fixed at creation

    @property
    def backend(self) -> Backend:
        """The object this handle delegates to: in-process the engine's
        :class:`~millpond.core.TieredBuffer` (a read-only dataset for an in-process
        :class:`~millpond.OfflineDatasetBuffer`); on a server a
        :class:`~millpond.remote.buffer.RemoteBuffer`; across shards a
        :class:`~millpond.sharded.buffer.ShardedBuffer`. Same methods, results and errors."""
        return self._backend

    @property
    def client(self) -> Any:
        """The client this handle reaches its server through (a :class:`millpond.Client`,
        or for shards a :class:`millpond.sharded.client.ShardedClient`); None in-process."""
        return getattr(self._backend, "client", None)  # remote and sharded backends have one

    @property
    def transport(self) -> str:
        """How this handle's data moves: "in-process"; for a server "shm" while the
        same-host shared-memory fast path is in use, else "grpc" (the client's
        ``transport``); across shards that of every shard, or "mixed"."""
        client = self.client
        return "in-process" if client is None else client.transport

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_episode_local", None)  # per-thread episodes stay with this process
        return state

    def __len__(self) -> int:
        return len(self._backend)

    def is_empty(self) -> bool:
        return len(self) == 0

    def push(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Append one record.

        Transition buffers: ``push(obs, action, reward, terminated, truncated,
        next_obs)``; schema buffers: ``push(**{field: value})``. ``timeout``:
        see :meth:`push_batch`. On an episodic buffer the record continues
        this thread's current episode, and ends it if its ``terminated`` or
        ``truncated`` is true.
        """
        self._check_writable("push")
        self._push_one(self._bind(PUSH_ORDER, args, kwargs), None, timeout)

    def push_batch(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> None:
        """Append many records at once, validated as a whole before storing.

        Transition buffers: ``push_batch(obs, next_obs, actions, rewards,
        terminated, truncated)`` with ``[n, dim]`` or flat ``[n*dim]`` arrays;
        ``terminated``/``truncated`` may be bool or float (non-zero is true).
        Schema buffers: ``push_batch(**{field: array[n, *shape]})``.
        With a rate limiter the push waits up to ``timeout`` seconds while it
        would break it (in-process None waits without limit; remote None is the
        client's call timeout), then raises RateLimitTimeoutError. On an
        episodic buffer the records continue this thread's episodes, like
        pushes one by one.
        """
        self._check_writable("push_batch")
        self._push_many(self._bind(PUSH_BATCH_ORDER, args, kwargs), None, timeout)

    def sample(self, batch_size: int, seed: int | None = None, *, timeout: float | None = None,
               n_step: int | None = None, gamma: float = 0.99,
               filter_meta: Mapping[str, Any] | None = None,
               device: Any = None) -> dict[str, Any]:
        """Draw ``batch_size`` records from hot + cold storage.

        Returns ``{field: array[batch_size, *shape]}`` (for transitions: ``obs``,
        ``next_obs``, ``actions``, ``rewards``, ``terminated``, ``truncated``).
        Uniform and deterministic for the same contents and ``seed`` in
        replay mode; the oldest (queue) or newest (stack) records, removed,
        otherwise. With a rate limiter it waits up to ``timeout`` seconds
        (see :meth:`push_batch`), then raises RateLimitTimeoutError.

        Episodic buffers: ``filter_meta={name: value}`` draws only records of
        episodes with those meta values. ``n_step=N`` (transition schema)
        returns n-step transitions: ``obs``/``actions`` of step t,
        ``rewards`` = sum of ``gamma**k * r[t+k]`` for k < ``n_step_lens`` =
        min(N, steps stored from t on), and ``next_obs``/``terminated``/
        ``truncated`` of step t + n_step_lens - 1.

        ``device`` (a torch device, e.g. ``"cpu"``, ``"cuda"``): torch tensors on
        it instead of numpy arrays (see :mod:`millpond.handle.devices`).
        """
        if device is not None:  # checked before the draw (a queue's sample removes)
            check_device(device)
            return to_device(self.sample(batch_size, seed, timeout=timeout, n_step=n_step,
                                         gamma=gamma, filter_meta=filter_meta), device)
        call = sample_arguments(self.config, batch_size, seed, timeout, n_step, gamma,
                                filter_meta)
        if call.n_step is not None:
            return self._backend.sample_n_step(call.batch_size, call.n_step, call.gamma,
                                               call.seed, filter_meta=call.filter_meta,
                                               timeout=call.timeout)
        if call.filter_meta:
            return self._backend.sample(call.batch_size, call.seed, timeout=call.timeout,
                                        filter_meta=call.filter_meta)
        return self._backend.sample(call.batch_size, call.seed, timeout=call.timeout)

    def flush(self) -> None:
        """Return once every record pushed before this call is stored.

        For remote buffers with client-side batching, ``push`` only queues
        records: they are acknowledged when ``flush()`` (or ``close()``)
        returns, and a failed send raises here. The in-process buffer stores
        on push, so this does nothing there.
        """
        self._backend.flush()

    def sampler(
        self,
        batch_size: int,
        prefetch: int = 2,
        seed: int | None = None,
        max_batches: int | None = None,
        device: Any = None,
        *,
        n_step: int | None = None,
        gamma: float = 0.99,
        filter_meta: Mapping[str, Any] | None = None,
    ) -> Sampler:
        """An iterator of ``sample(batch_size)`` batches with ``prefetch`` requests in flight.

        With ``seed``, batch ``i`` equals ``sample(batch_size, seed + i)``.
        Endless unless ``max_batches`` is given; close it (or use ``with``)
        when done. See :class:`millpond.handle.sampler.Sampler`. ``device``,
        ``n_step``, ``gamma``, ``filter_meta``: as for :meth:`sample` (the
        prefetching threads make the tensors).
        """
        options = sampler_options(device, n_step, gamma, filter_meta)
        sample = functools.partial(self.sample, **options) if options else self.sample
        return Sampler(sample, batch_size, prefetch=prefetch, seed=seed, max_batches=max_batches)

    def info(self) -> BufferInfo:
        """Sizes, capacities and counters: a read-only mapping (see :class:`millpond.BufferInfo`)."""
        return self._backend.info()

    def close(self) -> None:
        """Stop using this handle; later calls raise BufferClosedError. Idempotent.

        In-process, and on a server when this handle created the buffer, the
        buffer and its file are deleted (as the reference does). A handle
        that attached to an existing server buffer (``client.buffer(name)``,
        or a create that found it) leaves it to the others sharing it.
        """
        self._backend.close()

    def delete(self) -> None:
        """Delete the buffer and its file, whoever created it. Idempotent."""
        self._backend.delete()

    def release(self) -> None:
        """Stop using this handle but keep the data (a persistent file, or the server's buffer)."""
        self._backend.release()

    @property
    def closed(self) -> bool:
        return self._backend.closed

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(len={len(self)}, hot_capacity={self.hot_capacity}, "
            f"total_capacity={self.total_capacity}, schema={self.schema!r}, "
            f"backend={type(self._backend).__name__})"
        )

    def _check_writable(self, what: str) -> None:
        """ReadOnlyBufferError for any write to a read-only dataset, before the write's
        arguments are bound or checked: a push of ordinary transitions to a dataset
        lacks its ``returns_to_go``, but that is not what is wrong."""
        if getattr(self._backend, "read_only", False):
            raise ReadOnlyBufferError(f"{what}: this buffer is a read-only offline dataset; "
                                      "nothing was written")

    def _bind(self, order: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
        """Map the reference's positional/keyword arguments to field names (:func:`bind`)."""
        return bind(self.schema, order, args, kwargs)

    # ---- episodes ----------------------------------------------------------------------------


    def _stream(self) -> EpisodeStream:
        """This thread's stream of episodes on this handle."""
        local = self.__dict__.get("_episode_local")
        if local is None:
            local = self.__dict__.setdefault("_episode_local", threading.local())
        stream = getattr(local, "stream", None)
        if stream is None:
            stream = local.stream = EpisodeStream()
        return stream

    def _push_one(self, record: Mapping[str, Any], priority: float | None,
                  timeout: float | None) -> None:
        """Push one bound record, in this thread's current episode if episodic."""
        if not self.config.episodes:
            self._backend.push(record, priority, timeout=timeout)
            return
        stream = self._stream()
        updates = stream.meta_update()
        self._backend.push(record, priority, episode=stream.current, updates=updates,
                           timeout=timeout)
        stream.take(record_ends_of(record))

    def _push_many(self, columns: Mapping[str, Any], priorities: Any,
                   timeout: float | None) -> None:
        """Push bound columns, continuing this thread's episodes if episodic."""
        if not self.config.episodes:
            self._backend.push_batch(columns, priorities, timeout=timeout)
            return
        n, batch = self.config.schema.coerce_batch(columns)
        stream = self._stream()
        ends = record_ends(self.config.schema, batch, n)
        ids, updates = stream.ids(ends), stream.meta_update() if n else None
        self._backend.push_batch(batch, priorities, episodes=ids, updates=updates,
                                 timeout=timeout)
        stream.advance(ids, ends)

    def store(self, **step: Any) -> None:
        """Append one step (``store(**{field: value})``) to this thread's current episode."""
        self._check_writable("store")
        self._push_one(self._bind((), (), step), None, None)

    def end_episode(self, **meta: Any) -> None:
        """End this thread's current episode, giving it ``meta`` (meta fields).

        Records pushed before are flushed first. Right after a record's
        ``terminated``/``truncated`` ended the episode, this gives that
        episode its meta. With nothing written since, it does nothing.
        """
        self._check_writable("end_episode")
        checked = check_meta(self.config.meta_fields, meta)
        self._require_episodes()
        self.flush()
        stream = self._stream()
        running = stream.steps > 0
        target = stream.end()
        if target is not None and (running or checked):  # (a flag ended it already)
            self._backend.update_episodes([(target, checked, True)])

    @contextlib.contextmanager
    def one_episode(self, **meta: Any) -> Iterator[dict[str, Any]]:
        """``with buf.one_episode(**meta): buf.store(**step)``: one episode, ended on leaving.

        ``meta`` reaches every record of the episode (sampled with filters
        while it runs). The block gets a dict: meta put in it is given at the
        end. An exception leaves the episode unended (never complete) and the
        next record starts another.
        """
        self._check_writable("one_episode")
        checked = check_meta(self.config.meta_fields, meta)
        self._require_episodes()
        stream = self._stream()
        if stream.steps:  # an episode under way is ended first: this one starts fresh
            self.end_episode()
        stream.meta = checked or None  # sent with the episode's first record, atomically
        final: dict[str, Any] = {}
        try:
            yield final
        except BaseException:
            self._stream().end()
            raise
        self.end_episode(**final)

    def episode_writer(self, n_envs: int, max_records: int | None = None) -> EpisodeWriter:
        """A writer for ``n_envs`` vectorized environments (see :class:`EpisodeWriter`)."""
        self._check_writable("episode_writer")
        return EpisodeWriter(self, n_envs, max_records)

    def _require_episodes(self) -> None:
        require_episodes(self.config)

    def sample_sequences(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                         filter_meta: Mapping[str, Any] | None = None,
                         timeout: float | None = None, device: Any = None) -> dict[str, Any]:
        """``batch_size`` windows of ``seq_len`` steps, each within one episode.

        Fields ``[batch_size, seq_len, ...]`` (zero past the window's end),
        ``mask``, ``lens``, ``episode_ids``, ``start_steps`` and meta fields.
        Starts are drawn like :meth:`sample`'s records (by priority on a
        prioritized buffer, adding ``weights`` and ``indices``). ``device``: torch
        tensors on it (see :mod:`millpond.handle.devices`).
        """
        check_device(device)
        call = sequence_arguments(self.config, batch_size, seq_len, seed, filter_meta, timeout)
        return to_device(self._backend.sample_sequences(
            call.batch_size, call.seq_len, call.seed, filter_meta=call.filter_meta,
            timeout=call.timeout), device)

    def sample_trajectories(self, batch_size: int, seq_len: int, seed: int | None = None, *,
                            filter_meta: Mapping[str, Any] | None = None,
                            timeout: float | None = None) -> dict[str, np.ndarray]:
        """:meth:`sample_sequences` under rlox's name."""
        return self.sample_sequences(batch_size, seq_len, seed, filter_meta=filter_meta,
                                     timeout=timeout)

    def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                        max_len: int | None = None, filter_meta: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> dict[str, np.ndarray]:
        """``batch_size`` complete live episodes, padded (``mask``, ``lens``, meta fields)."""
        call = episode_arguments(self.config, batch_size, seed, max_len, filter_meta, timeout)
        return self._backend.sample_episodes(call.batch_size, call.seed, max_len=call.max_len,
                                             filter_meta=call.filter_meta, timeout=call.timeout)

    def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None
                        ) -> dict[str, np.ndarray]:
        """The complete live episodes in episode order: ``episode_ids``, ``lens``, meta
        fields and ``seqs`` (their records, for :meth:`read`)."""
        self._require_episodes()
        return self._backend.episode_catalog(check_filter(self.config, filter_meta))

    def read(self, seqs: Any, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Records by index (``seqs``), and ``live``: which were still there."""
        return self._backend.read(check_indices(seqs, "seqs"), check_fields(self.config, fields))

    def dataloader(self, batch_size: int, n_steps: int | None = None,
                   fields: Sequence[str] | None = None,
                   current_fields: Sequence[str] | None = None,
                   next_fields: Sequence[str] | None = None,
                   sequence_fields: Sequence[str] | None = None,
                   filter_meta: Mapping[str, Any] | None = None,
                   fieldname_map: Mapping[str, str] | None = None, return_mask: bool = False,
                   timestep_level: bool = False, to_named_tuple: Sequence[str] | None = None,
                   shuffle: bool = False, drop_last: bool = False, seed: int | None = None,
                   device: Any = None) -> EpisodeLoader:
        """An iterable over the complete episodes at trajectory, timestep or n-step level,
        with memmap-replay-buffer's arguments and output names (see
        :mod:`millpond.handle.dataloader`)."""
        self._require_episodes()
        return EpisodeLoader(self, batch_size, n_steps, fields, current_fields, next_fields,
                             sequence_fields, filter_meta, fieldname_map, return_mask,
                             timestep_level, to_named_tuple, shuffle, drop_last, seed, device)

    # ---- learner-side reads (objectrl's access patterns) -------------------------------------


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
        batch = self._backend.read(check_indices(indices, "positions"),
                                   check_fields(self.config, fields), positions=True)
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
        return to_device(self._backend.contents(check_fields(self.config, fields)), device)

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
        plan = EpochPlan(self.config, batch_size, n_epochs, shuffle, seed, drop_last, fields,
                         device)

        def batches() -> Iterator[dict[str, Any]]:
            for _ in range(plan.n_epochs):
                for positions in plan.epoch(len(self)):
                    yield self.sample_by_index(positions, plan.names, device=device)

        return batches()

    def calculate_num_batches(self, batch_size: int) -> int:
        """Batches of ``batch_size`` per epoch: ``ceil(len / batch_size)``, as objectrl
        counts them (with ``drop_last`` an epoch yields ``len // batch_size``)."""
        return num_batches(len(self), batch_size)

    def reset(self) -> None:
        """Drop every record; keep the buffer, its config (and file, if persistent).

        Priorities (``max_priority`` back to 1), use counts, the episode
        index and the rate limiter's balance start again as for a new
        buffer; ``beta`` and the ``inserts``/``samples``/``pushed`` totals
        do not. A persistent buffer reset then reopened (even after a crash)
        is empty. Remote: pushes queued on this handle are stored first,
        then dropped with the rest; needs the ``learner`` or ``admin`` role.
        """
        self._check_writable("reset")
        self._backend.reset()

    def checkpoint(self, path: str | os.PathLike, *,
                   progress: Callable[[int, int], None] | None = None) -> CheckpointResult:
        """Write a consistent copy of the buffer, while others keep pushing, as a buffer
        file (``.buffer`` appended to ``path`` if missing; an existing file is never
        replaced): what a daemon serves from its data directory (``millpond restore``),
        and what :meth:`millpond.MmapReplayBuffer.open` reopens.

        The copy holds the records pushed before the call (this handle's own pushes are
        flushed first) that are still held when copied, each checked; it is copied a few
        MiB at a time, so pushes wait for one step at most (see
        :mod:`millpond.core.snapshot` for the exact guarantee). ``progress(copied,
        total)`` hears how far it is. In-process the file is written at ``path``
        directly. On a server the daemon writes it under its ``--backup-dir`` (``path``
        relative to it, or absolute inside it; admin role). A sharded buffer writes one
        file per shard, each under its own daemon's ``--backup-dir``:
        ``PATH-shard0.buffer``, ``PATH-shard1.buffer``, ... (the result's ``shards``)."""
        return self._backend.checkpoint(path, progress=progress)

    def export(self, path: str | os.PathLike) -> str:
        """Write the records, oldest first, to the ``.npz`` at ``path`` (one array per
        field, ``episode_ids`` if episodic); return its path. See
        :func:`millpond.handle.export.export`."""
        return export(self, path)


class PrioritizedBuffer(Buffer):
    """A prioritized buffer handle: ``push(..., priority=)``, ``update_priorities``, ``set_beta``."""

    def push(self, *args: Any, priority: float | None = None, timeout: float | None = None,
             **kwargs: Any) -> None:
        """``push(obs, action, reward, terminated, truncated, next_obs, priority=None)``."""
        self._check_writable("push")
        self._push_one(self._bind(PUSH_ORDER, args, kwargs), priority, timeout)

    def push_batch(self, *args: Any, priorities: Any = None, timeout: float | None = None,
                   **kwargs: Any) -> None:
        """Like :meth:`Buffer.push_batch`, with one priority per record (optional)."""
        self._check_writable("push_batch")
        self._push_many(self._bind(PUSH_BATCH_ORDER, args, kwargs), priorities, timeout)

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """New priorities for sampled ``indices``; returns how many were still live."""
        self._check_writable("update_priorities")
        return self._backend.update_priorities(*priority_arguments(indices, priorities))

    def set_beta(self, beta: float) -> None:
        """Set the importance-sampling exponent (anneal it towards 1)."""
        self._backend.set_beta(check_exponent("beta", beta))


def handle_for(backend: Backend) -> Buffer:
    """The handle class for ``backend``'s config: prioritized or not."""
    if backend.config.prioritized is not None:
        return PrioritizedBuffer(backend)
    return Buffer(backend)


# One epoch_iterator covers at most this many epochs (a bound on one call, not a use).
MAX_EPOCHS = 1 << 30


# ---- arguments, checked once: by this handle, and by millpond.aio's -------------------------


def bind(schema: Schema, order: tuple[str, ...], args: tuple, kwargs: Mapping[str, Any]
         ) -> dict[str, Any]:
    """Map the reference's positional/keyword arguments (``order``: :data:`PUSH_ORDER` or
    :data:`PUSH_BATCH_ORDER`; aliases such as ``action``) to ``schema``'s field names."""
    transition = schema.is_transition
    if not transition:
        order = schema.names
    if len(args) > len(order):
        raise FieldMismatchError(f"expected at most {len(order)} positional arguments")
    bound = dict(zip(order, args))
    for key, value in kwargs.items():
        name = _ALIASES.get(key, key) if transition else key
        if name in bound:
            raise FieldMismatchError(f"field {name!r} given twice")
        bound[name] = value
    return bound


class SampleArguments(NamedTuple):
    """A sample's arguments, checked (:func:`sample_arguments`)."""

    batch_size: int
    seed: int | None
    timeout: float | None
    filter_meta: dict[str, np.ndarray] | None
    n_step: int | None  # None: records, not n-step transitions
    gamma: float


def sample_arguments(config: BufferConfig, batch_size: Any, seed: Any, timeout: Any,
                     n_step: Any, gamma: Any, filter_meta: Mapping[str, Any] | None
                     ) -> SampleArguments:
    """The arguments of :meth:`Buffer.sample` (``device`` aside), checked."""
    batch_size, seed = check_batch_size(batch_size), check_seed(seed)
    timeout, wanted = check_timeout(timeout), check_filter(config, filter_meta)
    if n_step is not None:
        n_step, gamma = check_n_step(config, n_step, gamma)
    return SampleArguments(batch_size, seed, timeout, wanted, n_step, gamma)


def sampler_options(device: Any, n_step: int | None, gamma: float,
                    filter_meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments a sampler passes to each ``sample`` call: those given
    (``gamma`` with ``n_step`` only); ``device`` checked now, not in the first call."""
    check_device(device)
    given = {"device": device, "n_step": n_step, "filter_meta": filter_meta}
    options: dict[str, Any] = {key: value for key, value in given.items() if value is not None}
    if n_step is not None:
        options["gamma"] = gamma
    return options


class SequenceArguments(NamedTuple):
    batch_size: int
    seq_len: int
    seed: int | None
    filter_meta: dict[str, np.ndarray] | None
    timeout: float | None


def sequence_arguments(config: BufferConfig, batch_size: Any, seq_len: Any, seed: Any,
                       filter_meta: Mapping[str, Any] | None, timeout: Any
                       ) -> SequenceArguments:
    """The arguments of :meth:`Buffer.sample_sequences` (``device`` aside), checked."""
    require_episodes(config)
    batch_size, seed = check_batch_size(batch_size), check_seed(seed)
    seq_len = check_count("seq_len", seq_len, MAX_WINDOW)
    return SequenceArguments(batch_size, seq_len, seed, check_filter(config, filter_meta),
                             check_timeout(timeout))


class EpisodeArguments(NamedTuple):
    batch_size: int
    seed: int | None
    max_len: int | None
    filter_meta: dict[str, np.ndarray] | None
    timeout: float | None


def episode_arguments(config: BufferConfig, batch_size: Any, seed: Any, max_len: Any,
                      filter_meta: Mapping[str, Any] | None, timeout: Any) -> EpisodeArguments:
    """The arguments of :meth:`Buffer.sample_episodes`, checked."""
    require_episodes(config)
    batch_size, seed = check_batch_size(batch_size), check_seed(seed)
    if max_len is not None:
        max_len = check_count("max_len", max_len, MAX_WINDOW)
    return EpisodeArguments(batch_size, seed, max_len, check_filter(config, filter_meta),
                            check_timeout(timeout))


def priority_arguments(indices: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, priorities)`` of :meth:`PrioritizedBuffer.update_priorities`, checked."""
    seqs = check_indices(indices)
    return seqs, check_priorities(priorities, len(seqs))


def num_batches(size: int, batch_size: Any) -> int:
    """:meth:`Buffer.calculate_num_batches` of a buffer of ``size`` records."""
    return -(-size // check_batch_size(batch_size))


class EpochPlan:
    """The positions an :meth:`Buffer.epoch_iterator` reads, its arguments checked when
    made (in this order: batch size, epochs, seed, fields, device, the two flags)."""

    def __init__(self, config: BufferConfig, batch_size: Any, n_epochs: Any, shuffle: Any,
                 seed: Any, drop_last: Any, fields: Sequence[str] | None, device: Any):
        self.batch_size = check_batch_size(batch_size)
        self.n_epochs = check_count("n_epochs", n_epochs, MAX_EPOCHS)
        self._rng = np.random.default_rng(check_seed(seed))
        self.names = check_fields(config, fields)
        check_device(device)
        if not isinstance(shuffle, bool) or not isinstance(drop_last, bool):
            raise InvalidArgumentError("shuffle and drop_last must be True or False")
        self.shuffle, self.drop_last = shuffle, drop_last

    def epoch(self, n: int) -> Iterator[np.ndarray]:
        """The positions of each batch of one epoch over the ``n`` records held now."""
        order = self._rng.permutation(n) if self.shuffle else np.arange(n)
        stop = n - n % self.batch_size if self.drop_last else n
        for start in range(0, stop, self.batch_size):
            yield order[start:start + self.batch_size]
