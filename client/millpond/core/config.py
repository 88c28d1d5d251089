"""A buffer's configuration: one immutable value, checked once, compared with ``==``.

Every way of making a buffer ends here: the constructor classes, the
client's ``create_buffer``, the Create RPC (:mod:`millpond.wire.codec`), the
server's TOML file and the buffer file's metadata. :meth:`BufferConfig.build`
is the one place where capacities and schemas are resolved from the
user-facing arguments; :class:`BufferConfig` itself validates the result.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Mapping

from millpond.core.checks import is_integral, is_real
from millpond.core.ratelimit import Queue, RateLimiter
from millpond.core.schema import Schema
from millpond.errors import InvalidConfigError

if TYPE_CHECKING:
    from millpond.core.frames import FrameGroup

MODES = ("replay", "queue", "stack")
MAX_CAPACITY = 2**40  # records: far beyond any disk, and safe in int64 seq arithmetic
MAX_TIMES_SAMPLED = 2**32 - 1  # draw counts are uint32
# The keys episodic samples add beside the record fields: no field or meta field may take them.
EPISODE_KEYS = ("mask", "lens", "episode_ids", "start_steps", "n_step_lens", "weights", "indices")


def _capacity(label: str, value: Any) -> int:
    if not is_integral(value) or isinstance(value, bool) or not 0 < value <= MAX_CAPACITY:
        raise InvalidConfigError(
            f"{label} must be a positive integer of at most {MAX_CAPACITY:,}, got {value!r}")
    return int(value)


def check_exponent(label: str, value: Any) -> float:
    """``value`` as a finite float >= 0 (alpha, beta), or InvalidConfigError."""
    if not is_real(value) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise InvalidConfigError(f"{label} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Prioritized:
    """Proportional prioritized sampling: ``P(i) ~ priority_i ** alpha``.

    ``beta`` is the importance-sampling exponent at creation. Learners anneal
    it (``set_beta``), so it is not part of a buffer's identity: two configs
    that differ only in ``beta`` compare equal.
    """

    alpha: float = 0.6
    beta: float = field(default=0.4, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", check_exponent("alpha", self.alpha))
        object.__setattr__(self, "beta", check_exponent("beta", self.beta))


@dataclass(frozen=True)
class BufferConfig:
    """What a buffer is: its records, capacities and how it is sampled.

    * ``schema``: the fields of a record;
    * ``hot_capacity`` records in RAM, ``total_capacity`` in all (the rest in
      the cold tier; equal means RAM only);
    * ``mode``: ``"replay"`` (draw with replacement), ``"queue"`` (return and
      remove the oldest) or ``"stack"`` (the newest);
    * ``max_times_sampled``: replay mode only, a record leaves after its n-th
      draw (None: never; 0 is read as None);
    * ``rate_limiter``: when pushes and samples may proceed; queues and
      stacks default to ``Queue(total_capacity)``;
    * ``prioritized``: proportional prioritized sampling (replay mode), or
      None for uniform;
    * ``episodes``: records belong to episodes, and sequences, episodes and
      n-step transitions can be sampled (replay mode; see
      :mod:`.episodes`); ``meta_fields`` (a Schema, or None) are values per
      episode;
    * ``frame_stack`` (``{field: axis}``) and ``next_of`` (``{field: source
      field}``): frames stored once (see :mod:`.frames`); ``frame_capacity``
      frames in the frame store of each source field (None: the default,
      :func:`.frames.default_frame_capacity`). Normalized to sorted tuples of
      pairs and a number (None without these options);
    * ``compression`` (``"zstd"``, ``"lz4"``, or per field, with levels: see
      :mod:`.codecs`): large fields stored compressed, each in a ring of
      ``compressed_bytes`` bytes (None: the default, see
      :func:`.frames.default_compressed_bytes`; see :mod:`.arena`). Normalized
      to a sorted tuple of ``(field, codec, level)`` (empty: nothing compressed).

    Construction validates and normalizes, so equal buffers have equal
    configs (compare with ``==``; ``beta`` excepted, see :class:`Prioritized`).
    """

    schema: Schema
    hot_capacity: int
    total_capacity: int
    mode: str = "replay"
    max_times_sampled: int | None = None
    rate_limiter: RateLimiter | None = None
    prioritized: Prioritized | None = None
    episodes: bool = False
    meta_fields: Schema | None = None
    frame_stack: Any = ()
    next_of: Any = ()
    frame_capacity: int | None = None
    compression: Any = ()
    compressed_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.schema, Schema):
            raise InvalidConfigError(f"schema must be a millpond Schema, got {self.schema!r}")
        hot = _capacity("hot_capacity", self.hot_capacity)
        total = _capacity("total_capacity", self.total_capacity)
        if total < hot:
            raise InvalidConfigError(
                f"total_capacity ({total}) must be >= hot_capacity ({hot})")
        if self.mode not in MODES:
            raise InvalidConfigError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        limit = self.max_times_sampled
        if limit is not None:
            if not is_integral(limit) or isinstance(limit, bool) or not 0 <= limit <= MAX_TIMES_SAMPLED:
                raise InvalidConfigError(
                    f"max_times_sampled must be an integer in [0, {MAX_TIMES_SAMPLED}] "
                    f"(0: unlimited), got {limit!r}")
            limit = int(limit) or None
        if limit is not None and self.mode != "replay":
            raise InvalidConfigError(f"a {self.mode} removes every record it returns: "
                                     "max_times_sampled is for mode='replay'")
        limiter = self.rate_limiter
        if limiter is not None and not isinstance(limiter, RateLimiter):
            raise InvalidConfigError(
                "rate_limiter must come from millpond.MinSize, SampleToInsertRatio or Queue")
        if limiter is None and self.mode != "replay":
            limiter = Queue(total)
        if self.prioritized is not None:
            if not isinstance(self.prioritized, Prioritized):
                raise InvalidConfigError(f"prioritized must be a Prioritized, got {self.prioritized!r}")
            if self.mode != "replay":
                raise InvalidConfigError("a prioritized buffer samples in mode='replay' only")
        self._check_episodes()
        # (these modules import this one)
        from millpond.core.codecs import check_compression
        from millpond.core.frames import check_frame_options, compression_units
        stack, nexts, _ = check_frame_options(self.schema, total, self.frame_stack, self.next_of,
                                              None)
        compression = check_compression(self.compression,
                                        *compression_units(self.schema, dict(stack), dict(nexts)))
        _, _, frame_capacity = check_frame_options(
            self.schema, total, self.frame_stack, self.next_of, self.frame_capacity,
            compressed=bool(compression))
        object.__setattr__(self, "compression", compression)
        object.__setattr__(self, "frame_stack", stack)
        object.__setattr__(self, "next_of", nexts)
        object.__setattr__(self, "frame_capacity", frame_capacity)
        object.__setattr__(self, "compressed_bytes",
                           self._check_compressed_bytes(bool(compression)))
        for name, value in (("hot_capacity", hot), ("total_capacity", total),
                            ("max_times_sampled", limit), ("rate_limiter", limiter)):
            object.__setattr__(self, name, value)

    def _check_compressed_bytes(self, compressed: bool) -> int | None:
        value = self.compressed_bytes
        if value is None:
            return None
        if not compressed:
            raise InvalidConfigError("compressed_bytes is for buffers with compression")
        if not is_integral(value) or isinstance(value, bool) or not 0 < value <= 2**46:
            raise InvalidConfigError(f"compressed_bytes must be a positive integer, got {value!r}")
        largest = max(g.frame_nbytes for g in self.frame_groups if g.codec is not None)
        if value < 4 * largest:
            raise InvalidConfigError(
                f"compressed_bytes {value:,} cannot hold even a few values of {largest:,} bytes "
                f"(at least {4 * largest:,})")
        return int(value)

    def _check_episodes(self) -> None:
        if not isinstance(self.episodes, bool):
            raise InvalidConfigError(f"episodes must be True or False, got {self.episodes!r}")
        if not self.episodes:
            if self.meta_fields is not None:
                raise InvalidConfigError("meta_fields are values per episode: give episodes=True")
            return
        if self.mode != "replay":
            raise InvalidConfigError(f"a {self.mode} removes what it returns: episodes are "
                                     "for mode='replay'")
        taken = set(self.schema.names) & set(EPISODE_KEYS)
        if taken:
            raise InvalidConfigError(f"field names {sorted(taken)} are taken by the keys of "
                                     "episodic samples")
        meta = self.meta_fields
        if meta is None:
            return
        if not isinstance(meta, Schema):
            raise InvalidConfigError(f"meta_fields must be a millpond Schema, got {meta!r}")
        taken = set(meta.names) & (set(self.schema.names) | set(EPISODE_KEYS))
        if taken:
            raise InvalidConfigError(f"meta field names {sorted(taken)} are taken by record "
                                     "fields or by the keys of episodic samples")

    # ---- the one resolution of user-facing arguments -----------------------------

    @classmethod
    def build(
        cls,
        *,
        capacity: Any = None,
        hot_capacity: Any = None,
        total_capacity: Any = None,
        obs_dim: Any = None,
        act_dim: Any = None,
        fields: Any = None,
        mode: str = "replay",
        max_times_sampled: Any = None,
        rate_limiter: Any = None,
        prioritized: bool | Prioritized | None = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        episodes: bool = False,
        meta_fields: Any = None,
        frame_stack: Any = None,
        next_of: Any = None,
        frame_capacity: Any = None,
        compression: Any = None,
        compressed_bytes: Any = None,
    ) -> "BufferConfig":
        """The config for the arguments users give (constructors, ``create_buffer``, TOML).

        Capacities: ``capacity=N`` alone is RAM only (``hot = total = N``);
        ``total_capacity`` with ``hot_capacity`` adds a cold tier;
        ``total_capacity`` alone is RAM only too. Schema: ``fields``
        (``{name: (dtype, shape)}`` or a Schema) or ``obs_dim`` + ``act_dim``
        (the reference's transitions). ``prioritized=True`` uses ``alpha``
        and ``beta``. ``meta_fields``: ``{name: (dtype, shape)}``, a bare
        dtype meaning a scalar (``{"task_id": "int64"}``), or a Schema.
        ``frame_stack``, ``next_of``, ``frame_capacity``: see :mod:`.frames`;
        ``compression``, ``compressed_bytes``: see :mod:`.codecs` and :mod:`.arena`.
        """
        hot, total = resolve_capacities(capacity, hot_capacity, total_capacity)
        if isinstance(rate_limiter, Mapping):  # RateLimiter.to_dict()'s form
            rate_limiter = RateLimiter.from_dict(rate_limiter)
        if prioritized is True:
            prioritized = Prioritized(alpha, beta)
        elif prioritized is False or prioritized is None:
            prioritized = None
        return cls(Schema.resolve(obs_dim, act_dim, fields), hot, total, mode,
                   max_times_sampled, rate_limiter, prioritized, episodes,
                   meta_schema(meta_fields), frame_stack or (), next_of or (), frame_capacity,
                   compression or (), compressed_bytes)

    # ---- derived values --------------------------------------------------------------

    @property
    def cold_capacity(self) -> int:
        return self.total_capacity - self.hot_capacity

    @property
    def removes(self) -> bool:
        """Whether sampling removes what it returns (queue, stack)."""
        return self.mode != "replay"

    @functools.cached_property
    def frame_groups(self) -> "tuple[FrameGroup, ...]":
        """The groups of fields whose frames are stored once (empty: a plain buffer)."""
        from millpond.core.frames import frame_groups
        return frame_groups(self.schema, dict(self.frame_stack), dict(self.next_of),
                            {field: (name, level) for field, name, level in self.compression})

    @functools.cached_property
    def stored_schema(self) -> Schema:
        """The schema of the records the tiers hold: :attr:`schema` itself for a plain
        buffer; frame fields replaced by their frames' ids (see :mod:`.frames`)."""
        from millpond.core.frames import stored_schema
        return stored_schema(self.schema, self.frame_groups)

    def with_beta(self, beta: float) -> "BufferConfig":
        """The same config with another creation ``beta`` (prioritized buffers)."""
        if self.prioritized is None:
            return self
        return replace(self, prioritized=replace(self.prioritized, beta=beta))

    # ---- comparison, for attaching ----------------------------------------------------

    def differences(self, other: "BufferConfig") -> list[tuple[str, str, str]]:
        """``(setting, self's value, other's value)`` for each setting that differs."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append((f.name, _describe(mine), _describe(theirs)))
        return out

    # ---- the buffer file's metadata ---------------------------------------------------

    def sampling_meta(self) -> dict[str, Any]:
        """How the buffer samples, as its file records it (JSON-able)."""
        prioritized = self.prioritized
        return {
            "mode": self.mode,
            "max_times_sampled": self.max_times_sampled,
            "rate_limiter": self.rate_limiter and self.rate_limiter.to_dict(),
            "prioritized": prioritized and {"alpha": prioritized.alpha, "beta": prioritized.beta},
            "episodes": self.episodes,
            "meta_fields": self.meta_fields and self.meta_fields.spec(),
            **self.frame_meta(),
        }

    def frame_meta(self) -> dict[str, Any]:
        """The frame options as a file records them (nothing for a plain buffer, whose
        metadata stay as they were): the options, and the record fields as pushed
        (the file's ``schema`` is :attr:`stored_schema`)."""
        if not self.frame_groups:
            return {}
        meta: dict[str, Any] = {"frame_stack": dict(self.frame_stack), "next_of": dict(self.next_of),
                "frame_capacity": self.frame_capacity,
                "fields": {name: [dt, list(shape)]
                           for name, (dt, shape) in self.schema.spec().items()}}
        if self.compression:  # (format 7: see .bufferfile)
            meta["compression"] = [list(item) for item in self.compression]
            meta["compressed_bytes"] = self.compressed_bytes
        return meta

    @classmethod
    def from_file_meta(cls, meta: Mapping[str, Any], schema: Schema) -> "BufferConfig":
        """The config a buffer file records (files older than a setting lack its key)."""
        prioritized = meta.get("prioritized")
        limiter = meta.get("rate_limiter")
        if "fields" in meta:  # a buffer with frames: ``schema`` is what its tiers hold
            schema = Schema.from_spec({k: (dt, tuple(shape)) for k, (dt, shape)
                                       in meta["fields"].items()})
        return cls(schema, meta["hot_capacity"], meta["total_capacity"],
                   meta.get("mode", "replay"), meta.get("max_times_sampled"),
                   limiter and RateLimiter.from_dict(limiter),
                   prioritized and Prioritized(prioritized["alpha"], prioritized["beta"]),
                   meta.get("episodes", False), meta_schema(meta.get("meta_fields")),
                   meta.get("frame_stack") or (), meta.get("next_of") or (),
                   meta.get("frame_capacity"),
                   tuple(tuple(item) for item in meta.get("compression") or ()),
                   meta.get("compressed_bytes"))


class ConfigAccessors:
    """The settings every buffer object reads from its ``config``: in-process
    buffers, remote handles and infos alike."""

    config: BufferConfig

    @property
    def schema(self) -> Schema:
        return self.config.schema

    @property
    def hot_capacity(self) -> int:
        return self.config.hot_capacity

    @property
    def total_capacity(self) -> int:
        return self.config.total_capacity


def meta_schema(meta_fields: Any) -> Schema | None:
    """The Schema of ``meta_fields`` (see :meth:`BufferConfig.build`); None for none."""
    if meta_fields is None or isinstance(meta_fields, Schema):
        return meta_fields
    if not isinstance(meta_fields, Mapping):
        raise InvalidConfigError("meta_fields must be a mapping name -> (dtype, shape)")
    if not meta_fields:
        return None
    return Schema.from_spec({name: spec if isinstance(spec, (tuple, list)) else (spec, ())
                             for name, spec in meta_fields.items()})


def resolve_capacities(capacity: Any, hot_capacity: Any, total_capacity: Any) -> tuple[Any, Any]:
    """``(hot, total)`` from ``capacity=`` or ``hot_capacity=``/``total_capacity=``.

    Values are checked by :class:`BufferConfig`; this only decides which
    argument means what.
    """
    if capacity is not None:
        if hot_capacity is not None or total_capacity is not None:
            raise InvalidConfigError("give capacity= or hot_capacity=/total_capacity=, not both")
        return capacity, capacity
    if total_capacity is None:
        raise InvalidConfigError(
            "give capacity= (RAM only), or total_capacity= with hot_capacity= for a cold tier")
    return (total_capacity if hot_capacity is None else hot_capacity), total_capacity


def _describe(value: Any) -> str:
    if isinstance(value, RateLimiter):
        return repr(value.to_dict())
    return repr(value)
