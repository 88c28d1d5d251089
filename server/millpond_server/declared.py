"""Buffers declared in the server's TOML file (``--config``), created at start-up.

::

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
``MinSize(min_size_to_sample)``), ``episodes = true`` with optional
``[buffers.meta_fields]`` (``task_id = { dtype = "int64" }``, as fields);
``frame_stack = { obs = 0 }``, ``next_of = { next_obs = "obs" }`` and
``frame_capacity`` (frames stored once: see :mod:`millpond.core.frames`);
``compression = "zstd"`` (or ``"lz4"``, or ``{ obs = ["zstd", 5] }`` per field) and
``compressed_bytes`` (large fields compressed: see :mod:`millpond.core.codecs`).

Offline datasets served read-only (as ``--dataset NAME=PATH``; a relative
path is relative to the TOML file)::

    [[datasets]]
    name = "hopper"
    path = "/data/hopper-medium-v2.hdf5"   # .npz, HDF5 or a Minari dataset folder

Every mistake is a :class:`ConfigError` naming the file and the table,
never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from millpond.core import BufferConfig
from millpond.core.ratelimit import MinSize, RateLimiter, SampleToInsertRatio
from millpond.errors import InvalidConfigError

from .compat import tomllib


class ConfigError(Exception):
    """Bad flags, environment or TOML: reported on stderr, exit code 2."""


@dataclass(frozen=True)
class BufferSpec:
    """A buffer the TOML file declares."""

    name: str
    config: BufferConfig


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset to serve read-only (``--dataset NAME=PATH`` or ``[[datasets]]``)."""

    name: str
    path: Path


def dataset_spec(name: Any, path: Any, where: str, base: Path | None = None) -> DatasetSpec:
    """A checked :class:`DatasetSpec` (``base``: the directory relative paths start from);
    ConfigError naming ``where`` if the name is invalid or nothing is at the path."""
    from .registry import check_name

    try:
        name = check_name(name)
    except ValueError as exc:  # InvalidArgumentError
        raise ConfigError(f"{where}: {exc}") from None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: path must be a non-empty string, got {path!r}")
    full = Path(path).expanduser()
    if base is not None and not full.is_absolute():
        full = base / full
    full = full.absolute()
    if not full.exists():
        raise ConfigError(f"{where}: no dataset at {full}")
    return DatasetSpec(name, full)


def load_datasets(path: Path) -> list[DatasetSpec]:
    """The ``[[datasets]]`` tables of the TOML file at ``path``."""
    tables = _read(path).get("datasets", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"config file {path}: 'datasets' must be an array of tables "
                          "[[datasets]]")
    specs = []
    for i, table in enumerate(tables):
        where = f"config file {path}: [[datasets]] #{i + 1}"
        unknown = set(table) - {"name", "path"}
        if unknown or "name" not in table or "path" not in table:
            raise ConfigError(f"{where}: a dataset is {{ name, path }}, got keys {sorted(table)}")
        specs.append(dataset_spec(table["name"], table["path"], where, path.parent))
    return specs


_BUFFER_KEYS = {"name", "hot_capacity", "total_capacity", "capacity", "obs_dim", "act_dim", "fields",
                "mode", "max_times_sampled", "prioritized", "rate_limiter", "episodes",
                "meta_fields", "frame_stack", "next_of", "frame_capacity", "compression",
                "compressed_bytes"}


def load_buffers(path: Path) -> list[BufferSpec]:
    doc = _read(path)
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


def _read(path: Path) -> dict[str, Any]:
    """The TOML document at ``path``, with only known top-level keys."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path}: invalid TOML: nested too deep") from None
    unknown = set(doc) - {"buffers", "datasets"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown top-level keys {sorted(unknown)}")
    return doc


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
            prioritized=prioritized is not None, **(prioritized or {}),
            episodes=table.get("episodes", False),
            meta_fields=(_fields(table["meta_fields"], where, "meta field")
                         if "meta_fields" in table else None),
            frame_stack=table.get("frame_stack"), next_of=table.get("next_of"),
            frame_capacity=table.get("frame_capacity"), compression=table.get("compression"),
            compressed_bytes=table.get("compressed_bytes"))
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
        if len(error_buffer) != 2:
            raise ConfigError(f"{where}: rate_limiter: error_buffer must be a number or "
                              f"[min_diff, max_diff], got {error_buffer!r}")
        error_buffer = tuple(error_buffer)
    return SampleToInsertRatio(spec["samples_per_insert"], min_size, error_buffer)


def _prioritized(spec: Any, where: str) -> dict[str, Any] | None:
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - {"alpha", "beta"}:
        raise ConfigError(f"{where}: prioritized must be {{ alpha, beta }}, got {spec!r}")
    return spec


def _fields(fields: Any, where: str, what: str = "field"
            ) -> dict[str, tuple[str, tuple[int, ...]]]:
    if not isinstance(fields, dict) or not fields:
        raise ConfigError(f"{where}: {what}s must be a non-empty table name = {{ dtype, shape }}")
    spec = {}
    for name, value in fields.items():
        if not isinstance(value, dict) or "dtype" not in value or set(value) - {"dtype", "shape"}:
            raise ConfigError(
                f"{where}: {what} {name!r} must be {{ dtype = \"...\", shape = [...] }}, got {value!r}"
            )
        shape = value.get("shape", [])
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = [shape]
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise ConfigError(f"{where}: {what} {name!r}: shape must be a list of integers")
        if not isinstance(value["dtype"], str):
            raise ConfigError(f"{where}: {what} {name!r}: dtype must be a string")
        spec[name] = (value["dtype"], tuple(shape))
    return spec


