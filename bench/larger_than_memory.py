"""The bench's "larger than memory" section: a daemon in a memory cgroup a quarter of its buffer.

Prints, each beside a baseline measured in the same run:

* Atari ``sample(256)`` (shm) from a buffer about 4x the cgroup limit, mostly
  cold rows read from disk, beside a threaded ``preadv`` of as many random
  rows of the same file, from a cold page cache too;
* a hot-only buffer's ``sample(256)`` under the same limit, beside a numpy
  gather of the same bytes;
* recovery after SIGKILL: time, and the cgroup's peak memory.

Needs root to create the cgroup; otherwise it says so and skips.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from support import MemoryCgroup, ServerProcess

import millpond
from millpond.core.bufferfile import BufferFile

FRAME = (84, 84, 4)
FIELDS = {"obs": ("uint8", FRAME), "next_obs": ("uint8", FRAME), "actions": ("int64", ()),
          "rewards": ("float32", ())}
RECORD = 2 * int(np.prod(FRAME)) + 12
BATCH = 256


def section(tmp: Path, quick: bool, seconds: float) -> None:
    limit = (128 if quick else 256) << 20
    print(f"\nLarger than memory: the daemon in a memory cgroup of {limit >> 20} MiB")
    try:
        cgroup = MemoryCgroup.create(limit)
    except OSError as exc:
        print(f"  skipped: cannot create a memory cgroup here ({exc}); run as root")
        return
    try:
        _cold(tmp / "ltm", cgroup, limit, seconds)
        _hot(tmp / "ltm-hot", cgroup, limit, seconds)
    finally:
        cgroup.remove()


def _fill(buf, n: int) -> None:
    rng = np.random.default_rng(0)
    for start in range(0, n, 64):
        k = min(64, n - start)
        frames = rng.integers(0, 255, (k, *FRAME), dtype=np.uint8)
        buf.push_batch(obs=frames, next_obs=frames, actions=np.zeros(k, np.int64),
                       rewards=np.zeros(k, np.float32))


def _rate(fn, seconds: float) -> float:
    """Median calls per second over 3 runs of about ``seconds``."""
    rates = []
    for _ in range(3):
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            fn()
            calls += 1
        rates.append(calls / (time.perf_counter() - start))
    return statistics.median(rates)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cold(data: Path, cgroup: MemoryCgroup, limit: int, seconds: float) -> None:
    total = 4 * limit // RECORD
    hot = max(BATCH, limit // 8 // RECORD)
    server = ServerProcess(data, cgroup=cgroup).start()
    try:
        client = millpond.connect(server.address, timeout=120)
        buf = client.create_buffer("ltm", hot_capacity=hot, total_capacity=total, fields=FIELDS)
        _fill(buf, total)
        path = data / "ltm.buffer"
        _drop_cache(path)
        served = _rate(lambda: buf.sample(BATCH), seconds) * BATCH * RECORD
        _drop_cache(path)
        limit_rate = _preadv_rate(path, total - hot, cgroup, seconds)
        print(f"  Atari sample({BATCH}), buffer {total * RECORD / 1e9:.2f} GB ({total:,} records, "
              f"{hot:,} hot): {served / 1e9:.3f} GB/s vs a 16-thread preadv of as many random "
              f"rows (same cgroup) {limit_rate / 1e9:.3f} GB/s = {served / limit_rate:.2f}x (goal >= 0.7x)")
        server.stop(signal.SIGKILL)
        _reset_peak(cgroup)
        started = time.perf_counter()
        server = ServerProcess(data, cgroup=cgroup).start(timeout=600)
        took = time.perf_counter() - started
        print(f"  recovery after SIGKILL: {took:.1f} s for {total:,} records; cgroup peak "
              f"{cgroup.peak() / 2**20:,.0f} MiB of {limit >> 20} MiB; OOM kills: "
              f"{cgroup.oom_kills()}")
    finally:
        server.stop()


def _preadv_rate(path: Path, cold: int, cgroup: MemoryCgroup, seconds: float) -> float:
    """Bytes/s of 16 threads reading BATCH random cold records' large fields with preadv,
    from a process in the same cgroup as the daemon (the same memory to cache them in)."""
    regions = BufferFile.peek(str(path))["regions"]
    offsets = [regions["obs"][0], regions["next_obs"][0]]
    proc = subprocess.run(
        [sys.executable, "-c", PREADV_BASELINE, str(path), str(cold), str(seconds), *map(str, offsets)],
        capture_output=True, text=True, check=True, timeout=120, preexec_fn=cgroup.enter)
    return float(proc.stdout) * BATCH * RECORD


PREADV_BASELINE = """
import os, sys, time, statistics
from concurrent.futures import ThreadPoolExecutor
import numpy as np
path, cold, seconds, *offsets = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), *map(int, sys.argv[4:])
size = 84 * 84 * 4
fd, rng, pool = os.open(path, os.O_RDONLY), np.random.default_rng(1), ThreadPoolExecutor(16)
out = np.empty((256, 2, size), np.uint8)
def read(job):
    slot, row = job
    for i, offset in enumerate(offsets):
        os.preadv(fd, [out[row, i]], offset + slot * size)
rates = []
for _ in range(3):
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        list(pool.map(read, zip(rng.integers(0, cold, 256).tolist(), range(256))))
        calls += 1
    rates.append(calls / (time.perf_counter() - start))
print(statistics.median(rates))
"""


def _hot(data: Path, cgroup: MemoryCgroup, limit: int, seconds: float) -> None:
    capacity = limit // 4 // RECORD  # a hot-only buffer well inside the limit
    with ServerProcess(data, cgroup=cgroup) as server:
        buf = millpond.connect(server.address).create_buffer("hot", capacity=capacity,
                                                             fields=FIELDS)
        _fill(buf, capacity)
        served = _rate(lambda: buf.sample(BATCH), seconds) * BATCH * RECORD
    ring = np.random.default_rng(2).integers(0, 255, (capacity, RECORD), dtype=np.uint8)
    out = np.empty((BATCH, RECORD), np.uint8)
    rng = np.random.default_rng(3)
    gather = _rate(lambda: ring.take(rng.integers(0, capacity, BATCH),
                                     axis=0, out=out), seconds) * BATCH * RECORD
    print(f"  hot-only sample({BATCH}) ({capacity:,} records) in the same limit: "
          f"{served / 1e9:.2f} GB/s vs a numpy gather {gather / 1e9:.2f} GB/s = "
          f"{served / gather:.2f}x (goal >= 0.7x)")


def _reset_peak(cgroup: MemoryCgroup) -> None:
    try:
        cgroup.write("memory.max_usage_in_bytes", "0")  # v1; v2's memory.peak cannot be reset
    except OSError:
        pass
