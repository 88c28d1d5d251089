"""Episodic calls <-> protocol messages: meta values, filters and episode updates.

Meta values (an update's, a filter's) travel as a Batch with one column per
meta field shaped like the field; the receiver checks them against the
buffer's meta fields (:func:`millpond.core.episodes.check_meta`), as the
sender did.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from google.protobuf.message import DecodeError

from millpond.errors import InvalidArgumentError
from millpond.v1 import replay_pb2 as pb
from millpond.wire.codec import decode_batch, encode_batch
from millpond.wire.frames import MAX_MESSAGE_FIELDS


def encode_meta(meta: Mapping[str, np.ndarray] | None) -> pb.Batch:
    return encode_batch(meta or {})


def decode_meta(message: pb.Batch) -> dict[str, np.ndarray]:
    return decode_batch(message)


def encode_updates(name: str, updates: Sequence[tuple[int, Mapping[str, np.ndarray], bool]]
                   ) -> pb.UpdateEpisodesRequest:
    return pb.UpdateEpisodesRequest(name=name, updates=[
        pb.EpisodeUpdate(episode_id=episode, meta=encode_meta(meta), end=end)
        for episode, meta, end in updates])


def decode_updates(request: pb.UpdateEpisodesRequest
                   ) -> list[tuple[int, dict[str, np.ndarray], bool]]:
    if len(request.updates) > MAX_MESSAGE_FIELDS:  # each costs Python work: bounded
        raise InvalidArgumentError(f"{len(request.updates):,} episode updates in one request; "
                                   f"at most {MAX_MESSAGE_FIELDS:,} are allowed")
    return [(u.episode_id, decode_meta(u.meta), u.end) for u in request.updates]


def decode_update(raw: bytes) -> tuple[int, dict[str, np.ndarray], bool]:
    """One serialized EpisodeUpdate (a push's); InvalidArgumentError if malformed."""
    try:
        update = pb.EpisodeUpdate.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(f"malformed EpisodeUpdate: {exc}") from None
    return update.episode_id, decode_meta(update.meta), update.end


def optional(message: Any, name: str) -> Any:
    """A proto3 ``optional`` field's value, or None when unset."""
    return getattr(message, name) if message.HasField(name) else None
