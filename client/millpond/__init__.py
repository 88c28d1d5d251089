"""millpond: an experience-replay server and the buffers it serves.

In-process::

    buf = millpond.MmapReplayBuffer(10_000, 1_000_000, obs_dim=4, act_dim=1,
                                    cold_path="/tmp/replay.buffer")

Remote (same methods, same results, same exceptions)::

    buf = millpond.MmapReplayBuffer(10_000, 1_000_000, obs_dim=4, act_dim=1,
                                    address="localhost:50051", name="cartpole")

Exports are loaded on first use, so that ``import millpond.core`` (the
daemon does) does not pull in the client library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__  # the one place it is written

# Public name -> the module that defines it.
_EXPORTS = {
    **dict.fromkeys(("MmapReplayBuffer", "PrioritizedReplayBuffer", "ReplayBuffer"), "api"),
    **dict.fromkeys(("Buffer", "PrioritizedBuffer"), "handle"),
    "Client": "client",
    "connect": "api",
    "OfflineDatasetBuffer": "offline",
    **dict.fromkeys(("BufferConfig", "BufferInfo", "Field", "Prioritized", "Schema"), "core"),
    "CheckpointResult": "core.snapshot",
    **dict.fromkeys(("MinSize", "Queue", "RateLimiter", "SampleToInsertRatio"), "core.ratelimit"),
    **dict.fromkeys((
        "AuthenticationError", "PermissionDeniedError",
        "BufferClosedError", "BufferDamagedError", "BufferNotFoundError", "ConfigMismatchError",
        "CorruptFileError",
        "DTypeMismatchError", "DeadlineExceededError", "FieldMismatchError", "FileConflictError",
        "IndexOutOfRangeError", "InternalError", "LimitExceededError",
        "InvalidArgumentError", "InvalidBatchSizeError", "InvalidConfigError",
        "MessageTooLargeError", "NotEnoughDataError", "RateLimitTimeoutError",
        "ReadOnlyBufferError", "ReplayError",
        "ProtocolError", "ServerStartingError", "ServerUnavailableError", "ShapeMismatchError",
        "SharedMemoryError", "StorageFullError", "StorageIOError",
    ), "errors"),
}

# Submodules reachable as attributes of the package (loaded on first use too).
_SUBMODULES = ("aio", "datasets")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:  # millpond.datasets.load(...) after a bare "import millpond"
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'millpond' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if TYPE_CHECKING:  # what static checkers and IDEs see
    from millpond import aio, datasets  # noqa: F401
    from millpond.api import (  # noqa: F401
        MmapReplayBuffer,
        PrioritizedReplayBuffer,
        ReplayBuffer,
        connect,  # noqa: F401
    )
    from millpond.client import Client  # noqa: F401
    from millpond.core import BufferConfig, BufferInfo, Field, Prioritized, Schema  # noqa: F401
    from millpond.core.ratelimit import MinSize, Queue, RateLimiter, SampleToInsertRatio  # noqa: F401
    from millpond.core.snapshot import CheckpointResult  # noqa: F401
    from millpond.errors import *  # noqa: F401,F403
    from millpond.handle.buffer import Buffer, PrioritizedBuffer  # noqa: F401
    from millpond.offline.buffer import OfflineDatasetBuffer  # noqa: F401
