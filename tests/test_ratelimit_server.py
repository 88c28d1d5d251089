"""Rate limiting and queues on a real server: deadlines, concurrency, killed clients.

Every test talks to a real ``millpond serve`` process, over gRPC and (where
the transport matters) over the shared-memory fast path.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from support import ServerProcess, wait_until

import millpond
from millpond.errors import ConfigMismatchError, RateLimitTimeoutError
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc
from millpond.wire.status import ERROR_CODE_KEY

pytestmark = pytest.mark.daemon

FIELDS = {"id": ("int64", ())}
TRANSPORTS = ["grpc", "shm"]


def connect(server, transport: str, **kwargs) -> millpond.Client:
    client = millpond.connect(server.address, shm=transport == "shm", **kwargs)
    assert client.transport == transport
    return client


def ids(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sample_times_out_with_a_clear_error_and_changes_nothing(shared_server, transport):
    client = connect(shared_server, transport)
    buf = client.create_buffer(f"timeout-{transport}", 100, fields=FIELDS,
                               rate_limiter=millpond.MinSize(10))
    buf.push_batch(id=ids(0, 3))
    start = time.monotonic()
    with pytest.raises(RateLimitTimeoutError, match="min size to sample 10"):
        buf.sample(2, timeout=0.5)
    assert 0.4 <= time.monotonic() - start < 10
    info = buf.info()
    assert (info["size"], info["samples"], info["sample_waits"]) == (3, 0, 1)
    assert info["sample_wait_seconds"] > 0.3


def test_the_grpc_status_is_deadline_exceeded_with_a_stable_code(shared_server):
    millpond.connect(shared_server.address).create_buffer(
        "status-code", 10, fields=FIELDS, rate_limiter=millpond.MinSize(5))
    stub = pb_grpc.ReplayStub(grpc.insecure_channel(shared_server.address))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Sample(pb.SampleRequest(name="status-code", batch_size=1), timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (ERROR_CODE_KEY, "RATE_LIMIT_TIMEOUT") in caught.value.trailing_metadata()


def test_waiting_samples_block_neither_other_buffers_nor_the_server(server):
    """More waiters than the engine's thread pool has threads: all wait on the loop."""
    client = millpond.connect(server.address, shm=False)
    gated = client.create_buffer("gated", 100, fields=FIELDS, rate_limiter=millpond.MinSize(5))
    other = client.create_buffer("other", 100, fields=FIELDS)
    waiters = 24
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(gated.sample(1, timeout=30)))
               for _ in range(waiters)]
    for thread in threads:
        thread.start()
    wait_until(lambda: gated.info()["waiting_samples"] == waiters, timeout=20)
    start = time.monotonic()
    for i in range(20):  # the other buffer is served as usual meanwhile
        other.push_batch(id=ids(i * 10, 10))
        assert len(other.sample(5)["id"]) == 5
    assert time.monotonic() - start < 10
    gated.push_batch(id=ids(0, 5))
    for thread in threads:
        thread.join(20)
    assert len(results) == waiters
    info = gated.info()
    assert (info["waiting_samples"], info["sample_waits"]) == (0, waiters)


def _actor(address: str, name: str, seed: int, stop) -> None:
    buf = millpond.connect(address).buffer(name)
    start = seed * 10**6
    while not stop.is_set():
        try:
            buf.push_batch(id=ids(start, 16), timeout=0.2)
            start += 16
        except RateLimitTimeoutError:
            pass


def _learner(address: str, name: str, batches: int) -> None:
    buf = millpond.connect(address).buffer(name)
    for _ in range(batches):
        assert len(buf.sample(32, timeout=30)["id"]) == 32


def test_actor_and_learner_processes_hold_the_ratio_within_its_band(server):
    limiter = millpond.SampleToInsertRatio(samples_per_insert=2.0, min_size_to_sample=100,
                                           error_buffer=300)
    client = millpond.connect(server.address)
    buf = client.create_buffer("ratio", hot_capacity=1000, total_capacity=10_000,
                               fields=FIELDS, rate_limiter=limiter)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    actors = [ctx.Process(target=_actor, args=(server.address, "ratio", s, stop))
              for s in range(2)]
    learners = [ctx.Process(target=_learner, args=(server.address, "ratio", 60))
                for _ in range(2)]
    for proc in actors + learners:
        proc.start()
    snapshots = []
    try:
        while any(p.is_alive() for p in learners):
            snapshots.append(buf.info())
        for proc in learners:
            proc.join(60)
            assert proc.exitcode == 0
    finally:
        stop.set()
        for proc in actors:
            proc.join(30)
    assert all(proc.exitcode == 0 for proc in actors)
    final = buf.info()
    assert final["samples"] == 2 * 60 * 32
    for info in snapshots + [final]:
        gap = info["inserts"] * limiter.samples_per_insert - info["samples"]
        assert limiter.min_diff <= gap <= limiter.max_diff, info
    assert final["insert_waits"] + final["sample_waits"] > 0


_WAIT_FOREVER = """
import sys, millpond
client = millpond.connect(sys.argv[1], shm=sys.argv[3] == "shm")
assert client.transport == sys.argv[3]
client.buffer(sys.argv[2]).sample(1, timeout=120)
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_killed_client_releases_its_wait(shared_server, transport):
    name = f"killed-{transport}"
    buf = millpond.connect(shared_server.address).create_buffer(
        name, 10, fields=FIELDS, rate_limiter=millpond.MinSize(5))
    proc = subprocess.Popen([sys.executable, "-c", _WAIT_FOREVER, shared_server.address, name,
                             transport])
    try:
        wait_until(lambda: buf.info()["waiting_samples"] == 1, timeout=30)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_until(lambda: buf.info()["waiting_samples"] == 0, timeout=10)
    assert buf.info()["sample_waits"] == 1
    buf.push_batch(id=ids(0, 5))  # and the buffer still works
    assert len(buf.sample(5, timeout=5)["id"]) == 5


def _producer(address: str, name: str, total: int, transport: str) -> None:
    buf = millpond.connect(address, shm=transport == "shm").buffer(name)
    for start in range(0, total, 25):
        buf.push_batch(id=ids(start, 25), timeout=30)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_queue_between_processes_hands_out_every_record_once_in_order(server, transport):
    client = connect(server, transport)
    queue = client.create_buffer("queue", hot_capacity=20, total_capacity=50, fields=FIELDS,
                                 mode="queue")
    total = 1000
    producer = mp.get_context("spawn").Process(
        target=_producer, args=(server.address, "queue", total, transport))
    producer.start()
    got: list[int] = []
    while len(got) < total:
        got.extend(queue.sample(10, timeout=30)["id"].tolist())
    producer.join(30)
    assert producer.exitcode == 0
    assert got == list(range(total))
    info = queue.info()
    assert (info["size"], info["inserts"], info["samples"]) == (0, total, total)
    assert info["insert_waits"] > 0  # a 50-record queue made the producer wait


def test_sampling_config_is_part_of_the_buffer_and_survives_a_restart(tmp_path):
    limiter = millpond.SampleToInsertRatio(1.5, 10, error_buffer=(5, 40))
    with ServerProcess(tmp_path / "data") as server:
        client = millpond.connect(server.address)
        buf = client.create_buffer("kept", 100, fields=FIELDS, rate_limiter=limiter,
                                   max_times_sampled=3)
        assert client.create_buffer("kept", 100, fields=FIELDS, rate_limiter=limiter,
                                    max_times_sampled=3).info()["name"] == "kept"
        with pytest.raises(ConfigMismatchError, match="rate_limiter"):
            client.create_buffer("kept", 100, fields=FIELDS, max_times_sampled=3)
        with pytest.raises(ConfigMismatchError, match="max_times_sampled"):
            client.create_buffer("kept", 100, fields=FIELDS, rate_limiter=limiter)
        client.create_buffer("fifo", 30, fields=FIELDS, mode="queue").push_batch(id=ids(0, 7))
        buf.push_batch(id=ids(0, 20))
    with ServerProcess(tmp_path / "data") as server:
        client = millpond.connect(server.address)
        info = client.buffer("kept").info()
        assert millpond.RateLimiter.from_dict(info["rate_limiter"]) == limiter
        assert info["max_times_sampled"] == 3 and info["mode"] == "replay"
        fifo = client.buffer("fifo")
        assert fifo.info()["mode"] == "queue"
        assert fifo.sample(7, timeout=5)["id"].tolist() == list(range(7))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigterm_while_calls_wait_stops_the_server_cleanly(tmp_path, transport):
    server = ServerProcess(tmp_path / "data", "--grace", "2").start()
    try:
        client = connect(server, transport)
        buf = client.create_buffer("gate", 10, fields=FIELDS, rate_limiter=millpond.MinSize(5))
        errors: list = []

        def wait():
            try:
                buf.sample(1, timeout=60)
            except millpond.ReplayError as exc:
                errors.append(exc)

        thread = threading.Thread(target=wait)
        thread.start()
        wait_until(lambda: buf.info()["waiting_samples"] == 1, timeout=20)
        start = time.monotonic()
        assert server.stop(signal.SIGTERM, timeout=30) == 0
        assert time.monotonic() - start < 15
        thread.join(30)
        assert not thread.is_alive() and len(errors) == 1  # the waiter got an error, not a hang
    finally:
        server.stop(signal.SIGKILL)
