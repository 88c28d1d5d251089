"""numpy batches <-> protocol messages.

A column is dtype + shape + raw little-endian bytes. Decoding is
``np.frombuffer`` on the received bytes (no copy, no pickle, no object dtype),
after checking that the dtype is a plain number type and that the byte count
matches the shape, so a hostile message cannot make us read out of bounds.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from ..core.buffer import DEFAULT_SAMPLING, Sampling
from ..core.ratelimit import RateLimiter
from ..core.schema import Schema, plain_dtype
from ..errors import DTypeMismatchError, InvalidConfigError, ShapeMismatchError
from ..v1 import replay_pb2 as pb



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
    if math.prod(shape) * dt.itemsize != nbytes:
        raise ShapeMismatchError(f"column {name!r}: {nbytes} bytes do not hold {dt}{list(shape)}")
    return dt, shape


def encode_config(schema: Schema, hot_capacity: int, total_capacity: int,
                  prioritized: tuple[float, float] | None = None,
                  sampling: Sampling = DEFAULT_SAMPLING) -> pb.BufferConfig:
    """``prioritized``: ``(alpha, beta)`` for a prioritized buffer, None for uniform.
    ``sampling``: ``(mode, max_times_sampled, rate_limiter)``."""
    config = pb.BufferConfig(
        hot_capacity=hot_capacity,
        total_capacity=total_capacity,
        fields=[pb.FieldSpec(name=f.name, dtype=f.dtype.str, shape=f.shape) for f in schema],
    )
    if prioritized is not None:
        config.prioritized.alpha, config.prioritized.beta = prioritized
    mode, max_times_sampled, limiter = sampling
    config.mode = "" if mode == "replay" else mode
    config.max_times_sampled = max_times_sampled or 0
    if limiter is not None:
        config.rate_limiter.CopyFrom(pb.RateLimiter(
            samples_per_insert=limiter.samples_per_insert,
            min_size_to_sample=limiter.min_size_to_sample,
            min_diff=limiter.min_diff, max_diff=limiter.max_diff))
    return config


def decode_prioritized(config: pb.BufferConfig) -> tuple[float, float] | None:
    """``(alpha, beta)`` of a prioritized buffer's config, None for uniform."""
    if not config.HasField("prioritized"):
        return None
    return config.prioritized.alpha, config.prioritized.beta


def decode_sampling(config: pb.BufferConfig) -> Sampling:
    """``(mode, max_times_sampled, rate_limiter)``; raises InvalidConfigError."""
    limiter = None
    if config.HasField("rate_limiter"):
        r = config.rate_limiter
        limiter = RateLimiter(r.samples_per_insert, r.min_size_to_sample, r.min_diff, r.max_diff)
    return config.mode or "replay", config.max_times_sampled or None, limiter


def decode_config(config: pb.BufferConfig) -> tuple[Schema, int, int]:
    """Return (schema, hot_capacity, total_capacity); raises InvalidConfigError."""
    if not config.fields:
        raise InvalidConfigError("buffer config has no fields")
    spec = {f.name: (f.dtype, tuple(f.shape)) for f in config.fields}
    if len(spec) != len(config.fields):
        raise InvalidConfigError("buffer config repeats a field name")
    return Schema.from_spec(spec), config.hot_capacity, config.total_capacity


