"""Named buffers of one server: name -> :class:`millpond.core.TieredBuffer`.

No gRPC here. Thread-safe: the name table has its own short lock, and buffer
creation (which may preallocate a large cold file) is serialized by a second
lock so lookups of other buffers never wait for a disk allocation.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

from millpond.core import Schema, TieredBuffer
from millpond.errors import BufferNotFoundError, ConfigMismatchError, InvalidArgumentError

log = logging.getLogger("millpond.registry")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
COLD_SUFFIX = ".cold"


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid buffer name (safe as a file name)."""
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise InvalidArgumentError(
            f"invalid buffer name {name!r}: use 1-128 of A-Z a-z 0-9 _ . - "
            "starting with a letter or digit"
        )
    return name


def describe(schema: Schema, hot: int, total: int) -> str:
    return f"hot={hot} total={total} fields={schema.spec()}"


class Registry:
    """The server's named buffers; cold files live at ``<data_dir>/<name>.cold``."""

    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._buffers: dict[str, TieredBuffer] = {}
        self._lock = threading.Lock()         # guards _buffers; held briefly
        self._create_lock = threading.Lock()  # serializes creations

    def cold_path(self, name: str) -> Path:
        return self.data_dir / f"{check_name(name)}{COLD_SUFFIX}"

    def create(self, name: str, schema: Schema, hot: int, total: int) -> tuple[TieredBuffer, bool]:
        """Create ``name`` or attach to it; return ``(buffer, created)``.

        Attaching requires the identical configuration (schema, capacities),
        else :class:`ConfigMismatchError`.
        """
        path = self.cold_path(name)
        with self._create_lock:
            with self._lock:
                existing = self._buffers.get(name)
            if existing is not None:
                if (existing.schema, existing.hot_capacity, existing.total_capacity) != (
                    schema, hot, total,
                ):
                    raise ConfigMismatchError(
                        f"buffer {name!r} exists with a different config: has "
                        f"{describe(existing.schema, existing.hot_capacity, existing.total_capacity)}"
                        f", asked for {describe(schema, hot, total)}"
                    )
                return existing, False
            buffer = TieredBuffer(schema, hot, total, cold_path=path)
            with self._lock:
                self._buffers[name] = buffer
        log.info("buffer created", extra={"kv": {"buffer": name, "hot": hot, "total": total,
                                                  "record_bytes": schema.record_nbytes}})
        return buffer, True

    def get(self, name: str) -> TieredBuffer:
        with self._lock:
            buffer = self._buffers.get(name)
        if buffer is None:
            raise BufferNotFoundError(f"no buffer named {name!r}")
        return buffer

    def close(self, name: str) -> None:
        """Remove ``name`` and close it (its cold file is deleted)."""
        with self._lock:
            buffer = self._buffers.pop(name, None)
        if buffer is None:
            raise BufferNotFoundError(f"no buffer named {name!r}")
        buffer.close()
        log.info("buffer closed", extra={"kv": {"buffer": name}})

    def list(self) -> list[tuple[str, TieredBuffer]]:
        """``(name, buffer)`` pairs sorted by name (a snapshot)."""
        with self._lock:
            return sorted(self._buffers.items())

    def close_all(self) -> None:
        """Close every buffer (shutdown). The data directory itself stays."""
        with self._lock:
            buffers, self._buffers = list(self._buffers.items()), {}
        for name, buffer in buffers:
            try:
                buffer.close()
            except Exception:  # keep closing the others
                log.exception("closing buffer failed", extra={"kv": {"buffer": name}})

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffers)
