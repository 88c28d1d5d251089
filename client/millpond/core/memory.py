"""How much memory this process may still use: the machine's, capped by its memory cgroup.

Containers see the host's ``/proc/meminfo``, so the cgroup limit (v2
``memory.max``, v1 ``memory.limit_in_bytes``) minus current usage counts too.
"""

from __future__ import annotations

from ..errors import StorageFullError


def check_available(needed: int, what: str) -> None:
    """Raise StorageFullError, before anything is allocated, if ``needed`` bytes of
    RAM are more than this process may still use (allocating them would end in
    MemoryError at best, the OOM killer at worst)."""
    available = available_memory()
    if available is not None and needed > available:
        raise StorageFullError(
            f"{what} needs {needed:,} bytes of memory; only {available:,} are available "
            "(machine, or memory cgroup limit)")


def available_memory() -> int | None:
    """Bytes this process may still use: MemAvailable, capped by its memory cgroup.

    Containers see the host's /proc/meminfo, so the cgroup limit (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``) minus current usage counts too.
    """
    candidates = [_read_int("/proc/meminfo", "MemAvailable:", 1024)]
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base = f"/sys/fs/cgroup{path}"
            limit, usage = f"{base}/memory.max", f"{base}/memory.current"
        elif "memory" in controllers.split(","):  # cgroup v1
            base = f"/sys/fs/cgroup/memory{path}"
            limit, usage = f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"
        else:
            continue
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None:
            candidates.append(cap - used)
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def _read_int(path: str, prefix: str = "", scale: int = 1) -> int | None:
    """An integer from a file ("max" and unreadable files give None)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return int(line[len(prefix):].split()[0]) * scale
    except (OSError, ValueError, IndexError):
        pass
    return None
