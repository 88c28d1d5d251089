"""Pushes and samples over gRPC travel as messages on open streams (grpc_streams.py).

Every call keeps the unary call's contract (the contract, auth, metrics and
rate-limit suites run over them); these tests cover what streams add: one per
thread, gone with the thread or the client, replaced when the daemon ends one
(a restart, or idle), deadlines while the daemon does not answer, and unary
calls for a daemon without them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
from support import ServerProcess, wait_until
from test_contract import transitions

import millpond

pytestmark = pytest.mark.daemon


def stream_readers(server: ServerProcess) -> int:
    """Streams this process has open to ``server`` (their reader threads)."""
    return sum(t.name == f"millpond-stream {server.address}" for t in threading.enumerate())


def test_each_thread_has_its_streams_and_they_end_with_it(tmp_path):
    with ServerProcess(tmp_path / "data") as server:
        client = millpond.connect(server.address, shm=False)
        buf = client.create_buffer("threads", capacity=100, obs_dim=2, act_dim=1)
        idle = threading.active_count()

        def actor_and_learner(start: int) -> None:
            buf.push_batch(**transitions(start, 5))
            assert len(buf.sample(2)["obs"]) == 2

        workers = [threading.Thread(target=actor_and_learner, args=(5 * i,)) for i in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(30)
        assert len(buf) == 20
        wait_until(lambda: threading.active_count() <= idle)  # gRPC's threads too
        actor_and_learner(20)
        assert stream_readers(server) == 2  # this thread's push and sample streams
        client.close()
        wait_until(lambda: threading.active_count() <= idle and stream_readers(server) == 0)


def test_calls_go_on_across_a_daemon_restart(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    server = ServerProcess(tmp_path / "data", "--port", port).start()
    client = millpond.connect(server.address, shm=False, timeout=30)
    buf = client.create_buffer("restarts", capacity=100, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 5))
    buf.sample(2)
    start = time.monotonic()
    server.stop()  # its open streams end at once: the stop does not wait out --grace (10 s)
    assert time.monotonic() - start < 5
    server = ServerProcess(tmp_path / "data", "--port", port).start()
    try:
        buf.push_batch(**transitions(5, 5))  # its stream died with the daemon: a new one
        assert len(buf) == 10 and len(buf.sample(4)["obs"]) == 4
    finally:
        server.stop()


def test_an_idle_stream_ends_and_the_next_call_opens_another(tmp_path):
    with ServerProcess(tmp_path / "data", "--stream-idle-s", "0.2") as server:
        client = millpond.connect(server.address, shm=False)
        buf = client.create_buffer("idle", capacity=100, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 5))
        wait_until(lambda: stream_readers(server) == 0)  # the daemon ended it
        buf.push_batch(**transitions(5, 5))
        assert len(buf) == 10 and stream_readers(server) == 1


def test_a_daemon_that_does_not_answer_gets_a_deadline_error_then_a_new_stream(tmp_path):
    with ServerProcess(tmp_path / "data") as server:
        client = millpond.connect(server.address, shm=False, timeout=1.0)
        buf = client.create_buffer("stopped", capacity=100, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 5))
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(millpond.DeadlineExceededError):
                buf.sample(2)
            assert time.monotonic() - start < 10
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert len(buf.sample(2)["obs"]) == 2


def _push_from_child(buf, start: int, results) -> None:
    try:
        buf.push_batch(**transitions(start, 5))
        results.put(("ok", len(buf)))
    except BaseException as exc:  # report to the parent instead of a bare exit code
        results.put(("error", repr(exc)))


def test_a_fork_closes_idle_streams_first_and_both_processes_go_on(tmp_path):
    """gRPC skips its fork handlers while a call is open, as a stream is: idle streams are
    closed before a fork, and the next calls open new ones, in parent and child."""
    with ServerProcess(tmp_path / "data") as server:
        buf = millpond.connect(server.address, shm=False).create_buffer(
            "forks", capacity=100, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 5))
        buf.sample(2)
        assert stream_readers(server) == 2
        ctx = mp.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_push_from_child, args=(buf, 5, results))
        child.start()
        assert stream_readers(server) == 0  # closed, and ended, before the fork
        assert results.get(timeout=60) == ("ok", 10)
        child.join(30)
        assert child.exitcode == 0
        buf.push_batch(**transitions(10, 5))
        assert len(buf) == 15 and stream_readers(server) == 1
