"""The fast path's message encoding: binary sample requests and replies, JSON for the rest.

Handlers see the same dicts whichever form a message took, so what must hold
is that decoding gives back what was encoded, and that anything the binary
form cannot carry exactly still goes (as JSON) to the server's checks.
"""

from __future__ import annotations

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
