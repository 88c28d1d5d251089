"""The hand-written wire format agrees with protobuf and refuses hostile bytes."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import millpond
from millpond.v1 import replay_pb2 as pb
from millpond.wire.codec import decode_batch, encode_batch
from millpond.wire.frames import (
    PUSH_BATCH_FIELD,
    PUSH_PRIORITIES_FIELD,
    SAMPLE_BATCH_FIELD,
    decode_batch_field,
    decode_doubles,
    decode_name,
    encode_with_batch,
    encoded_batch_nbytes,
)

DTYPES = st.sampled_from(["<f4", "<f8", "|u1", "<i8", "|b1", "<u2", "<f2"])
ARRAYS = DTYPES.flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5))
)
COLUMNS = st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), ARRAYS, max_size=4)


def same_columns(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
        for k in a
    )


@settings(max_examples=150, deadline=None)
@given(columns=COLUMNS, name=st.text(min_size=0, max_size=20))
def test_push_batch_request_is_byte_identical_to_protobuf(columns, name):
    ours = encode_with_batch(PUSH_BATCH_FIELD, columns, name)
    theirs = pb.PushBatchRequest(name=name, batch=encode_batch(columns)).SerializeToString()
    assert ours == theirs
    assert decode_name(ours) == name
    assert same_columns(decode_batch_field(ours, PUSH_BATCH_FIELD), columns)


@settings(max_examples=50, deadline=None)
@given(columns=COLUMNS, priorities=st.lists(st.floats(0, 1e6), max_size=20))
def test_push_batch_priorities_match_protobuf(columns, priorities):
    ours = encode_with_batch(PUSH_BATCH_FIELD, columns, "b", np.array(priorities))
    theirs = pb.PushBatchRequest(name="b", batch=encode_batch(columns),
                                 priorities=priorities).SerializeToString()
    assert ours == theirs
    np.testing.assert_array_equal(decode_doubles(ours, PUSH_PRIORITIES_FIELD), priorities)


@settings(max_examples=150, deadline=None)
@given(columns=COLUMNS)
def test_sample_reply_is_byte_identical_to_protobuf(columns):
    ours = encode_with_batch(SAMPLE_BATCH_FIELD, columns)
    assert ours == pb.SampleReply(batch=encode_batch(columns)).SerializeToString()
    assert same_columns(decode_batch_field(ours, SAMPLE_BATCH_FIELD), columns)
    sizes = {k: (v.dtype.str, v.shape, v.nbytes) for k, v in columns.items()}
    assert encoded_batch_nbytes(sizes) == len(ours)


def test_parser_reads_what_protobuf_writes_including_unknown_fields():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = pb.PushBatchRequest(name="b", batch=encode_batch({"x": arr})).SerializeToString()
    raw += b"\x78\x05"  # field 15, varint: unknown to this schema, skipped
    assert decode_name(raw) == "b"
    np.testing.assert_array_equal(decode_batch_field(raw, PUSH_BATCH_FIELD)["x"], arr)
    assert same_columns(decode_batch(pb.PushBatchRequest.FromString(raw).batch), {"x": arr})


def hostile(raw: bytes) -> list[bytes]:
    return [raw[:cut] for cut in range(1, len(raw))] + [raw[:-1] + b"\xff", b"\x12\xff\xff\xff\xff\x0f"]


def test_truncated_or_garbled_messages_are_read_as_protobuf_reads_them():
    """Each hostile variant is either refused with a typed error, as protobuf refuses
    it (or as our column checks refuse what protobuf parses), or decoded to exactly
    what protobuf decodes: garbage is never silently accepted."""
    raw = encode_with_batch(PUSH_BATCH_FIELD, {"x": np.arange(6, dtype=np.int64)}, "buf")
    outcomes = set()
    for bad in hostile(raw):
        outcomes.add(same_as_protobuf(bad))
    assert outcomes == {"refused", "decoded"}  # both kinds occur among the variants


def same_as_protobuf(message: bytes) -> str:
    try:
        ours = decode_batch_field(message, PUSH_BATCH_FIELD)
    except millpond.InvalidArgumentError as exc:
        ours = exc
    try:
        theirs = decode_batch(pb.PushBatchRequest.FromString(message).batch)
    except DecodeError:
        assert isinstance(ours, millpond.InvalidArgumentError), (message, ours)
        return "refused"
    except millpond.InvalidArgumentError as exc:  # parsed, but its columns are not sound
        assert type(ours) is type(exc), (message, ours, exc)
        return "refused"
    assert not isinstance(ours, Exception), (message, ours)
    assert same_columns(ours, theirs), message
    return "decoded"


@pytest.mark.parametrize(
    "column, error",
    [
        (pb.Column(name="x", dtype="<f4", shape=[3], data=b"\0" * 8), millpond.ShapeMismatchError),
        (pb.Column(name="x", dtype="<f4", shape=[-1], data=b""), millpond.ShapeMismatchError),
        (pb.Column(name="x", dtype="O", shape=[1], data=b"\0" * 8), millpond.DTypeMismatchError),
        (pb.Column(name="x", dtype="not-a-dtype", shape=[1], data=b"\0"), millpond.DTypeMismatchError),
        (pb.Column(name="x", dtype="<U3", shape=[1], data=b"\0" * 12), millpond.DTypeMismatchError),
    ],
    ids=["short-data", "negative-dim", "object", "unknown", "unicode"],
)
def test_bad_columns_are_refused(column, error):
    raw = pb.SampleReply(batch=pb.Batch(columns=[column])).SerializeToString()
    with pytest.raises(error):
        decode_batch_field(raw, SAMPLE_BATCH_FIELD)


def test_repeated_column_is_refused():
    col = pb.Column(name="x", dtype="|u1", shape=[1], data=b"\1")
    raw = pb.SampleReply(batch=pb.Batch(columns=[col, col])).SerializeToString()
    with pytest.raises(millpond.ShapeMismatchError):
        decode_batch_field(raw, SAMPLE_BATCH_FIELD)
