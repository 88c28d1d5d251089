"""Sampling with prefetch for learners.

A :class:`Sampler` keeps ``prefetch`` sample requests in flight on worker
threads (gRPC and numpy release the GIL while they wait or copy), so a
learner that is slower than the server never waits on a round trip.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Protocol, cast

import numpy as np

from millpond.core.buffer import check_batch_size, check_seed
from millpond.core.checks import is_integral
from millpond.errors import InvalidArgumentError

SampleFn = Callable[[int, "int | None"], dict[str, np.ndarray]]

THREAD_NAME = "millpond-sampler"


class Sampler:
    """Iterate over batches ``sample(batch_size, seed)``, ``prefetch`` requests ahead.

    Batches come in request order. With ``seed`` given, request ``i`` (from
    0) uses seed ``seed + i``: the sequence equals calling
    ``sample(batch_size, seed + i)`` for i = 0, 1, ... in turn (on the same
    buffer contents). ``seed=None`` draws fresh batches. ``max_batches=None``
    never ends; otherwise iteration stops after that many.

    The first requests go out when iteration starts (the first ``next``), so
    a sampler may be made before the buffer holds enough records. From then
    on, while the caller works on batch ``k`` the requests ``k+1 ..
    k+prefetch`` are in flight or done.

    An error from ``sample`` is raised by ``next`` at the position of the
    failed request (the batches before it are delivered first); the sampler
    is then closed and further ``next`` calls raise ``StopIteration``.

    :meth:`close` (idempotent; also on leaving a ``with`` block) drops
    requests not yet started and waits for the ones running. Closing the
    buffer makes running requests fail promptly, so it never hangs a sampler.
    A sampler dropped without ``close`` stops its (daemon) threads too.
    """

    def __init__(
        self,
        sample: SampleFn,
        batch_size: int,
        prefetch: int = 2,
        seed: int | None = None,
        max_batches: int | None = None,
    ):
        if not callable(sample):
            raise InvalidArgumentError("sample must be callable")
        self.batch_size, self.prefetch, self.seed, self.max_batches = sampler_arguments(
            batch_size, prefetch, seed, max_batches)
        self._state = _SamplerState(sample, batch_size, self.prefetch, seed, self.max_batches)
        # Dropped without close(): stop the workers (they hold the state only).
        self._finalizer = weakref.finalize(self, _shut_from_finalizer, self._state)

    def __iter__(self) -> "Sampler":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self._state.next()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self) -> None:
        """Cancel requests not yet started, wait for running ones, join threads."""
        self._finalizer.detach()
        self._state.shut()
        self._state.join()

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Sampler(batch_size={self.batch_size}, prefetch={self.prefetch}, seed={self.seed}, "
            f"max_batches={self.max_batches}, closed={self.closed})"
        )


def sampler_arguments(batch_size: Any, prefetch: Any, seed: Any, max_batches: Any
                      ) -> tuple[int, int, int | None, int | None]:
    """``(batch_size, prefetch, seed, max_batches)`` of a sampler (this one, or millpond.aio's
    ``samples``), checked."""
    batch_size = check_batch_size(batch_size)
    if not is_integral(prefetch) or isinstance(prefetch, bool) or prefetch < 1:
        raise InvalidArgumentError(f"prefetch must be an integer >= 1, got {prefetch!r}")
    seed = check_seed(seed)
    if max_batches is not None and (
        not is_integral(max_batches) or isinstance(max_batches, bool)
        or max_batches < 0
    ):
        raise InvalidArgumentError(
            f"max_batches must be None or an integer >= 0, got {max_batches!r}"
        )
    return batch_size, int(prefetch), seed, None if max_batches is None else int(max_batches)


class _SamplerState:
    """What the consumer and the workers share; workers never hold the Sampler."""

    def __init__(self, sample: SampleFn, batch_size: int, prefetch: int,
                 seed: int | None, max_batches: int | None):
        self.sample = sample
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.seed = seed
        self.max_batches = max_batches
        # Reentrant, so a finalizer can tell whether its thread holds it.
        self.lock = threading.RLock()
        self.ready = threading.Condition(self.lock)  # consumer: a result arrived
        self.room = threading.Condition(self.lock)   # workers: a request may be issued
        self.issued = 0      # requests handed to workers
        self.delivered = 0   # batches returned by next()
        self.failed = False  # a request failed: issue no more
        self.closed = False
        self.results: dict[int, tuple[bool, Any]] = {}
        self.threads: list[threading.Thread] = []

    def _start(self) -> None:
        # Called with the lock held, on the first next().
        for _ in range(self.prefetch):
            thread = threading.Thread(target=_work, args=(self,), name=THREAD_NAME, daemon=True)
            self.threads.append(thread)
            thread.start()

    def _may_issue(self) -> bool:
        return (
            not self.closed and not self.failed
            and self.issued < self.delivered + self.prefetch
            and (self.max_batches is None or self.issued < self.max_batches)
        )

    def next(self) -> dict[str, np.ndarray]:
        with self.lock:
            if self.closed or (
                self.max_batches is not None and self.delivered >= self.max_batches
            ):
                self._shut_locked()
                raise StopIteration
            if not self.threads:
                self._start()
            i = self.delivered
            while i not in self.results:
                if self.closed:
                    raise StopIteration
                self.ready.wait()
            ok, value = self.results.pop(i)
            self.delivered = i + 1
            if not ok:
                self._shut_locked()
                raise value
            if self.max_batches is not None and self.delivered >= self.max_batches:
                self._shut_locked()
            else:
                self.room.notify()  # one more request may go out
            return value

    def shut(self) -> None:
        with self.lock:
            self._shut_locked()

    def _shut_locked(self) -> None:
        self.closed = True
        self.results.clear()
        self.ready.notify_all()
        self.room.notify_all()

    def join(self) -> None:
        me = threading.current_thread()
        for thread in self.threads:
            if thread is not me:
                thread.join()


class _OwnedLock(Protocol):
    """An RLock as the finalizer uses it: its ``_is_owned`` is not in the typeshed stubs."""

    def _is_owned(self) -> bool: ...


def _shut_from_finalizer(state: _SamplerState) -> None:
    """Stop the workers of a collected sampler.

    Garbage collection may run this in a worker while it holds the lock
    inside ``Condition.wait`` before registering as a waiter; a notify then
    would be lost. Notify from a new thread in that case.
    """
    if cast(_OwnedLock, state.lock)._is_owned():
        threading.Thread(target=state.shut, name="millpond-sampler-stop", daemon=True).start()
    else:
        state.shut()


def _work(state: _SamplerState) -> None:
    lock, room, ready = state.lock, state.room, state.ready
    while True:
        with lock:
            while not state._may_issue():
                if state.closed or state.failed or (
                    state.max_batches is not None and state.issued >= state.max_batches
                ):
                    return
                room.wait()
            i = state.issued
            state.issued = i + 1
        result: tuple[bool, Any]
        try:
            seed = None if state.seed is None else state.seed + i
            result = (True, state.sample(state.batch_size, seed))
        except BaseException as exc:  # delivered to the consumer at position i
            result = (False, exc)
        with lock:
            if not result[0]:
                state.failed = True
                room.notify_all()  # idle workers: issue no more, exit
            if not state.closed:
                state.results[i] = result
            ready.notify_all()
