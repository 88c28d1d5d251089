"""numpy batches, buffer configs and infos <-> protocol messages.

A column is dtype + shape + raw little-endian bytes. Decoding is
``np.frombuffer`` on the received bytes (no copy, no pickle, no object dtype),
after checking that the dtype is a plain number type and that the byte count
matches the shape, so a hostile message cannot make us read out of bounds.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from millpond.core.config import BufferConfig, Prioritized
from millpond.core.info import COUNTERS, PRIORITY_STATE, BufferInfo
from millpond.core.ratelimit import RateLimiter
from millpond.core.schema import MAX_DIMENSION, MAX_FIELD_NDIM, MAX_FIELDS, Schema, plain_dtype
from millpond.errors import DTypeMismatchError, InvalidConfigError, ShapeMismatchError
from millpond.v1 import replay_pb2 as pb


def encode_batch(columns: Mapping[str, np.ndarray]) -> pb.Batch:
    """Encode ``{name: array}`` as a Batch (arrays are sent C-ordered, little-endian)."""
    return pb.Batch(columns=[encode_column(name, arr) for name, arr in columns.items()])


def encode_column(name: str, arr: np.ndarray) -> pb.Column:
    arr = np.asarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # tobytes() makes one C-ordered copy; protobuf needs an owned bytes object.
    return pb.Column(name=name, dtype=arr.dtype.str, shape=arr.shape, data=arr.tobytes())


def decode_batch(batch: pb.Batch) -> dict[str, np.ndarray]:
    """Decode a Batch into read-only arrays viewing the message bytes."""
    out: dict[str, np.ndarray] = {}
    for column in batch.columns:
        if column.name in out:
            raise ShapeMismatchError(f"column {column.name!r} appears twice")
        out[column.name] = decode_column(column)
    return out


def decode_column(column: pb.Column) -> np.ndarray:
    data = column.data  # protobuf copies bytes on every attribute access: read once
    dtype, shape = check_column(column.name, column.dtype, tuple(column.shape), len(data))
    return np.frombuffer(data, dtype).reshape(shape)


def check_column(name: str, dtype: str, shape: tuple[int, ...], nbytes: int
                 ) -> tuple[np.dtype, tuple[int, ...]]:
    """Check a received column's header against its byte count; return (dtype, shape)."""
    dt = plain_dtype(dtype)
    if dt is None:
        raise DTypeMismatchError(f"column {name!r}: dtype {dtype!r} is not allowed on the wire")
    if any(d < 0 for d in shape):
        raise ShapeMismatchError(f"column {name!r}: negative dimension in {shape}")
    if len(shape) > MAX_FIELD_NDIM + 1 or any(d > MAX_DIMENSION for d in shape):
        raise ShapeMismatchError(f"column {name!r}: {len(shape)} dimensions, or one too large")
    if math.prod(shape) * dt.itemsize != nbytes:
        raise ShapeMismatchError(f"column {name!r}: {nbytes} bytes do not hold {dt}{list(shape)}")
    return dt, shape


def config_to_proto(config: BufferConfig) -> pb.BufferConfig:
    """A :class:`BufferConfig` as the protocol's ``BufferConfig`` message."""
    message = pb.BufferConfig(
        hot_capacity=config.hot_capacity,
        total_capacity=config.total_capacity,
        fields=_field_specs(config.schema),
        mode="" if config.mode == "replay" else config.mode,
        max_times_sampled=config.max_times_sampled or 0,
        episodes=config.episodes,
        meta_fields=_field_specs(config.meta_fields),
        frame_stack=dict(config.frame_stack),
        next_of=dict(config.next_of),
        frame_capacity=config.frame_capacity or 0,
        compression={field: pb.Compression(codec=name, level=level)
                     for field, name, level in config.compression},
        compressed_bytes=config.compressed_bytes or 0,
    )
    if config.prioritized is not None:
        message.prioritized.alpha = config.prioritized.alpha
        message.prioritized.beta = config.prioritized.beta
    limiter = config.rate_limiter
    if limiter is not None:
        message.rate_limiter.CopyFrom(pb.RateLimiter(
            samples_per_insert=limiter.samples_per_insert,
            min_size_to_sample=limiter.min_size_to_sample,
            min_diff=limiter.min_diff, max_diff=limiter.max_diff))
    return message


def _field_specs(schema: Schema | None) -> list[pb.FieldSpec]:
    return [pb.FieldSpec(name=f.name, dtype=f.dtype.str, shape=f.shape) for f in schema or ()]


def _schema_spec(specs: Any, what: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    if len(specs) > MAX_FIELDS:  # before a field is looked at
        raise InvalidConfigError(f"a buffer config may have at most {MAX_FIELDS:,} {what}s, "
                                 f"got {len(specs):,}")
    spec = {f.name: (f.dtype, tuple(f.shape)) for f in specs}
    if len(spec) != len(specs):
        raise InvalidConfigError(f"buffer config repeats a {what} name")
    return spec


def config_from_proto(message: pb.BufferConfig) -> BufferConfig:
    """The :class:`BufferConfig` a message describes; raises InvalidConfigError."""
    if not message.fields:
        raise InvalidConfigError("buffer config has no fields")
    spec = _schema_spec(message.fields, "field")
    meta = _schema_spec(message.meta_fields, "meta field")
    limiter = None
    if message.HasField("rate_limiter"):
        r = message.rate_limiter
        limiter = RateLimiter(r.samples_per_insert, r.min_size_to_sample, r.min_diff, r.max_diff)
    prioritized = None
    if message.HasField("prioritized"):
        prioritized = Prioritized(message.prioritized.alpha, message.prioritized.beta)
    return BufferConfig(Schema.from_spec(spec), message.hot_capacity, message.total_capacity,
                        message.mode or "replay", message.max_times_sampled or None, limiter,
                        prioritized, message.episodes, Schema.from_spec(meta) if meta else None,
                        dict(message.frame_stack), dict(message.next_of),
                        message.frame_capacity or None,
                        {field: (c.codec, c.level) for field, c in message.compression.items()},
                        message.compressed_bytes or None)


def info_to_proto(info: BufferInfo) -> pb.BufferInfo:
    """A :class:`BufferInfo` as the protocol's message (every counter by name). A buffer
    held out of service without a config (its file's header unreadable) has none."""
    message = pb.BufferInfo(name=info.name or "", path=info.path or "",
                            state=info.state, reason=info.reason,
                            **{key: info[key] for key in COUNTERS})
    if info.config is not None:
        message.config.CopyFrom(config_to_proto(info.config))
        message.record_nbytes = info.record_nbytes
    for key in PRIORITY_STATE:
        if info[key] is not None:
            setattr(message, key, info[key])
    return message


def info_from_proto(message: pb.BufferInfo) -> BufferInfo:
    """The :class:`BufferInfo` a message describes. A buffer held out of service (state
    not "ok"; "" from a server that predates states is "ok") may come without a config."""
    health = message.state or "ok"
    config = (None if health != "ok" and not message.config.fields
              else config_from_proto(message.config))
    priority: dict[str, Any] = {key: getattr(message, key) if message.HasField(key) else None
                                for key in PRIORITY_STATE}
    counters: dict[str, Any] = {key: getattr(message, key) for key in COUNTERS}
    return BufferInfo(config, name=message.name or None, path=message.path or None,
                      **priority, **counters, state=health, reason=message.reason)
