"""millpond benchmark: throughput and memory, each beside a baseline measured in the same run.

    make bench                 # full run (a few minutes)
    make bench ARGS=--quick    # smaller, for a smoke check

For CartPole-size (obs float32[4]) and Atari-size (obs uint8[84,84,4])
transitions it prints push_batch and sample(256) throughput for a plain numpy
ring (the baseline: one slice copy per field to push, one np.take per field to
sample), the in-process millpond buffer, and a remote buffer on a daemon in
another process. Figures are medians of repeated timed runs; ratios are
against the numpy ring of the same run, since machines here are shared.
The gRPC rows are then measured again beside a bare gRPC echo server and the
disk's write speed, the limits of what gRPC and the disk carry, in the same
run (grpc_limits.py).
Finally it fills a daemon with 1M CartPole transitions and prints its resident
memory per stored record against the record's payload bytes, what
authentication costs: sample(256) over gRPC with a token and with TLS and a
token, beside a daemon without either, and one buffer sharded over 1, 2 and 3
daemons (bench_sharded.py). Episodic and learner-side sections: bench_episodes.py,
bench_learner.py (epoch_iterator beside a numpy permutation-gather, device="cpu"),
bench_contention.py (a learner's latency while an actor pushes), bench_integrity.py (the
record checksum, persistent pushes and recovery: format 5 beside format 4), bench_backup.py
(an actor's push throughput while the daemon writes snapshots of its buffer, vs alone),
bench_sb3.py (DQN's steps per second with SB3's own buffer, the SB3 adapter in-process and
on a daemon), bench_torchrl.py
(TorchRL's TensorDictReplayBuffer over MillpondStorage beside millpond's own sample).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import larger_than_memory  # noqa: E402
from bench_backup import section as backup_section  # noqa: E402
from bench_contention import section as contention_section  # noqa: E402
from bench_episodes import section as episodes_section  # noqa: E402
from bench_integrity import section as integrity_section  # noqa: E402
from bench_learner import section as learner_section  # noqa: E402
from bench_pixels import section as pixels_section  # noqa: E402
from bench_sb3 import section as sb3_section  # noqa: E402
from bench_sharded import sharded_section  # noqa: E402
from bench_torchrl import section as torchrl_section  # noqa: E402
from grpc_limits import call_rate, grpc_limits_section  # noqa: E402
from support import ServerProcess  # noqa: E402

import millpond  # noqa: E402
from millpond.core import BufferConfig, Prioritized, Schema, TieredBuffer  # noqa: E402

SAMPLE_BATCH = 256
CALLERS = 4  # concurrent callers (threads) for the "grpc xN" rows


@dataclass
class Workload:
    name: str
    schema: Schema
    push_batch: int  # records per push_batch call
    hot: int
    total: int

    def config(self, **sampling) -> BufferConfig:
        return BufferConfig(self.schema, self.hot, self.total, **sampling)

    def batch(self, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = {}
        for f in self.schema:
            if f.dtype.kind == "b":
                out[f.name] = rng.random((n,) + f.shape) < 0.01
            elif f.dtype.kind == "u":
                out[f.name] = rng.integers(0, 255, (n,) + f.shape, dtype=f.dtype)
            else:
                out[f.name] = rng.random((n,) + f.shape).astype(f.dtype)
        return out


def workloads(quick: bool) -> list[Workload]:
    scale = 10 if quick else 1
    atari = Schema.from_spec({
        "obs": ("uint8", (84, 84, 4)),
        "next_obs": ("uint8", (84, 84, 4)),
        "actions": ("int64", ()),
        "rewards": ("float32", ()),
        "terminated": ("bool", ()),
        "truncated": ("bool", ()),
    })
    return [
        Workload("CartPole", Schema.transition(4, 1), 10_000, 100_000 // scale, 1_000_000 // scale),
        Workload("Atari", atari, 64, 2_000 // scale, 10_000 // scale),
    ]


class NumpyRing:
    """The baseline: a single-tier ring of numpy arrays, nothing else."""

    def __init__(self, schema: Schema, capacity: int):
        self.capacity = capacity
        self.columns = {f.name: np.zeros((capacity,) + f.shape, f.dtype) for f in schema}
        self.pos = self.size = 0

    def push_batch(self, batch: dict) -> None:
        n = len(next(iter(batch.values())))
        head = min(n, self.capacity - self.pos)  # rows before the ring wraps
        for name, col in self.columns.items():
            col[self.pos:self.pos + head] = batch[name][:head]
            col[:n - head] = batch[name][head:]
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int, seed=None, out: dict | None = None) -> dict:
        idx = np.random.default_rng(seed).integers(0, self.size, batch_size)
        if out is None:
            return {name: np.take(col, idx, axis=0, mode="clip") for name, col in self.columns.items()}
        for name, col in self.columns.items():
            np.take(col, idx, axis=0, out=out[name], mode="clip")
        return out


def timed_rate(fn, items_per_call: int, seconds: float, threads: int = 1, repeats: int = 3) -> float:
    """Median items/s over ``repeats`` runs of about ``seconds``, ``threads`` callers each."""
    fn()  # warm up
    return statistics.median(call_rate(fn, seconds, threads) * items_per_call
                             for _ in range(repeats))


def measure(w: Workload, push, sample, seconds: float, threads: int = 1) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    batch = w.batch(w.push_batch, rng)
    filled = 0
    while filled < w.total:  # fill, so sampling reaches both tiers
        push(batch)
        filled += w.push_batch
    push_rate = timed_rate(lambda: push(batch), w.push_batch, seconds, threads)
    sample_rate = timed_rate(lambda: sample(SAMPLE_BATCH), SAMPLE_BATCH, seconds, threads)
    return push_rate, sample_rate


def fmt_rate(rate: float, record_nbytes: int) -> str:
    return f"{rate:>12,.0f} rec/s {rate * record_nbytes / 1e9:>7.2f} GB/s"


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def memory_figure(server: ServerProcess, records: int) -> None:
    """Daemon RSS per stored record, filling one buffer with ``records`` CartPole records.

    The baseline is taken after the buffer exists and holds its first batch,
    so code pages and fixed costs first touched there are not counted as
    per-record memory; everything after it is (hot arrays, cold pages mapped
    in, seq column, any retained message buffers).
    """
    w = Workload("CartPole", Schema.transition(4, 1), 10_000, records // 10, records)
    buf = millpond.connect(server.address).create_buffer(
        "bench-memory", hot_capacity=w.hot, total_capacity=w.total, fields=w.schema
    )
    batch = w.batch(w.push_batch, np.random.default_rng(1))
    buf.push_batch(**batch)
    before = rss_bytes(server.proc.pid)
    for _ in range(records // w.push_batch - 1):
        buf.push_batch(**batch)
    grown = rss_bytes(server.proc.pid) - before
    per_record = grown / (records - w.push_batch)
    payload = w.schema.record_nbytes
    print(f"\nMemory: daemon RSS grew {grown / 1e6:,.1f} MB for {records - w.push_batch:,} more "
          f"CartPole records (hot {w.hot:,} in RAM, the rest in the mapped cold file)")
    print(f"  {per_record:.1f} bytes/record resident vs {payload} payload bytes "
          f"= {per_record / payload:.2f}x (target <= 1.2x)")
    buf.close()


def latency_p50(fn, seconds: float) -> float:
    """Median seconds per call over about ``seconds``."""
    fn()
    times, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput_table(server: ServerProcess, tmp: Path, quick: bool, seconds: float) -> dict:
    """The main table; returns the rates and rings the shared-memory section reuses."""
    grpc_client = millpond.connect(server.address, shm=False)
    shm_client = millpond.connect(server.address, shm=True)
    header = f"{'workload':9} {'op':17} {'path':10} {'throughput':>31} {'vs numpy':>9}"
    print(header + "\n" + "-" * len(header))
    results = {}
    for w in workloads(quick):
        ring = NumpyRing(w.schema, w.total)
        local = TieredBuffer(w.config(), tmp / f"{w.name}.buffer")
        grpc_buf = grpc_client.create_buffer(f"bench-{w.name}", hot_capacity=w.hot,
                                             total_capacity=w.total, fields=w.schema)
        shm_buf = shm_client.buffer(f"bench-{w.name}")
        paths = {  # path: (push, sample, concurrent callers)
            "numpy": (ring.push_batch, ring.sample, 1),
            "in-process": (local.push_batch, local.sample, 1),
            "grpc": (lambda b: grpc_buf.push_batch(**b), grpc_buf.sample, 1),
            f"grpc x{CALLERS}": (lambda b: grpc_buf.push_batch(**b), grpc_buf.sample, CALLERS),
            "shm": (lambda b: shm_buf.push_batch(**b), shm_buf.sample, 1),
        }
        rates = {path: measure(w, push, sample, seconds, threads)
                 for path, (push, sample, threads) in paths.items()}
        for i, op in enumerate((f"push_batch({w.push_batch})", f"sample({SAMPLE_BATCH})")):
            for path, pair in rates.items():
                ratio = pair[i] / rates["numpy"][i]
                print(f"{w.name:9} {op:17} {path:10} {fmt_rate(pair[i], w.schema.record_nbytes)}"
                      f" {ratio:>8.2f}x")
        results[w.name] = (w, ring, rates, shm_buf, local)  # closed by shared_memory_section
    return results


def shared_memory_section(results: dict, server: ServerProcess, seconds: float) -> None:
    """The same-host targets, each beside its limit measured in the same run."""
    atari, atari_ring, atari_rates, _, atari_local = results["Atari"]
    cart, cart_ring, _, cart_shm, cart_local = results["CartPole"]
    atari_local.close()  # (its file: gigabytes)
    out = {f.name: np.empty((SAMPLE_BATCH,) + f.shape, f.dtype) for f in atari.schema}
    gather = timed_rate(lambda: atari_ring.sample(SAMPLE_BATCH, out=out), SAMPLE_BATCH, seconds)
    nbytes = atari.schema.record_nbytes
    rows = [
        ("Atari sample(256)", atari_rates["shm"][1] * nbytes / 1e9, "GB/s",
         "numpy gather into preallocated arrays", gather * nbytes / 1e9, ">= 0.7x"),
        (f"Atari push_batch({atari.push_batch})", atari_rates["shm"][0] * nbytes / 1e9, "GB/s",
         "np.copyto of the same bytes into a ring", atari_rates["numpy"][0] * nbytes / 1e9,
         ">= 0.5x"),
    ]
    cart_out = {f.name: np.empty((SAMPLE_BATCH,) + f.shape, f.dtype) for f in cart.schema}
    # In turns, so that a noisy moment (the kernel writing back the Atari rows' pages) hits
    # both alike: the medians of 3 turns.
    turns = [(latency_p50(lambda: cart_local.sample(SAMPLE_BATCH), seconds / 2),
              latency_p50(lambda: cart_shm.sample(SAMPLE_BATCH), seconds / 2)) for _ in range(3)]
    local_p50, shm_p50 = (statistics.median(p) * 1e6 for p in zip(*turns))
    cart_local.close()
    numpy_p50 = latency_p50(lambda: cart_ring.sample(SAMPLE_BATCH, out=cart_out), seconds) * 1e6
    print("\nSame host, shared memory (client.transport == 'shm'):")
    for op, value, unit, limit_name, limit, target in rows:
        print(f"  {op:22} {value:7.2f} {unit} vs {limit_name} {limit:6.2f} {unit}"
              f" = {value / limit:.2f}x (target {target})")
    print(f"  {'CartPole sample(256)':22} p50 {shm_p50:6.0f} us vs in-process p50 "
          f"{local_p50:.0f} us: +{shm_p50 - local_p50:.0f} us (target <= +50 us; "
          f"a numpy ring: {numpy_p50:.0f} us)")
    steps = push_per_step_rate(server, seconds)
    print(f"  {'CartPole push per step':22} {steps:9,.0f} steps/s with client-side batching "
          f"(target >= 100,000)")


def prioritized_shm_rows(server: ServerProcess, quick: bool, seconds: float) -> None:
    """Prioritized sample(256) over shared memory beside uniform (the throughput table's buffers)."""
    shm_client = millpond.connect(server.address, shm=True)
    grpc_client = millpond.connect(server.address, shm=False)
    print("\nPrioritized replay over shared memory, beside uniform over shared memory")
    for w in workloads(quick):
        uniform = shm_client.buffer(f"bench-{w.name}")  # filled by throughput_table
        prio = shm_client.create_buffer(f"bench-prio-{w.name}", hot_capacity=w.hot,
                                        total_capacity=w.total, fields=w.schema, prioritized=True)
        batch = w.batch(w.push_batch, np.random.default_rng(3))
        for i in range(w.total // w.push_batch):
            prio.push_batch(**batch, priorities=np.random.default_rng(i).random(w.push_batch))
        base = timed_rate(lambda: uniform.sample(SAMPLE_BATCH), SAMPLE_BATCH, seconds)
        rate = timed_rate(lambda: prio.sample(SAMPLE_BATCH), SAMPLE_BATCH, seconds)
        seqs = prio.sample(SAMPLE_BATCH)["indices"]
        new = np.random.default_rng(5).random(SAMPLE_BATCH)
        over_grpc = grpc_client.buffer(f"bench-prio-{w.name}")
        shm_p50 = latency_p50(lambda: prio.update_priorities(seqs, new), seconds) * 1e6
        grpc_p50 = latency_p50(lambda: over_grpc.update_priorities(seqs, new), seconds) * 1e6
        print(f"  {w.name:9} sample(256) {rate:12,.0f} rec/s vs uniform shm {base:12,.0f} = "
              f"{rate / base:.2f}x; update_priorities(256) p50 {shm_p50:.0f} us "
              f"(gRPC {grpc_p50:.0f} us)")
        prio.close()


def push_per_step_rate(server: ServerProcess, seconds: float) -> float:
    """An actor's loop: one ``push`` per environment step, batched by the client."""
    buf = millpond.connect(server.address, shm=True).create_buffer(
        "bench-steps", capacity=1_000_000, obs_dim=4, act_dim=1)
    obs, action, next_obs = np.zeros(4, np.float32), np.zeros(1, np.float32), np.ones(4, np.float32)

    def step() -> None:
        for _ in range(1_000):
            buf.push(obs, action, 1.0, False, False, next_obs)
        buf.flush()

    rate = timed_rate(step, 1_000, seconds)
    buf.close()
    return rate


def queue_section(server: ServerProcess, seconds: float) -> None:
    """How fast a waiting sample wakes up: a queue handing single records from a producer
    thread to a consumer blocked on the empty queue, beside a sample that need not wait."""
    print("\nQueues and rate limits: hand-off of one record to a consumer waiting on an empty "
          "queue, p50")
    fields = {"t": ("float64", ())}
    for transport in ("grpc", "shm"):
        client = millpond.connect(server.address, shm=transport == "shm")
        queue = client.create_buffer(f"bench-queue-{transport}", 1024, fields=fields, mode="queue")
        plain = client.create_buffer(f"bench-plain-{transport}", 1024, fields=fields)
        plain.push_batch(t=np.zeros(16))
        baseline = latency_p50(lambda: plain.sample(1), seconds)
        producer_client = millpond.connect(server.address, shm=transport == "shm")
        producer = producer_client.buffer(queue.info()["name"])
        lags, stop = [], threading.Event()

        def produce():
            while not stop.is_set():
                if queue.info()["waiting_samples"]:  # hand over only to a waiting consumer
                    producer.push_batch(t=np.array([time.perf_counter()]))
                time.sleep(0.001)

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        deadline = time.perf_counter() + max(seconds, 1.0)
        while time.perf_counter() < deadline or len(lags) < 20:
            sent = queue.sample(1, timeout=10)["t"][0]
            lags.append(time.perf_counter() - sent)
        stop.set()
        thread.join()
        print(f"  {transport:5} {statistics.median(lags) * 1e6:8,.0f} us from push to the waiting "
              f"consumer; a sample(1) that need not wait: {baseline * 1e6:,.0f} us round trip")
        queue.close()
        plain.close()


def durability_section(tmp: Path, seconds: float) -> None:
    """What durability costs: push throughput under each --sync policy, same run."""
    w = workloads(quick=True)[0]  # CartPole, 10,000 records per push_batch
    batch = w.batch(w.push_batch, np.random.default_rng(2))
    print(f"\nDurability: CartPole push_batch({w.push_batch}) through shared memory by --sync policy")
    for policy in ("none", "interval", "always"):
        with ServerProcess(tmp / f"sync-{policy}", "--sync", policy) as server:
            buf = millpond.connect(server.address).create_buffer(
                "bench-sync", hot_capacity=w.hot, total_capacity=w.total, fields=w.schema)
            rate = timed_rate(lambda: buf.push_batch(**batch), w.push_batch, seconds)
            print(f"  --sync {policy:9} {fmt_rate(rate, w.schema.record_nbytes)}")


def prioritized_section(tmp: Path, quick: bool, seconds: float) -> None:
    """Prioritized sample(256) and update_priorities(256) beside uniform sampling (in-process)."""
    print("\nPrioritized replay, in-process (target: sample >= 0.5x uniform)")
    for w in workloads(quick):
        uniform = TieredBuffer(w.config(), tmp / f"u-{w.name}.buffer")
        prio = TieredBuffer(w.config(prioritized=Prioritized()), tmp / f"p-{w.name}.buffer")
        batch = w.batch(w.push_batch, np.random.default_rng(3))
        for _ in range(w.total // w.push_batch):
            uniform.push_batch(batch)
            prio.push_batch(batch, priorities=np.random.default_rng(4).random(w.push_batch))
        base = timed_rate(lambda: uniform.sample(SAMPLE_BATCH), SAMPLE_BATCH, seconds)
        rate = timed_rate(lambda: prio.sample(SAMPLE_BATCH), SAMPLE_BATCH, seconds)
        seqs = prio.sample(SAMPLE_BATCH)["indices"]
        new = np.random.default_rng(5).random(SAMPLE_BATCH)
        update = timed_rate(lambda: prio.update_priorities(seqs, new), SAMPLE_BATCH, seconds)
        print(f"  {w.name:9} sample(256) {rate:12,.0f} rec/s vs uniform {base:12,.0f} = "
              f"{rate / base:.2f}x; update_priorities(256) {update:12,.0f} rec/s")
        uniform.close()
        prio.close()


def _server_certificate(directory: Path) -> tuple[str, str, str] | None:
    """``(ca.pem, server.pem, server.key)`` for 127.0.0.1, made by ``openssl``; None without it."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        return None

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=bench-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "san.ext")
    return tuple(str(directory / name) for name in ("ca.pem", "server.pem", "server.key"))


def auth_section(tmp: Path, seconds: float) -> None:
    """What authentication costs: sample(256) over gRPC against daemons without auth, with a
    token, and with TLS and a token, measured in turns (the quick sizes: ratios matter)."""
    import contextlib
    import secrets

    token = secrets.token_urlsafe(32)
    (tmp / "pki").mkdir()
    pki = _server_certificate(tmp / "pki")
    setups: dict[str, tuple[tuple[str, ...], dict[str, str], dict]] = {
        "no auth": ((), {}, {}),
        "token": ((), {"MILLPOND_TOKEN": token}, {"token": token}),
    }
    if pki is not None:
        ca, cert, key = pki
        setups["TLS+token"] = (("--tls-cert", cert, "--tls-key", key), {"MILLPOND_TOKEN": token},
                               {"token": token, "tls_ca": ca})
    print("\nAuthentication: sample(256) over gRPC (shm=False), each beside no auth"
          + ("" if pki else " (no openssl here: no TLS row)"))
    with contextlib.ExitStack() as stack:
        buffers: dict[str, list] = {}
        for label, (args, env, credentials) in setups.items():
            server = stack.enter_context(ServerProcess(tmp / f"auth-{label}", *args, env=env))
            client = millpond.connect(server.address, shm=False, **credentials)
            buffers[label] = [client.create_buffer(f"bench-auth-{w.name}", hot_capacity=w.hot,
                                                   total_capacity=w.total, fields=w.schema)
                              for w in workloads(quick=True)]
        for i, w in enumerate(workloads(quick=True)):
            batch = w.batch(w.push_batch, np.random.default_rng(6))
            for handles in buffers.values():
                for _ in range(w.total // w.push_batch):
                    handles[i].push_batch(**batch)
            rates: dict[str, list[float]] = {label: [] for label in buffers}
            for _ in range(3):  # in turns, so a noisy moment hits every daemon alike
                for label, handles in buffers.items():
                    buf = handles[i]
                    rates[label].append(timed_rate(lambda: buf.sample(SAMPLE_BATCH), SAMPLE_BATCH,
                                                   seconds, repeats=1))
            base = statistics.median(rates["no auth"])
            for label, values in rates.items():
                rate = statistics.median(values)
                print(f"  {w.name:9} sample(256) {label:10} {fmt_rate(rate, w.schema.record_nbytes)}"
                      f" = {rate / base:.2f}x no auth")


def no_storage_server(data_dir: Path) -> ServerProcess:
    """A daemon with its storage work patched out (bench/no_storage.py), for the ceiling
    of the gRPC rows."""
    return ServerProcess(data_dir, script=Path(__file__).with_name("no_storage.py"))


def grpc_section(address: str, tmp: Path, quick: bool, seconds: float) -> None:
    with no_storage_server(tmp / "no-storage") as ceiling:
        grpc_limits_section(address, workloads(quick), tmp, seconds, CALLERS, ceiling.address)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, short timings")
    parser.add_argument("--seconds", type=float, default=None, help="time per measurement")
    parser.add_argument("--only", choices=["grpc", "load", "integrity", "backup", "pixels", "sb3",
                                           "torchrl"],
                        help="only the section 'gRPC beside bare gRPC', 'Under load' (to compare "
                        "two source trees: PYTHONPATH=TREE/client:TREE/server), 'Integrity' "
                        "(format 5's checksum and commit beside format 4's), 'Backups', 'Pixels' "
                        "(frames stored once, on Atari frames), 'SB3' (DQN with SB3's buffer "
                        "beside the adapter) or 'TorchRL' (TorchRL's buffers over millpond)")
    args = parser.parse_args()
    seconds = args.seconds or (0.3 if args.quick else 1.0)
    tmp = Path(tempfile.mkdtemp(prefix="millpond-bench-"))
    print(f"millpond {millpond.__version__} benchmark; numpy {np.__version__}; "
          f"{os.cpu_count()} cores; sample batch {SAMPLE_BATCH}; median of 3 x {seconds}s\n")
    try:
        if args.only == "integrity":
            integrity_section(workloads(args.quick), args.quick, seconds, timed_rate)
            return
        if args.only == "backup":
            backup_section(tmp, workloads(args.quick), seconds, fmt_rate)
            return
        if args.only == "pixels":
            pixels_section(args.quick, seconds, timed_rate)
            return
        if args.only == "sb3":
            sb3_section(tmp, 2_000 if args.quick else 5_000)
            return
        if args.only is not None:
            with ServerProcess(tmp / "data") as server:
                if args.only == "grpc":
                    grpc_section(server.address, tmp, args.quick, seconds)
                elif args.only == "torchrl":
                    torchrl_section(server.address, args.quick, seconds, timed_rate)
                else:
                    contention_section(server.address, workloads(args.quick), seconds)
            return
        with ServerProcess(tmp / "data") as server:
            results = throughput_table(server, tmp, args.quick, seconds)
            shared_memory_section(results, server, seconds)
            prioritized_shm_rows(server, args.quick, seconds)
            grpc_section(server.address, tmp, args.quick, seconds)
            queue_section(server, seconds)
            contention_section(server.address, workloads(args.quick), seconds)
            memory_figure(server, 100_000 if args.quick else 1_000_000)
            episodes_section(server.address, args.quick, seconds, timed_rate)
            learner_section(server.address, args.quick, seconds, timed_rate)
            torchrl_section(server.address, args.quick, seconds, timed_rate)
        durability_section(tmp, seconds)
        integrity_section(workloads(args.quick), args.quick, seconds, timed_rate)
        backup_section(tmp, workloads(args.quick), seconds, fmt_rate)
        pixels_section(args.quick, seconds, timed_rate)
        larger_than_memory.section(tmp, args.quick, seconds)
        prioritized_section(tmp, args.quick, seconds)
        auth_section(tmp, seconds)
        sharded_section(tmp, workloads(args.quick), CALLERS, timed_rate, fmt_rate, seconds)
        sb3_section(tmp, 2_000 if args.quick else 5_000)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gigabytes of buffer files


if __name__ == "__main__":
    main()
