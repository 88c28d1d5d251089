from __future__ import annotations

import subprocess
import tempfile

import pytest
import support
from support import ServerProcess, start_all

# Fixtures that start daemons: these three, and a few modules' own (test_auth.py's, test_tls.py's).
# A test using one, directly or through another fixture, is a `daemon` test (pyproject.toml
# lists the kinds; `make test-fast` leaves them out). A test that starts a daemon otherwise
# is marked where it is written; support.ServerProcess fails a test that is not.
DAEMON_FIXTURES = frozenset({"server", "shared_server", "shards",
                             "auth_server", "tls_server", "mtls_server"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if DAEMON_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.daemon)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Tell support.ServerProcess which test it starts a daemon for (setup to teardown)."""
    support.running_test = item
    try:
        yield
    finally:
        support.running_test = None


@pytest.fixture
def server(tmp_path):
    """A real daemon on a free port, with its own data directory."""
    with ServerProcess(tmp_path / "data") as proc:
        yield proc


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One daemon for a whole test module (for suites of many small tests)."""
    with ServerProcess(tmp_path_factory.mktemp("srv") / "data") as proc:
        yield proc


@pytest.fixture(scope="module")
def aio_loop():
    """An event loop on a thread of its own, for millpond.aio clients driven from sync tests
    (tests/aio_sync.py)."""
    from aio_sync import LoopThread
    runner = LoopThread()
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three daemons for a whole test module: their addresses (a sharded client's target)."""
    root = tmp_path_factory.mktemp("shards")
    servers = start_all([ServerProcess(root / f"shard{i}") for i in range(3)])
    yield [s.address for s in servers]
    for server in servers:
        server.stop()


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MB tmpfs (needs root); skipped where it cannot be mounted."""
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
            check=True, capture_output=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here ({exc}); needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=10)


@pytest.fixture
def private_tmpdir(tmp_path, monkeypatch):
    """The test's temp dir as everyone's: Stable-Baselines3's logger makes an ``SB3-<time>``
    directory in the system's temp dir on every ``learn()``, in this process and in the
    examples it runs, which would pile up in /tmp run after run."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path
