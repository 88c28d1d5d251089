"""How much memory this process may use: the machine's, capped by its memory cgroup.

Containers see the host's ``/proc/meminfo``, so the limits of the process's
memory cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) count too.
What a cgroup holds in page cache it can drop (inactive file pages), so it is
not counted as used, as ``MemAvailable`` does not count it either.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import time
from typing import Iterator

from millpond.errors import StorageFullError


def check_available(needed: int, what: str) -> None:
    """Raise StorageFullError, before anything is allocated, if ``needed`` bytes of
    RAM are more than this process may still use (allocating them would end in
    MemoryError at best, the OOM killer at worst)."""
    available = available_memory()
    if available is not None and needed > available:
        raise StorageFullError(
            f"{what} needs {needed:,} bytes of memory; only {available:,} are available "
            f"(machine, or memory cgroup limit {memory_limit() or 0:,})")


LIMIT_TTL = 1.0  # seconds a read limit is reused: every Info reports it, limits rarely move
_limit: tuple[float, int | None] = (-1.0, None)  # (read at, value)


def memory_limit() -> int | None:
    """The most memory this process may use: MemTotal, or its cgroup's limit if lower
    (read at most once per :data:`LIMIT_TTL` seconds)."""
    global _limit
    read_at, value = _limit
    now = time.monotonic()
    if now - read_at >= LIMIT_TTL or read_at < 0:
        value = _read_limit()
        _limit = (now, value)
    return value


def _read_limit() -> int | None:
    known = [_read_int("/proc/meminfo", "MemTotal:", 1024)]
    known += [limit for limit, _, _ in _cgroups()]
    values = [v for v in known if v is not None]
    return min(values) if values else None


def available_memory() -> int | None:
    """Bytes this process may still use: MemAvailable, capped by what its cgroup allows."""
    known = [_read_int("/proc/meminfo", "MemAvailable:", 1024)]
    for limit, used, reclaimable in _cgroups():
        if used is not None:
            known.append(limit - used + (reclaimable or 0))
    values = [v for v in known if v is not None]
    return min(values) if values else None


def _cgroups() -> Iterator[tuple[int, int | None, int | None]]:
    """``(limit, usage, inactive file bytes)`` of each memory cgroup that limits us."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            base = f"/sys/fs/cgroup{path}"
            files = ("memory.max", "memory.current", "inactive_file ")
        elif "memory" in controllers.split(","):  # cgroup v1
            base = f"/sys/fs/cgroup/memory{path}"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file ")
        else:
            continue
        limit = _read_int(f"{base}/{files[0]}")
        if limit is not None and limit < 1 << 60:  # v1 says "no limit" with a huge number
            yield (limit, _read_int(f"{base}/{files[1]}"),
                   _read_int(f"{base}/memory.stat", files[2]))


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


def keep_resident(mm: mmap.mmap, offset: int, length: int, address: int) -> bool:
    """Keep ``length`` bytes of the mapping ``mm`` at ``offset`` (``address`` in memory)
    resident: ``mlock`` them, or where that is not permitted (RLIMIT_MEMLOCK) at
    least read them in ahead (``MADV_WILLNEED``). True if locked."""
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    length += offset - start
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.mlock(ctypes.c_void_p(address - (offset - start)), ctypes.c_size_t(length)) == 0:
            return True
    except (OSError, AttributeError):
        pass
    mm.madvise(mmap.MADV_WILLNEED, start, length)
    return False
