"""What the client's gRPC calls send, and how their replies are read: shared by both gRPC
transports.

The blocking transport (:mod:`millpond.remote.grpc_transport`: threads, each with its
open streams) and the asyncio one (:mod:`millpond.remote.aio_transport`: coroutines on a
``grpc.aio`` channel) make their calls differently, and build and read them here, the
same way: the same bytes go out, and a reply that one refuses the other refuses too
(the checks themselves: :mod:`millpond.remote.replies`). Everything here is a pure
function of its arguments: no channel, no I/O, no waiting.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import grpc
import numpy as np

from millpond.core.schema import Schema
from millpond.core.sequences import Spec
from millpond.errors import DeadlineExceededError, MessageTooLargeError, ServerUnavailableError
from millpond.remote.shm.protocol import SAMPLE_EXTRAS
from millpond.v1 import replay_pb2 as pb
from millpond.wire.episodic import encode_meta, encode_updates
from millpond.wire.frames import (
    PUSH_BATCH_FIELD,
    PUSH_UPDATES_FIELD,
    SAMPLE_BATCH_FIELD,
    decode_batch_field,
    encode_messages,
    encode_with_batch,
)
from millpond.wire.inplace import sole_writable

log = logging.getLogger("millpond.client")

# A call that finds its channel not connected waits this long for it (READY) before it
# says what it waits for (wait_for_server=True: one warning) ...
NOTICE_S = 1.0
# ... or, failing fast (wait_for_server=False), before it gives up: at once when the
# channel has failed to connect (refused, no such host, TLS), else after this long.
FAIL_FAST_S = 2.0

# Protobuf framing per column (name, dtype, shape, length prefixes) is tiny;
# this margin keeps size checks honest without computing it exactly.
FRAMING_BYTES = 64 * 1024


def push_request(buffer: str, n: int, columns: dict[str, np.ndarray], schema: Schema,
                 priorities: np.ndarray | None, timeout: float, updates: list | None,
                 max_message_bytes: int) -> bytes:
    """A serialized PushBatchRequest of ``n`` records (``columns``, validated already), or
    MessageTooLargeError before anything is sent if it would exceed ``max_message_bytes``."""
    nbytes = n * schema.record_nbytes + FRAMING_BYTES
    if nbytes > max_message_bytes:
        raise MessageTooLargeError(
            f"push_batch of {n:,} records is {nbytes:,} bytes, over the client's message "
            f"limit of {max_message_bytes:,} bytes (max_message_mb); split it into "
            "smaller batches")
    request = encode_with_batch(PUSH_BATCH_FIELD, columns, buffer, priorities, timeout)
    if updates:  # episode meta and ends, applied with the records
        request += encode_messages(PUSH_UPDATES_FIELD, [
            u.SerializeToString() for u in encode_updates(buffer, updates).updates])
    return request


def sample_request(buffer: str, batch_size: int, seed: int | None, timeout: float,
                   filter_meta: dict[str, np.ndarray] | None = None,
                   n_step: int | None = None, gamma: float = 0.0) -> bytes:
    """A serialized SampleRequest (``n_step``: of n-step transitions, discounted by ``gamma``)."""
    if seed is None and filter_meta is None and n_step is None:  # a learner's usual call
        return plain_sample_request(buffer, batch_size, timeout)
    request = pb.SampleRequest(name=buffer, batch_size=batch_size, seed=seed, timeout=timeout,
                               filter_meta=encode_meta(filter_meta), stored_form=True)
    if n_step is not None:
        request.n_step, request.gamma = n_step, gamma
    return request.SerializeToString()


@functools.lru_cache(maxsize=256)
def plain_sample_request(buffer: str, batch_size: int, timeout: float) -> bytes:
    """A serialized SampleRequest without seed or filter (building one costs a cold
    client some 10 us a call)."""
    return pb.SampleRequest(name=buffer, batch_size=batch_size, timeout=timeout,
                            stored_form=True).SerializeToString()


@functools.lru_cache(maxsize=256)
def sample_specs(schema: Schema, batch_size: int, extras: bool) -> Spec:
    """What a sample of ``batch_size`` records of ``schema`` returns (``extras``: a
    prioritized buffer's :data:`SAMPLE_EXTRAS` too)."""
    return (*((f.name, f.dtype, (batch_size, *f.shape)) for f in schema),
            *((name, dtype, (batch_size,)) for name, dtype in SAMPLE_EXTRAS.items() if extras))


def sequences_request(buffer: str, batch_size: int, filter_meta: dict[str, np.ndarray] | None,
                      params: dict[str, Any], timeout: float) -> pb.SampleSequencesRequest:
    return pb.SampleSequencesRequest(
        name=buffer, batch_size=batch_size, seq_len=params["seq_len"], seed=params["seed"],
        timeout=timeout, filter_meta=encode_meta(filter_meta), stored_form=True)


def episodes_request(buffer: str, batch_size: int, filter_meta: dict[str, np.ndarray] | None,
                     params: dict[str, Any], timeout: float) -> pb.SampleEpisodesRequest:
    return pb.SampleEpisodesRequest(
        name=buffer, batch_size=batch_size, seed=params["seed"], max_len=params["max_len"],
        timeout=timeout, filter_meta=encode_meta(filter_meta))


def catalog_request(buffer: str, filter_meta: dict[str, np.ndarray] | None
                    ) -> pb.EpisodeCatalogRequest:
    return pb.EpisodeCatalogRequest(name=buffer, filter_meta=encode_meta(filter_meta))


def read_request(buffer: str, seqs: np.ndarray, names: list[str] | None, positions: bool,
                 episode_ids: bool) -> pb.ReadRequest:
    return pb.ReadRequest(name=buffer, seqs=seqs.tolist(), fields=names or [],
                          positions=positions, episode_ids=episode_ids)


def update_priorities_request(buffer: str, indices: np.ndarray, priorities: np.ndarray
                              ) -> pb.UpdatePrioritiesRequest:
    return pb.UpdatePrioritiesRequest(name=buffer, indices=indices.tolist(),
                                      priorities=priorities.tolist())


def reply_columns(reply: bytes) -> dict[str, np.ndarray]:
    """The arrays of a reply framed like a SampleReply. Call it on the reply itself, held
    by nothing else (``reply_columns(await call(...))``): see below."""
    # The caller may modify the arrays in place, as with in-process results.
    # The reply is new and ours alone (checked): its columns are writable
    # views of it, the aligned ones kept as they are; anything else, and
    # every column of a reply someone else might see, is copied out once.
    whole = sole_writable(reply)
    columns = decode_batch_field(reply if whole is None else whole.data, SAMPLE_BATCH_FIELD)
    return {name: column if whole is not None and column.flags.aligned else np.array(column)
            for name, column in columns.items()}


def unreachable_cause(details: str) -> str:
    """What a channel's last connection error (``details`` of an UNAVAILABLE status)
    means, in words, with the error itself: the words are a hint for people only (no
    error is told apart by them)."""
    text = details.lower()
    if "connection refused" in text:
        what = "nothing listens there (connection refused): is the server up, on this port?"
    elif any(word in text for word in ("dns", "resolv", "domain name not found",
                                       "name or service not known", "hostname")):
        what = "its host name does not resolve (DNS)"
    elif any(word in text for word in ("ssl", "tls", "handshake", "certificate")):
        what = ("the TLS handshake failed: do TLS settings agree (tls=, tls_ca=, "
                "tls_cert=/tls_key= or MILLPOND_TLS_*)?")
    elif "timed out" in text or "deadline" in text:
        what = "no answer (a firewall, or a host that is down?)"
    else:
        what = ("it cannot be reached: is it up at that address, and do TLS settings agree "
                "(tls=, tls_ca=, tls_cert=/tls_key= or MILLPOND_TLS_*)?")
    return f"{what} [{details}]" if details else what


class Episodes:
    """Whether a client told of the current episode of its server's unreachability (one
    per client: its connections come and go, a connection that failed to open included)."""

    def __init__(self) -> None:
        self.told = False


def patience(fail_fast: bool, left: float) -> float:
    """How long a call's first health check may wait for its channel (``left``: the
    call's time left): NOTICE_S before it tells what it waits for, FAIL_FAST_S before it
    gives up (``fail_fast``: ``wait_for_server=False``)."""
    return max(0.0, min(FAIL_FAST_S if fail_fast else NOTICE_S, left))


def settle_reach(cause: str | None, episodes: Episodes, address: str, fail_fast: bool,
                 left: float) -> bool:
    """Whether the server was reached, given why the health checks before a call did not
    reach it (``cause``; None: answered). Not reached: ServerUnavailableError when failing
    fast, else the waiting notice, once per episode of unreachability (``left``: the
    call's time left)."""
    if cause is None:
        episodes.told = False
        return True
    if fail_fast:
        raise unavailable(address or "?", cause)
    if not episodes.told:
        episodes.told = True
        waiting_notice(address or "?", cause, left)
    return False


def waiting_notice(address: str, cause: str, left: float) -> None:
    """Log what a call that waits for the server at ``address`` waits for (once per
    episode of unreachability: :class:`Episodes`)."""
    log.warning("the server at %s is not reachable: %s; calls wait for it up to their "
                "deadline (%.0f s left); connect(wait_for_server=False) fails fast instead",
                address, cause, left)


def unavailable(address: str, cause: str) -> ServerUnavailableError:
    """The error of a call that fails fast (``wait_for_server=False``)."""
    return ServerUnavailableError(
        f"the server at {address} cannot be reached: {cause} (wait_for_server=False: "
        "not waiting for it)")


def probe_cause(probe: grpc.RpcError | None) -> str | None:
    """Why a health check made without waiting (``probe``: its error, None if answered)
    did not reach the server; None if it did (any answer but UNAVAILABLE or
    DEADLINE_EXCEEDED comes from the server)."""
    if probe is None:
        return None
    code = probe.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return unreachable_cause(probe.details() or "")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer yet, still connecting (a firewall, or a host that is down?)"
    return None


def unreached(error: DeadlineExceededError, probe: grpc.RpcError | None, address: str = ""
              ) -> DeadlineExceededError:
    """What a call that waited its whole deadline says, given how a health check made
    without waiting (``probe``: its error, None if it was answered) fared: a TLS mismatch
    (plaintext to a TLS server, an unknown CA, no client certificate) looks to a waiting
    call like a server that is not up, and the channel knows its last connection error."""
    if probe is not None and probe.code() == grpc.StatusCode.UNAVAILABLE:
        return DeadlineExceededError(
            f"{error}: the server at {address or '?'} was never reached: "
            f"{unreachable_cause(probe.details() or '')}")
    return error
