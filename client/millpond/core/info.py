"""What ``info()`` reports about a buffer: one type, whatever the transport.

A :class:`BufferInfo` is a read-only mapping (``info["size"]``, ``dict(info)``)
with attributes as well (``info.size``). The wire codec converts it to and
from the protocol's ``BufferInfo`` message using :data:`COUNTERS`, so every
key is written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping

from .config import BufferConfig, ConfiguredBuffer


@dataclass(frozen=True, eq=False)
class BufferInfo(ConfiguredBuffer, Mapping[str, Any]):
    """A snapshot of one buffer: its config, sizes and counters.

    Sizes: ``size`` records can be sampled (live, not damaged, not used up);
    ``hot_size`` / ``cold_size`` live records per tier; ``pushed`` records
    ever pushed; ``damaged`` live records left out at reopen. Counters since
    the buffer was created or reopened: ``inserts``, ``samples``,
    ``samples_per_insert`` (the current ratio), ``insert_waits`` /
    ``sample_waits`` (calls that had to wait for the rate limiter),
    ``insert_wait_seconds`` / ``sample_wait_seconds`` (time they waited),
    ``waiting_inserts`` / ``waiting_samples`` (calls waiting now).
    ``path`` is the buffer's file (on a server: relative to its data
    directory). A prioritized buffer also reports ``beta``, its current
    importance-sampling exponent, and ``max_priority``, the priority a record
    pushed without one gets (the largest seen). The config's settings are keys too: ``hot_capacity``,
    ``total_capacity``, ``record_nbytes``, ``fields``, ``mode``,
    ``max_times_sampled``, ``rate_limiter``, ``prioritized``.
    """

    config: BufferConfig
    name: str | None = None
    path: str | None = None
    beta: float | None = None
    max_priority: float | None = None
    size: int = 0
    pushed: int = 0
    hot_size: int = 0
    cold_size: int = 0
    damaged: int = 0
    inserts: int = 0
    samples: int = 0
    samples_per_insert: float = 0.0
    insert_waits: int = 0
    sample_waits: int = 0
    insert_wait_seconds: float = 0.0
    sample_wait_seconds: float = 0.0
    waiting_inserts: int = 0
    waiting_samples: int = 0

    # ---- the config's settings, as keys ------------------------------------------

    @property
    def record_nbytes(self) -> int:
        return self.config.schema.record_nbytes

    @property
    def fields(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return self.config.schema.spec()

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def max_times_sampled(self) -> int:
        return self.config.max_times_sampled or 0

    @property
    def rate_limiter(self) -> dict[str, Any] | None:
        limiter = self.config.rate_limiter
        return None if limiter is None else limiter.to_dict()

    @property
    def prioritized(self) -> dict[str, float] | None:
        p = self.config.prioritized
        return None if p is None else {"alpha": p.alpha, "beta": p.beta}

    # ---- the mapping -----------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        if key not in KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(KEYS)

    def __len__(self) -> int:
        return len(KEYS)

    def __repr__(self) -> str:
        return f"BufferInfo({dict(self)!r})"


# Numbers of prioritized buffers only (None otherwise; optional fields on the wire).
PRIORITY_STATE = ("beta", "max_priority")
# Numbers that travel as they are (the wire message has a field of each name).
COUNTERS: tuple[str, ...] = tuple(
    f.name for f in fields(BufferInfo)
    if f.name not in ("config", "name", "path", *PRIORITY_STATE))
SETTINGS = ("hot_capacity", "total_capacity", "record_nbytes", "fields", "mode",
            "max_times_sampled", "rate_limiter", "prioritized")
KEYS: tuple[str, ...] = ("name", "path", *COUNTERS, *SETTINGS, *PRIORITY_STATE)
