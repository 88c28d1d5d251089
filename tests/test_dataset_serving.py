"""Datasets a real daemon serves read-only (--dataset, [[datasets]]), over gRPC and shm."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from support import ServerProcess

import millpond
from millpond import datasets

pytestmark = pytest.mark.daemon


def write_files(folder):
    h5py = pytest.importorskip("h5py")  # the `datasets` extra (not in `test`)

    rng = np.random.default_rng(0)
    n = 300
    terminals = np.zeros(n, bool)
    terminals[rng.choice(n, 12, replace=False)] = True
    npz = folder / "walker.npz"
    np.savez(npz, obs=rng.normal(2.0, 3.0, size=(n, 5)).astype(np.float32),
             next_obs=rng.normal(size=(n, 5)).astype(np.float32),
             actions=rng.normal(size=(n, 2)).astype(np.float32),
             rewards=rng.normal(size=n).astype(np.float32), terminated=terminals,
             truncated=np.zeros(n, bool))
    h5 = folder / "hopper.hdf5"
    with h5py.File(h5, "w") as f:  # D4RL's layout: no next observations, timeouts
        f["observations"] = rng.normal(size=(n, 4)).astype(np.float32)
        f["actions"] = rng.normal(size=(n, 3)).astype(np.float32)
        f["rewards"] = rng.normal(size=n).astype(np.float32)
        f["terminals"] = np.arange(n) % 50 == 49
        f["timeouts"] = np.arange(n) % 70 == 69
    return npz, h5


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("datasets")
    npz, h5 = write_files(folder)
    toml = folder / "server.toml"
    toml.write_text('[[datasets]]\nname = "hopper"\npath = "hopper.hdf5"\n'  # relative path
                    '[[buffers]]\nname = "online"\ncapacity = 10\nobs_dim = 5\nact_dim = 2\n')
    before = {p: digest(p) for p in (npz, h5)}
    with ServerProcess(folder / "data", "--dataset", f"walker={npz}", "--config", str(toml)) as srv:
        yield srv, {"walker": npz, "hopper": h5}
    assert {p: digest(p) for p in (npz, h5)} == before  # nothing wrote the files


@pytest.fixture(params=["grpc", "shm"])
def client(request, served):
    srv, _ = served
    c = millpond.connect(srv.address, shm=request.param == "shm")
    assert c.transport == request.param
    yield c
    c.close()


@pytest.mark.parametrize("name", ["walker", "hopper"])
def test_remote_samples_equal_local_samples(served, client, name):
    _, files = served
    local = millpond.OfflineDatasetBuffer(**datasets.load(files[name]), normalize=True)
    remote = millpond.OfflineDatasetBuffer.from_buffer(client.buffer(name), normalize=True)
    assert len(remote) == len(local) and remote.config == local.config
    for seed in (0, 1, 2):
        a, b = remote.sample(64, seed=seed), local.sample(64, seed=seed)
        assert sorted(a) == sorted(b)
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        a, b = remote.sample_trajectories(8, 16, seed=seed), local.sample_trajectories(8, 16, seed=seed)
        assert sorted(a) == sorted(b)
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    remote_stats, local_stats = remote.stats(), local.stats()
    assert sorted(remote_stats) == sorted(local_stats)
    for key in local_stats:
        np.testing.assert_array_equal(remote_stats[key], local_stats[key], err_msg=key)
    assert remote.n_episodes() == local.n_episodes() > 1
    if client.transport == "shm":
        assert client.calls["shm", "sample"] >= 3 and client.calls["shm", "sample_sequences"] >= 3
    remote.close()


def test_the_address_constructor(served):
    srv, files = served
    buf = millpond.OfflineDatasetBuffer(address=srv.address, name="walker")
    local = millpond.OfflineDatasetBuffer(**datasets.load(files["walker"]))
    assert buf.stats() == local.stats() and not buf.normalize
    buf.close()
    with pytest.raises(millpond.BufferNotFoundError):
        millpond.OfflineDatasetBuffer(address=srv.address, name="absent")
    with pytest.raises(millpond.InvalidArgumentError, match="not an offline dataset"):
        millpond.OfflineDatasetBuffer(address=srv.address, name="online")


def test_writes_are_refused_and_change_nothing(served, client):
    srv, files = served
    buf = client.buffer("walker")
    before = buf.sample(32, seed=5)
    rows = buf.sample_all()
    one = {k: v[:1] for k, v in rows.items()}
    calls = [
        lambda: buf.push_batch(**one),
        lambda: (buf.push(**{k: v[0] for k, v in one.items()}), buf.flush()),
        lambda: buf.backend.update_episodes([(0, None, True)]),
        lambda: buf.reset(),
        lambda: buf.delete(),
        lambda: client.delete_buffer("walker"),
    ]
    for call in calls:
        with pytest.raises(millpond.ReadOnlyBufferError):
            call()
    handle = millpond.OfflineDatasetBuffer.from_buffer(buf)
    with pytest.raises(millpond.ReadOnlyBufferError):
        handle.push_batch(**one)
    assert len(buf) == 300 and buf.info()["pushed"] == 300
    after = buf.sample(32, seed=5)
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])
    buf.close()  # an attached handle lets go; the dataset stays served
    assert len(client.buffer("walker")) == 300
    assert files["walker"].exists()


def test_the_server_lists_its_datasets(served):
    srv, _ = served
    with millpond.connect(srv.address) as c:
        infos = {info.name: info for info in c.list_buffers()}
    assert set(infos) == {"walker", "hopper", "online"}
    assert infos["walker"].path == "walker.npz" and infos["walker"]["episodes"] > 1
    assert infos["hopper"].size == len(datasets.load(served[1]["hopper"])["rewards"])


def test_creating_a_buffer_of_a_datasets_name(served):
    srv, _ = served
    with millpond.connect(srv.address) as c:
        with pytest.raises(millpond.ConfigMismatchError):
            c.create_buffer("walker", capacity=10, obs_dim=5, act_dim=2)


def run_serve(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "millpond_server", "serve", "--port", "0",
                           *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MILLPOND_TOKEN": ""})


@pytest.mark.parametrize("args,needle", [
    (["--dataset", "walker"], "expected NAME=PATH"),
    (["--dataset", "walker=/no/such/file.npz"], "no dataset at /no/such/file.npz"),
    (["--dataset", "bad name=x.npz"], "invalid buffer name"),
])
def test_bad_dataset_flags_exit_2(tmp_path, args, needle):
    result = run_serve("--data-dir", str(tmp_path / "d"), *args)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr


def test_a_name_given_twice_or_taken_exits_2(tmp_path):
    npz, _ = write_files(tmp_path)
    result = run_serve("--data-dir", str(tmp_path / "d"), "--dataset", f"a={npz}",
                       "--dataset", f"a={npz}")
    assert result.returncode == 2 and "given twice: ['a']" in result.stderr
    data = tmp_path / "data"
    with ServerProcess(data) as srv:  # a buffer file named "a" in the data directory
        with millpond.connect(srv.address) as c:
            c.create_buffer("a", capacity=4, obs_dim=1, act_dim=1).release()
    result = run_serve("--data-dir", str(data), "--dataset", f"a={npz}")
    assert result.returncode == 2 and "a buffer of that name exists" in result.stderr


def test_a_file_that_is_no_dataset_exits_1(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, something=np.zeros(3))
    result = run_serve("--data-dir", str(tmp_path / "d"), "--dataset", f"x={bad}")
    assert result.returncode == 1 and "lacks" in result.stderr
