"""The gRPC rows of ``make bench``, each beside its limit measured in the same run.

The limits are what gRPC itself carries here, with no millpond code in the
way: a bare echo server in another process (raw bytes in and out, methods
``Empty``, ``Upload``, ``Download`` and ``Ping``, the same message-size options as the
daemon), run both as a ``grpc.aio`` server on uvloop (as the daemon is) and
as a synchronous ``grpc.server``; a row is judged against the faster of the
two. A persistent buffer's pushes also end on disk, so the Atari push row is
judged against the lower of the bare upload and the disk's sequential write
speed (write + ``fdatasync`` of a file of as many bytes as one timed push run
moved, in the benchmark's temp dir, like ``dd ... conv=fdatasync``).

The CartPole rows are also measured against a second daemon whose storage
work is patched out (``bench/no_storage.py``): the same client, framing and
handlers, nothing stored. That is the ceiling no engine change can pass.

The client sends small pushes and all samples as messages on streams it keeps
open (``client/millpond/grpc_streams.py``), which skip the setup of a call. So
the CartPole rows are also given against what one open bidi stream of the bare
servers carries (method ``Ping``: empty messages, one round trip at a time),
measured in the same turns: the table's limit stays the empty unary call, as
the issue defines it.

Rows and their limits are measured in turns (millpond for the bench's time per
measurement, then bare aio and bare sync for half of it each; three times), so
a noisy moment on this shared machine hits them alike; each figure is the
median of its turns and each ratio the median of the per-turn ratios.

    python bench/grpc_limits.py serve aio|sync   # the bare server (prints its port)
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import grpc
import numpy as np

SERVICE = "bench.Echo"
MAX_MESSAGE = 512 << 20
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE),
           ("grpc.max_receive_message_length", MAX_MESSAGE)]
TURNS = 3
IN_FLIGHT = 16  # the actor's window in the pushes-in-flight row


# ---- the bare server (a subprocess) ---------------------------------------------------


def _payload(nbytes: int, cache: dict[int, bytes] = {}) -> bytes:  # noqa: B006 (a cache)
    if nbytes not in cache:
        cache[nbytes] = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8).tobytes()
    return cache[nbytes]


def serve(kind: str) -> None:
    """Run the bare echo server (``kind``: "aio" or "sync") until killed; print its port."""
    replies: dict[str, Callable[[bytes], bytes]] = {
        "Empty": lambda request: b"",
        "Upload": lambda request: b"",
        "Download": lambda request: _payload(int(request)),  # the request: how many bytes
    }
    if kind == "sync":
        from concurrent.futures import ThreadPoolExecutor

        handlers = {name: grpc.unary_unary_rpc_method_handler(
            lambda request, context, reply=reply: reply(request)) for name, reply in replies.items()}
        handlers["Ping"] = grpc.stream_stream_rpc_method_handler(
            lambda requests, context: (b"" for _ in requests))
        server = grpc.server(ThreadPoolExecutor(8), options=OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        print(server.add_insecure_port("127.0.0.1:0"), flush=True)
        server.start()
        server.wait_for_termination()
        return

    def handler(reply: Callable[[bytes], bytes]):
        async def handle(request: bytes, context) -> bytes:
            return reply(request)
        return grpc.unary_unary_rpc_method_handler(handle)

    async def ping(requests, context):  # an empty reply to each message of the stream
        async for _ in requests:
            yield b""

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        handlers = {name: handler(reply) for name, reply in replies.items()}
        handlers["Ping"] = grpc.stream_stream_rpc_method_handler(ping)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    import uvloop

    uvloop.run(main())


class BareEcho:
    """A bare echo server subprocess and a channel to it."""

    def __init__(self, kind: str):
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", kind],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
        self.empty = self.channel.unary_unary(f"/{SERVICE}/Empty")
        self.upload = self.channel.unary_unary(f"/{SERVICE}/Upload")
        self.download = self.channel.unary_unary(f"/{SERVICE}/Download")
        self.ping = self.channel.stream_stream(f"/{SERVICE}/Ping")

    def ping_rate(self, seconds: float) -> float:
        """Round trips/s of empty messages on one open bidi stream, one at a time."""
        requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        replies = self.ping(iter(requests.get, None))
        requests.put(b"")
        next(replies)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            requests.put(b"")
            next(replies)
            n += 1
        rate = n / (time.perf_counter() - start)
        requests.put(None)
        for _ in replies:  # the stream ends
            pass
        return rate

    def close(self) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.wait()


def disk_write_rate(directory: Path, nbytes: int) -> float:
    """Bytes/s of writing ``nbytes`` to a new file in ``directory`` and fdatasync-ing it."""
    block = np.random.default_rng(1).integers(0, 255, 16 << 20, np.uint8).tobytes()
    path = directory / "disk-limit.tmp"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block[: min(len(block), nbytes - written)])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return nbytes / elapsed


# ---- the section ------------------------------------------------------------------------


def call_rate(fn: Callable[[], object], seconds: float, threads: int = 1) -> float:
    """Calls/s of ``fn`` over about ``seconds``, ``threads`` callers."""
    counts = [0] * threads
    start = time.perf_counter()
    deadline = start + seconds

    def caller(i: int) -> None:
        while time.perf_counter() < deadline:
            fn()
            counts[i] += 1

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    finish = getattr(fn, "finish", None)
    if finish is not None:  # calls answered later (pushes in flight) count once answered
        finish()
    return sum(counts) / (time.perf_counter() - start)


def grpc_limits_section(address: str, workloads: list, tmp: Path, seconds: float,
                        callers: int, no_storage_address: str | None = None) -> None:
    """Print the gRPC rows of the issue beside their same-run limits (see the module doc).

    ``no_storage_address``: a daemon with its storage work patched out
    (``bench/no_storage.py``), measured in the same turns for the CartPole rows:
    the ceiling no engine change can pass.
    """
    import millpond

    cart_w, atari_w = workloads
    client = millpond.connect(address, shm=False)
    # An actor with pushes in flight (connect(max_in_flight=)) on the same buffer.
    in_flight = millpond.connect(address, shm=False, max_in_flight=IN_FLIGHT)
    cart = client.create_buffer("bench-limits-CartPole", hot_capacity=cart_w.hot,
                                total_capacity=cart_w.total, fields=cart_w.schema)
    atari = client.create_buffer("bench-limits-Atari", hot_capacity=atari_w.hot,
                                 total_capacity=atari_w.total, fields=atari_w.schema)
    rng = np.random.default_rng(7)
    cart_batch, atari_batch = cart_w.batch(1000, rng), atari_w.batch(128, rng)
    ceiling = None
    if no_storage_address is not None:
        ceiling = millpond.connect(no_storage_address, shm=False).create_buffer(
            "bench-limits-CartPole", hot_capacity=cart_w.hot, total_capacity=cart_w.total,
            fields=cart_w.schema)
    for _ in range(cart_w.total // 1000):  # fill: samples reach both tiers
        cart.push_batch(**cart_batch)
        if ceiling is not None:
            ceiling.push_batch(**cart_batch)
    for _ in range(-(-atari_w.total // 128)):
        atari.push_batch(**atari_batch)
    atari_bytes = atari_w.schema.record_nbytes
    up, down = 128 * atari_bytes, 256 * atari_bytes
    down_request = str(down).encode()
    sampler = atari.sampler(256, prefetch=4)
    next(sampler)
    cart_sampler = cart.sampler(256, prefetch=4)  # a learner's samples in flight
    next(cart_sampler)
    bares = [BareEcho("aio"), BareEcho("sync")]
    for bare in bares:  # connect and warm up
        bare.empty(b"")
        bare.upload(_payload(up))
        bare.download(down_request)
    sustained = max(seconds, 2.0) if seconds >= 1.0 else seconds
    cart_actor = in_flight.buffer("bench-limits-CartPole")
    ceilings = {} if ceiling is None else {  # the same calls, to the no-storage daemon
        "CartPole push_batch(1000)": lambda: ceiling.push_batch(**cart_batch),
        "CartPole sample(256)": lambda: ceiling.sample(256)}
    # (row, millpond call, units per call, its limit's call on a bare server, units per call,
    #  callers, seconds)
    plan = [
        ("CartPole push_batch(1000)", lambda: cart.push_batch(**cart_batch), 1,
         lambda b: b.empty(b""), 1, 1, seconds),
        ("CartPole sample(256)", lambda: cart.sample(256), 1, lambda b: b.empty(b""), 1, 1, seconds),
        (f"Atari push_batch(128) {up / 1e6:.1f} MB", lambda: atari.push_batch(**atari_batch), up,
         lambda b: b.upload(_payload(up)), up, 1, sustained),
        (f"Atari sample(256) {down / 1e6:.1f} MB", lambda: atari.sample(256), down,
         lambda b: b.download(down_request), down, 1, seconds),
        ("Atari sampler(prefetch=4)", lambda: next(sampler), down,
         lambda b: b.download(down_request), down, 1, seconds),
        (f"{callers} callers: CartPole sample(256)", lambda: cart.sample(256), 256,
         lambda b: b.empty(b""), 256, callers, seconds),
        (f"{callers} callers: Atari sample(256)", lambda: atari.sample(256), down,
         lambda b: b.download(down_request), down, callers, seconds),
        (f"CartPole push_batch(1000), {IN_FLIGHT} in flight", _flushed(cart_actor, cart_batch),
         1, lambda b: b.empty(b""), 1, 1, seconds),
        ("CartPole sampler(256, prefetch=4)", lambda: next(cart_sampler), 1,
         lambda b: b.empty(b""), 1, 1, seconds),
    ]
    results = []
    streams: dict[str, list[tuple[float, float]]] = {}  # row -> (ping/s, row / ping) per turn
    try:
        for row, call, units, bare_call, bare_units, threads, secs in plan:
            ours, limits, ratios, ceiling_ratios = [], [], [], []
            for _ in range(TURNS):
                ours.append(call_rate(call, secs, threads) * units)
                limit = max(call_rate(lambda b=b: bare_call(b), secs / 2, threads) * bare_units
                            for b in bares)
                limits.append(limit)
                ratios.append(ours[-1] / limit)
                if row in ceilings:
                    ceiling_ratios.append(call_rate(ceilings[row], secs, threads) / limit)
                    ping = max(b.ping_rate(secs / 2) for b in bares)
                    streams.setdefault(row, []).append((ping, ours[-1] / ping))
            results.append((row, statistics.median(ours), statistics.median(limits),
                            statistics.median(ratios),
                            statistics.median(ceiling_ratios) if ceiling_ratios else None))
    finally:
        sampler.close()
        cart_sampler.close()
        for bare in bares:
            bare.close()
    push_row = results[2]
    disk = disk_write_rate(tmp, int(min(2 << 30, max(256 << 20, push_row[1] * sustained))))
    _print(results, disk, callers)
    _print_streams(streams)
    cart_actor.release()
    in_flight.close()
    cart.close()
    atari.close()


class _flushed:
    """``buf.push_batch(**batch)`` for :func:`call_rate`, which calls :meth:`finish`
    (flush) before it stops its clock: every push counted was acknowledged."""

    def __init__(self, buf, batch: dict):
        self.buf, self.batch = buf, batch

    def __call__(self) -> None:
        self.buf.push_batch(**self.batch)

    def finish(self) -> None:
        self.buf.flush()


def _print(results: list, disk: float, callers: int) -> None:
    print("\ngRPC beside bare gRPC, same run: one daemon, connect(shm=False); limit: a bare gRPC "
          "echo server (the\nfaster of grpc.aio and sync) making calls of the same shape; "
          f"medians of {TURNS} turns")
    print(f"  {'row':42} {'millpond':>19} {'limit':>19}  {'ratio':>5}  {'target':8} limit is")
    for i, (row, ours, limit, ratio, _) in enumerate(results):
        if i == 2:  # a persistent buffer's pushes end on disk: the lower limit counts
            limit, ratio = min(limit, disk), ratio * limit / min(limit, disk)
        if i < 2:
            what, target, unit, scale = "empty calls", ">= 0.7x", "calls/s", 1.0
        elif i in (7, 8):
            what, target, unit, scale = "sequential empty calls", ">= 1x", "calls/s", 1.0
        elif i == 5:
            what, target = f"{callers} callers' empty calls x 256", ">= 500k"
            unit, scale = "rec/s", 1.0
        else:
            what = {2: f"the lower of upload {results[2][2] / 1e9:.2f} GB/s and disk write "
                       f"{disk / 1e9:.2f} GB/s", 3: "download", 4: "download (1 caller)",
                    6: f"{callers} callers' downloads"}[i]
            target, unit, scale = (">= 0.9x" if i == 4 else ">= 0.7x"), "GB/s", 1e-9
        figures = " ".join(f"{f'{value * scale:,.2f}' if scale < 1 else f'{value:,.0f}':>11} "
                           f"{unit:7}" for value in (ours, limit))
        print(f"  {row:42} {figures}  {ratio:4.2f}x  {target:8} {what}")
    ceilings = [(row, ceiling) for row, _, _, _, ceiling in results if ceiling is not None]
    if ceilings:
        print("  the same calls to a daemon with its storage work patched out (bench/no_storage.py),"
              " the ceiling\n  of any engine change: " + "; ".join(
                  f"{row} {ceiling:.2f}x" for row, ceiling in ceilings))


def _print_streams(streams: dict[str, list[tuple[float, float]]]) -> None:
    """The CartPole rows against what one open stream carries (their calls are messages
    on open streams), beside the table's limit of empty unary calls."""
    if not streams:
        return
    pings = [ping for turns in streams.values() for ping, _ in turns]
    print(f"  the same rows against empty messages on one open bidi stream of the bare servers, "
          f"one round\n  trip at a time ({statistics.median(pings):,.0f}/s; millpond sends "
          "these calls so): " + "; ".join(
              f"{row} {statistics.median(r for _, r in turns):.2f}x"
              for row, turns in streams.items()))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(__doc__)
