"""What a backup costs the actors: ``make bench``'s "Backups" section.

One daemon with ``--backup-dir``; an actor thread pushes into a full buffer as fast as it
can (shared memory, the client's default on one host), first alone, then while the main
thread has the daemon write snapshots of that very buffer back to back
(``Client.checkpoint``), in turns (alone, during, alone, during, ...) so that a noisy
moment of a shared machine hits both alike. Prints the actor's push throughput during
the snapshots against alone as a ratio, its longest push in each, and how fast the
snapshots copied.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import numpy as np
from support import ServerProcess

import millpond

TURNS = 5


def _actor(buf, batch: dict, n: int, stop: threading.Event, out: list) -> None:
    """Push ``batch`` until ``stop``; append (records pushed, seconds, longest push)."""
    pushed, longest = 0, 0.0
    start = time.perf_counter()
    while not stop.is_set():
        t = time.perf_counter()
        buf.push_batch(**batch)
        longest = max(longest, time.perf_counter() - t)
        pushed += n
    out.append((pushed, time.perf_counter() - start, longest))


def section(tmp: Path, workloads: list, seconds: float, fmt_rate) -> None:
    turn = max(3.0, 3 * seconds)
    print(f"\nBackups: an actor's push_batch into a full buffer while the daemon writes "
          f"snapshots of it back to back, vs alone ({TURNS} turns of {turn:.0f} s each, medians)")
    for w in workloads:
        backups = tmp / f"backups-{w.name}"
        with ServerProcess(tmp / f"backup-{w.name}", "--backup-dir", str(backups)) as server:
            client = millpond.connect(server.address)
            buf = client.create_buffer("bench-backup", hot_capacity=w.hot, total_capacity=w.total,
                                       fields=w.schema)
            batch = w.batch(w.push_batch, np.random.default_rng(7))
            while len(buf) < w.total:
                buf.push_batch(**batch)
            alone, during, copies = [], [], []
            for i in range(TURNS):
                for label, results in (("alone", alone), ("during", during)):
                    stop, out = threading.Event(), []
                    actor = threading.Thread(target=_actor,
                                             args=(buf, batch, w.push_batch, stop, out))
                    actor.start()
                    end = time.perf_counter() + turn
                    k = 0
                    while time.perf_counter() < end:
                        if label == "alone":
                            time.sleep(0.01)
                            continue
                        start = time.perf_counter()
                        result = client.checkpoint("bench-backup", f"turn{i}-{k}")
                        copies.append((result.records, time.perf_counter() - start))
                        Path(result.path).unlink()  # (gigabytes, turn after turn)
                        k += 1
                    stop.set()
                    actor.join()
                    pushed, elapsed, longest = out[0]
                    results.append((pushed / elapsed, longest))
            base = statistics.median(rate for rate, _ in alone)
            loaded = statistics.median(rate for rate, _ in during)
            nbytes = w.schema.record_nbytes
            print(f"  {w.name:9} push_batch({w.push_batch}) during snapshots "
                  f"{fmt_rate(loaded, nbytes)} vs alone {fmt_rate(base, nbytes)} = "
                  f"{loaded / base:.2f}x; longest push {max(x for _, x in during) * 1e3:.0f} ms "
                  f"(alone {max(x for _, x in alone) * 1e3:.0f} ms)")
            print(f"  {'':9} {len(copies)} snapshots, {statistics.median(s for _, s in copies):.2f} s "
                  f"each, holding {statistics.median(r for r, _ in copies):,.0f} of the "
                  f"{w.total:,} records of their cut (median; the others were evicted by the "
                  "actor before the copy reached them)")
            buf.close()
