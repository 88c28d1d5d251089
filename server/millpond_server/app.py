"""Server lifecycle: build the grpc.aio server, serve, stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import resource
import secrets
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from millpond.errors import StorageIOError
from millpond.remote.malloc import tune_malloc_for_large_messages
from millpond.remote.shm import facilities

from .auth import load_auth, reload_tokens, server_credentials
from .backups import BackupDir
from .compat import run as run_loop
from .config import ServeConfig
from .edge import EdgeLimits, Gate
from .fatal import fatal_storage_error
from .metrics import start_metrics
from .observe import ObservingInterceptor
from .operations import Operations
from .registry import Registry
from .service import SERVICE_NAME, ReplayService, add_to_server
from .shm_listener import MAX_SESSIONS_TOTAL, FastPathLimits, FastPathServer

log = logging.getLogger("millpond.server")
# Where the hard limit of open files is unlimited, the soft one is raised to this.
OPEN_FILES_CEILING = 1 << 20

def start_fastpath(cfg: ServeConfig, ops: Operations) -> tuple[FastPathServer | None, str]:
    """Start the shared-memory fast path, or say why it is off.

    Unless ``--shm-max-sessions-total`` says otherwise, its sessions may take at most
    half the open files limit (each holds a descriptor): however many there are, gRPC
    clients can still connect."""
    if not cfg.shm:
        return None, "disabled by the server (--no-shm)"
    lacking = facilities.lacking()
    if lacking:  # not Linux, or a Python without what the fast path uses
        log.warning("shm fast path unavailable", extra={"kv": {"error": lacking}})
        return None, f"unavailable on the server: {lacking}"
    sessions_total = cfg.shm_max_sessions_total
    if sessions_total is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        sessions_total = (MAX_SESSIONS_TOTAL if soft == resource.RLIM_INFINITY
                          else max(1, min(MAX_SESSIONS_TOTAL, soft // 2)))
    limits = FastPathLimits(
        bytes_total=cfg.shm_max_mb << 20,
        bytes_per_client=(cfg.shm_max_mb_per_client or cfg.shm_max_mb) << 20,
        sessions_per_client=cfg.shm_max_sessions,
        sessions_per_user=cfg.shm_max_sessions_per_user,
        sessions_total=sessions_total,
        hello_s=cfg.shm_hello_s,
        idle_s=cfg.shm_idle_s)
    try:
        fastpath = FastPathServer(ops, cfg.shm_group, limits)
    except OSError as exc:  # no abstract Unix sockets or memfd here
        log.warning("shm fast path unavailable", extra={"kv": {"error": exc}})
        return None, f"unavailable on the server: {exc}"
    fastpath.start()
    log.info("fast-path limits", extra={"kv": dataclasses.asdict(limits)})
    return fastpath, ""


def grpc_options(cfg: ServeConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        # Notice dead clients: ping an idle connection every 20 s, drop it if
        # no ack within 10 s.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Let clients ping every ~10 s (even without calls) without being
        # disconnected for "too many pings".
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
        # The edge's connection limits (see edge.py for calls, streams and bytes):
        # connections beyond the cap are closed at once, a connection that never
        # completes its handshake (a scanner's, or one that sends nothing) is
        # closed after --handshake-s, and one without calls after --connection-idle-s.
        ("grpc.max_allowed_incoming_connections", cfg.max_connections),
        ("grpc.server_handshake_timeout_ms", int(cfg.handshake_s * 1000)),
        ("grpc.max_connection_idle_ms", int(cfg.connection_idle_s * 1000)),
    ]


def edge_limits(cfg: ServeConfig) -> EdgeLimits:
    return EdgeLimits(max_calls=cfg.max_concurrent_calls, max_calls_per_peer=cfg.max_calls_per_peer,
                      first_message_s=cfg.first_message_s,
                      max_inflight_bytes=cfg.max_inflight_mb << 20,
                      max_inflight_bytes_per_peer=cfg.max_inflight_mb_per_peer << 20)


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


def _local_address(host: str, port: int) -> str:
    """Where a client on this host reaches a server bound to ``host``."""
    host = host.strip("[]")
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return _bind_address(host, port)


def _write_address_file(path: Path, address: str) -> None:
    """``--address-file``: replace ``path`` atomically (a reader sees all of it or none).
    The temporary file has an unguessable name and is created, never opened: nothing
    planted in the directory (a symlink) is followed."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(address + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit (each client
    connection, stream and fast-path session holds descriptors); ``(before, after)``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, OPEN_FILES_CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


async def serve(cfg: ServeConfig) -> int:
    """Run until SIGTERM/SIGINT; return the exit code.

    The port opens at once with health NOT_SERVING and every Replay call
    answered UNAVAILABLE; buffers are then recovered from the data directory
    (logged, with progress) and only then is the daemon SERVING and the
    "serving on" line printed.
    """
    auth, credentials = load_auth(cfg), server_credentials(cfg)  # ConfigError: exit 2
    before, after = raise_open_files_limit()
    limit: dict[str, int] = {"soft": after}
    if after != before:
        limit["raised_from"] = before
    log.info("open files limit", extra={"kv": limit})
    malloc_tuned = tune_malloc_for_large_messages()
    registry = Registry(cfg.data_dir, sync_every_push=cfg.sync == "always",
                        skip_corrupt=cfg.recover == "skip-corrupt", max_buffers=cfg.max_buffers,
                        max_data_bytes=None if cfg.max_data_gb is None else int(cfg.max_data_gb * 1e9))
    backups = BackupDir(cfg.backup_dir, cfg.data_dir)
    backups.prepare()  # ConfigError: exit 2
    executor = ThreadPoolExecutor(cfg.workers, thread_name_prefix="millpond-engine")
    ops = Operations(registry, executor, auth, max_waiting_calls=cfg.max_waiting_calls,
                     max_waiting_bytes=cfg.max_waiting_mb << 20)
    ops.backups = backups
    ops.start(asyncio.get_running_loop())
    fastpath, off_reason = start_fastpath(cfg, ops)
    metrics = start_metrics(cfg, registry, ops, fastpath)  # --metrics-port; serving from now
    observe = metrics is not None or cfg.log_format == "json" or cfg.log_level == "DEBUG"
    gate = Gate(auth, edge_limits(cfg), None if metrics is None else metrics.refused)
    if metrics is not None:
        metrics.gate = gate
    interceptors: list[grpc.aio.ServerInterceptor] = [gate]
    if observe:  # inside the gate: calls it refuses are not timed
        interceptors.append(ObservingInterceptor(None if metrics is None else metrics.call))
    server = grpc.aio.server(options=grpc_options(cfg), interceptors=interceptors)
    service = ReplayService(ops, cfg.max_message_mb, fastpath, off_reason, cfg.stream_idle_s)
    add_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    syncer = None
    try:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            bind = _bind_address(cfg.host, cfg.port)
            port = (server.add_insecure_port(bind) if credentials is None
                    else server.add_secure_port(bind, credentials))
        except RuntimeError as exc:
            log.error("cannot bind", extra={"kv": {"address": _bind_address(cfg.host, cfg.port),
                                                   "error": exc}})
            print(f"millpond serve: cannot bind {_bind_address(cfg.host, cfg.port)}: {exc}",
                  file=sys.stderr)
            return 1
        await server.start()
        stop = _stop_on_signals(cfg)
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_tokens, cfg, auth)

        loop = asyncio.get_running_loop()
        _freeze_startup_objects()
        await loop.run_in_executor(executor, _recover_and_declare, registry, cfg)
        if cfg.sync == "interval":
            syncer = PeriodicSync(registry, cfg.sync_interval)
            syncer.start()
        ops.ready = True
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        address = _bind_address(cfg.host, port)
        log.info("serving", extra={"kv": {
            "address": address, "data_dir": cfg.data_dir, "buffers": len(registry),
            "held_out": len(registry.held_list()), "backup_dir": cfg.backup_dir,
            "max_message_mb": cfg.max_message_mb, "workers": cfg.workers, "sync": cfg.sync,
            "malloc_tuned": malloc_tuned, "shm": "on" if fastpath else off_reason,
        }})
        if cfg.address_file is not None:
            _write_address_file(cfg.address_file, _local_address(cfg.host, port))
        print(f"serving on {address}", flush=True)

        await stop.wait()
        if cfg.address_file is not None:
            cfg.address_file.unlink(missing_ok=True)
        await health_servicer.enter_graceful_shutdown()  # NOT_SERVING for every service
        service.streams.end()
        await server.stop(cfg.grace)
        log.info("server stopped")
        return 0
    finally:
        # On a failed start too: a server left running would be stopped by its
        # finalizer after the loop closed ("Event loop is closed").
        await server.stop(None)
        # Handlers cancelled by stop() may still run on the pool: let them end
        # before their buffers are released.
        executor.shutdown(wait=True, cancel_futures=True)
        if syncer is not None:
            syncer.stop()
        if fastpath is not None:
            fastpath.stop()
        if metrics is not None:
            metrics.stop()
        registry.release_all()
        log.info("buffers synced and released")


def _stop_on_signals(cfg: ServeConfig) -> asyncio.Event:
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("already stopping", extra={"kv": {"signal": signal.Signals(signum).name}})
            return
        log.info("stopping", extra={"kv": {"signal": signal.Signals(signum).name,
                                            "grace_s": cfg.grace}})
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop


def _freeze_startup_objects() -> None:
    """Leave the objects made so far (modules, classes, gRPC's and numpy's) out of every
    later cyclic collection.

    There are some 40,000 of them, and each full collection walked them all:
    a 10-15 ms pause of the event loop and every call on it. They live as long
    as the daemon, so nothing is lost by never collecting them; buffers are
    made after this (recovered or created), so a closed buffer's cycles are
    still collected.
    """
    gc.collect()  # startup's garbage first: frozen objects are never collected
    gc.freeze()


def _recover_and_declare(registry: Registry, cfg: ServeConfig) -> None:
    """Reopen the data directory's buffers, load the datasets to serve, then create
    the buffers the TOML declares."""
    registry.recover()  # logs its start, each buffer, progress and its end
    for dataset in cfg.datasets:
        registry.add_dataset(dataset.name, dataset.path)
    for spec in cfg.buffers:
        if registry.held(spec.name) is not None:  # never stops the start: it stays listed
            log.error("declared buffer held out of service: not created", extra={"kv": {
                "buffer": spec.name}})
            continue
        registry.create(spec.name, spec.config)


class PeriodicSync(threading.Thread):
    """``--sync interval``: sync (fdatasync) every buffer every ``interval`` seconds.

    A failed sync cannot be retried safely (the kernel may already have
    dropped the dirty pages it failed to write), so it stops the daemon at once.
    """

    def __init__(self, registry: Registry, interval: float):
        super().__init__(name="millpond-sync", daemon=True)
        self.registry = registry
        self.interval = interval
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self.registry.sync_all()
            except StorageIOError as exc:
                fatal_storage_error(exc)

    def stop(self) -> None:
        self._stopped.set()
        self.join(10)


def run(cfg: ServeConfig) -> int:
    return run_loop(serve(cfg))
