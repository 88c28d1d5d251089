"""The backend of a buffer spread over shards (see :mod:`millpond.sharded.client`).

:class:`ShardedBuffer` has the methods of :class:`~millpond.remote.buffer.RemoteBuffer`
and composes one per shard, so the public handles wrap it unchanged.

* **Writes** stick to the handle's shard (the client's handles take the
  shards in turn): a batch is never split, so episodes and sequences pushed
  through one handle stay on one shard. A shard that does not answer within
  the deadline hands the handle (and the batch) to the next live shard. A
  batch that was in flight when its shard died may have been stored there
  as well: pushes are acknowledged at least once, never lost.
* **Samples** (replay mode) draw per-shard counts from a multinomial over the
  live shards' sizes (prioritized: their ``priority ** alpha`` mass), fetch
  them in parallel and concatenate them in shard order; prioritized weights
  are made global and ``indices`` carry their shard
  (:mod:`millpond.sharded.placement`). A queue or stack returns the oldest (newest)
  records of the shard that holds the most.
* **Rate limiters** stay per shard: each shard applies the buffer's limiter
  to its own inserts and samples.

Episodes never span shards: a handle writes every record, meta and end of
its episodes to its own shard (:meth:`ShardedBuffer._send`), so each shard
holds whole episodes and serves windows, n-step transitions and episodes
from them on its own. Across shards:

* ``sample_sequences`` and ``sample(n_step=...)`` draw their starts like
  ``sample``: per-shard counts from a multinomial over the live shards'
  sizes (prioritized: priority mass), fetched in parallel, concatenated in
  shard order, ``indices`` carrying the shard.
* ``sample_episodes`` draws per-shard counts over the shards' complete
  episodes, so each complete episode is equally likely; the parts are
  padded to the widest.
* With ``filter_meta``, the counts still follow the shards' sizes (a shard
  does not say how many records match without a scan); a shard holding no
  match gives its draws to the others. Within each shard draws are uniform
  among the matches.
* ``episode_catalog`` lists shard after shard; its ``seqs`` carry the
  shard like sample ``indices``, so ``read`` sends each to its shard.
* Positions (``sample_by_index``, ``sample_all``, ``epoch_iterator``,
  ``export``) count the shards' records shard after shard (shard 0's oldest
  is 0), from the sizes the shards report at the start of the call; each
  shard resolves its own positions under its lock, but the shards are not
  read at one instant. ``reset`` empties every shard, and every shard must
  answer.
* ``checkpoint(PATH)`` has every shard's daemon write its part at once, each under its
  own ``--backup-dir``: ``PATH-shard0.buffer``, ``PATH-shard1.buffer``, ... Each part is
  a consistent snapshot of its shard; the parts are cut at nearly, not exactly, the
  same instant. Every shard must answer. Restore each into its own daemon's data
  directory (``millpond restore PATH-shardK.buffer --name NAME``).
* If a handle's shard stops answering mid-episode, the rest of the episode
  goes to the next shard, which stores it as an episode of its own (steps
  from 0); the head stays on the old shard, never ended.

No shard is trusted. Each shard's replies are checked by its transport
against the shard's config and the request made of it (rows, columns,
dtypes, shapes: :mod:`millpond.remote.grpc_transport`,
:mod:`millpond.remote.shm.session`), and every shard's config has the same
schema (:mod:`millpond.sharded.client` checks it when creating or attaching),
so the parts merged here are alike and hold the rows asked of each. What only
the sharded buffer can know is checked here, raising ProtocolError naming the
shard's address: a shard's size and episodes within its share of the capacity
(:meth:`ShardedBuffer._shard_info`: draws are placed by them), and the
``indices`` and catalog ``seqs`` it returns below ``2**48`` (they would name
another shard's records: :meth:`ShardedBuffer._encoded`).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from millpond.core.config import BufferConfig, ConfigAccessors
from millpond.core.info import BufferInfo, ShardInfo
from millpond.core.snapshot import SUFFIX, CheckpointResult
from millpond.errors import (
    BufferNotFoundError,
    IndexOutOfRangeError,
    NotEnoughDataError,
    ProtocolError,
    ServerUnavailableError,
)
from millpond.remote.buffer import RemoteBuffer, read_all
from millpond.remote.writes import QueuedWrites
from millpond.sharded.placement import (
    SHARD_SHIFT,
    aggregate,
    cap,
    decode_indices,
    encode_indices,
    global_config,
    is_down,
    pieces,
    plan,
    raise_answered,
    rescale_weights,
)

if TYPE_CHECKING:
    from millpond.remote.buffer import RemoteBuffer
    from millpond.sharded.client import ShardedClient

if TYPE_CHECKING:
    from millpond.sharded.client import ShardedClient


class ShardedBuffer(QueuedWrites, ConfigAccessors):
    """The buffer ``name`` on every shard of ``client`` (shard ``i`` with ``configs[i]``).

    ``owner``: this handle's create made it, so :meth:`close` deletes it on
    every shard. Picklable (never owning); safe after fork.
    """

    def __init__(self, client: "ShardedClient", name: str, configs: list[BufferConfig],
                 owner: bool = False):
        self._client = client
        self.name = name
        self.shard_configs = list(configs)
        self.config = global_config(configs)
        self.owner = owner
        self.remotes = [RemoteBuffer(shard_client, name, config, windowed=False)
                        for shard_client, config in zip(client.clients, configs)]
        self._home = client.next_shard()
        self._lock = threading.Lock()
        self._beta: float | None = None  # the last set_beta: down shards get it once back

    @property
    def client(self) -> Any:
        """The client this buffer's calls go through."""
        return self._client

    def __reduce__(self) -> tuple[Any, tuple]:
        return (ShardedBuffer, (self._client, self.name, self.shard_configs))

    @property
    def shard(self) -> int:
        """The shard this handle's pushes go to."""
        return self._home

    def __len__(self) -> int:
        return self.info().size

    def info(self) -> BufferInfo:
        """Counters summed over the shards; ``info.shards`` has each one's (None if down)."""
        self._check_open()
        self.flush()
        infos = self._infos()
        down = self._client.down()
        shards = [ShardInfo(s, self._client.addresses[s], infos.get(s),
                            None if s in infos else down.get(s, "not asked: marked down"))
                  for s in range(self._client.shards)]
        return aggregate(self.name, self.config, shards)

    def _infos(self) -> dict[int, BufferInfo]:
        """The info of every shard that answers (every shard is tried if none is live)."""
        client = self._client
        live = client.live() or list(range(client.shards))
        infos, errors = client.fan_out(live, self._shard_info)
        raise_answered(errors)
        if self._beta is not None:  # a shard that was down missed a set_beta
            stale = [s for s, i in infos.items() if i.beta is not None and i.beta != self._beta]
            for s in stale:
                self.remotes[s].set_beta(self._beta)
                infos[s] = self._shard_info(s)
        return infos

    def _shard_info(self, shard: int) -> BufferInfo:
        """The info of ``shard``, if possible for its share of the buffer (its config's
        ``total_capacity``): its size, and its complete episodes and episodes in
        progress together, at most that; else ProtocolError naming the shard. (Its
        transport checked the rest: see :meth:`GrpcTransport._info
        <millpond.remote.grpc_transport.GrpcTransport._info>`.) A size beyond the share
        would take draws from every other shard."""
        client = self._client
        info = client.clients[shard].connection.grpc.info(self.name, client.timeout)
        share = self.shard_configs[shard].total_capacity
        if max(info.size, info.episodes + info.episodes_in_progress) > share:
            raise ProtocolError(
                f"shard {shard} ({client.addresses[shard]}) reported buffer {self.name!r} "
                f"holding {info.size:,} records, {info.episodes:,} complete episodes and "
                f"{info.episodes_in_progress:,} in progress: more than its share of the "
                f"capacity, {share:,} records")
        return info

    # ---- writes ---------------------------------------------------------------------------

    def _send(self, n: int, batch: dict[str, np.ndarray], priorities: np.ndarray | None,
              timeout: float | None, episodes: np.ndarray | None = None,
              updates: list | None = None) -> None:
        """Push to this handle's shard; if it does not answer, to the next live one."""
        tried: set[int] = set()
        while True:
            shard = self._writer(tried)
            try:
                self.remotes[shard]._send(n, batch, priorities, timeout, episodes, updates)
                return
            except Exception as exc:
                if not is_down(exc):
                    raise
                self._client.mark_down(shard, exc)
                tried.add(shard)
                if len(tried) == self._client.shards:
                    raise

    def _writer(self, tried: set[int]) -> int:
        """This handle's shard if live, else the next live one (which becomes its shard)."""
        n = self._client.shards
        live = [s for s in self._client.live() if s not in tried]
        with self._lock:
            home = self._home
            if home in live:
                return home
            candidates = live or [s for s in range(n) if s not in tried]
            self._home = min(candidates, key=lambda s: (s - home) % n)
            return self._home

    def update_priorities(self, indices: Any, priorities: Any) -> int:
        """Route each index to its shard; returns how many records were still live.
        Updates meant for a shard that does not answer are dropped (not counted)."""
        self._check_open()
        self._check_priorities_allowed(True)
        values = np.asarray(priorities)  # (checked by the handle)
        shards, seqs = decode_indices(np.asarray(indices), self._client.shards)
        self.flush()
        rows = {int(s): np.flatnonzero(shards == s) for s in np.unique(shards)}
        updated, errors = self._client.fan_out(
            list(rows), lambda s: self.remotes[s].update_priorities(seqs[rows[s]], values[rows[s]]))
        raise_answered(errors)
        return int(sum(updated.values()))

    def set_beta(self, beta: float) -> None:
        """Set beta on every live shard (down ones get it when they are back)."""
        self._check_open()
        self._check_priorities_allowed(True)
        self._beta = beta
        _, errors = self._client.fan_out(self._client.live(),
                                         lambda s: self.remotes[s].set_beta(beta))
        raise_answered(errors)

    # ---- reads ------------------------------------------------------------------------------

    def sample(self, batch_size: int, seed: int | None = None, *,
               timeout: float | None = None, filter_meta: Mapping[str, Any] | None = None
               ) -> dict[str, np.ndarray]:
        """Draw ``batch_size`` records over the live shards (see the module docstring).
        ``filter_meta`` (episodic buffers): a shard with no matching record gives its
        draws to the others."""
        self._check_open()
        k = batch_size
        options = {"filter_meta": filter_meta} if filter_meta else {}
        self.flush()
        if self._client.shards == 1:  # one shard: its own draw is the draw
            return self._tagged(0, self.remotes[0].sample(k, seed, timeout=timeout, **options))
        infos = self._live_infos()
        if self.config.removes:
            return self._pop(k, timeout, infos)
        return self._draw_records(k, seed, infos, lambda s, count, sd: self.remotes[s].sample(
            count, sd, timeout=timeout, **options), bool(options))

    def _draw_records(self, k: int, seed: int | None, infos: dict[int, BufferInfo],
                      fetch: Callable[[int, int, int | None], dict[str, np.ndarray]],
                      shed_short: bool) -> dict[str, np.ndarray]:
        """:meth:`_draw` of ``k`` records as one buffer's ``sample`` draws them: at most
        the records held (NotEnoughDataError, without a rate limiter, for more; with one,
        the shards' samples wait for their records, as one buffer's does)."""
        sizes = {s: i.size for s, i in infos.items()}
        limited = self.config.rate_limiter is not None
        if k > sum(sizes.values()):
            if not limited:
                raise NotEnoughDataError(f"batch_size {k} > buffer len {sum(sizes.values())}")
            return self._draw(k, seed, infos, fetch, None, shed_short)
        # (no shard is asked for more than it holds: a sample needs its records held)
        return self._draw(k, seed, infos, fetch, sizes, shed_short)

    def _live_infos(self) -> dict[int, BufferInfo]:
        """:meth:`_infos`, or ServerUnavailableError if no shard answers."""
        infos = self._infos()
        if not infos:
            raise ServerUnavailableError(f"no shard of buffer {self.name!r} answered: "
                                         f"{self._client.down()}")
        return infos

    def _draw(self, k: int, seed: int | None, infos: dict[int, BufferInfo],
              fetch: Callable[[int, int, int | None], dict[str, np.ndarray]],
              sizes: dict[int, int] | None = None, shed_short: bool = False,
              masses: dict[int, float] | None = None,
              merge: Callable[[list[dict[str, np.ndarray]]], dict[str, np.ndarray]] | None = None
              ) -> dict[str, np.ndarray]:
        """``k`` draws over the shards of ``infos``: per-shard counts from :func:`plan`
        over ``masses`` (default: sizes, or priority masses of a prioritized buffer),
        ``fetch(shard, count, seed)`` on each in parallel, results tagged and
        concatenated in shard order.

        ``sizes``: a shard draws at most its size per call (a plain sample: split into
        pieces, or capped for ``max_times_sampled``). A shard that stops answering, or
        (``shed_short``) raises NotEnoughDataError, gives its draws to the others.
        ``merge``: how the parts become one (default: concatenated).
        """
        if masses is None:
            masses = {s: float(i.size) for s, i in infos.items()}
            if self.config.prioritized is not None and any(i.priority_total for i in infos.values()):
                masses = {s: float(i.priority_total or 0.0) for s, i in infos.items()}
        global_min = min((i.priority_min for i in infos.values() if i.priority_min is not None),
                         default=None)
        rng = np.random.default_rng(seed)
        counts, seeds = plan(rng, k, masses, self._client.shards, seed is not None)
        parts: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}  # (shard, round, piece)
        for round_ in itertools.count():
            if not counts:
                break
            if sizes is not None and self.config.max_times_sampled:
                counts = cap(counts, {s: sizes[s] for s in masses})
            split_up = sizes is not None and not self.config.max_times_sampled
            jobs = [(s, j, b, sd) for s, c in sorted(counts.items())
                    for j, (b, sd) in enumerate(pieces(c, sizes[s], seeds[s]) if sizes and split_up
                                                else [(c, seeds[s])])]
            got, errors = self._client.fan_out(jobs, lambda job: fetch(job[0], job[2], job[3]),
                                               shard_of=lambda job: job[0])
            shed = {job: e for job, e in errors.items()
                    if is_down(e) or (shed_short and isinstance(e, NotEnoughDataError))}
            raise_answered({job: e for job, e in errors.items() if job not in shed})
            for (s, j, _, _), part in got.items():
                parts[s, round_, j] = self._tagged(s, part, infos[s], global_min)
            for job in shed:  # drawn from shards that died (or hold no match) since: redraw
                masses.pop(job[0], None)
            lost = sum(job[2] for job in shed)
            if lost and not masses:
                short = [e for e in shed.values() if not is_down(e)]
                raise short[0] if short else ServerUnavailableError(
                    f"no shard of buffer {self.name!r} answered")
            counts, seeds = (plan(rng, lost, masses, self._client.shards, seed is not None)
                             if lost else ({}, seeds))
        ordered = [parts[key] for key in sorted(parts)]
        if merge is not None:
            return merge(ordered)
        return {name: np.concatenate([p[name] for p in ordered]) for name in ordered[0]}

    def _tagged(self, shard: int, part: dict[str, np.ndarray], info: BufferInfo | None = None,
                global_min: float | None = None) -> dict[str, np.ndarray]:
        """A shard's sample with indices that carry the shard and weights against the
        whole buffer's smallest priority (``info``: the shard's, read before the draw)."""
        if "indices" in part:
            part["indices"] = self._encoded(shard, part["indices"], "indices")
        if "weights" in part and info is not None and global_min is not None:
            part["weights"] = rescale_weights(part["weights"], info.priority_min, global_min,
                                              info.beta)
        return part

    def _encoded(self, shard: int, seqs: np.ndarray, what: str) -> np.ndarray:
        """A shard's ``seqs`` (int64, checked by its transport) as the sharded buffer's
        (:func:`encode_indices`), if each is a seq (in ``[0, 2**48)``); else
        ProtocolError naming the shard: one beyond would name another shard's record."""
        if len(seqs) and not 0 <= seqs.min() <= seqs.max() < 1 << SHARD_SHIFT:
            raise ProtocolError(
                f"shard {shard} ({self._client.addresses[shard]}) answered with {what} from "
                f"{int(seqs.min())} to {int(seqs.max())}, not seqs in [0, 2**{SHARD_SHIFT})")
        return encode_indices(shard, seqs)

    def _pop(self, k: int, timeout: float | None,
             infos: dict[int, BufferInfo]) -> dict[str, np.ndarray]:
        """Queue / stack: the oldest (newest) records of the shard holding the most."""
        n = self._client.shards
        order = sorted(infos, key=lambda s: (-infos[s].size, (s - self._home) % n))
        for shard in order:
            try:
                return self.remotes[shard].sample(k, None, timeout=timeout)
            except Exception as exc:
                if not is_down(exc) or shard == order[-1]:
                    raise
                self._client.mark_down(shard, exc)
        raise AssertionError("unreachable")

    # ---- lifecycle -----------------------------------------------------------------------

    def delete(self) -> None:
        """Flush queued pushes, then delete the buffer on every shard. Idempotent."""
        if self._closed:
            return
        if self._batcher is not None:
            self._batcher.close()

        def delete(shard: int) -> None:
            try:
                self._client.clients[shard].connection.grpc.delete(self.name, self._client.timeout)
            except BufferNotFoundError:
                pass

        _, errors = self._client.fan_out(list(range(self._client.shards)), delete)
        if errors:
            raise errors[min(errors)]
        self._closed = True

    # ---- episodic calls, reads, reset --------------------------------------------------------

    def update_episodes(self, updates: Any) -> None:
        """Apply ``(episode id, meta, end)`` updates on this handle's shard (where its
        episodes are), after the pushes queued before."""
        self._check_open()
        self.flush()
        self.remotes[self._home].update_episodes(updates)  # (which checks them)

    def sample_n_step(self, batch_size: int, n_step: int, gamma: float = 0.99,
                      seed: int | None = None, *, filter_meta: Mapping[str, Any] | None = None,
                      timeout: float | None = None) -> dict[str, np.ndarray]:
        """n-step transitions drawn over the shards (see the engine's ``sample_n_step``)."""
        return self._episodic_draw(batch_size, seed, filter_meta, timeout, "records",
                                   lambda remote, count, sd, options: remote.sample_n_step(
                                       count, n_step, gamma, sd, **options))

    def sample_sequences(self, batch_size: int, seq_len: int,
                         seed: int | None = None, *, filter_meta: Mapping[str, Any] | None = None,
                         timeout: float | None = None) -> dict[str, np.ndarray]:
        """Windows of episodes drawn over the shards (see the engine's ``sample_sequences``)."""
        return self._episodic_draw(batch_size, seed, filter_meta, timeout, "starts",
                                   lambda remote, count, sd, options: remote.sample_sequences(
                                       count, seq_len, sd, **options))

    sample_trajectories = sample_sequences  # rlox's name

    def sample_episodes(self, batch_size: int, seed: int | None = None, *,
                        max_len: int | None = None, filter_meta: Mapping[str, Any] | None = None,
                        timeout: float | None = None) -> dict[str, np.ndarray]:
        """Complete episodes drawn over the shards, each equally likely (see the engine's
        ``sample_episodes``), padded to the longest drawn (or ``max_len``)."""
        return self._episodic_draw(batch_size, seed, filter_meta, timeout, "episodes",
                                   lambda remote, count, sd, options: remote.sample_episodes(
                                       count, sd, max_len=max_len, **options))

    def _episodic_draw(self, batch_size: int, seed: int | None,
                       filter_meta: Mapping[str, Any] | None, timeout: float | None,
                       draws: str, call: Callable[..., dict[str, np.ndarray]]
                       ) -> dict[str, np.ndarray]:
        """``call(remote, count, seed, options)`` on each shard drawn, and merge.
        ``draws``: ``"records"`` like :meth:`sample` (at most the records held),
        ``"starts"`` with replacement, or ``"episodes"`` over complete episodes."""
        self._check_open()
        k = batch_size
        options: dict[str, Any] = {"timeout": timeout}
        if filter_meta:
            options["filter_meta"] = filter_meta
        self.flush()
        infos = self._live_infos()

        def fetch(shard: int, count: int, sd: int | None) -> dict[str, np.ndarray]:
            return call(self.remotes[shard], count, sd, options)

        if draws == "starts":
            return self._draw(k, seed, infos, fetch, shed_short=True)
        if draws == "records":
            return self._draw_records(k, seed, infos, fetch, True)
        masses = {s: float(i.episodes) for s, i in infos.items()}
        if not any(masses.values()):
            raise NotEnoughDataError("no complete episode to sample (on any live shard)")
        stepwise = {*self.config.schema.names, "mask"}
        return self._draw(k, seed, infos, fetch, shed_short=True, masses=masses,
                          merge=lambda parts: _merge_padded(parts, stepwise))

    def episode_catalog(self, filter_meta: Mapping[str, Any] | None = None
                        ) -> dict[str, np.ndarray]:
        """Every live shard's catalog, shard after shard; ``seqs`` carry their shard."""
        self._check_open()
        self.flush()
        shards = sorted(self._live_infos())
        got, errors = self._client.fan_out(
            shards, lambda s: self.remotes[s].episode_catalog(filter_meta))
        raise_answered(errors)
        parts = [{**got[s], "seqs": self._encoded(s, got[s]["seqs"], "catalog seqs")}
                 for s in sorted(got)]
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def read(self, seqs: Any, fields: Any = None, *, positions: bool = False,
             episode_ids: bool = False) -> dict[str, np.ndarray]:
        """Records by index (a sharded sample's ``indices``, a sharded catalog's ``seqs``)
        or by position (see the module docstring), in the order given, and ``live``.
        A shard that does not answer raises: its records cannot be read elsewhere."""
        self._check_open()
        wanted, names = np.asarray(seqs, np.int64), fields  # (checked by the handle)
        self.flush()
        if positions:
            shards, local = self._positions(wanted)
        else:
            shards, local = decode_indices(wanted, self._client.shards)
        rows = {int(s): np.flatnonzero(shards == s) for s in np.unique(shards)}
        options = dict(positions=positions, episode_ids=episode_ids)
        if not rows:  # nothing asked: the shape of an answer from shard 0
            return self.remotes[0].read(local, names, **options)
        got, errors = self._client.fan_out(
            list(rows), lambda s: self.remotes[s].read(local[rows[s]], names, **options))
        for shard in sorted(errors):
            raise errors[shard]
        first = got[min(got)]
        out = {name: np.empty((len(wanted),) + a.shape[1:], a.dtype) for name, a in first.items()}
        for s, part in got.items():
            for name, array in part.items():
                out[name][rows[s]] = array
        return out

    def _positions(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shards, local positions)`` of positions over the shards' contents, shard
        after shard; IndexOutOfRangeError (nothing read) for one past the end."""
        sizes = [0] * self._client.shards
        for shard, info in self._every_info().items():
            sizes[shard] = info.size
        starts = np.cumsum([0] + sizes)
        outside = (positions < 0) | (positions >= starts[-1])
        if outside.any():
            raise IndexOutOfRangeError(
                f"position {int(positions[outside][0])} is out of range: the buffer holds "
                f"{int(starts[-1])} records (positions 0 to {int(starts[-1]) - 1})")
        shards = np.searchsorted(starts, positions, side="right") - 1
        return shards, positions - starts[shards]

    def _every_info(self) -> dict[int, BufferInfo]:
        """Every shard's info; raise if one does not answer (reads by position and
        reset need them all)."""
        shards = list(range(self._client.shards))
        infos, errors = self._client.fan_out(shards, self._shard_info)
        for shard in sorted(errors):
            raise errors[shard]
        return infos

    def contents(self, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Every record, shard after shard, in reads of at most :meth:`read_chunk` records
        (see :func:`millpond.remote.buffer.read_all`)."""
        return read_all(self, fields)

    def read_chunk(self, record_nbytes: int) -> int:
        """Records one read's reply may carry (the smallest of the shards' limits)."""
        return min(remote.read_chunk(record_nbytes) for remote in self.remotes)

    def checkpoint(self, path: str | os.PathLike, *,
                   progress: Callable[[int, int], None] | None = None,
                   timeout: float | None = None) -> CheckpointResult:
        """Every shard's daemon writes a snapshot of its part, in parallel:
        ``PATH-shardK.buffer`` under its own --backup-dir (see the module docstring).
        ``progress(copied, total)`` hears the sums; the result sums the shards' counts,
        ``shards`` has each one's. Every shard must answer (else the first error)."""
        self._check_open()
        self.flush()
        base = os.fspath(path).removesuffix(SUFFIX)
        seen: dict[int, tuple[int, int]] = {}
        lock = threading.Lock()

        def shard_progress(shard: int) -> Callable[[int, int], None]:
            def report(copied: int, total: int) -> None:
                with lock:
                    seen[shard] = (copied, total)
                    done = sum(c for c, _ in seen.values())
                    whole = sum(t for _, t in seen.values())
                if progress is not None:
                    progress(done, whole)
            return report

        results, errors = self._client.fan_out(
            list(range(self._client.shards)),
            lambda s: self.remotes[s].checkpoint(f"{base}-shard{s}{SUFFIX}",
                                                 progress=shard_progress(s), timeout=timeout))
        for shard in sorted(errors):
            raise errors[shard]
        parts = tuple(results[s] for s in range(self._client.shards))
        return CheckpointResult(f"{base}-shard*{SUFFIX}", sum(r.records for r in parts), 0, 0,
                                sum(r.dropped for r in parts), sum(r.damaged for r in parts),
                                sum(r.nbytes for r in parts), parts)

    def reset(self) -> None:
        """Drop every record on every shard (each answers, or this raises; shards that
        did answer are empty then)."""
        self._check_open()
        self.flush()
        _, errors = self._client.fan_out(list(range(self._client.shards)),
                                         lambda s: self.remotes[s].reset())
        for shard in sorted(errors):
            raise errors[shard]


def _merge_padded(parts: list[dict[str, np.ndarray]], stepwise: set[str]
                  ) -> dict[str, np.ndarray]:
    """Episode samples of different widths as one: the ``stepwise`` arrays (fields and
    ``mask``, ``[batch, width, ...]``) zero-padded to the widest part."""
    width = max(p["mask"].shape[1] for p in parts)
    out = {}
    for name in parts[0]:
        arrays = [part[name] for part in parts]
        if name in stepwise:
            arrays = [np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
                      for a in arrays]
        out[name] = np.concatenate(arrays)
    return out
