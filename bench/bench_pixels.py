"""`make bench` section 'Pixels': frames stored once (frame_stack, next_of) on real Atari
transitions (extra `atari`), beside the plain buffer in the same run.

Stored bytes per transition (``info()``'s ``stored_bytes`` over the live records, after the
buffer is full and has evicted) and in-process ``sample(32)`` rates of the two buffers,
measured in turns. Run alone: ``python bench/bench.py --only pixels``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from bench_pixel_pushes import section as pushes_section

from millpond.core.buffer import TieredBuffer
from millpond.core.config import BufferConfig

OPTIONS = {"frame_stack": {"obs": 0}, "next_of": {"next_obs": "obs"}}
NAMES = ("obs", "next_obs", "actions", "rewards", "terminated", "truncated")


def section(quick: bool, seconds: float, timed_rate: Callable) -> None:
    print("\nPixels: frames stored once (frame_stack={'obs': 0}, next_of={'next_obs': 'obs'}) "
          "beside plain, Atari 84x84x4 uint8 transitions, in-process")
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
                   for label, options in (("plain", {}), ("shared", OPTIONS))}
        for lo in range(0, steps, 32):
            for buf in buffers.values():
                buf.push_batch({name: data[name][lo:lo + 32] for name in NAMES})
        per = {label: buf.info().stored_bytes / len(buf) for label, buf in buffers.items()}
        rates: dict[str, list[float]] = {label: [] for label in buffers}
        for _ in range(3):  # in turns: a noisy moment hits both alike
            for label, buf in buffers.items():
                rates[label].append(timed_rate(lambda b=buf: b.sample(32), 32, seconds / 3,
                                               repeats=1))
        rate = {label: float(np.median(values)) for label, values in rates.items()}
        print(f"  {game:9} ({padding} padding, {steps:,} steps, capacity {capacity:,}): stored "
              f"{per['shared'] / 1e3:6.1f} KB/transition vs plain {per['plain'] / 1e3:6.1f} KB "
              f"= 1/{per['plain'] / per['shared']:.1f}; sample(32) "
              f"{rate['shared']:,.0f}/s vs plain {rate['plain']:,.0f}/s "
              f"= {rate['shared'] / rate['plain']:.2f}x")
        for buf in buffers.values():
            buf.close()
        pushes_section(game, data, seconds / 3, timed_rate)  # (bench_pixel_pushes.py)
