"""Client-side batching for actors that push one record per environment step.

A :class:`PushBatcher` copies each record into preallocated column arrays and
hands them to a ``send`` callable (e.g. a remote buffer's batch push) once
``max_records`` are pending, or once the oldest pending record is
``max_delay`` seconds old, or on :meth:`PushBatcher.flush` /
:meth:`PushBatcher.close` / interpreter exit.

The batcher's shared state, its slots, locks and thread are in
:mod:`millpond.remote.batch_state`; see the class docstring for the contract.
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping

from millpond.remote.batch_state import SendFn, _State, _stop_from_finalizer
from millpond.core.checks import is_integral, is_real
from millpond.core.schema import Schema
from millpond.errors import InvalidArgumentError

__all__ = ["PushBatcher", "SendFn"]


class PushBatcher:
    """Accumulate single records and send them as batches.

    ``send(columns)`` stores one batch ``{field: array[n, *shape]}`` (for a
    remote buffer: its batch push). It may raise; :class:`~millpond.errors.ReplayError`
    subclasses are passed through unchanged. The arrays it gets are views of
    the batcher's own buffers, reused once ``send`` returns: ``send`` must
    copy them if it keeps them (encoding or storing them counts as a copy).
    ``send`` is never called concurrently for one batcher, and batches go out
    in the order their records were added. ``send`` must not call back into
    the same batcher.

    **Records are acknowledged only when flushed.** :meth:`add` returning
    means the record was validated and copied, not that it is stored. It is
    stored once :meth:`flush` (or :meth:`close`) returns without raising, or
    once a send that included it returned. Sends happen:

    * when ``max_records`` records are pending (in the :meth:`add` that
      filled the batch, which raises the send's error);
    * when the oldest pending record is ``max_delay`` seconds old, from a
      background thread (``max_delay=None`` turns this off). Its error is
      kept and raised by the next :meth:`add`, :meth:`flush` or
      :meth:`close` (if several fail in between, the first is raised);
    * on :meth:`flush`, :meth:`close`, garbage collection of the batcher and
      interpreter exit (errors there are printed to stderr: nobody is left
      to catch them).

    A failed send drops its batch (it is not retried) and raises. ``add`` is
    thread-safe; several threads may add concurrently.
    """

    def __init__(
        self,
        schema: Schema,
        send: SendFn,
        max_records: int = 256,
        max_delay: float | None = 0.05,
    ):
        if not isinstance(schema, Schema):
            raise InvalidArgumentError(f"schema must be a millpond Schema, got {schema!r}")
        if not callable(send):
            raise InvalidArgumentError("send must be callable")
        if (not is_integral(max_records) or isinstance(max_records, bool)
                or max_records <= 0):
            raise InvalidArgumentError(
                f"max_records must be a positive integer, got {max_records!r}"
            )
        if max_delay is not None:
            if (not is_real(max_delay) or isinstance(max_delay, bool)
                    or not 0 <= max_delay < float("inf")):
                raise InvalidArgumentError(
                    f"max_delay must be None or a finite number of seconds >= 0, got {max_delay!r}"
                )
            max_delay = float(max_delay)
        self.schema = schema
        self.max_records = int(max_records)
        self.max_delay = max_delay
        self._state = _State(schema, send, self.max_records, max_delay)
        # Dropped without close(): wake the thread, which sends what is
        # pending and exits. The finalizer holds the state, not the batcher.
        self._finalizer = weakref.finalize(self, _stop_from_finalizer, self._state)

    # ---- the hot path ------------------------------------------------------------

    def add(self, record: Mapping[str, Any]) -> None:
        """Validate ``record`` (``{field: value}``) and queue a copy of it.

        Raises at once, queuing nothing, on a record
        :meth:`Schema.coerce_record` would refuse (same exceptions). Also
        raises, before queuing, an error kept from a failed background send,
        and :class:`~millpond.errors.BufferClosedError` after :meth:`close`.
        If this record completes a batch, the batch is sent before returning
        and a send error is raised here (the record was part of that batch).
        Returning does **not** mean the record is stored; see :meth:`flush`.
        """
        state = self._state
        if state.error is not None:
            state.raise_kept_error()
        state.add(record)

    # ---- acknowledgement and lifecycle ---------------------------------------

    def flush(self) -> None:
        """Send what is pending; return once ``send`` has stored it.

        Every record whose :meth:`add` returned before this call is stored
        when this returns without raising (including batches another thread
        was sending). Raises the error of this send, or else an error kept
        from an earlier background send.
        """
        state = self._state
        state.flush()
        if state.error is not None:
            state.raise_kept_error()

    @property
    def pending(self) -> int:
        """Records added but not yet handed to ``send``."""
        return self._state.current.n

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Flush, then stop the background thread. Idempotent.

        Later :meth:`add` calls raise :class:`~millpond.errors.BufferClosedError`.
        Raises like :meth:`flush` (the batcher is closed even then).
        """
        state = self._state
        if not state.close_for_adds():
            return
        try:
            self.flush()
        finally:
            self._finalizer.detach()
            state.stop()
            state.join_thread()

    def __enter__(self) -> "PushBatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PushBatcher(pending={self.pending}, max_records={self.max_records}, "
            f"max_delay={self.max_delay}, closed={self.closed})"
        )
