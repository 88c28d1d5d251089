"""What the client uses of Python 3.11 and newer, for CPython 3.10 too.

The client runs on CPython 3.10 to 3.13 (README, "Platforms"); the daemon's own shims are
in ``millpond_server/compat.py``. Dropping 3.10 means deleting this file and calling the
standard library directly.

- ``add_note(error, note)``: ``BaseException.add_note`` (PEP 678, 3.11). On 3.10 the note
  is appended to ``error.__notes__``, where 3.11 keeps it too, but 3.10's tracebacks do not
  print it.
"""

from __future__ import annotations

import sys

__all__ = ["add_note"]

if sys.version_info >= (3, 11):
    def add_note(error: BaseException, note: str) -> None:
        """Add ``note`` to ``error``: printed after its message in a traceback."""
        error.add_note(note)
else:  # pragma: no cover - CPython 3.10 (`make test-pythons`)
    def add_note(error: BaseException, note: str) -> None:
        """Add ``note`` to ``error``'s ``__notes__`` (3.10's tracebacks do not print them)."""
        notes = getattr(error, "__notes__", None)
        if notes is None:
            notes = error.__notes__ = []  # type: ignore[attr-defined]
        notes.append(note)
