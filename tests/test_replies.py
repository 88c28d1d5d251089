"""A client trusts no reply: a daemon that lies (tests/lying_daemon.py) gets a typed
ProtocolError, never wrong arrays, a raw KeyError or a draw that skips the data."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import ServerProcess
from test_contract import transitions

import millpond

pytestmark = pytest.mark.daemon
LYING = str(Path(__file__).with_name("lying_daemon.py"))


@pytest.mark.parametrize("lie", ["rows", "dtype", "extra", "missing"])
def test_a_sample_reply_that_does_not_match_the_request_is_refused(tmp_path, lie):
    with ServerProcess(tmp_path / "data", env={"MILLPOND_LIE": lie}, script=LYING) as server:
        buf = millpond.connect(server.address, shm=False).create_buffer(
            "lies", capacity=100, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 20))
        with pytest.raises(millpond.ProtocolError):
            buf.sample(8)


def test_a_shard_that_claims_an_impossible_size_is_refused(tmp_path):
    honest = ServerProcess(tmp_path / "honest")
    lying = ServerProcess(tmp_path / "lying", env={"MILLPOND_LIE": "size"}, script=LYING)
    with honest, lying:
        client = millpond.connect([honest.address, lying.address], shm=False)
        with pytest.raises(millpond.ProtocolError, match=lying.address):  # its Create's info
            buf = client.create_buffer("sizes", capacity=100, obs_dim=2, act_dim=1)
            buf.push_batch(**transitions(0, 20))
            buf.sample(8)
