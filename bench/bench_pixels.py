"""`make bench` section 'Pixels': frames stored once (frame_stack, next_of), then also
compressed (compression="lz4", "zstd"), on real Atari transitions (extra `atari`), beside
the plain buffer in the same run.

Stored bytes per transition (``info()``'s ``stored_bytes`` over the live records, after the
buffer is full and has evicted) and in-process ``sample(32)`` rates of the buffers,
measured in turns, each as a ratio to the plain buffer's; then a remote learner over gRPC
sampling each buffer from a daemon (:func:`remote_learner`: rebuilt bytes per second beside
the bare-gRPC download limit). Run alone:
``python bench/bench.py --only pixels``.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
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
    recorded = {}
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
        shm_choice(buffers, seconds, timed_rate)
        for buf in buffers.values():
            buf.close()
        pushes_section(game, data, seconds / 3, timed_rate)  # (bench_pixel_pushes.py)
        recorded[game] = data
    remote_learner(recorded, quick, seconds)


def shm_choice(buffers: dict, seconds: float, timed_rate: Callable) -> None:
    """What the fast path would gain by the stored form: over shared memory the daemon
    gathers a sample straight into the client's segment (``sample(out=)``: the client
    copies nothing), where the stored form would have it write the small tables and the
    client rebuild (``sample_stored`` + ``rebuild``: the same decompression and one copy of
    the arrays, moved to the client). Both in-process, in turns, as a ratio, with malloc
    tuned as the daemon and a connected client have it (see :mod:`millpond.remote.malloc`:
    else the rebuild's fresh arrays pay page faults)."""
    from millpond.remote.malloc import tune_malloc_for_large_messages

    tune_malloc_for_large_messages()
    ratios = []
    for label, buf in list(buffers.items())[1:]:
        out = {f.name: np.empty((REMOTE_BATCH, *f.shape), f.dtype) for f in buf.schema}
        plain, stored = [], []
        for _ in range(3):
            plain.append(timed_rate(lambda b=buf: b.sample(REMOTE_BATCH, out=out), 1,
                                    seconds / 3, repeats=1))
            stored.append(timed_rate(lambda b=buf: b.sample_stored(REMOTE_BATCH).rebuild(b.schema),
                                     1, seconds / 3, repeats=1))
        ratios.append(f"{label} {statistics.median(stored) / statistics.median(plain):.2f}x")
    print(f"    shared memory: the stored form rebuilt by the client, beside the plain sample("
          f"{REMOTE_BATCH}) gathered into the segment by the daemon: {', '.join(ratios)} "
          "(the fast path sends plain arrays)")


REMOTE_BATCH = 256  # a learner's sample: 14.5 MB as plain Atari transitions


def remote_learner(recorded: dict, quick: bool, seconds: float) -> None:
    """A remote learner over gRPC (``shm=False``): ``sample(256)`` of each buffer of a
    daemon, in the stored form (what crosses the wire: each group's distinct frames once,
    compressed ones as stored; the client rebuilds), as *rebuilt* bytes per second (the
    plain arrays delivered) beside the bare-gRPC download limit of a reply of the plain
    size (``grpc_limits.BareEcho``: the faster of a bare grpc.aio and a bare sync echo
    server), measured in turns in the same run; the median of the per-turn ratios. One
    call at a time (``sample``), and as a learner takes them (``sampler(prefetch=4)``:
    calls in flight while it rebuilds), the bare download one call at a time either way.
    Also the bytes a sample's reply carries, and ``sample`` with the client's
    decompression on two threads forced beside one thread forced (``PARALLEL_FRAMES``: see
    :mod:`millpond.core.stored`), in turns, the median ratio."""
    from grpc_limits import BareEcho, call_rate
    from support import ServerProcess

    import millpond
    import millpond.core.stored as stored

    print(f"\n  A remote learner over gRPC: sample({REMOTE_BATCH}) rebuilt at the client, "
          "beside the bare-gRPC download of a reply of the plain size (same run, in turns)")
    with tempfile.TemporaryDirectory(prefix="millpond-bench-pixels-") as tmp, \
            ServerProcess(Path(tmp) / "data") as server, \
            millpond.connect(server.address, shm=False) as client:
        bares = [BareEcho("aio"), BareEcho("sync")]
        try:
            for game, data in recorded.items():
                steps = len(data["obs"])
                fields = {name: (data[name].dtype.str, data[name].shape[1:]) for name in NAMES}
                handles = {}
                for label, options in KINDS:
                    buf = client.create_buffer(f"px-{game}-{label}", capacity=steps // 2,
                                               fields=fields, **options)
                    for lo in range(0, steps, 64):
                        buf.push_batch(**{name: data[name][lo:lo + 64] for name in NAMES})
                    buf.flush()
                    handles[label] = buf
                plain_bytes = REMOTE_BATCH * sum(data[name][0].nbytes for name in NAMES)
                request = str(plain_bytes).encode()
                for bare in bares:
                    bare.download(request)
                samplers = {label: buf.sampler(REMOTE_BATCH, prefetch=4)
                            for label, buf in handles.items()}
                calls = {label: (lambda b=buf: b.sample(REMOTE_BATCH),
                                 lambda s=samplers[label]: next(s))
                         for label, buf in handles.items()}
                rates: dict[str, list[list[float]]] = {label: [[], []] for label in handles}
                ratios: dict[str, list[list[float]]] = {label: [[], []] for label in handles}
                limits = []
                for _ in range(3):  # in turns
                    limit = max(call_rate(lambda b=b: b.download(request), seconds / 2)
                                for b in bares) * plain_bytes
                    limits.append(limit)
                    for label in handles:
                        for way, call in enumerate(calls[label]):
                            call()  # warm up
                            rate = call_rate(call, seconds) * plain_bytes
                            rates[label][way].append(rate)
                            ratios[label][way].append(rate / limit)
                for sampler in samplers.values():
                    sampler.close()
                threaded: dict[str, list[float]] = {"lz4": [], "zstd": []}
                saved = stored.PARALLEL_FRAMES
                try:
                    for _ in range(3):  # in turns: two threads, then one
                        for label, turns in threaded.items():
                            buf, rate = handles[label], []
                            for stored.PARALLEL_FRAMES in (1, 1 << 40):
                                rate.append(call_rate(lambda b=buf: b.sample(REMOTE_BATCH),
                                                      seconds / 2))
                            turns.append(rate[0] / rate[1])
                finally:
                    stored.PARALLEL_FRAMES = saved
                print(f"  {game}: bare-gRPC download of {plain_bytes / 1e6:.1f} MB replies "
                      f"{statistics.median(limits) / 1e9:.2f} GB/s")
                for label in handles:
                    wire = wire_bytes(server.address, f"px-{game}-{label}")
                    one, ahead = (statistics.median(r) for r in rates[label])
                    line = (f"    {label:7} reply {wire / 1e6:6.2f} MB; sample(): "
                            f"{one / 1e9:5.2f} GB/s = "
                            f"{statistics.median(ratios[label][0]):.2f}x the bare download; "
                            f"sampler(prefetch=4): {ahead / 1e9:5.2f} GB/s = "
                            f"{statistics.median(ratios[label][1]):.2f}x")
                    if label in threaded:
                        line += (f"; decompressing on 2 threads: "
                                 f"{statistics.median(threaded[label]):.2f}x one")
                    print(line)
        finally:
            for bare in bares:
                bare.close()


def wire_bytes(address: str, name: str) -> int:
    """Bytes of one sample reply as a client asking for the stored form receives it."""
    import grpc

    from millpond.v1 import replay_pb2 as pb

    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]
                               ) as channel:
        call = channel.unary_unary("/millpond.v1.Replay/Sample", response_deserializer=None,
                                   request_serializer=pb.SampleRequest.SerializeToString)
        return len(call(pb.SampleRequest(name=name, batch_size=REMOTE_BATCH, seed=0,
                                          stored_form=True), timeout=60))
