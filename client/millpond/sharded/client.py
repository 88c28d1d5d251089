"""Several millpond servers as one buffer: the sharded client.

``millpond.connect(["host1:50051", "host2:50051"])`` or
``millpond.connect("dns:///NAME:PORT")`` (every address a name resolves to,
e.g. a Kubernetes headless Service) returns a :class:`ShardedClient`. Its
buffers (:class:`~millpond.sharded.buffer.ShardedBuffer` behind the usual
handles) span the shards: capacities are split, each writer sticks to one
shard, samples are uniform (or prioritized) over the union. The arithmetic
is in :mod:`millpond.sharded.placement`.

Shard ``i`` is the ``i``-th address as given. ``dns:///`` is resolved once,
when connecting, to every address of the name; where each address has a
name of its own (reverse DNS that resolves back to it, e.g. a StatefulSet
pod's ``millpond-0.millpond.ns.svc.cluster.local``), the shards are those
names in natural order, and gRPC finds a pod again after it restarts with a
new address; else they are the addresses sorted (IPv4 before IPv6,
numerically). Either way every client of the same name sees the same order.

A shard that does not answer within the call's deadline (the client's
``timeout``) is marked down: pushes go to another shard, samples draw from
the shards that answer, and ``info().degraded`` says so. A down shard is
probed in the background (its health service, every :data:`PROBE_INTERVAL`
seconds) and used again as soon as it says SERVING.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from millpond.client import BufferClient, Client, check_create, missing_buffer_error
from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo, ShardInfo
from millpond.core.snapshot import CheckpointResult
from millpond.errors import (
    BufferNotFoundError,
    ConfigMismatchError,
    InvalidConfigError,
    ReplayError,
    ServerUnavailableError,
)
from millpond.handle.buffer import Buffer, handle_for
from millpond.sharded.buffer import ShardedBuffer
from millpond.sharded.names import DNS_SCHEME, resolve
from millpond.sharded.placement import aggregate, global_config, is_down, same_but_capacities, shard_configs

PROBE_INTERVAL = 0.5  # seconds between health probes of a down shard
PROBE_TIMEOUT = 1.0
T = TypeVar("T")
K = TypeVar("K")


class ShardedClient(BufferClient):
    """One buffer namespace over several servers; see the module docstring and
    :func:`millpond.connect` (whose settings every shard's client gets).

    Each shard has its :class:`millpond.Client`. Pickles as its addresses and
    settings, like a :class:`~millpond.Client`; each process picks its own first
    shard at random.
    """

    def __init__(self, target: str | Sequence[str], **settings: Any):
        if isinstance(target, str):
            if not target.startswith(DNS_SCHEME):
                raise InvalidConfigError(f"a sharded target is a list of addresses or "
                                         f"'dns:///NAME:PORT', got {target!r}")
            addresses = resolve(target)
            if not addresses:
                raise ServerUnavailableError(f"{target} resolves to no address")
        else:
            addresses = list(target)
            if not addresses or not all(isinstance(a, str) and a for a in addresses):
                raise InvalidConfigError(
                    f"shard addresses must be a non-empty list of 'host:port', got {target!r}")
            if len(set(addresses)) != len(addresses):
                raise InvalidConfigError(f"shard addresses repeat: {addresses}")
        self.target = target if isinstance(target, str) else None
        self.addresses = tuple(addresses)
        self.clients = [Client(address, **settings) for address in addresses]
        self.timeout = self.clients[0].timeout
        self.push_batch_size = self.clients[0].push_batch_size
        self.push_max_delay = self.clients[0].push_max_delay
        self.max_message_bytes = self.clients[0].max_message_bytes
        self._settings = self.clients[0].__reduce__()[1][1]  # credentials resolved once
        self._lock = threading.Lock()
        self._pid = -1
        self._pool: ThreadPoolExecutor | None = None
        self._turn = 0
        self._down: dict[int, tuple[float, str]] = {}  # shard -> (next probe time, why)
        self._probing: set[int] = set()
        self._probe_channels: dict[int, grpc.Channel] = {}

    def __reduce__(self) -> tuple[Any, tuple]:
        return (_rebuild, (list(self.addresses), self._settings))

    @property
    def shards(self) -> int:
        return len(self.addresses)

    @property
    def address(self) -> str:
        return self.target or ",".join(self.addresses)

    @property
    def transport(self) -> str:
        """"shm" or "grpc" if every shard uses it, else "mixed"."""
        kinds = {client.transport for client in self.clients}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def calls(self) -> Counter[tuple[str, str]]:
        total: Counter[tuple[str, str]] = Counter()
        for client in self.clients:
            total.update(client.calls)
        return total

    # ---- this process's pool, turns and shard health -----------------------------------

    def _process(self) -> None:
        """(Re)make the per-process state: a pool, a random first shard, no probes."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._pool = ThreadPoolExecutor(max(4, 4 * self.shards),
                                                    thread_name_prefix="millpond-shards")
                    self._turn = random.SystemRandom().randrange(self.shards)
                    self._probing, self._probe_channels = set(), {}
                    self._pid = os.getpid()

    def next_shard(self) -> int:
        """The shard of the next writer: in turn, from a random first one per process."""
        self._process()
        with self._lock:
            shard, self._turn = self._turn, (self._turn + 1) % self.shards
        return shard

    def live(self) -> list[int]:
        """Shards not marked down (probing those whose probe is due)."""
        self._process()
        now = time.monotonic()
        with self._lock:
            due = [s for s, (at, _) in self._down.items() if at <= now and s not in self._probing]
            self._probing.update(due)
            live = [s for s in range(self.shards) if s not in self._down]
        for shard in due:
            assert self._pool is not None
            self._pool.submit(self._probe, shard)
        return live

    def down(self) -> dict[int, str]:
        """Shards marked down, with why."""
        with self._lock:
            return {shard: why for shard, (_, why) in self._down.items()}

    def mark_down(self, shard: int, exc: BaseException) -> None:
        with self._lock:
            self._down[shard] = (time.monotonic() + PROBE_INTERVAL, f"{type(exc).__name__}: {exc}")

    def _probe(self, shard: int) -> None:
        """Ask a down shard's health service (no waiting); mark it live if SERVING."""
        try:
            with self._lock:
                channel = self._probe_channels.get(shard)
                if channel is None:
                    options = [("grpc.max_reconnect_backoff_ms", int(PROBE_INTERVAL * 1000))]
                    channel = self.clients[shard].credentials.channel(self.addresses[shard],
                                                                     options)
                    self._probe_channels[shard] = channel
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT,
                wait_for_ready=True)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            serving = False
        with self._lock:
            self._probing.discard(shard)
            if serving:
                self._down.pop(shard, None)
            elif shard in self._down:
                self._down[shard] = (time.monotonic() + PROBE_INTERVAL, self._down[shard][1])

    def fan_out(self, jobs: Sequence[K], call: Callable[[K], T],
                shard_of: Callable[[K], int] = lambda job: job,  # type: ignore[assignment,return-value]
                ) -> tuple[dict[K, T], dict[K, BaseException]]:
        """``call(job)`` for each job in parallel (jobs are shards, unless ``shard_of``
        says which shard a job calls): ``(results, errors)`` by job. A shard that
        did not answer is marked down; other errors are returned as they are."""
        self._process()
        assert self._pool is not None
        results: dict[K, T] = {}
        errors: dict[K, BaseException] = {}
        futures = {job: self._pool.submit(call, job) for job in jobs[1:]}
        for job in jobs[:1]:  # the first on this thread: one hop to the pool less
            try:
                results[job] = call(job)
            except Exception as exc:
                errors[job] = exc
        for job, future in futures.items():
            try:
                results[job] = future.result()
            except Exception as exc:
                errors[job] = exc
        for job, error in errors.items():
            if is_down(error):
                self.mark_down(shard_of(job), error)
        return results, errors

    # ---- buffers -----------------------------------------------------------------------

    def remote_buffer(self, name: str, config: BufferConfig,
                      create: bool | None = True) -> ShardedBuffer:
        """Create ``name`` with ``config`` on every shard, or attach where it exists.

        ``create=False``: attach only (BufferNotFoundError, naming buffers of close
        names, if no shard has it). ``create=None`` creates it too: a sharded buffer's
        shards are made together, when the handle is (unlike one server's, see
        :meth:`millpond.Client.remote_buffer`).

        Where it exists its shard's own capacities are kept (an order of
        shards that changed since, e.g. pods with new addresses, still
        attaches), as long as the capacities add up to ``config``'s (where it
        exists on some shards only: none more than ``config``'s) and every
        other setting is equal (else ConfigMismatchError). Where it is made,
        the shard's Create must answer with the config asked (else
        ProtocolError: see :meth:`GrpcTransport.create
        <millpond.remote.grpc_transport.GrpcTransport.create>`). Every shard must
        answer.
        """
        check_create(create)
        wanted = shard_configs(config, self.shards)
        found = self._infos(name, missing_ok=True)
        existing = {s: i.checked_config() for s, i in found.items() if i is not None}
        if not existing and create is False:
            try:
                names: list[str] | None = [i.name for i in self.list_buffers() if i.name]
            except ReplayError:
                names = None
            raise missing_buffer_error(name, ", ".join(self.addresses), names)
        if existing:
            for shard, have in existing.items():
                differs = same_but_capacities(have, config)
                if have.total_capacity > config.total_capacity:  # more than the whole
                    differs.append(("total_capacity", str(have.total_capacity),
                                    f"{config.total_capacity} over all shards"))
                if differs:
                    raise ConfigMismatchError(f"buffer {name!r} exists on shard {shard} "
                                              f"({self.addresses[shard]}) with a different config: "
                                              + "; ".join(f"{k}: has {a}, asked for {b}"
                                                          for k, a, b in differs))
            if len(existing) == self.shards:
                have_all = [existing[s] for s in range(self.shards)]
                glob = global_config(have_all)
                if (glob.hot_capacity, glob.total_capacity) != (config.hot_capacity,
                                                                config.total_capacity):
                    raise ConfigMismatchError(
                        f"buffer {name!r} exists over these {self.shards} shards with "
                        f"hot/total capacity {glob.hot_capacity}/{glob.total_capacity}, asked "
                        f"for {config.hot_capacity}/{config.total_capacity}")
                frames = global_config(wanted).frame_capacity
                if glob.frame_capacity != frames:
                    raise ConfigMismatchError(
                        f"buffer {name!r} exists over these {self.shards} shards with "
                        f"frame_capacity {glob.frame_capacity} in all, asked for {frames}")
        missing = [s for s in range(self.shards) if s not in existing]
        created, errors = self.fan_out(
            missing, lambda s: self.clients[s].connection.grpc.create(name, wanted[s],
                                                                      self.timeout))
        _raise_first(errors)
        configs = [existing[s] if s in existing else created[s][0].checked_config()
                   for s in range(self.shards)]
        owner = any(created[s][1] for s in missing)
        return ShardedBuffer(self, name, configs, owner=owner)

    def buffer(self, name: str) -> Buffer:
        """Attach to ``name`` on every shard (BufferNotFoundError if a shard lacks it)."""
        found = self._infos(name, missing_ok=False)
        configs = [found[s].checked_config() for s in range(self.shards)]
        for shard, config in enumerate(configs[1:], 1):  # one schema: their parts merge
            differs = same_but_capacities(config, configs[0])
            if differs:
                raise ConfigMismatchError(
                    f"buffer {name!r} has another config on shard {shard} "
                    f"({self.addresses[shard]}) than on shard 0 ({self.addresses[0]}): "
                    + "; ".join(f"{k}: {a}, not {b}" for k, a, b in differs))
        return handle_for(ShardedBuffer(self, name, configs))

    def _infos(self, name: str, missing_ok: bool) -> dict[int, Any]:
        """Every shard's info of ``name`` (None where missing, if ``missing_ok``)."""
        def info(shard: int) -> BufferInfo | None:
            try:
                return self.clients[shard].connection.grpc.info(name, self.timeout)
            except BufferNotFoundError:
                if missing_ok:
                    return None
                raise BufferNotFoundError(
                    f"no buffer named {name!r} on shard {shard} ({self.addresses[shard]})"
                ) from None

        found, errors = self.fan_out(range(self.shards), info)
        _raise_first(errors)
        return found

    def list_buffers(self) -> list[BufferInfo]:
        """One info per buffer name on any shard that answers (see ``info.shards``)."""
        lists, errors = self.fan_out(range(self.shards),
                                     lambda s: self.clients[s].list_buffers())
        if not lists:
            _raise_first(errors)
        names = sorted({info.name for infos in lists.values() for info in infos if info.name})
        out = []
        for name in names:
            shards = []
            for s in range(self.shards):
                if s in errors:
                    shards.append(ShardInfo(s, self.addresses[s], None, str(errors[s])))
                    continue
                info = next((i for i in lists[s] if i.name == name), None)
                shards.append(ShardInfo(s, self.addresses[s], info,
                                        None if info else "no such buffer on this shard"))
            infos = [s.info for s in shards if s.info is not None]
            configs = [i.config for i in infos if i.config is not None]
            whole = global_config(configs) if len(configs) == len(infos) else None
            info = aggregate(name, whole, shards)
            unwell = [s for s in shards if s.info is not None and not s.info.ok]
            if unwell:  # a shard holds its part out of service: so is the whole
                assert unwell[0].info is not None
                info = dataclasses.replace(info, state=unwell[0].info.state, reason="; ".join(
                    f"shard {s.index} ({s.address}): {s.info.reason}"
                    for s in unwell if s.info is not None))
            out.append(info)
        return out

    def checkpoint(self, name: str, path: str | os.PathLike, *,
                   progress: Callable[[int, int], None] | None = None,
                   timeout: float | None = None) -> CheckpointResult:
        """Every shard's daemon writes a snapshot of its part of ``name``:
        ``PATH-shardK.buffer`` under its own --backup-dir (see
        :meth:`millpond.sharded.buffer.ShardedBuffer.checkpoint`)."""
        handle = self.buffer(name)
        backend = handle.backend
        assert isinstance(backend, ShardedBuffer)
        try:
            return backend.checkpoint(path, progress=progress, timeout=timeout)
        finally:
            handle.release()

    def delete_buffer(self, name: str) -> None:
        """Delete ``name`` on every shard (BufferNotFoundError if no shard had it)."""
        done, errors = self.fan_out(
            range(self.shards),
            lambda s: self.clients[s].delete_buffer(name))
        missing = [s for s, e in errors.items() if isinstance(e, BufferNotFoundError)]
        _raise_first({s: e for s, e in errors.items() if s not in missing})
        if not done:
            raise BufferNotFoundError(f"no buffer named {name!r} on any shard")

    def close(self) -> None:
        """Close every shard's connection (buffers stay on the servers). Idempotent."""
        for client in self.clients:
            client.close()
        with self._lock:
            if self._pid == os.getpid():
                if self._pool is not None:
                    self._pool.shutdown(wait=False, cancel_futures=True)
                for channel in self._probe_channels.values():
                    channel.close()
            self._pool, self._probe_channels, self._pid = None, {}, -1

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShardedClient({list(self.addresses)!r}, timeout={self.timeout})"


def _raise_first(errors: Mapping[int, BaseException]) -> None:
    """Raise the error of the lowest shard, if any, naming the shard."""
    if errors:
        shard = min(errors)
        exc = errors[shard]
        if isinstance(exc, ReplayError) and is_down(exc):
            raise type(exc)(f"shard {shard}: {exc}") from exc
        raise exc


def _rebuild(addresses: list[str], settings: dict[str, Any]) -> ShardedClient:
    return ShardedClient(addresses, **settings)
