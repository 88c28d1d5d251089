"""What ``info()`` reports about a buffer: one type, whatever the transport.

A :class:`BufferInfo` is a read-only mapping (``info["size"]``, ``dict(info)``)
with attributes as well (``info.size``). The wire codec converts it to and
from the protocol's ``BufferInfo`` message using :data:`COUNTERS`, so every
key is written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping

from millpond.core.config import BufferConfig
from millpond.core.schema import Schema
from millpond.errors import BufferDamagedError

# A buffer is served ("ok"), or held out of service for one of these reasons (a daemon
# that found its file so at start-up): see BufferInfo.state.
STATES = ("ok", "damaged", "unreadable", "unknown-format")


@dataclass(frozen=True, eq=False)
class BufferInfo(Mapping[str, Any]):
    """A snapshot of one buffer: its config, sizes and counters.

    Sizes: ``size`` records can be sampled (live, not damaged, not used up);
    ``hot_size`` / ``cold_size`` live records per tier; ``pushed`` records
    ever pushed; ``damaged`` live records left out at reopen. Counters since
    the buffer was created or reopened: ``inserts``, ``samples``,
    ``samples_per_insert`` (the current ratio), ``insert_waits`` /
    ``sample_waits`` (calls that had to wait for the rate limiter),
    ``insert_wait_seconds`` / ``sample_wait_seconds`` (time they waited),
    ``waiting_inserts`` / ``waiting_samples`` (calls waiting now).
    ``memory_needed``: bytes of RAM the buffer keeps resident (its hot tier,
    sum trees), beside ``memory_limit``, what the process may use (machine or
    memory cgroup; 0 if unknown). Episodic buffers count ``episodes``
    (complete: ended, first record live) and ``episodes_in_progress`` (not
    ended, with a live record). ``stored_bytes``: what the live records
    occupy (RAM and disk); ``logical_bytes``: what they would as plain arrays
    (equal, but for buffers with ``frame_stack`` or ``next_of``). ``read_only``: an
    offline dataset, whose writes all raise ReadOnlyBufferError.
    ``path`` is the buffer's file (on a server: relative to its data
    directory). A prioritized buffer also reports ``beta``, its current
    importance-sampling exponent, ``max_priority``, the priority a record
    pushed without one gets (the largest seen), and ``priority_total`` /
    ``priority_min``, the sum and the smallest non-zero of ``priority **
    alpha`` over the records it may draw (what a sharded client weighs shards
    and importance weights by). The config's settings are keys too: ``hot_capacity``,
    ``total_capacity``, ``record_nbytes``, ``fields``, ``mode``,
    ``max_times_sampled``, ``rate_limiter``, ``prioritized``.

    ``state`` is ``"ok"`` for a buffer that is served. A daemon holds a buffer out of
    service when its file failed at start-up: ``"damaged"`` (records or header fail
    their checks), ``"unreadable"`` (permissions, I/O errors) or ``"unknown-format"``
    (not a millpond buffer file, or another format version); ``reason`` says what and
    names the file. Such a buffer's numbers are 0, and its ``config`` is None when its
    file's header could not be read (its settings read None as keys; as attributes they
    raise :class:`~millpond.errors.BufferDamagedError`).

    ``shards`` (an attribute, not a key) is empty except in the info of a
    sharded buffer (:mod:`millpond.sharded.client`): one :class:`ShardInfo` per
    shard, whose sums the other numbers are; ``degraded`` says whether one
    of them did not answer.
    """

    config: BufferConfig | None
    name: str | None = None
    path: str | None = None
    beta: float | None = None
    max_priority: float | None = None
    priority_total: float | None = None
    priority_min: float | None = None
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
    memory_needed: int = 0
    memory_limit: int = 0
    episodes: int = 0
    episodes_in_progress: int = 0
    stored_bytes: int = 0
    logical_bytes: int = 0
    read_only: bool = False
    state: str = "ok"
    reason: str = ""
    shards: tuple["ShardInfo", ...] = ()

    @property
    def ok(self) -> bool:
        """Whether the buffer is served (``state == "ok"``)."""
        return self.state == "ok"

    @property
    def degraded(self) -> bool:
        """A sharded buffer's info only: some shard did not answer (its numbers are missing)."""
        return any(not shard.live for shard in self.shards)

    # ---- the config's settings, as keys ------------------------------------------

    def checked_config(self) -> BufferConfig:
        """:attr:`config`, or BufferDamagedError for a buffer held out of service whose
        file's header could not be read (it has none)."""
        if self.config is None:
            raise BufferDamagedError(f"buffer {self.name!r} is held out of service "
                                     f"({self.state}): {self.reason}")
        return self.config

    @property
    def schema(self) -> Schema:
        return self.checked_config().schema

    @property
    def hot_capacity(self) -> int:
        return self.checked_config().hot_capacity

    @property
    def total_capacity(self) -> int:
        return self.checked_config().total_capacity

    @property
    def record_nbytes(self) -> int:
        return self.checked_config().schema.record_nbytes

    @property
    def fields(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return self.checked_config().schema.spec()

    @property
    def mode(self) -> str:
        return self.checked_config().mode

    @property
    def max_times_sampled(self) -> int:
        return self.checked_config().max_times_sampled or 0

    @property
    def rate_limiter(self) -> dict[str, Any] | None:
        limiter = self.checked_config().rate_limiter
        return None if limiter is None else limiter.to_dict()

    @property
    def prioritized(self) -> dict[str, float] | None:
        p = self.checked_config().prioritized
        return None if p is None else {"alpha": p.alpha, "beta": p.beta}

    @property
    def meta_fields(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        meta = self.checked_config().meta_fields
        return None if meta is None else meta.spec()

    # ---- the mapping -----------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        if key not in KEYS:
            raise KeyError(key)
        if self.config is None and key in SETTINGS:  # held out, its header unreadable
            return None
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(KEYS)

    def __len__(self) -> int:
        return len(KEYS)

    def __repr__(self) -> str:
        return f"BufferInfo({dict(self)!r})"


@dataclass(frozen=True)
class ShardInfo:
    """One shard of a sharded buffer: its index, address, and its info (None if it
    did not answer; ``error`` says why)."""

    index: int
    address: str
    info: BufferInfo | None = None
    error: str | None = None

    @property
    def live(self) -> bool:
        return self.info is not None


# Numbers of prioritized buffers only (None otherwise; optional fields on the wire).
PRIORITY_STATE = ("beta", "max_priority", "priority_total", "priority_min")
# Why a buffer is, or is not, served (strings; the wire message has a field of each name).
HEALTH = ("state", "reason")
# Numbers that travel as they are (the wire message has a field of each name).
COUNTERS: tuple[str, ...] = tuple(
    f.name for f in fields(BufferInfo)
    if f.name not in ("config", "name", "path", "shards", *PRIORITY_STATE, *HEALTH))
SETTINGS = ("hot_capacity", "total_capacity", "record_nbytes", "fields", "mode",
            "max_times_sampled", "rate_limiter", "prioritized", "meta_fields")
KEYS: tuple[str, ...] = ("name", "path", *HEALTH, *COUNTERS, *SETTINGS, *PRIORITY_STATE)
