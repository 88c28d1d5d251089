"""Pushes a server acknowledges once logged (a mixin of the buffer; see :mod:`.pushlog`).

The buffer keeps at most one logged push not yet stored (``_logged``, its
record count; the records are in the file's push log). Its lock is a
:class:`SettlingLock`: whoever takes it next, for any use of the buffer, stores
that push first. So nothing ever sees the buffer without it, and the order of
operations is the order in which they were acknowledged.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Mapping

import numpy as np

from .fifo import Fifo


class LoggedPushes:
    """:meth:`push_logged` and :meth:`settle`, for :class:`.buffer.TieredBuffer`."""

    _fifo: Fifo
    _lock: Any
    _closed: bool
    _logged: int | None
    _episodes: Any
    schema: Any
    draws_ahead: bool
    _check_open: Callable[[], None]
    _store: Callable[..., tuple[int, int]]
    _append: Callable[..., None]

    def push_logged(self, columns: Mapping[str, Any], priorities: Any = None, *,
                    episodes: Any = None, updates: Any = None,
                    timeout: float | None = None) -> tuple[int, int]:
        """``push_batch``, returning ``(size, pushed)`` after it, possibly once the
        batch is only *logged* (:mod:`.pushlog`): as safe from a crash of the process as
        stored, and stored at the next use of the buffer or :meth:`settle`. For a
        server, which acknowledges the push and calls :meth:`settle` right after.

        Only a persistent buffer's file has a push log, and only plain pushes of a
        uniform replay buffer (no priorities, episodes or use limits; at most
        ``LOG_PAYLOAD_BYTES``; not ``sync_every_push``) are logged: others are stored now.
        """
        self._check_open()
        n, batch = self.schema.coerce_batch(columns)
        return self._store(n, batch, priorities, episodes, updates, timeout, log=True)

    def settle(self, wait: bool = True) -> None:
        """Store the logged push now, if there is one. ``wait=False``: only if no other
        thread holds the lock (whoever holds it has stored it, or will first)."""
        # Taking the lock stores the push (SettlingLock).
        if self._logged is not None and self._lock.acquire(blocking=wait):
            self._lock.release()

    def _log(self, n: int, batch: Mapping[str, np.ndarray]) -> bool:
        """Log a plain push of ``n`` records admitted in full, if it may be (lock held)."""
        fifo = self._fifo
        log = fifo.file.log if fifo.file is not None else None
        if (log is None or not 0 < n or not fifo.durable or fifo.sync_every_push
                or not log.fits(n) or not self.draws_ahead or self._episodes is not None):
            return False
        log.write(fifo.pushed, n, batch)
        # Stored later from the log's copy: the batch may be memory its sender reuses
        # once answered (a shared-memory push).
        self._logged = n
        return True

    def _store_logged(self) -> None:
        """Store the logged push, if any, and clear the log (the lock's settle: held)."""
        n = self._logged
        if n is not None and not self._closed:
            self._logged = None
            log = self._fifo.file.log if self._fifo.file is not None else None
            assert log is not None  # only a file with a log logs
            self._append(n, log.columns(n))
            log.clear()


class SettlingLock:
    """A buffer's re-entrant lock that first stores its logged push, if any, whenever
    it is taken (``with``, :meth:`acquire`, and a :class:`threading.Condition`'s wait
    returning): so no use of the buffer ever sees it without that push.

    ``settle(owner)`` stores it; ``owner`` (the buffer) is held weakly: the lock must
    not keep its buffer alive.
    """

    def __init__(self, owner: Any, settle: Callable[[Any], None]):
        self._lock = threading.RLock()
        self._owner = weakref.ref(owner)
        self._settle = settle

    def _settled(self) -> None:
        owner = self._owner()
        if owner is not None:
            self._settle(owner)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken = self._lock.acquire(blocking, timeout)
        if taken:
            try:
                self._settled()
            except BaseException:  # (a storage error) not left held
                self._lock.release()
                raise
        return taken

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    # What threading.Condition uses of a lock, when the lock has it (an RLock does).
    def _release_save(self) -> Any:
        return self._lock._release_save()  # type: ignore[attr-defined]

    def _acquire_restore(self, state: Any) -> None:
        self._lock._acquire_restore(state)  # type: ignore[attr-defined]
        self._settled()

    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined]
