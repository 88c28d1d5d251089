"""millpond: an experience-replay server and the buffers it serves.

In-process::

    buf = millpond.MmapReplayBuffer(10_000, 1_000_000, obs_dim=4, act_dim=1,
                                    cold_path="/tmp/replay.cold")

Remote (same methods, same results, same exceptions)::

    buf = millpond.MmapReplayBuffer(10_000, 1_000_000, obs_dim=4, act_dim=1,
                                    address="localhost:50051", name="cartpole")
"""

from .api import Buffer, MmapReplayBuffer, PrioritizedReplayBuffer, ReplayBuffer
from .client import Client, connect
from .core import Field, Schema
from .core.ratelimit import MinSize, Queue, RateLimiter, SampleToInsertRatio
from .errors import (
    BufferClosedError,
    BufferNotFoundError,
    ConfigMismatchError,
    CorruptFileError,
    DeadlineExceededError,
    DTypeMismatchError,
    FieldMismatchError,
    InternalError,
    InvalidArgumentError,
    InvalidBatchSizeError,
    InvalidConfigError,
    MessageTooLargeError,
    NotEnoughDataError,
    RateLimitTimeoutError,
    ReplayError,
    ServerUnavailableError,
    ShapeMismatchError,
    StorageIOError,
    SharedMemoryError,
    StorageFullError,
)

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "BufferClosedError",
    "BufferNotFoundError",
    "Client",
    "ConfigMismatchError",
    "CorruptFileError",
    "DTypeMismatchError",
    "DeadlineExceededError",
    "Field",
    "FieldMismatchError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidBatchSizeError",
    "InvalidConfigError",
    "MessageTooLargeError",
    "MinSize",
    "MmapReplayBuffer",
    "NotEnoughDataError",
    "PrioritizedReplayBuffer",
    "Queue",
    "RateLimitTimeoutError",
    "RateLimiter",
    "ReplayBuffer",
    "ReplayError",
    "SampleToInsertRatio",
    "Schema",
    "ServerUnavailableError",
    "ShapeMismatchError",
    "SharedMemoryError",
    "StorageFullError",
    "StorageIOError",
    "connect",
]
