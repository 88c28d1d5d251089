"""What the fast path needs of the operating system (Linux's), and whether this one has it.

Both ends need sealed memfds with their memory reserved up front (``memfd_create``,
``posix_fallocate``, the ``F_*_SEALS`` commands), a ``SOCK_SEQPACKET`` Unix socket in the
abstract namespace (Linux's alone) that passes descriptors (``SCM_RIGHTS``) and tells who is
at the other end (``SO_PEERCRED``), and ``MADV_DONTNEED`` on a reused result segment. Where
any is missing (another system, or a Python built without it) the client uses gRPC and
the daemon offers no fast path; :func:`lacking` says why. Nothing of this module or of the
fast path's needs Linux to be imported: only to be used.
"""

from __future__ import annotations

import importlib
import sys

# (module, attribute): what the fast path uses that Linux has and other systems may not.
NEEDED = (
    ("os", "memfd_create"),
    ("os", "MFD_ALLOW_SEALING"),
    ("os", "posix_fallocate"),
    ("fcntl", "F_ADD_SEALS"),
    ("fcntl", "F_GET_SEALS"),
    ("socket", "AF_UNIX"),
    ("socket", "SOCK_SEQPACKET"),
    ("socket", "SOCK_CLOEXEC"),
    ("socket", "SCM_RIGHTS"),
    ("socket", "SO_PEERCRED"),
    ("mmap", "MADV_DONTNEED"),
)


def lacking() -> str:
    """Why this system cannot have the fast path: what it lacks; "" if nothing."""
    missing = []
    if not sys.platform.startswith("linux"):
        missing.append(f"abstract Unix sockets (Linux only; this is {sys.platform})")
    for module_name, name in NEEDED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        if not hasattr(module, name):
            missing.append(f"{module_name}.{name}")
    if not missing:
        return ""
    return f"this system lacks {', '.join(missing)} (the fast path needs Linux)"
