"""Pushes in flight: ``connect(max_in_flight=N)`` (push_window.py), against a real daemon.

What an actor relies on: every push it made is stored, in the order made,
once ``flush()`` (or any other call of the handle) returns; a push the
daemon refused is raised at the next call, and the pushes sent after it are
known not stored; a process that exits right after its last push has it
stored.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support import ServerProcess, wait_until
from test_contract import transitions

import millpond


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("data")) as server:
        yield server


def test_pushes_in_flight_are_stored_in_the_order_made(server):
    client = millpond.connect(server.address, shm=False, max_in_flight=4)
    buf = client.create_buffer("ordered", capacity=10_000, obs_dim=2, act_dim=1)
    for start in range(0, 2_000, 10):
        buf.push_batch(**transitions(start, 10))
    assert len(buf) == 2_000  # len flushes first: it sees the handle's own pushes
    stored = buf.sample_by_index(np.arange(2_000))
    np.testing.assert_array_equal(stored["rewards"], np.arange(2_000, dtype=np.float32))
    buf.close()
    client.close()


def test_a_refused_push_is_raised_at_the_next_call_and_what_followed_was_not_stored(server):
    client = millpond.connect(server.address, shm=False, max_in_flight=8)
    admin = millpond.connect(server.address, shm=False)
    buf = client.create_buffer("refused", capacity=100, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(0, 5))
    buf.flush()
    admin.delete_buffer("refused")
    with pytest.raises(millpond.BufferNotFoundError) as refused:
        for start in range(5, 20, 5):  # sent; the refusal is raised by a later call
            buf.push_batch(**transitions(start, 5))
        buf.flush()
    notes = getattr(refused.value, "__notes__", [])
    assert all("were not stored" in note for note in notes)
    fresh = admin.create_buffer("refused", capacity=100, obs_dim=2, act_dim=1)
    buf.push_batch(**transitions(100, 5))  # the handle goes on, on a new stream
    buf.flush()
    assert len(fresh) == 5  # nothing sent after the refused push came back to life
    fresh.close()
    client.close()
    admin.close()


def test_every_other_call_waits_for_the_pushes_in_flight(server):
    client = millpond.connect(server.address, shm=False, max_in_flight=64)
    buf = client.create_buffer("read-your-writes", capacity=1_000, obs_dim=2, act_dim=1)
    for start in range(0, 300, 3):
        buf.push_batch(**transitions(start, 3))
        batch = buf.sample_by_index([start + 2])  # a read right after a push sees it
        assert batch["rewards"][0] == start + 2
    buf.close()
    client.close()


def test_a_process_that_exits_after_pushing_has_every_push_stored(server):
    script = textwrap.dedent(f"""
        import millpond
        from test_contract import transitions
        client = millpond.connect({server.address!r}, shm=False, max_in_flight=16)
        buf = client.buffer("exiting")
        for start in range(0, 500, 5):
            buf.push_batch(**transitions(start, 5))
        # no flush, no close: the interpreter's exit waits for the acknowledgements
    """)
    admin = millpond.connect(server.address, shm=False)
    buf = admin.create_buffer("exiting", capacity=1_000, obs_dim=2, act_dim=1)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                   cwd=str(__import__("pathlib").Path(__file__).parent))
    assert len(buf) == 500
    buf.close()
    admin.close()


def test_max_in_flight_is_checked():
    for bad in (0, -1, 1.5, True, 10**9):
        with pytest.raises(millpond.InvalidConfigError):
            millpond.connect("127.0.0.1:1", max_in_flight=bad)


def test_a_push_returns_once_sent_while_the_server_holds_it(server):
    """A full queue holds a push at the server (rate limiter): an actor with pushes in
    flight goes on meanwhile; once a learner makes room, flush() sees it stored."""
    admin = millpond.connect(server.address, shm=False)
    queue = admin.create_buffer("held", capacity=5, obs_dim=2, act_dim=1, mode="queue")
    actor = millpond.connect(server.address, shm=False, max_in_flight=4).buffer("held")
    actor.push_batch(**transitions(0, 5))
    actor.flush()
    actor.push_batch(**transitions(5, 1), timeout=60)  # the queue is full: held at the server
    wait_until(lambda: queue.info()["waiting_inserts"] == 1)  # sent, parked at the server
    assert queue.sample(1)["rewards"].tolist() == [0.0]  # room for it
    actor.flush()
    assert queue.sample(5)["rewards"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    queue.close()
    admin.close()
