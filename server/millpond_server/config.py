"""Server configuration: flags > ``MILLPOND_*`` environment > defaults, plus TOML.

Every ``serve`` flag ``--some-flag`` can also be given as ``MILLPOND_SOME_FLAG``.
The optional TOML file declares buffers to create at start-up::

    [[buffers]]
    name = "cartpole"
    hot_capacity = 100_000
    total_capacity = 1_000_000     # or: capacity = N (RAM only)
    obs_dim = 4
    act_dim = 1

    [[buffers]]
    name = "atari"
    capacity = 50_000
    [buffers.fields]
    obs = { dtype = "uint8", shape = [84, 84, 4] }
    action = { dtype = "int64" }    # shape defaults to [] (a scalar)

Optional per buffer, as in the client's ``create_buffer``: ``mode = "queue"``
(or ``"stack"``), ``max_times_sampled = N``, ``prioritized = { alpha = 0.6,
beta = 0.4 }``, and ``rate_limiter = { samples_per_insert = 4.0,
min_size_to_sample = 1000, error_buffer = 100 }`` (``error_buffer`` may be
``[min_diff, max_diff]``; without ``samples_per_insert`` it is
``MinSize(min_size_to_sample)``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from millpond.core import BufferConfig
from millpond.core.ratelimit import MinSize, RateLimiter, SampleToInsertRatio
from millpond.errors import InvalidConfigError

ENV_PREFIX = "MILLPOND_"


class ConfigError(Exception):
    """Bad flags, environment or TOML: reported on stderr, exit code 2."""


@dataclass(frozen=True)
class BufferSpec:
    """A buffer the TOML file declares."""

    name: str
    config: BufferConfig


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
    Option("log_level", _log_level, "WARNING", "debug, info, warning (default), error"),
    Option("sync", _sync_policy, "interval",
           "when buffer files reach the disk: none, interval (every --sync-interval s), always"),
    Option("sync_interval", _positive_float, 1.0, "seconds between syncs with --sync interval"),
    Option("recover", _recover_policy, "fail",
           "damaged records at start-up: fail (name them, exit) or skip-corrupt (serve the rest)"),
    Option("shm", _bool, True, "offer the same-host shared-memory fast path (--no-shm: off)"),
    Option("shm_group", _group_ids, None, "groups (names or gids) also allowed on the fast path"),
    Option("shm_max_mb", _positive_int, 8192, "shared memory one fast-path client may hold, MiB"),
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
    log_level: str = "WARNING"
    sync: str = "interval"
    sync_interval: float = 1.0
    recover: str = "fail"
    shm: bool = True
    shm_group: frozenset[int] = frozenset()
    shm_max_mb: int = 8192
    buffers: list[BufferSpec] = field(default_factory=list)

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


def resolve_serve_config(args: argparse.Namespace, environ=os.environ) -> ServeConfig:
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
    cfg = ServeConfig(**values)
    if cfg.config is not None:
        cfg.buffers = load_buffers(cfg.config)
    return cfg


# ---- TOML -------------------------------------------------------------------

_BUFFER_KEYS = {"name", "hot_capacity", "total_capacity", "capacity", "obs_dim", "act_dim", "fields",
                "mode", "max_times_sampled", "prioritized", "rate_limiter"}


def load_buffers(path: Path) -> list[BufferSpec]:
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid TOML: {exc}") from None
    unknown = set(doc) - {"buffers"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown top-level keys {sorted(unknown)}")
    tables = doc.get("buffers", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"config file {path}: 'buffers' must be an array of tables [[buffers]]")
    specs, seen = [], set()
    for i, table in enumerate(tables):
        where = f"config file {path}: [[buffers]] #{i + 1}"
        if isinstance(table.get("name"), str):
            where += f" ({table['name']!r})"
        spec = _buffer_spec(table, where)
        if spec.name in seen:
            raise ConfigError(f"{where}: duplicate buffer name")
        seen.add(spec.name)
        specs.append(spec)
    return specs


def _buffer_spec(table: dict, where: str) -> BufferSpec:
    from .registry import check_name

    unknown = set(table) - _BUFFER_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_BUFFER_KEYS)})")
    if "name" not in table:
        raise ConfigError(f"{where}: missing 'name'")
    try:
        name = check_name(table["name"])
        prioritized = _prioritized(table.get("prioritized"), where)
        config = BufferConfig.build(
            capacity=table.get("capacity"), hot_capacity=table.get("hot_capacity"),
            total_capacity=table.get("total_capacity"), obs_dim=table.get("obs_dim"),
            act_dim=table.get("act_dim"),
            fields=_fields(table["fields"], where) if "fields" in table else None,
            mode=table.get("mode", "replay"), max_times_sampled=table.get("max_times_sampled"),
            rate_limiter=_rate_limiter(table.get("rate_limiter"), where),
            prioritized=prioritized is not None, **(prioritized or {}))
    except (InvalidConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return BufferSpec(name, config)


def _rate_limiter(spec: Any, where: str) -> RateLimiter | None:
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - {"samples_per_insert", "min_size_to_sample",
                                                 "error_buffer"}:
        raise ConfigError(f"{where}: rate_limiter must be {{ samples_per_insert, "
                          f"min_size_to_sample, error_buffer }}, got {spec!r}")
    min_size = spec.get("min_size_to_sample", 1)
    if "samples_per_insert" not in spec:
        if "error_buffer" in spec:
            raise ConfigError(f"{where}: rate_limiter: error_buffer needs samples_per_insert")
        return MinSize(min_size)
    error_buffer = spec.get("error_buffer")
    if error_buffer is None:
        raise ConfigError(f"{where}: rate_limiter: samples_per_insert needs error_buffer")
    if isinstance(error_buffer, list):
        error_buffer = tuple(error_buffer)
    return SampleToInsertRatio(spec["samples_per_insert"], min_size, error_buffer)


def _prioritized(spec: Any, where: str) -> dict[str, Any] | None:
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - {"alpha", "beta"}:
        raise ConfigError(f"{where}: prioritized must be {{ alpha, beta }}, got {spec!r}")
    return spec


def _fields(fields: Any, where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    if not isinstance(fields, dict) or not fields:
        raise ConfigError(f"{where}: fields must be a non-empty table name = {{ dtype, shape }}")
    spec = {}
    for name, value in fields.items():
        if not isinstance(value, dict) or "dtype" not in value or set(value) - {"dtype", "shape"}:
            raise ConfigError(
                f"{where}: field {name!r} must be {{ dtype = \"...\", shape = [...] }}, got {value!r}"
            )
        shape = value.get("shape", [])
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = [shape]
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise ConfigError(f"{where}: field {name!r}: shape must be a list of integers")
        if not isinstance(value["dtype"], str):
            raise ConfigError(f"{where}: field {name!r}: dtype must be a string")
        spec[name] = (value["dtype"], tuple(shape))
    return spec


# ---- logging ----------------------------------------------------------------

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _kv(key: str, value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return f"{key}={text}"


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=... logger=... msg="..." key=value ...`` (one line, then traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            _kv("ts", self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}"),
            _kv("level", record.levelname.lower()),
            _kv("logger", record.name),
            _kv("msg", record.getMessage()),
        ]
        for key, value in (getattr(record, "kv", None) or {}).items():
            parts.append(_kv(key, value))
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
