"""The fast path's message encoding: binary sample and read requests and sample replies, JSON
for the rest.

Handlers see the same dicts whichever form a message took, so what must hold
is that decoding gives back what was encoded, and that anything the binary
form cannot carry exactly still goes (as JSON) to the server's checks.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from millpond.errors import InvalidArgumentError
from millpond.remote.shm import protocol

U64 = st.integers(0, 2**64 - 1)
SAMPLES = st.fixed_dictionaries({
    "op": st.just("sample"), "buffer": st.text(max_size=40), "segment": U64, "offset": U64,
    "batch_size": U64, "seed": st.none() | U64,
    "timeout": st.floats(allow_nan=False) | st.integers(0, 2**53)})


@given(SAMPLES)
def test_sample_requests_travel_binary_and_decode_to_what_was_sent(message):
    data = protocol.encode(message)
    assert data[:1] != b"{"
    assert protocol.decode(data) == message


NAMES = st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=20)
READS = U64.flatmap(lambda n: st.fixed_dictionaries({
    "op": st.just("read"), "buffer": NAMES, "push_segment": U64,
    "seqs": st.just([0, "<i8", [n]]), "n": st.just(n),
    "fields": st.none() | st.lists(NAMES, min_size=1, max_size=5),
    "positions": st.booleans(), "episode_ids": st.booleans(), "segment": U64, "offset": U64}))


@given(READS)
def test_read_requests_travel_binary_and_decode_to_what_was_sent(message):
    data = protocol.encode(message)
    assert data[:1] != b"{"
    assert protocol.decode(data) == message


@pytest.mark.parametrize("change", [
    {"fields": []}, {"fields": ["a\0b"]}, {"buffer": "b\0"}, {"fields": "obs"},
    {"fields": [3]}, {"seqs": [64, "<i8", [4]]}, {"seqs": [0, "<i8", [5]]},
    {"seqs": (0, "<i8", [4])}, {"n": -1}, {"n": 2**64}, {"positions": 1},
    {"episode_ids": None}, {"segment": True}, {"offset": 1.0}, {"extra": 1},
])
def test_what_the_binary_read_cannot_carry_goes_as_json_unchanged(change):
    message = {"op": "read", "buffer": "b", "push_segment": 1, "seqs": [0, "<i8", [4]],
               "n": 4, "fields": None, "positions": True, "episode_ids": False,
               "segment": 2, "offset": 0, **change}
    data = protocol.encode(message)
    assert data[:1] == b"{"
    assert protocol.decode(data) == json.loads(data)


@given(st.lists(st.sampled_from(sorted(protocol.SAMPLE_EXTRAS)), unique=True))
def test_sample_replies_travel_binary_and_name_the_extras_written(extras):
    data = protocol.encode({"ok": True, "extras": extras})
    assert len(data) == protocol.SAMPLE_REPLY.size
    assert sorted(protocol.decode(data)["extras"]) == sorted(extras)


@pytest.mark.parametrize("change", [
    {"batch_size": -1}, {"batch_size": 2**64}, {"batch_size": True}, {"batch_size": 2.0},
    {"seed": -5}, {"seed": "7"}, {"segment": None}, {"offset": [0]}, {"timeout": None},
    {"timeout": "1"}, {"buffer": 3}, {"filter_meta": {"task": 1}}, {"extra": 1},
])
def test_what_the_binary_form_cannot_carry_goes_as_json_unchanged(change):
    message = {"op": "sample", "buffer": "b", "segment": 1, "offset": 0, "batch_size": 4,
               "seed": None, "timeout": 0.0, **change}
    data = protocol.encode(message)
    assert data[:1] == b"{"
    assert protocol.decode(data) == message


def test_nan_timeout_survives_the_binary_form_for_the_server_to_refuse():
    decoded = protocol.decode(protocol.encode(
        {"op": "sample", "buffer": "b", "segment": 1, "offset": 0, "batch_size": 4,
         "seed": None, "timeout": math.nan}))
    assert math.isnan(decoded["timeout"])


@pytest.mark.parametrize("data", [
    protocol.encode({"op": "sample", "buffer": "b", "segment": 1, "offset": 0,
                     "batch_size": 4, "seed": None, "timeout": 0.0})[:20],
    b"\x02", b"\x02\x00\x00", b"[1, 2]", b"\x01" + bytes(46), b"\x01" + bytes(47) + b"\xff",
    b"\x03" + bytes(30), b"\x03" + bytes(39) + b"\xff",  # truncated; a name not UTF-8
    b"\x03\x04" + bytes(38) + b"b",  # says fields follow, names none
])
def test_malformed_messages_are_invalid_arguments(data):
    with pytest.raises((InvalidArgumentError, ValueError)):
        protocol.decode(data)


def test_other_messages_stay_json():
    for message in ({"op": "hello", "version": protocol.VERSION}, {"ok": True},
                    {"ok": True, "size": 3, "pushed": 9}, {"ok": True, "extras": ["nope"]},
                    protocol.error_reply(InvalidArgumentError("no"))):
        data = protocol.encode(message)
        assert data[:1] == b"{" and protocol.decode(data) == message
