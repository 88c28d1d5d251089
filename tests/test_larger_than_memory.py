"""A buffer larger than the memory the daemon may use: the case the cold tier exists for.

The daemon runs in a memory cgroup about a third of its buffer's size. It
must fill the buffer, serve samples, recover after SIGKILL, and keep every
acknowledged record, without being OOM-killed. Skipped, saying why, where
this process cannot create a cgroup (it needs root; CI runs as root).
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
from support import MemoryCgroup, ServerProcess

import millpond
from millpond.core import TieredBuffer

pytestmark = pytest.mark.daemon

LIMIT = 192 << 20
FRAME = (84, 84, 4)  # an Atari observation: 28,224 bytes
FIELDS = {"obs": ("uint8", FRAME), "id": ("int64", ())}
HOT, TOTAL = 400, 20_000  # 11 MB hot, 565 MB in all: 3x the limit


@pytest.fixture
def cgroup():
    try:
        group = MemoryCgroup.create(LIMIT)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup here ({exc}); needs root and cgroup memory")
    yield group
    group.remove()


def frames(ids: np.ndarray) -> np.ndarray:
    """Self-checking observations: every byte of record i is i % 251, its last byte i % 256."""
    obs = np.repeat((ids % 251).astype(np.uint8)[:, None], np.prod(FRAME), axis=1)
    obs[:, -1] = (ids % 256).astype(np.uint8)
    return obs.reshape(len(ids), *FRAME)


def check(batch: dict) -> None:
    ids = batch["id"]
    np.testing.assert_array_equal(batch["obs"], frames(ids))


@pytest.mark.slow
def test_a_buffer_three_times_the_memory_limit_fills_samples_and_recovers(tmp_path, cgroup):
    data = tmp_path / "data"
    acknowledged = 0
    server = ServerProcess(data, cgroup=cgroup).start()
    try:
        client = millpond.connect(server.address, timeout=60)
        buf = client.create_buffer("big", hot_capacity=HOT, total_capacity=TOTAL, fields=FIELDS)
        info = buf.info()
        assert 0 < info["memory_limit"] <= LIMIT and info["memory_needed"] < LIMIT // 4
        for start in range(0, TOTAL + 2_000, 500):  # the oldest 2,000 are evicted again
            ids = np.arange(start, start + 500)
            buf.push_batch(obs=frames(ids), id=ids)
            acknowledged = start + 500
        for seed in range(12):  # mostly cold rows: read from disk, not through the mapping
            batch = buf.sample(256, seed=seed)
            check(batch)
            assert (batch["id"] < acknowledged - HOT).sum() > 200
        server.stop(signal.SIGKILL)
        server = ServerProcess(data, cgroup=cgroup).start(timeout=120)  # recovery, in the limit
        again = millpond.connect(server.address, timeout=60).buffer("big")
        assert len(again) == TOTAL
        check(again.sample(256, seed=99))
        assert server.stop() == 0
    finally:
        server.stop(signal.SIGKILL)
    assert cgroup.oom_kills() == 0
    assert cgroup.peak() <= LIMIT
    stored = TieredBuffer.open(data / "big.buffer")  # here, outside the limit: read it all
    try:
        contents = stored.contents()
        np.testing.assert_array_equal(contents["id"], np.arange(acknowledged - TOTAL, acknowledged))
        check(contents)
    finally:
        stored.release()


def test_a_hot_tier_that_cannot_fit_is_refused_with_what_it_needs(tmp_path, cgroup):
    with ServerProcess(tmp_path / "data", cgroup=cgroup) as server:
        client = millpond.connect(server.address)
        with pytest.raises(millpond.StorageFullError, match="needs .* bytes of memory") as info:
            client.create_buffer("too-hot", hot_capacity=10_000, total_capacity=20_000,
                                 fields=FIELDS)  # a 282 MB hot tier in a 192 MiB cgroup
        assert "cgroup limit" in str(info.value)
        assert not list((tmp_path / "data").glob("*.buffer"))
        fits = client.create_buffer("fits", hot_capacity=1_000, total_capacity=20_000,
                                    fields=FIELDS)
        assert fits.info()["memory_needed"] < fits.info()["memory_limit"]
