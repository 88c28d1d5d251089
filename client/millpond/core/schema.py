"""Record schemas: named fields, each a numpy dtype and a per-record shape.

A :class:`Schema` is immutable and validates every batch before the buffer
touches it (:meth:`Schema.coerce_batch`), so a rejected push changes nothing.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import abc
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from millpond.errors import (
    DTypeMismatchError,
    FieldMismatchError,
    InvalidConfigError,
    ShapeMismatchError,
)

# Fixed-size numeric kinds only: no objects, strings or datetimes ever cross
# the wire or land in a file.
_STORABLE_KINDS = "biuf"
# Bounds a hostile config (or column header) cannot get past: numpy allows 64
# dimensions in all, and no record needs more than this many bytes.
MAX_FIELD_NDIM = 16
MAX_DIMENSION = 2**31 - 1
MAX_RECORD_BYTES = 1 << 30
MAX_FIELDS = 1024  # per schema: far beyond any RL record, and cheap to check on every push
MAX_NAME_CHARS = 128


def plain_dtype(dtype: Any) -> np.dtype | None:
    """``np.dtype(dtype)`` if it is a fixed-size bool/int/uint/float, else None."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    if dt.kind not in _STORABLE_KINDS or dt.fields is not None or dt.subdtype is not None:
        return None
    return dt


def _storage_dtype(dtype: Any) -> np.dtype:
    dt = plain_dtype(dtype)
    if dt is None:
        raise InvalidConfigError(f"dtype {dtype!r} is not a fixed-size bool/int/uint/float type")
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt


@dataclass(frozen=True)
class Field:
    """One named column: ``dtype`` (little-endian) and per-record ``shape``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @functools.cached_property  # hot paths ask often; the field never changes
    def size(self) -> int:
        """Number of scalars per record."""
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes per record."""
        return self.size * self.dtype.itemsize

    def spec(self) -> tuple[str, tuple[int, ...]]:
        return (self.dtype.str, self.shape)


def _make_field(name: Any, dtype: Any, shape: Any) -> Field:
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidConfigError(f"field name must be a Python identifier, got {name!r:.80}")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidConfigError(f"field name {name[:40]!r}... has {len(name):,} characters; "
                                 f"at most {MAX_NAME_CHARS} are allowed")
    raw = shape if isinstance(shape, (tuple, list)) else (shape,)
    # operator.index, not int(): a dimension of 2.5 or "3" is a mistake, not 2 or 3.
    try:
        if any(isinstance(d, bool) for d in raw):
            raise TypeError("bool is not a dimension")
        dims = tuple(operator.index(d) for d in raw)
    except TypeError as exc:
        raise InvalidConfigError(f"field {name!r}: shape must be a tuple of ints") from exc
    if any(d <= 0 for d in dims):
        raise InvalidConfigError(f"field {name!r}: every dimension must be > 0, got {dims}")
    if len(dims) > MAX_FIELD_NDIM or any(d > MAX_DIMENSION for d in dims):
        raise InvalidConfigError(
            f"field {name!r}: at most {MAX_FIELD_NDIM} dimensions of at most {MAX_DIMENSION:,}, "
            f"got {len(dims)} dimensions")
    field = Field(name, _storage_dtype(dtype), dims)
    if field.nbytes > MAX_RECORD_BYTES:
        raise InvalidConfigError(f"field {name!r}: {field.nbytes:,} bytes per record is more than "
                                 f"the {MAX_RECORD_BYTES:,} a record may have")
    return field


class Schema:
    """An ordered set of fields. Equality compares names, dtypes and shapes."""

    def __init__(self, fields: list[Field]):
        if not fields:
            raise InvalidConfigError("a schema needs at least one field")
        if len(fields) > MAX_FIELDS:
            raise InvalidConfigError(f"a schema may have at most {MAX_FIELDS:,} fields, "
                                     f"got {len(fields):,}")
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise InvalidConfigError(f"duplicate field names in {names}")
        record_nbytes = sum(f.nbytes for f in fields)
        if record_nbytes > MAX_RECORD_BYTES:
            raise InvalidConfigError(f"a record may have at most {MAX_RECORD_BYTES:,} bytes")
        self.fields: tuple[Field, ...] = tuple(fields)
        self._by_name = {f.name: f for f in fields}
        # Computed once: hot paths (every push and sample, and the caches keyed
        # by schema, which compare equal schemas) ask for these on each call.
        self.names: tuple[str, ...] = tuple(names)
        self.record_nbytes: int = record_nbytes  # payload bytes of one record
        self._key = tuple(self.spec().items())
        self._hash = hash(self._key)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "Schema":
        """Build from ``{name: (dtype, shape)}``; ``shape`` ``()`` is a scalar."""
        if not isinstance(spec, Mapping):
            raise InvalidConfigError("fields must be a mapping name -> (dtype, shape)")
        fields = []
        for name, value in spec.items():
            try:
                dtype, shape = value
            except (TypeError, ValueError) as exc:
                raise InvalidConfigError(f"field {name!r}: expected (dtype, shape)") from exc
            fields.append(_make_field(name, dtype, shape))
        return cls(fields)

    @classmethod
    def transition(cls, obs_dim: int, act_dim: int) -> "Schema":
        """The reference API's transition schema (``obs_dim``/``act_dim``)."""
        for label, dim in (("obs_dim", obs_dim), ("act_dim", act_dim)):
            if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) or dim <= 0:
                raise InvalidConfigError(f"{label} must be a positive integer, got {dim!r}")
        return cls.from_spec(transition_spec(int(obs_dim), int(act_dim)))

    @classmethod
    def resolve(cls, obs_dim: Any = None, act_dim: Any = None, fields: Any = None) -> "Schema":
        """The schema a buffer constructor asked for: ``fields`` or the dims."""
        if fields is not None:
            if obs_dim is not None or act_dim is not None:
                raise InvalidConfigError("give either fields= or obs_dim/act_dim, not both")
            return fields if isinstance(fields, Schema) else cls.from_spec(fields)
        if obs_dim is None or act_dim is None:
            raise InvalidConfigError("obs_dim and act_dim are required unless fields= is given")
        return cls.transition(obs_dim, act_dim)

    def spec(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The inverse of :meth:`from_spec` (dtype as a string)."""
        return {f.name: f.spec() for f in self.fields}

    def __getitem__(self, name: str) -> Field:
        return self._by_name[name]

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Schema) and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        parts = ", ".join(f"{f.name}: {f.dtype.name}{list(f.shape)}" for f in self.fields)
        return f"Schema({parts})"

    @functools.cached_property
    def is_transition(self) -> bool:
        """True for the reference transition schema built from obs/act dims."""
        if self.names != TRANSITION_NAMES:
            return False
        obs_dim, act_dim = self["obs"].size, self["actions"].size
        return self == Schema.transition(obs_dim, act_dim)

    # ---- validation -------------------------------------------------------

    def coerce_batch(self, columns: Mapping[str, Any]) -> tuple[int, dict[str, np.ndarray]]:
        """Validate a batch and return ``(n, {name: array[n, *shape]})``.

        Accepts per field an array shaped ``[n, *shape]`` or flat ``[n * size]``
        (the reference's flat layout). Values are converted to the field dtype
        only when that loses nothing of kind (ints into floats, float64 into
        float32); bool fields accept any numeric input, non-zero being true.
        Raises a typed error and changes nothing on bad input.
        """
        self._check_names(columns)
        arrays = {name: _as_array(name, columns[name]) for name in self.names}
        n = self._batch_length(arrays)
        return n, {f.name: _fit(f, arrays[f.name], n) for f in self.fields}

    def coerce_record(self, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Validate one record and return it as a batch of length 1."""
        self._check_names(record)
        return {f.name: check_value(f, record[f.name])[np.newaxis] for f in self.fields}

    def _check_names(self, columns: Mapping[str, Any]) -> None:
        if not isinstance(columns, abc.Mapping):
            raise FieldMismatchError("a batch must be a mapping of field name -> array")
        if columns.keys() == self._by_name.keys():  # the usual case, in one comparison
            return
        missing = [n for n in self.names if n not in columns]
        extra = [n for n in columns if n not in self._by_name]
        if missing or extra:
            raise FieldMismatchError(
                f"batch fields do not match the schema: missing {missing}, unknown {extra}"
            )

    def _batch_length(self, arrays: dict[str, np.ndarray]) -> int:
        lengths = set()
        for f in self.fields:
            arr = arrays[f.name]
            shape = arr.shape
            if shape[1:] == f.shape and len(shape) == 1 + len(f.shape):
                lengths.add(shape[0])
            elif arr.ndim == 1 and arr.size % f.size == 0:
                lengths.add(arr.size // f.size)
            else:
                raise ShapeMismatchError(
                    f"field {f.name!r}: expected shape [n, {', '.join(map(str, f.shape))}]"
                    f" or flat [n*{f.size}], got {list(arr.shape)}".replace("[n, ]", "[n]")
                )
        if len(lengths) != 1:
            got = {f.name: list(arrays[f.name].shape) for f in self.fields}
            raise ShapeMismatchError(f"fields disagree on the number of records: {got}")
        return lengths.pop()


TRANSITION_NAMES = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")


def transition_spec(obs_dim: int, act_dim: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Field spec of the reference transition record."""
    return {
        "obs": ("float32", (obs_dim,)),
        "next_obs": ("float32", (obs_dim,)),
        "actions": ("float32", (act_dim,)),
        "rewards": ("float32", ()),
        "terminated": ("bool", ()),
        "truncated": ("bool", ()),
    }


def check_value(field: Field, value: Any) -> np.ndarray:
    """One value of ``field`` as an array of its shape and dtype (flat input of the
    right size is reshaped); conversions as for batches."""
    arr = _as_array(field.name, value)
    if arr.shape != field.shape and not (arr.ndim <= 1 and arr.size == field.size):
        raise ShapeMismatchError(
            f"field {field.name!r}: expected shape {field.shape}, got {arr.shape}")
    return _fit(field, arr.reshape((1,) + field.shape), 1)[0]


def _as_array(name: str, value: Any) -> np.ndarray:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.dtype.kind not in _STORABLE_KINDS:
        raise DTypeMismatchError(f"field {name!r}: cannot store dtype {arr.dtype}")
    return arr


def _fit(field: Field, arr: np.ndarray, n: int) -> np.ndarray:
    """Reshape to ``[n, *shape]`` and convert to the field dtype (no copy if equal).

    Conversion rules: bool fields take any number (non-zero is true); float
    fields take any bool/int/float; integer fields take bools and integers
    whose values fit. Floats into integer fields are refused.
    """
    full = (n, *field.shape)
    if arr.shape != full:  # flat [n * size]
        arr = arr.reshape(full)
    src, dst = arr.dtype, field.dtype
    if src == dst:
        # A bool array made from raw bytes (the wire, shared memory) may hold
        # 2..255: store what numpy means by it, True, as 1.
        if dst.kind == "b" and arr.size and _max_byte(arr.view(np.uint8)) > 1:
            return arr != 0
        return arr
    if dst.kind == "b":
        return arr != 0
    if dst.kind == "f" or (src.kind in "bui" and np.can_cast(src, dst, casting="safe")):
        return arr.astype(dst)
    if src.kind in "ui" and (arr.size == 0 or _ints_fit(arr, dst)):
        return arr.astype(dst)
    raise DTypeMismatchError(f"field {field.name!r}: cannot store {src} as {dst} without loss")


_max_byte = functools.partial(np.maximum.reduce, axis=None)  # ndarray.max without its wrapper


def _ints_fit(arr: np.ndarray, dtype: np.dtype) -> bool:
    info = np.iinfo(dtype)
    return int(arr.min()) >= info.min and int(arr.max()) <= info.max
