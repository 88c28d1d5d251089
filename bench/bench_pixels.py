"""`make bench` section 'Pixels': frames stored once (frame_stack, next_of), then also
compressed (compression="lz4", "zstd"), on real Atari transitions (extra `atari`), beside
the plain buffer in the same run.

Stored bytes per transition (``info()``'s ``stored_bytes`` over the live records, after the
buffer is full and has evicted) and in-process ``sample(32)`` rates of the buffers,
measured in turns, each as a ratio to the plain buffer's. Run alone:
``python bench/bench.py --only pixels``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from bench_pixel_pushes import section as pushes_section

from millpond.core.buffer import TieredBuffer
from millpond.core.config import BufferConfig

OPTIONS = {"frame_stack": {"obs": 0}, "next_of": {"next_obs": "obs"}}
KINDS = (("plain", {}), ("shared", OPTIONS), ("lz4", dict(OPTIONS, compression="lz4")),
         ("zstd", dict(OPTIONS, compression="zstd")))
NAMES = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")


def section(quick: bool, seconds: float, timed_rate: Callable) -> None:
    print("\nPixels: frames stored once (frame_stack={'obs': 0}, next_of={'next_obs': 'obs'}: "
          "'shared'), and also compressed ('lz4', 'zstd': compression=), beside plain, Atari "
          "84x84x4 uint8 transitions, in-process")
    try:
        import atari_frames
    except ImportError:
        print("  (skipped: needs the `atari` extra: ale-py, opencv-python-headless)")
        return
    steps = 1000 if quick else 3000
    capacity = steps // 2
    for game, padding in (("Pong", "reset"), ("Breakout", "zero")):
        try:
            data = atari_frames.record(game, steps, seed=0, padding=padding, max_steps=500)
        except ImportError:
            print("  (skipped: needs the `atari` extra: ale-py, opencv-python-headless)")
            return
        fields = {name: (data[name].dtype.str, data[name].shape[1:]) for name in NAMES}
        buffers = {label: TieredBuffer(BufferConfig.build(capacity=capacity, fields=fields,
                                                          **options))
                   for label, options in KINDS}
        for lo in range(0, steps, 32):
            for buf in buffers.values():
                buf.push_batch({name: data[name][lo:lo + 32] for name in NAMES})
        per = {label: buf.info().stored_bytes / len(buf) for label, buf in buffers.items()}
        rates: dict[str, list[float]] = {label: [] for label in buffers}
        for _ in range(5):  # in turns: a noisy moment hits all alike
            for label, buf in buffers.items():
                rates[label].append(timed_rate(lambda b=buf: b.sample(32), 32, seconds / 5,
                                               repeats=1))
        rate = {label: float(np.median(values)) for label, values in rates.items()}
        print(f"  {game} ({padding} padding, {steps:,} steps, capacity {capacity:,}): plain "
              f"{per['plain'] / 1e3:.1f} KB/transition, sample(32) {rate['plain']:,.0f}/s")
        for label, _ in KINDS[1:]:
            print(f"    {label:7} stored {per[label]:8,.0f} B/transition = 1/"
                  f"{per['plain'] / per[label]:<6.1f} sample(32) {rate[label]:9,.0f}/s "
                  f"= {rate[label] / rate['plain']:.2f}x plain")
        for buf in buffers.values():
            buf.close()
        pushes_section(game, data, seconds / 3, timed_rate)  # (bench_pixel_pushes.py)
