"""What the daemon uses of Python 3.11 and newer, for CPython 3.10 too.

The daemon runs on CPython 3.10 to 3.13 (README, "Platforms"). Each name here is the
standard library's on 3.11 and newer, and a backport or a few lines on 3.10; the rest of
the daemon imports these instead of asking which Python it runs on (asyncio's timeouts:
``millpond/compat.py``, shared with the client). Dropping 3.10 means importing them from
the standard library again and deleting this file.

- ``tomllib``: ``tomli`` on 3.10 (the same parser: the standard library's is a copy of it;
  a dependency only there, ``pyproject.toml``).
- ``run(main)``: runs the daemon's coroutine on uvloop where it is installed (every POSIX
  system: a dependency), else on asyncio's own loop. ``uvloop.run`` does what
  ``asyncio.Runner(loop_factory=...)`` does on 3.11 on every Python.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised by `make test-pythons` on 3.10
    import tomli as tomllib

__all__ = ["run", "tomllib"]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``main`` run to its end on a new event loop: uvloop's where it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main)
    return uvloop.run(main)
