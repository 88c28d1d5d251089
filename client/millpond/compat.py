"""What millpond uses of Python 3.11 and newer, for CPython 3.10 too.

millpond runs on CPython 3.10 to 3.13 (README, "Platforms"). Each name here is the standard
library's on 3.11 and newer, and a backport or a few lines on 3.10; the rest of the client
(and the daemon, whose other shims are in ``millpond_server/compat.py``) imports these
instead of asking which Python it runs on. Dropping 3.10 means importing them from the
standard library again and deleting this file.

- ``add_note(error, note)``: ``BaseException.add_note`` (PEP 678). On 3.10 the note is
  appended to ``error.__notes__``, where 3.11 keeps it too, but 3.10's tracebacks do not
  print it.
- ``timeout(delay)``, ``timeout_at(when)``: ``asyncio.timeout`` and ``asyncio.timeout_at``.
  On 3.10 they wrap ``async_timeout``'s (a dependency there only): its error is raised as
  the builtin ``TimeoutError``, as 3.11's is (there ``asyncio.TimeoutError`` is the same
  class), and ``expired()`` is a method, as 3.11's.
- ``cancelling(task)``: ``asyncio.Task.cancelling()``, the cancellations requested of a task
  and not yet done. 3.10 keeps no such count: there it is always 0, so code that tells a
  task's own cancellation from another cause (a closed channel's) takes the other cause.
"""

from __future__ import annotations

import asyncio
import sys
from types import TracebackType

__all__ = ["Timeout", "add_note", "cancelling", "timeout", "timeout_at"]

if sys.version_info >= (3, 11):
    from asyncio import Timeout, timeout, timeout_at

    def add_note(error: BaseException, note: str) -> None:
        """Add ``note`` to ``error``: printed after its message in a traceback."""
        error.add_note(note)

    def cancelling(task: asyncio.Task) -> int:
        return task.cancelling()
else:  # pragma: no cover - CPython 3.10 (`make test-pythons`)
    import async_timeout

    def add_note(error: BaseException, note: str) -> None:
        """Add ``note`` to ``error``'s ``__notes__`` (3.10's tracebacks do not print them)."""
        notes = getattr(error, "__notes__", None)
        if notes is None:
            notes = error.__notes__ = []  # type: ignore[attr-defined]
        notes.append(note)

    class Timeout:
        """What millpond uses of 3.11's ``asyncio.Timeout``: the block it guards is
        cancelled at ``when`` (the loop's clock; None: never) and raises TimeoutError;
        :meth:`expired` says whether that is what happened."""

        def __init__(self, when: float | None):
            self._scope = async_timeout.timeout_at(when)

        async def __aenter__(self) -> Timeout:
            await self._scope.__aenter__()
            return self

        async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                            traceback: TracebackType | None) -> bool | None:
            try:
                return await self._scope.__aexit__(kind, error, traceback)
            except asyncio.TimeoutError as exc:  # not the builtin TimeoutError before 3.11
                raise TimeoutError() from exc

        def expired(self) -> bool:
            return bool(self._scope.expired)

    def timeout_at(when: float | None) -> Timeout:
        return Timeout(when)

    def timeout(delay: float | None) -> Timeout:
        return Timeout(None if delay is None else asyncio.get_running_loop().time() + delay)

    def cancelling(task: asyncio.Task) -> int:
        return 0  # not counted before 3.11
