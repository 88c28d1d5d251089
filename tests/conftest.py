from __future__ import annotations

import pytest

from support import ServerProcess


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
