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
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from millpond.core.checks import check_batch_size, check_indices, check_priorities, check_seed, check_timeout
from millpond.core.config import BufferConfig, ConfigAccessors, check_exponent
from millpond.core.episode_checks import check_filter
from millpond.core.info import BufferInfo, ShardInfo
from millpond.errors import (
    BufferNotFoundError,
    NotEnoughDataError,
    ServerUnavailableError,
)
from millpond.remote.writes import QueuedWrites
from millpond.remote.buffer import RemoteBuffer
from millpond.sharded.reads import ShardedReads
from millpond.sharded.placement import (
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
    from millpond.sharded.client import ShardedClient


class ShardedBuffer(ShardedReads, QueuedWrites, ConfigAccessors):
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
        infos, errors = client.fan_out(live, lambda s: client.clients[s].connection.grpc.info(
            self.name, client.timeout))
        raise_answered(errors)
        if self._beta is not None:  # a shard that was down missed a set_beta
            stale = [s for s, i in infos.items() if i.beta is not None and i.beta != self._beta]
            for s in stale:
                self.remotes[s].set_beta(self._beta)
                infos[s] = client.clients[s].connection.grpc.info(self.name, client.timeout)
        return infos

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
        indices = check_indices(indices)
        values = check_priorities(priorities, len(indices))
        shards, seqs = decode_indices(indices, self._client.shards)
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
        self._beta = beta = check_exponent("beta", beta)
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
        k, seed, timeout = check_batch_size(batch_size), check_seed(seed), check_timeout(timeout)
        check_filter(self.config, filter_meta)
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
        the records held (NotEnoughDataError, without a rate limiter, for more)."""
        sizes = {s: i.size for s, i in infos.items()}
        limited = self.config.rate_limiter is not None
        if not limited and k > sum(sizes.values()):
            raise NotEnoughDataError(f"batch_size {k} > buffer len {sum(sizes.values())}")
        return self._draw(k, seed, infos, fetch, None if limited else sizes, shed_short)

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
            part["indices"] = encode_indices(shard, part["indices"])
        if "weights" in part and info is not None and global_min is not None:
            part["weights"] = rescale_weights(part["weights"], info.priority_min, global_min,
                                              info.beta)
        return part

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
