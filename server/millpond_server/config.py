"""Server configuration: flags > ``MILLPOND_*`` environment > defaults.

Every ``serve`` flag ``--some-flag`` can also be given as ``MILLPOND_SOME_FLAG``
(the token itself only as ``MILLPOND_TOKEN``, never as a flag, so that it
stays out of ``ps``). Buffers to create at start-up come from the TOML file
``--config`` names (:mod:`.declared`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .declared import BufferSpec, ConfigError, DatasetSpec, dataset_spec, load_buffers, load_datasets

ENV_PREFIX = "MILLPOND_"
TOKEN_ENV = "MILLPOND_TOKEN"

@dataclass(frozen=True)
class Option:
    dest: str
    type: Callable[[str], Any]
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be 0-65535, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"must be debug, info, warning, error or critical, got {text!r}")
    return level


def _log_format(text: str) -> str:
    value = text.strip().lower()
    if value not in ("text", "json"):
        raise ValueError(f"must be text or json, got {text!r}")
    return value


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {text!r}")


def _group_ids(text: str) -> frozenset[int]:
    """Comma-separated group names or numeric gids."""
    import grp

    gids = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item.isdigit():
            gids.add(int(item))
            continue
        try:
            gids.add(grp.getgrnam(item).gr_gid)
        except KeyError:
            raise ValueError(f"no group named {item!r}") from None
    return frozenset(gids)


def _sync_policy(text: str) -> str:
    value = text.strip().lower()
    if value not in ("none", "interval", "always"):
        raise ValueError(f"must be none, interval or always, got {text!r}")
    return value


def _recover_policy(text: str) -> str:
    value = text.strip().lower()
    if value not in ("fail", "skip-corrupt"):
        raise ValueError(f"must be fail or skip-corrupt, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


def _default_workers() -> int:
    return max(4, min(8, os.cpu_count() or 4))


SERVE_OPTIONS = (
    Option("host", str, "127.0.0.1", "address to bind (0.0.0.0: all interfaces)"),
    Option("port", _port, 50051, "port to bind (0: any free port)"),
    Option("data_dir", Path, Path("./millpond-data"), "directory for cold files (created)"),
    Option("config", Path, None, "TOML file declaring buffers to create at start"),
    Option("max_message_mb", _positive_int, 512, "max gRPC message size in MiB (both ways)"),
    Option("grace", _non_negative_float, 10.0, "seconds in-flight calls get on SIGTERM/SIGINT"),
    Option("workers", _positive_int, None, "engine thread pool size (default 4-8 by CPU)"),
    Option("log_level", _log_level, "INFO",
           "debug (also a line per call), info (default: start, recovery with its progress, "
           "serving, creations, deletions, repairs, backups, stop; no line per call), "
           "warning, error"),
    Option("log_format", _log_format, "text",
           "text (key=value lines) or json (one object per line, with buffer, method, peer)"),
    Option("metrics_port", _port, None,
           "serve Prometheus metrics over HTTP on this port, on --metrics-host (0: any free "
           "port; needs prometheus-client)"),
    Option("metrics_host", str, None,
           "address to bind --metrics-port (default: --host; 127.0.0.1: this host only)"),
    Option("sync", _sync_policy, "interval",
           "when buffer files reach the disk: none, interval (every --sync-interval s), always"),
    Option("sync_interval", _positive_float, 1.0, "seconds between syncs with --sync interval"),
    Option("recover", _recover_policy, "fail",
           "a buffer with damaged records at start-up: fail (hold it out of service until an "
           "admin repairs or deletes it) or skip-corrupt (repair it: drop them); the others "
           "are served either way"),
    Option("shm", _bool, True, "offer the same-host shared-memory fast path (--no-shm: off)"),
    Option("shm_group", _group_ids, None, "groups (names or gids) also allowed on the fast path"),
    Option("shm_max_mb", _positive_int, 8192,
           "shared memory all fast-path clients together may hold, MiB"),
    Option("shm_max_sessions", _positive_int, 64,
           "fast-path sessions one client process may hold at once"),
    Option("shm_max_mb_per_client", _positive_int, None,
           "shared memory one fast-path client process may hold, MiB (default: --shm-max-mb)"),
    Option("shm_max_sessions_per_user", _positive_int, 256,
           "fast-path sessions the processes of one user (uid) may hold at once"),
    Option("shm_max_sessions_total", _positive_int, None,
           "fast-path sessions all clients together may hold at once (default: 1024, or half "
           "the open files limit if that is lower)"),
    Option("shm_hello_s", _positive_float, 5.0,
           "seconds a fast-path connection has to complete a hello; then it is closed"),
    Option("shm_idle_s", _positive_float, 300.0,
           "seconds a fast-path session may go without a request; then it is closed and its "
           "shared memory released (clients open another)"),
    Option("token_file", Path, None,
           "file of 'ROLE TOKEN' lines (admin, actor, learner, read); not readable by others"),
    Option("tls_cert", Path, None, "PEM certificate chain: serve gRPC over TLS (with --tls-key)"),
    Option("tls_key", Path, None, "PEM private key of --tls-cert"),
    Option("tls_client_ca", Path, None,
           "PEM CA bundle: require client certificates it signed (mTLS; admin unless a token says)"),
    Option("insecure", _bool, False,
           "allow serving beyond loopback with neither a token nor client certificates"),
    Option("published_loopback", _bool, False,
           "the port, bound beyond loopback, is reachable from this host only (a container's "
           "port published on 127.0.0.1): tokens without TLS stay on this host, so the daemon "
           "says so at info instead of warning (authentication is still required)"),
    Option("address_file", Path, None,
           "write the address clients on this host reach the server at, once serving"),
    Option("max_buffers", _positive_int, 1000, "buffers the server may hold"),
    Option("max_data_gb", _positive_float, None,
           "disk the data directory's buffer files may take, GB, checked when a buffer is "
           "created: the blocks the files take (a compressed ring what it stores so far), and "
           "a new file's allocation with its compressed rings at their first size (default: "
           "what the disk has)"),
    Option("max_concurrent_calls", _positive_int, 1024,
           "gRPC calls and streams served at once, from all clients (more are refused; the "
           "health check is always answered)"),
    Option("max_calls_per_peer", _positive_int, 512,
           "gRPC calls and streams served at once for one client host (address)"),
    Option("first_message_s", _positive_float, 30.0,
           "seconds a call's request (a stream's first message) may take to arrive"),
    Option("stream_idle_s", _positive_float, 10.0,
           "seconds a client's stream of calls may stay open without one (it counts as a call)"),
    Option("max_inflight_mb", _positive_int, 2048,
           "MiB of requests the daemon holds at once (received, not yet answered)"),
    Option("max_inflight_mb_per_peer", _positive_int, 1024,
           "MiB of requests the daemon holds at once for one client host"),
    Option("max_connections", _positive_int, 2048,
           "gRPC connections open at once (more are closed as they arrive)"),
    Option("handshake_s", _positive_float, 10.0,
           "seconds a new connection may take to complete its TLS and HTTP/2 handshake"),
    Option("connection_idle_s", _positive_float, 300.0,
           "seconds a connection without a call stays open (the client reconnects when needed)"),
    Option("max_waiting_calls", _positive_int, 256,
           "calls that may wait for rate limiters at once (more are refused)"),
    Option("max_waiting_mb", _positive_int, 1024,
           "request bytes calls waiting for rate limiters may hold, MiB"),
    Option("backup_dir", Path, None,
           "directory the daemon writes snapshots of live buffers to (millpond backup, "
           "Client.checkpoint), created if missing; without it checkpoints are refused"),
)


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    data_dir: Path = Path("./millpond-data")
    config: Path | None = None
    max_message_mb: int = 512
    grace: float = 10.0
    workers: int = field(default_factory=_default_workers)
    log_level: str = "INFO"
    log_format: str = "text"
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: --host
    sync: str = "interval"
    sync_interval: float = 1.0
    recover: str = "fail"
    shm: bool = True
    shm_group: frozenset[int] = frozenset()
    shm_max_mb: int = 8192
    shm_max_sessions: int = 64
    shm_max_mb_per_client: int | None = None  # None: shm_max_mb
    shm_max_sessions_per_user: int = 256
    shm_max_sessions_total: int | None = None  # None: 1024, or half the open files limit
    shm_hello_s: float = 5.0
    shm_idle_s: float = 300.0
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    insecure: bool = False
    published_loopback: bool = False
    address_file: Path | None = None
    max_buffers: int = 1000
    max_data_gb: float | None = None
    max_concurrent_calls: int = 1024
    max_calls_per_peer: int = 512
    first_message_s: float = 30.0
    stream_idle_s: float = 10.0
    max_inflight_mb: int = 2048
    max_inflight_mb_per_peer: int = 1024
    max_connections: int = 2048
    handshake_s: float = 10.0
    connection_idle_s: float = 300.0
    max_waiting_calls: int = 256
    max_waiting_mb: int = 1024
    backup_dir: Path | None = None  # checkpoints are written under it (None: refused)
    token: str | None = field(default=None, repr=False)  # MILLPOND_TOKEN (admin)
    buffers: list[BufferSpec] = field(default_factory=list)
    datasets: list[DatasetSpec] = field(default_factory=list)  # --dataset and [[datasets]]

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for opt in SERVE_OPTIONS:
        help_text = f"{opt.help} [env {opt.env}; default {opt.default}]"
        if opt.type is _bool:  # --flag / --no-flag
            switch = parser.add_mutually_exclusive_group()
            switch.add_argument(opt.flag, dest=opt.dest, action="store_const", const="1",
                                default=None, help=help_text)
            switch.add_argument("--no-" + opt.flag[2:], dest=opt.dest, action="store_const",
                                const="0", help=argparse.SUPPRESS)
            continue
        # Parsed as text (default None) so we can tell "not given" from a default.
        parser.add_argument(opt.flag, dest=opt.dest, default=None, metavar=opt.dest.upper(),
                            help=help_text)
    parser.add_argument("--dataset", dest="dataset", action="append", default=[],
                        metavar="NAME=PATH",
                        help="serve the offline dataset at PATH (.npz, HDF5 or a Minari dataset "
                        "folder) read-only as buffer NAME; repeatable [flag or [[datasets]] in "
                        "--config only]")


def resolve_serve_config(args: argparse.Namespace,
                         environ: Mapping[str, str] = os.environ) -> ServeConfig:
    """Flag wins over environment, environment over default; then load the TOML."""
    values: dict[str, Any] = {}
    for opt in SERVE_OPTIONS:
        raw, source = getattr(args, opt.dest), opt.flag
        if raw is None and environ.get(opt.env, "") != "":
            raw, source = environ[opt.env], opt.env
        if raw is None:
            if opt.default is not None:
                values[opt.dest] = opt.default
            continue
        try:
            values[opt.dest] = opt.type(raw)
        except ValueError as exc:
            raise ConfigError(f"{source}={raw!r}: {exc}") from None
    cfg = ServeConfig(**values, token=environ.get(TOKEN_ENV) or None)
    if cfg.max_waiting_calls >= cfg.max_concurrent_calls:
        raise ConfigError(
            f"--max-waiting-calls ({cfg.max_waiting_calls}) must be below --max-concurrent-calls "
            f"({cfg.max_concurrent_calls}): calls waiting for rate limiters would take every "
            "call slot, and the pushes that would let them proceed could not get in")
    if cfg.max_message_mb > min(cfg.max_inflight_mb_per_peer, cfg.max_inflight_mb):
        raise ConfigError(
            f"--max-message-mb ({cfg.max_message_mb}) is more than --max-inflight-mb-per-peer "
            f"({cfg.max_inflight_mb_per_peer}) or --max-inflight-mb ({cfg.max_inflight_mb}): "
            "a request of the largest size allowed would always be refused")
    if cfg.metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError("--metrics-port needs the prometheus-client package: "
                              "pip install 'millpond[metrics]' (or pip install prometheus-client)"
                              ) from None
    if cfg.config is not None:
        cfg.buffers = load_buffers(cfg.config)
        cfg.datasets = load_datasets(cfg.config)
    for text in getattr(args, "dataset", None) or ():
        name, sep, path = text.partition("=")
        if not sep:
            raise ConfigError(f"--dataset {text!r}: expected NAME=PATH")
        cfg.datasets.append(dataset_spec(name, path, f"--dataset {text!r}"))
    names = [spec.name for spec in cfg.buffers] + [spec.name for spec in cfg.datasets]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"buffer or dataset names given twice: {twice}")
    return cfg


