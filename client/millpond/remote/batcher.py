"""Client-side batching for actors that push one record per environment step.

A :class:`PushBatcher` copies each record into preallocated column arrays and
hands them to a ``send`` callable (e.g. a remote buffer's batch push) once
``max_records`` are pending, or once the oldest pending record is
``max_delay`` seconds old, or on :meth:`PushBatcher.flush` /
:meth:`PushBatcher.close` / interpreter exit.

The class docstring states the contract; how it is kept: two sets of column arrays
("slots"), double-buffered: while one slot is being sent, ``add`` fills the other; a
full slot is never copied. One lock guards the slots (a record is copied in whole under
it, so a send never sees half a record); a second lock serialises ``send``, taken before
the first is released, so batches go out one at a time and in push order. The thread
(:func:`_age_loop`) holds this state, never the batcher: when the batcher is garbage
collected a finalizer wakes it to send what is pending and exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Mapping, NamedTuple, Protocol, cast

import numpy as np

from millpond.core.checks import is_integral, is_real
from millpond.core.schema import Schema
from millpond.errors import BufferClosedError, InvalidArgumentError

SendFn = Callable[[dict[str, np.ndarray]], Any]

# Every batcher state that may hold unsent records, for the exit hook and fork.
_live: "weakref.WeakSet[_BatcherState]" = weakref.WeakSet()


# ---- column slots ---------------------------------------------------------------


def _fast_types(field: Any) -> tuple[np.dtype, frozenset]:
    """What the fast path of ``add`` stores as is, for ``field``.

    An ndarray of exactly the field's dtype (compared by identity first: the
    canonical dtype instance) and shape; for scalar fields also Python and
    numpy scalars that store without conversion rules: ``float``/``bool``
    into float fields, ``bool`` into bool and int fields, the field's own
    numpy scalar type. Anything else goes through
    :meth:`Schema.coerce_record`, which applies (and enforces) the full rules.
    """
    scalars: tuple[type, ...] = ()
    if field.shape == ():
        native = (field.dtype.type,) if field.dtype.isnative else ()
        scalars = ((float, bool) if field.dtype.kind == "f" else (bool,)) + native
    return np.dtype(field.dtype.str), frozenset(scalars)


class _FieldPlan(NamedTuple):
    """How ``add`` writes one field of a record into a slot."""

    name: str
    dtype: np.dtype  # what an ndarray value must be to be stored as is
    shape: tuple[int, ...]
    scalars: frozenset  # scalar types stored as they are (see _fast_types)
    rows: list | None  # row views of a shaped field (None for scalar fields)
    array: np.ndarray


class _Slot:
    """One set of column arrays ``[max_records, *shape]`` and its fill count."""

    __slots__ = ("arrays", "plan", "n", "first_time", "capacity")

    def __init__(self, schema: Schema, max_records: int):
        self.capacity = max_records
        self.arrays = {f.name: np.empty((max_records,) + f.shape, f.dtype) for f in schema}
        # Shaped fields are written through precomputed row views
        # (``rows[i][...] = v`` is ~2x faster than ``array[i] = v``); scalar
        # fields (rows None) by ``array[i] = v``.
        plan = []
        for f in schema:
            arr = self.arrays[f.name]
            dt, scalars = _fast_types(f)
            plan.append(_FieldPlan(f.name, dt, f.shape, scalars,
                                   list(arr) if f.shape else None, arr))
        self.plan = tuple(plan)
        self.n = 0
        self.first_time = 0.0

    def columns(self) -> dict[str, np.ndarray]:
        n = self.n
        if n == self.capacity:
            return dict(self.arrays)
        return {name: arr[:n] for name, arr in self.arrays.items()}


class _BatcherState:
    """Everything the batcher and its thread share (the thread never holds the batcher)."""

    def __init__(self, schema: Schema, send: SendFn, max_records: int,
                 max_delay: float | None):
        self.schema = schema
        self.send = send
        self.max_records = max_records
        self.max_delay = max_delay
        self.n_fields = len(schema.names)
        self.current = _Slot(schema, max_records)
        self.spare = _Slot(schema, max_records)
        self.error: BaseException | None = None
        self.closed = False
        self.stopping = False
        self.thread: threading.Thread | None = None
        self._init_locks()
        _live.add(self)

    def _init_locks(self) -> None:
        # Reentrant, so a finalizer can tell whether its thread holds it.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.send_lock = threading.Lock()

    # -- adding

    def add(self, record: Mapping[str, Any]) -> None:
        """Validate and copy one record; send if that fills the slot."""
        lock = self.lock
        if type(record) is dict and len(record) == self.n_fields:
            # Fast path: check and copy each field in one pass under the lock.
            # A field that needs the full rules abandons the pass; row ``i``
            # is not committed until ``n`` moves, so the partial copy is moot.
            ndarray = np.ndarray
            lock.acquire()
            try:
                if self.closed:
                    raise BufferClosedError("add() on a closed PushBatcher")
                slot = self.current
                i = slot.n
                fast = False
                for name, dt, shape, scalars, rows, arr in slot.plan:
                    v = record.get(name, record)  # the record itself marks "missing"
                    tv = type(v)
                    if tv is ndarray:
                        vdt = v.dtype
                        if (vdt is not dt and vdt != dt) or v.shape != shape:
                            break
                    elif tv not in scalars:
                        break
                    if rows is None:
                        arr[i] = v
                    else:
                        rows[i][...] = v
                else:
                    fast = True
                if not fast:
                    lock.release()
            except BaseException:
                lock.release()
                raise
            if fast:
                self._commit(slot, i)  # releases the lock
                return
        batch = self.schema.coerce_record(record)
        self.put([batch[name][0] for name in self.schema.names])

    def put(self, values: list) -> None:
        """Copy one validated record (values in field order)."""
        lock = self.lock
        lock.acquire()
        try:
            if self.closed:
                raise BufferClosedError("add() on a closed PushBatcher")
            slot = self.current
            i = slot.n
            for (_, _, _, _, rows, arr), v in zip(slot.plan, values):
                if rows is None:
                    arr[i] = v
                else:
                    rows[i][...] = v
        except BaseException:
            lock.release()
            raise
        self._commit(slot, i)

    def _commit(self, slot: _Slot, i: int) -> None:
        """Count row ``i`` as pending. Called with the lock held; releases it."""
        try:
            slot.n = i + 1
            if i == 0:
                self._first_pending(slot)
            full = i + 1 == self.max_records
        except BaseException:
            self.lock.release()
            raise
        if full:
            self._dispatch()  # releases the lock
        else:
            self.lock.release()

    def _first_pending(self, slot: _Slot) -> None:
        if self.max_delay is None:
            return
        slot.first_time = time.monotonic()
        if self.thread is None:
            self.thread = threading.Thread(
                target=_age_loop, args=(self,), name="millpond-push-batcher", daemon=True
            )
            self.thread.start()
        else:
            self.cond.notify()

    # -- sending

    def _dispatch(self, keep_error: bool = False) -> None:
        """Send the current slot. Called with the lock held; returns with it released.

        Taking ``send_lock`` before releasing ``lock`` orders sends as the
        batches were cut, and waits for the spare slot's send to finish
        before ``add`` may write into it. With ``keep_error`` (background
        sends) a send error is kept for the next add/flush, before
        ``send_lock`` is released, so a flush that waited for this send sees it.
        If one is kept already, the later one is dropped: the first is raised.
        """
        try:
            self.send_lock.acquire()
        except BaseException:
            self.lock.release()
            raise
        slot = self.current
        self.current, self.spare = self.spare, slot
        self.lock.release()
        try:
            if slot.n:
                self.send(slot.columns())
        except BaseException as exc:
            if not keep_error:
                raise
            if self.error is None:
                self.error = exc
        finally:
            slot.n = 0
            self.send_lock.release()

    def flush(self) -> None:
        self.lock.acquire()
        self._dispatch()

    def raise_kept_error(self) -> None:
        with self.lock:
            exc, self.error = self.error, None
        if exc is not None:
            raise exc

    # -- lifecycle

    def close_for_adds(self) -> bool:
        """Refuse further adds; False if already closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def stop(self) -> None:
        """Ask the thread to send what is pending and exit (also the GC finalizer)."""
        with self.lock:
            self.stopping = True
            self.cond.notify_all()

    def join_thread(self) -> None:
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _after_fork_in_child(self) -> None:
        # The parent owns the pending records and its thread does not exist
        # here: start over empty, with fresh locks (another thread may have
        # held them at fork time).
        self._init_locks()
        self.current.n = self.spare.n = 0
        self.thread = None
        self.error = None


class _OwnedLock(Protocol):
    """An RLock as the finalizer uses it: its ``_is_owned`` is not in the typeshed stubs."""

    def _is_owned(self) -> bool: ...


def _stop_from_finalizer(state: _BatcherState) -> None:
    """Stop the thread of a collected batcher.

    Garbage collection may run this in the batcher's own thread while it
    holds the lock inside ``Condition.wait`` before registering as a waiter;
    a notify then would be lost. Notify from a new thread in that case: it
    gets the lock once the waiter is registered.
    """
    if cast(_OwnedLock, state.lock)._is_owned():
        threading.Thread(target=state.stop, name="millpond-push-batcher-stop", daemon=True).start()
    else:
        state.stop()


def _age_loop(state: _BatcherState) -> None:
    """Send the pending records once the oldest is ``max_delay`` old; sleep otherwise."""
    cond = state.cond
    max_delay = state.max_delay
    assert max_delay is not None  # the thread is started only for batchers with one
    cond.acquire()
    try:
        while True:
            slot = state.current
            if slot.n:
                wait = slot.first_time + max_delay - time.monotonic()
                if wait > 0 and not state.stopping:
                    cond.wait(wait)
                    continue
                # Errors are kept for the next add/flush; once stopping (the
                # batcher was collected) nobody is left to raise them to.
                try:
                    state._dispatch(keep_error=not state.stopping)  # releases the lock
                except BaseException as exc:
                    _report(exc)
                finally:
                    cond.acquire()
            elif state.stopping:
                return
            else:
                cond.wait()
    finally:
        cond.release()


def _report(exc: BaseException) -> None:
    """An error no caller can receive any more (exit, garbage collection)."""
    print("millpond: PushBatcher could not send its last records:", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


@atexit.register
def _flush_at_exit() -> None:
    """Send the records every live batcher still holds."""
    for state in list(_live):
        try:
            state.close_for_adds()
            state.flush()
            if state.error is not None:
                state.raise_kept_error()
        except BaseException as exc:
            _report(exc)
        finally:
            state.stop()


def _after_fork_in_child() -> None:
    for state in list(_live):
        state._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
        self._state = _BatcherState(schema, send, self.max_records, max_delay)
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
