"""The numbers a reply carries, checked the same way whatever the transport.

The client trusts no reply: one that cannot be the answer to its request
raises :class:`~millpond.errors.ProtocolError` naming the server, never a
wrong result or a raw ``KeyError``. Each transport checks what it decodes in
one place (gRPC: :meth:`GrpcTransport._checked
<millpond.remote.grpc_transport.GrpcTransport._checked>` for columns,
``_info`` for infos; shared memory: :meth:`ShmSession._reply
<millpond.remote.shm.session.ShmSession._reply>`); the counts both transports
carry are checked here:

* a push of ``n`` records answers ``(size, pushed)`` after it:
  ``min(n, capacity) <= size <= min(capacity, pushed)`` and ``pushed >= n``
  (the records just stored are live and counted); on one ordered stream of a
  buffer's pushes, where nothing else lowers ``pushed`` (any mode but a
  stack, whose pops lower it), each reply's ``pushed`` is at least the one
  before it plus ``n``. Across calls the client cannot know (another client
  may have deleted and made the buffer again, a restarted daemon's undeclared
  buffer starts anew), so nothing is asked there;
* ``update_priorities`` of ``n`` indices answers how many were live: ``0..n``.

Only integers and comparisons: nothing here looks at data.
"""

from __future__ import annotations

from typing import Any

from millpond.errors import ProtocolError


def refused(server: str, what: str, detail: str) -> ProtocolError:
    """The error for a reply from ``server`` to ``what`` that is not possible: ``detail``."""
    return ProtocolError(f"the server at {server or '?'} answered {what} with {detail}")


def count(value: Any, most: int, server: str, what: str) -> int:
    """``value`` if it is an integer in ``[0, most]``; else ProtocolError."""
    if not _integer(value) or not 0 <= value <= most:
        raise refused(server, what, f"a count of {value!r}, not one in [0, {most:,}]")
    return value


def pushed(size: Any, pushed: Any, n: int, capacity: int | None, after: int | None,
           server: str) -> int:
    """``pushed`` of the reply ``(size, pushed)`` to a push of ``n`` records into a buffer
    of ``capacity`` records (None: not known here), if possible (see the module
    docstring); ``after``: the ``pushed`` of the reply before it on the same ordered
    stream, if known. Else ProtocolError."""
    most = pushed if capacity is None else min(capacity, pushed)
    if not (_integer(size) and _integer(pushed) and n <= pushed
            and min(n, most) <= size <= most):
        raise refused(server, f"a push of {n:,} records",
                      f"{size!r} records held and {pushed!r} ever pushed"
                      + ("" if capacity is None else f", in a buffer of {capacity:,}"))
    if after is not None and pushed < after + n:
        raise refused(server, f"a push of {n:,} records",
                      f"{pushed:,} records ever pushed, after {after:,} in the reply before "
                      "it on the same stream")
    return pushed


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
