"""A learner's latency while an actor pushes: ``make bench``'s "Under load" section.

One daemon; an actor thread pushes Atari frames (push_batch(64)) into one buffer
as fast as it can while a learner samples a CartPole buffer (sample(256)), over
shared memory and then over gRPC. Prints the learner's latency percentiles and
the frames the actor stored meanwhile: a stall anywhere in the daemon (a lock,
the GIL held through a disk write) shows in the tail and in both rates.
"""

from __future__ import annotations

import threading
import time

import numpy as np

import millpond


def section(address: str, workloads: list, seconds: float) -> None:
    cart_w, atari_w = workloads
    actor = millpond.connect(address)
    atari = actor.create_buffer("bench-load-Atari", hot_capacity=atari_w.hot,
                                total_capacity=atari_w.total, fields=atari_w.schema)
    frames = atari_w.batch(64, np.random.default_rng(1))
    secs = max(5.0, 5 * seconds)  # long enough for several --sync-interval syncs
    print(f"\nUnder load: CartPole sample(256) while an actor pushes Atari push_batch(64) "
          f"into another buffer, {secs:.0f} s each")
    for shm in (True, False):
        learner = millpond.connect(address, shm=shm)
        cart = learner.create_buffer("bench-load-CartPole", hot_capacity=cart_w.hot,
                                     total_capacity=cart_w.total, fields=cart_w.schema)
        batch = cart_w.batch(10_000, np.random.default_rng(0))
        while len(cart) < cart_w.total:
            cart.push_batch(**batch)
        stop = threading.Event()
        before = atari.info()["pushed"]

        def push() -> None:
            while not stop.is_set():
                atari.push_batch(**frames)

        pusher = threading.Thread(target=push)
        pusher.start()
        latencies = []
        end = time.perf_counter() + secs
        while time.perf_counter() < end:
            start = time.perf_counter()
            cart.sample(256)
            latencies.append(time.perf_counter() - start)
        stop.set()
        pusher.join()
        pushed = (atari.info()["pushed"] - before) * atari_w.schema.record_nbytes / secs
        ms = np.percentile(latencies, [50, 99, 99.9, 100]) * 1e3
        print(f"  {learner.transport:4} p50 {ms[0]:5.2f} ms  p99 {ms[1]:6.2f} ms  "
              f"p99.9 {ms[2]:6.1f} ms  max {ms[3]:5.0f} ms; the actor stored "
              f"{pushed / 1e9:.2f} GB/s meanwhile")
        cart.delete()
    atari.delete()
