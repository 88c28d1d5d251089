"""The sharding section of ``make bench``: one buffer over 1, 2 and 3 daemons, same run.

Aggregate push_batch throughput (one handle per caller: the handles take the
shards in turn, so callers spread over them) and aggregate sample(256)
throughput (every caller samples the whole buffer: a round of Info calls,
then one Sample per shard drawn, in parallel), over gRPC as between hosts
(``shm=False``). Every daemon runs on this machine, so on few cores they
compete for the same CPUs with each other and with the callers.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from pathlib import Path

import numpy as np
from support import ServerProcess

import millpond

SHARDS = (1, 2, 3)


def _start(servers: list[ServerProcess]) -> None:
    import subprocess

    from support import wait_for_ready

    for server in servers:
        server.proc = subprocess.Popen(server.args, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=server.env)
    for server in servers:
        assert server.proc is not None
        server.address = wait_for_ready(server.proc, 60)


def sharded_section(tmp: Path, workloads, callers: int, timed_rate, fmt_rate,
                    seconds: float) -> None:
    print(f"\nSharding: one buffer over 1, 2 and 3 daemons (gRPC, {callers} callers, "
          f"each pushing through its own handle; every caller samples the whole buffer)")
    servers = [ServerProcess(tmp / f"shard{i}", "--no-shm") for i in range(max(SHARDS))]
    with contextlib.ExitStack() as stack:
        _start(servers)
        for server in servers:
            stack.callback(server.stop)
        for w in workloads:
            batch = w.batch(w.push_batch, np.random.default_rng(7))
            base: tuple[float, float] | None = None
            for n in SHARDS:
                client = millpond.connect([s.address for s in servers[:n]], shm=False)
                name = f"bench-sharded-{w.name}-{n}"
                buf = client.create_buffer(name, hot_capacity=w.hot, total_capacity=w.total,
                                           fields=w.schema)
                handles = [client.buffer(name) for _ in range(callers)]
                for i in range(0, w.total, w.push_batch):  # fill every shard
                    handles[(i // w.push_batch) % callers].push_batch(**batch)
                local, turns, lock = threading.local(), itertools.cycle(handles), threading.Lock()

                def push() -> None:  # each caller thread keeps a handle of its own
                    handle = getattr(local, "handle", None)
                    if handle is None:
                        with lock:
                            handle = local.handle = next(turns)
                    handle.push_batch(**batch)

                push_rate = timed_rate(push, w.push_batch, seconds, threads=callers)
                sample_rate = timed_rate(lambda: buf.sample(256), 256, seconds, threads=callers)
                single = timed_rate(lambda: buf.sample(256), 256, seconds, threads=1)
                if base is None:
                    base = (push_rate, sample_rate)
                for op, rate, ref in ((f"push_batch({w.push_batch})", push_rate, base[0]),
                                      ("sample(256)", sample_rate, base[1])):
                    print(f"  {w.name:9} {op:17} {n} shard{'s' if n > 1 else ' '} "
                          f"{fmt_rate(rate, w.schema.record_nbytes)} = {rate / ref:.2f}x 1 shard")
                print(f"  {w.name:9} {'sample(256) x1':17} {n} shard{'s' if n > 1 else ' '} "
                      f"{fmt_rate(single, w.schema.record_nbytes)} (one caller)")
                buf.close()
                client.close()
