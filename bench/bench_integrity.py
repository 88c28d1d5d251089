"""What checking every record costs: format 5 beside format 4, measured in the same run.

* the record checksum alone: format 5's keyed multiply hash (``core/checksum.py``) beside
  format 4's XOR fold (``core/checksum_v4.py``), over the same CartPole and Atari batches;
* ``push_batch`` into a persistent in-process buffer (what the daemon runs per push):
  format 5 (its checksum, computed from the stored copy, and one commit for a push and its
  evictions) beside the same buffer built the format 4 way (the XOR fold, three commits);
* recovery: reopening a full persistent buffer (every live record's seq and checksum
  checked, from the page cache), seconds per GB, beside the same reopen with the format 4
  fold.

    make bench ARGS="--only integrity"
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from millpond.core import BufferConfig, TieredBuffer, bufferfile, checksum, checksum_v4


@contextlib.contextmanager
def format4_way() -> Iterator[None]:
    """Buffers made and reopened here check and commit as format 4 did: the XOR fold
    (stored in the 32-bit column: the same work) and no spare slots (three commits)."""
    fmt = bufferfile.FORMATS[5]
    saved = fmt.checksums, bufferfile.spare_slots
    fmt.checksums = checksum_v4.record_checksums
    bufferfile.spare_slots = lambda *args: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        fmt.checksums, bufferfile.spare_slots = saved  # type: ignore[assignment]


def _seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def section(workloads: list, quick: bool, seconds: float, timed_rate: Callable) -> None:
    print("\nIntegrity: format 5 (32-bit keyed hash, one commit per push) beside format 4 "
          "(16-bit XOR fold, three commits), same run")
    tmp = Path(tempfile.mkdtemp(prefix="millpond-integrity-"))
    for w in workloads:
        rng = np.random.default_rng(0)
        batch = w.batch(w.push_batch, rng)
        seqs = np.arange(w.push_batch, dtype=np.uint64)
        nbytes = w.schema.record_nbytes
        rates = {name: timed_rate(lambda fn=fn: fn(batch, seqs), w.push_batch, seconds)
                 for name, fn in (("format 5", checksum.record_checksums),
                                  ("format 4", checksum_v4.record_checksums))}
        print(f"  {w.name:9} checksum of {w.push_batch:,} records: "
              f"{rates['format 5'] * nbytes / 1e9:6.2f} GB/s vs format 4 "
              f"{rates['format 4'] * nbytes / 1e9:6.2f} GB/s = "
              f"{rates['format 5'] / rates['format 4']:.2f}x")
        # In turns, so a noisy moment hits both alike: the median of 3 turns each.
        pushes: dict[str, list[float]] = {"format 5": [], "format 4": []}
        opens: dict[str, list[float]] = {"format 5": [], "format 4": []}
        for turn in range(3):
            for label in pushes:
                path = tmp / f"{w.name}-{turn}-{label[-1]}.buffer"
                with format4_way() if label == "format 4" else contextlib.nullcontext():
                    buf = TieredBuffer(BufferConfig(w.schema, w.hot, w.total), path,
                                       persistent=True)
                    for _ in range(-(-w.total // w.push_batch)):  # full: pushes evict
                        buf.push_batch(batch)
                    pushes[label].append(timed_rate(lambda buf=buf: buf.push_batch(batch),
                                                    w.push_batch, seconds, repeats=1))
                    buf.release()
                    opens[label].append(_seconds(
                        lambda path=path: TieredBuffer.open(path).release(), repeats=3))
                path.unlink()
        push = {label: statistics.median(v) for label, v in pushes.items()}
        reopen = {label: statistics.median(v) for label, v in opens.items()}
        gb = w.total * nbytes / 1e9
        print(f"  {w.name:9} persistent push_batch({w.push_batch:,}) {push['format 5']:12,.0f} "
              f"rec/s vs format 4 {push['format 4']:12,.0f} rec/s = "
              f"{push['format 5'] / push['format 4']:.2f}x")
        print(f"  {w.name:9} recovery of {w.total:,} records ({gb:.2f} GB, page cache): "
              f"{reopen['format 5'] / gb:6.2f} s/GB vs format 4 {reopen['format 4'] / gb:6.2f} "
              f"s/GB = {reopen['format 5'] / reopen['format 4']:.2f}x the time")
