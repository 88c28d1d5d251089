"""The daemon's edge against what a hostile or careless peer can do to it (issue 24, first
items): SIGHUP reloads the token file (revocation without a restart), the open files soft
limit is raised at start, client-chosen text reaches the text log escaped and bounded, and
the address file's temporary name cannot be planted.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
from pathlib import Path

import pytest
from support import ServerProcess, wait_until
from test_auth import write_token_file

import millpond

OLD, NEW = "old-admin-token-0123456789abcdef", "new-admin-token-0123456789abcdef"


def _refused(address: str, token: str) -> bool:
    try:
        millpond.connect(address, token=token, timeout=5, shm=False).list_buffers()
    except millpond.AuthenticationError:
        return True
    return False


@pytest.mark.daemon
def test_sighup_reloads_the_token_file_and_a_bad_one_changes_nothing(tmp_path):
    tokens, log = write_token_file(tmp_path / "tokens", f"admin {OLD}\n"), tmp_path / "log"
    with ServerProcess(tmp_path / "data", "--token-file", str(tokens), "--log-level", "info",
                       log_file=log) as server:
        address, proc = server.address, server.proc
        assert not _refused(address, OLD) and _refused(address, NEW)
        tokens.unlink()
        write_token_file(tokens, f"admin {NEW}\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: not _refused(address, NEW), timeout=10)
        assert _refused(address, OLD)  # revoked without a restart
        assert "before=admin:1 after=admin:1" in log.read_text()
        tokens.write_text("not a token file\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "the token file did not load" in log.read_text(), timeout=10)
        assert not _refused(address, NEW) and proc.poll() is None  # nothing changed
    assert server.proc.returncode == 0
    assert NEW not in log.read_text() and OLD not in log.read_text()  # never logged


@pytest.mark.daemon
def test_the_open_files_soft_limit_is_raised_to_the_hard_limit(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    log = tmp_path / "log"
    with ServerProcess(tmp_path / "data", "--log-level", "info", log_file=log,
                       preexec_fn=low_soft_limit) as server:
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        line = next(row for row in limits.splitlines() if row.startswith("Max open files"))
        assert int(line.split()[3]) > 256, line
    assert "raised_from=256" in log.read_text()


def test_client_chosen_text_reaches_the_text_log_escaped_and_bounded():
    from millpond_server.logs import MAX_VALUE_CHARS, KeyValueFormatter

    record = logging.LogRecord("millpond.test", logging.INFO, __file__, 1, "call", None, None)
    record.kv = {"buffer": "evil\rts=forged level=error\x1b[2J\u2028", "long": "x" * 100_000}
    line = KeyValueFormatter().format(record)
    assert "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert '\\r' in line and "\\u001b" in line
    assert len(line) < MAX_VALUE_CHARS + 400 and "(100,000 characters)" in line


def test_the_address_files_temporary_name_is_created_never_followed(tmp_path, monkeypatch):
    from millpond_server import app

    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    monkeypatch.setattr(app.secrets, "token_hex", lambda n: "planted")
    (tmp_path / ".address.planted.tmp").symlink_to(target)
    with pytest.raises(FileExistsError):
        app._write_address_file(tmp_path / "address", "127.0.0.1:1")
    assert target.read_text() == "keep\n" and not (tmp_path / "address").exists()
    monkeypatch.undo()
    app._write_address_file(tmp_path / "address", "127.0.0.1:2")
    assert (tmp_path / "address").read_text() == "127.0.0.1:2\n"
    assert sorted(os.listdir(tmp_path)) == [".address.planted.tmp", "address", "elsewhere"]
