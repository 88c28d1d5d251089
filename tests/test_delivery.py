"""Samples that consume records consume them only when their reply will be delivered.

Queue and stack samples remove what they return; a buffer with ``max_times_sampled``
counts each draw. Such a sample whose reply could not reach the client (larger than
the daemon's --max-message-mb, than the client's ``max_message_mb``, or than the
fast-path result segment it names) is refused with MessageTooLargeError before
anything is drawn: ``len(buf)`` and every record stay as they were, all still
sampleable.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import millpond
from millpond.core.sequences import sequence_specs
from millpond.remote.shm import protocol

MiB = 1 << 20
# Transitions of obs_dim=2, act_dim=1: 26 bytes a record; a prioritized sample adds
# 12 (weights float32, indices int64). 30,000 records: 0.78 MB of columns, under 1 MiB;
# with weights and indices 1.14 MB, over it.
OVER_BY_EXTRAS = 30_000
_names = itertools.count()


def records(start: int, n: int, episodic: bool = False) -> dict:
    """``n`` records whose ``rewards`` are their ids ``start..start+n``."""
    ids = np.arange(start, start + n, dtype=np.float32)
    return {"obs": np.repeat(ids[:, None], 2, 1), "next_obs": np.repeat(ids[:, None], 2, 1),
            "actions": ids[:, None] * 0.5, "rewards": ids,
            "terminated": np.zeros(n, bool) if episodic else ids % 7 == 0,
            "truncated": np.zeros(n, np.float32)}


def refused(call) -> None:
    with pytest.raises(millpond.MessageTooLargeError):
        call()


def drain(buf, n: int, chunk: int = 5_000) -> np.ndarray:
    """The ids of ``n`` records sampled ``chunk`` at a time (each reply fits any limit)."""
    return np.concatenate([buf.sample(min(chunk, n - i))["rewards"] for i in range(0, n, chunk)])


def episodic(address: str, name: str, episodes: int, steps: int, **kwargs):
    """An episodic prioritized buffer, each record drawn at most once, holding ``episodes``
    complete episodes of ``steps`` steps (meta ``task=0``)."""
    buf = millpond.connect(address, shm=False).create_buffer(
        name, capacity=episodes * steps, obs_dim=2, act_dim=1, episodes=True,
        meta_fields={"task": ("int64", ())}, prioritized=True, max_times_sampled=1, **kwargs)
    for e in range(episodes):
        with buf.one_episode(task=0):
            buf.push_batch(**records(e * steps, steps, episodic=True))
    return buf


def without_extras(specs):
    return tuple(spec for spec in specs if spec[0] not in ("weights", "indices"))


def largest_fitting(nbytes, limit: int = MiB) -> int:
    """The largest ``count`` whose array bytes ``nbytes(count)`` are at most ``limit``."""
    n = 1
    while nbytes(n * 2) <= limit:
        n *= 2
    step = n
    while step > 1:
        step //= 2
        if nbytes(n + step) <= limit:
            n += step
    return n


# ---- the fast path: its result segment ------------------------------------------------


def test_a_fast_path_sample_into_a_segment_that_cannot_hold_its_extras_uses_nothing(server):
    """The fast path's limit is the result segment the request names: one that holds the
    columns but not the weights and indices is refused before the draw."""
    client = millpond.connect(server.address, shm=True)
    n = OVER_BY_EXTRAS
    buf = client.create_buffer("shm-prio", capacity=n, obs_dim=2, act_dim=1, prioritized=True,
                               max_times_sampled=1)
    buf.push_batch(**records(0, n))
    schema = buf.config.schema
    columns_only = protocol.sample_layout(schema, n, False)[2]
    assert columns_only <= MiB < protocol.sample_layout(schema, n, True)[2]

    def into_small_segment(session):
        segment = session._free_result_segment(columns_only)  # 1 MiB
        try:
            return session._request({"op": "sample", "buffer": "shm-prio", "offset": 0,
                                     "segment": segment.id, "batch_size": n, "seed": None,
                                     "timeout": 0.0})
        finally:
            segment.free = True

    refused(lambda: client.connection.shm._on_session(10.0, into_small_segment))
    # Episodic: a window sample whose weights and indices do not fit either.
    ep = episodic(server.address, "shm-episodes", 40, 1_000)
    config = ep.config
    seq_len = 40
    batch = largest_fitting(lambda b: protocol.spec_layout(without_extras(
        sequence_specs(config, b, seq_len)))[1])
    assert protocol.spec_layout(sequence_specs(config, batch, seq_len))[1] > MiB

    def windows_into_small_segment(session):
        segment = session._free_result_segment(MiB)
        try:
            return session._request({"op": "sample_sequences", "buffer": "shm-episodes",
                                     "offset": 0, "segment": segment.id, "batch_size": batch,
                                     "seq_len": seq_len, "timeout": 0.0, "filter_meta": None})
        finally:
            segment.free = True

    refused(lambda: client.connection.shm._on_session(10.0, windows_into_small_segment))
    assert (len(buf), len(ep)) == (n, 40_000)
    assert client.transport == "shm"
    np.testing.assert_array_equal(np.sort(drain(buf, n)), np.arange(n, dtype=np.float32))
    np.testing.assert_array_equal(np.sort(drain(ep, 40_000)), np.arange(40_000, dtype=np.float32))
    assert client.calls["shm", "sample"] > 0
