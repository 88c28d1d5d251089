"""The client library against a real daemon: what only a remote buffer can do."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support import ServerProcess, wait_until
from test_contract import transitions

import millpond


def test_connect_create_attach_and_list(shared_server):
    client = millpond.connect(shared_server.address)
    buf = client.create_buffer("client-list", hot_capacity=4, total_capacity=16, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 10))
    again = client.buffer("client-list")
    assert len(again) == 10 and again.schema == buf.schema
    rows = {row["name"]: row for row in client.list_buffers()}
    assert rows["client-list"]["size"] == 10
    assert rows["client-list"]["hot_capacity"] == 4 and rows["client-list"]["total_capacity"] == 16
    buf.close()
    assert "client-list" not in {row["name"] for row in client.list_buffers()}


def test_same_config_attaches_and_other_config_is_refused(shared_server):
    client = millpond.connect(shared_server.address)
    first = client.create_buffer("client-mismatch", capacity=8, obs_dim=2, act_dim=1)
    first.push_batch(**transitions(0, 3))
    second = client.create_buffer("client-mismatch", capacity=8, obs_dim=2, act_dim=1)
    assert len(second) == 3
    with pytest.raises(millpond.ConfigMismatchError):
        client.create_buffer("client-mismatch", capacity=8, obs_dim=3, act_dim=1)
    assert len(first) == 3
    first.close()


def test_unknown_buffer_is_a_typed_key_error(shared_server):
    client = millpond.connect(shared_server.address)
    with pytest.raises(millpond.BufferNotFoundError) as info:
        client.buffer("no-such-buffer")
    assert isinstance(info.value, KeyError)


def test_constructor_with_address_is_the_one_line_switch(shared_server):
    buf = millpond.ReplayBuffer(16, 2, 1, address=shared_server.address, name="client-switch")
    buf.push_batch(**transitions(0, 5))
    assert len(buf) == 5 and buf.info()["cold_size"] == 0
    buf.close()


def test_oversized_push_is_refused_before_sending(shared_server):
    client = millpond.connect(shared_server.address, max_message_mb=1, shm=False)
    buf = client.create_buffer("client-big-push", capacity=200_000, fields={"x": ("float32", (64,))})
    with pytest.raises(millpond.MessageTooLargeError, match="max_message_mb"):
        buf.push_batch(x=np.zeros((10_000, 64), np.float32))  # 2.5 MB > 1 MB
    assert len(buf) == 0
    buf.close()


@pytest.mark.daemon
def test_oversized_sample_reply_names_the_server_limit(tmp_path):
    with ServerProcess(tmp_path / "data", "--max-message-mb", "1") as server:
        buf = millpond.connect(server.address, shm=False).create_buffer(
            "big", capacity=1000, fields={"x": ("float32", (1024,))}
        )
        for _ in range(2):  # 2 x 0.6 MB pushes, each under the limit
            buf.push_batch(x=np.ones((150, 1024), np.float32))
        with pytest.raises(millpond.MessageTooLargeError, match="max-message-mb"):
            buf.sample(300)
        assert buf.sample(10)["x"].shape == (10, 1024)


@pytest.mark.parametrize("shm", [False, True], ids=["grpc", "shm"])
def test_deadline_exceeded_is_typed_and_the_client_recovers(shared_server, shm):
    client = millpond.connect(shared_server.address, shm=shm)
    buf = client.create_buffer(f"client-deadline-{shm}", capacity=12_800,
                               fields={"x": ("float32", (1024,))})
    for _ in range(4):
        buf.push_batch(x=np.ones((3_200, 1024), np.float32))
    client.timeout = 0.002
    # 50 MB cannot be gathered and handed over in 2 ms.
    with pytest.raises(millpond.DeadlineExceededError) as info:
        buf.sample(12_800)
    assert isinstance(info.value, TimeoutError)
    client.timeout = 60
    assert buf.sample(10)["x"].shape == (10, 1024)
    assert client.transport == ("shm" if shm else "grpc")
    buf.close()


def test_timeout_must_be_positive():
    with pytest.raises(millpond.InvalidConfigError):
        millpond.connect("localhost:1", timeout=0)


@pytest.mark.daemon
def test_a_call_in_flight_when_the_server_dies_fails_in_seconds(tmp_path):
    server = ServerProcess(tmp_path / "data").start()
    client = millpond.connect(server.address, timeout=30, shm=False)
    buf = client.create_buffer("gone", capacity=8, obs_dim=2, act_dim=1,
                               rate_limiter=millpond.MinSize(5))
    buf.push_batch(**transitions(0, 2))
    failed = []

    def learner():  # waits on the server for records that never come
        started = time.monotonic()
        try:
            buf.sample(1, timeout=60)
        except millpond.ReplayError as exc:
            failed.append((exc, time.monotonic() - started))

    thread = threading.Thread(target=learner)
    thread.start()
    wait_until(lambda: buf.info()["waiting_samples"] == 1)
    server.stop(signal.SIGKILL)
    thread.join(10)
    (error, _), = failed
    assert isinstance(error, millpond.ServerUnavailableError) and isinstance(error, ConnectionError)


@pytest.mark.daemon
def test_a_call_to_a_server_that_stays_down_fails_by_its_deadline(tmp_path):
    """Calls wait for a server that is not there (it may be restarting), up to their
    deadline; one that went out on the connection as it died fails at once."""
    server = ServerProcess(tmp_path / "data").start()
    buf = millpond.connect(server.address, timeout=1).create_buffer("down", capacity=8, obs_dim=2,
                                                                     act_dim=1)
    buf.push_batch(**transitions(0, 2))
    server.stop(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises((millpond.DeadlineExceededError, millpond.ServerUnavailableError)):
        buf.sample(1)
    assert time.monotonic() - started < 5


def _push_from_child(handle, start, queue):
    try:
        handle.push_batch(**transitions(start, 5))
        queue.put(("ok", len(handle)))
    except BaseException as exc:  # report to the parent instead of a bare exit code
        queue.put(("error", repr(exc)))
        raise


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_handles_work_in_actor_processes(shared_server, method):
    buf = millpond.connect(shared_server.address).create_buffer(
        f"client-actors-{method}", capacity=100, obs_dim=2, act_dim=1
    )
    buf.push_batch(**transitions(0, 5))  # the parent's channel is live before fork
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    actors = [ctx.Process(target=_push_from_child, args=(buf, 5 * (i + 1), queue)) for i in range(2)]
    for actor in actors:
        actor.start()
    reports = [queue.get(timeout=60) for _ in actors]
    for actor in actors:
        actor.join(60)
    assert all(status == "ok" for status, _ in reports), reports
    assert [actor.exitcode for actor in actors] == [0, 0]
    assert len(buf) == 15
    assert max(size for _, size in reports) == 15
    buf.close()


def test_handles_pickle_by_address_and_name(shared_server):
    buf = millpond.connect(shared_server.address).create_buffer(
        "client-pickle", capacity=10, obs_dim=2, act_dim=1
    )
    buf.push_batch(**transitions(0, 3))
    clone = pickle.loads(pickle.dumps(buf))
    assert len(clone) == 3 and clone.schema == buf.schema
    client = millpond.connect(shared_server.address)
    assert pickle.loads(pickle.dumps(client)).address == shared_server.address
    buf.close()


def test_local_buffers_refuse_to_pickle(tmp_path):
    buf = millpond.ReplayBuffer(4, 2, 1)
    with pytest.raises(TypeError, match="address="):
        pickle.dumps(buf)


def test_single_pushes_are_batched_and_flushed(shared_server):
    actor = millpond.connect(shared_server.address, push_batch_size=100, push_max_delay=None)
    buf = actor.create_buffer("client-batched", capacity=1000, obs_dim=2, act_dim=1)
    observer = millpond.connect(shared_server.address).buffer("client-batched")
    for i in range(150):
        buf.push([i, i], [0.0], float(i), False, False, [i, i])
    assert len(observer) == 100  # one full batch went out; 50 records wait
    buf.flush()
    assert len(observer) == 150
    assert observer.info()["pushed"] == 150
    rewards = observer.sample(150, seed=0)["rewards"]
    assert set(rewards.tolist()) <= set(map(float, range(150)))


def test_queued_pushes_go_out_by_age(shared_server):
    actor = millpond.connect(shared_server.address, push_batch_size=1000, push_max_delay=0.05)
    buf = actor.create_buffer("client-aged", capacity=1000, obs_dim=2, act_dim=1)
    observer = millpond.connect(shared_server.address).buffer("client-aged")
    buf.push([1, 1], [0.0], 1.0, False, False, [1, 1])
    wait_until(lambda: len(observer) == 1, timeout=10)  # sent by age, no flush needed


ACTOR_EXITS_WITHOUT_FLUSH = """
import millpond
buf = millpond.connect({address!r}, push_max_delay=None).buffer("client-exit")
for i in range(7):
    buf.push([i, i], [0.0], float(i), False, False, [i, i])
"""


def test_queued_pushes_are_flushed_at_interpreter_exit(shared_server):
    buf = millpond.connect(shared_server.address).create_buffer("client-exit", capacity=100,
                                                                 obs_dim=2, act_dim=1)
    done = subprocess.run([sys.executable, "-c", ACTOR_EXITS_WITHOUT_FLUSH.format(
        address=shared_server.address)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(buf) == 7


def test_prefetching_sampler_over_the_server(shared_server):
    buf = millpond.connect(shared_server.address).create_buffer("client-sampler", capacity=100,
                                                                 obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 100))
    with buf.sampler(32, prefetch=3, seed=10, max_batches=5) as batches:
        got = [b["rewards"] for b in batches]
    assert len(got) == 5
    for i, rewards in enumerate(got):
        np.testing.assert_array_equal(rewards, buf.sample(32, seed=10 + i)["rewards"])


def _names_on(address: str) -> set[str]:
    return {info["name"] for info in millpond.connect(address).list_buffers()}


def test_close_deletes_a_shared_buffer_only_from_the_handle_that_created_it(shared_server):
    """Many actors and learners share a server buffer: closing an attached handle
    releases it; only the creator's close (or an explicit delete) deletes the data."""
    address = shared_server.address
    spec = dict(capacity=10, obs_dim=2, act_dim=1)
    creator = millpond.connect(address).create_buffer("owned", **spec)
    creator.push_batch(**transitions(0, 3))
    attached = millpond.connect(address).create_buffer("owned", **spec)  # found it: attaches
    by_name = millpond.connect(address).buffer("owned")
    constructed = millpond.ReplayBuffer(10, 2, 1, address=address, name="owned")
    pickled = pickle.loads(pickle.dumps(creator))  # a copy sent to an actor never owns
    for handle in (attached, by_name, constructed, pickled):
        handle.close()
        assert handle.closed
        with pytest.raises(millpond.BufferClosedError):
            handle.sample(1)
    assert "owned" in _names_on(address) and len(creator) == 3
    creator.close()
    assert "owned" not in _names_on(address)


def test_delete_removes_the_buffer_whoever_made_it(shared_server):
    address = shared_server.address
    spec = dict(capacity=10, obs_dim=2, act_dim=1)
    millpond.ReplayBuffer(10, 2, 1, address=address, name="deleted-by-handle").push_batch(
        **transitions(0, 2))
    attached = millpond.connect(address).buffer("deleted-by-handle")
    attached.delete()
    attached.delete()  # idempotent
    assert "deleted-by-handle" not in _names_on(address)
    client = millpond.connect(address)
    client.create_buffer("deleted-by-name", **spec)
    client.delete_buffer("deleted-by-name")
    assert "deleted-by-name" not in _names_on(address)
    with pytest.raises(millpond.BufferNotFoundError):
        client.delete_buffer("deleted-by-name")


def test_in_process_close_and_delete_both_delete(tmp_path):
    for method in ("close", "delete"):
        path = tmp_path / f"{method}.buffer"
        buf = millpond.MmapReplayBuffer(2, 6, 2, 1, cold_path=path)
        buf.push_batch(**transitions(0, 4))
        assert path.exists()
        getattr(buf, method)()
        assert not path.exists() and buf.closed
