"""Systems without what the fast path needs: the client uses gRPC, the daemon starts without
the fast path, and each says why (README, "Platforms").

Linux's facilities are taken away for real: each client or daemon here runs in a Python
whose ``os``/``socket`` modules lost them (``del os.memfd_create`` ...) before millpond was
imported, as a Python on another system, or one built without them, would lack them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support import ServerProcess
from test_contract import transitions

import millpond
from millpond.remote.shm import facilities

# What each case takes away: a system without memfds; one whose Unix sockets neither pass
# descriptors nor tell who is at the other end; one without posix_fallocate and fdatasync
# (macOS lacks both: buffer files are allocated with ftruncate and synced with fsync).
TAKEN = {
    "memfd": ["os.memfd_create"],
    "scm_rights-peercred": ["socket.SCM_RIGHTS", "socket.SO_PEERCRED"],
    "fallocate-fdatasync": ["os.posix_fallocate", "os.fdatasync"],
}


def without(names: list[str]) -> str:
    """Code that takes ``names`` (``module.attribute``) away from this Python."""
    return "import os, socket\n" + "".join(f"del {name}\n" for name in names)


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run


def test_this_linux_has_all_the_fast_path_needs():
    """The cases below take away what is here: else they would test nothing."""
    assert facilities.lacking() == ""


def test_what_is_lacking_is_named(monkeypatch):
    monkeypatch.delattr(os, "memfd_create")
    monkeypatch.setattr(sys, "platform", "darwin")
    lacking = facilities.lacking()
    assert "os.memfd_create" in lacking and "abstract Unix sockets" in lacking
    assert "socket.SO_PEERCRED" not in lacking


@pytest.mark.parametrize("case", TAKEN)
def test_without_them_everything_imports_and_says_what_is_lacking(case):
    code = without(TAKEN[case]) + textwrap.dedent("""
        import millpond, millpond.remote.connection, millpond_server.app
        from millpond.remote.shm import facilities
        print(facilities.lacking())
    """)
    lacking = run_python(code).stdout
    for name in TAKEN[case]:
        if name != "os.fdatasync":  # not a need of the fast path
            assert name in lacking


def test_in_process_buffers_need_neither_posix_fallocate_nor_fdatasync(tmp_path):
    code = without(TAKEN["fallocate-fdatasync"]) + textwrap.dedent("""
        import sys
        import numpy as np
        from millpond.core import BufferConfig, TieredBuffer

        config = BufferConfig.build(hot_capacity=8, total_capacity=64, obs_dim=2, act_dim=1)
        buf = TieredBuffer(config, sys.argv[1], persistent=True, sync_every_push=True)
        n = 40
        buf.push_batch({"obs": np.zeros((n, 2), np.float32), "next_obs": np.zeros((n, 2), np.float32),
                        "actions": np.zeros((n, 1), np.float32), "rewards": np.arange(n, dtype=np.float32),
                        "terminated": np.zeros(n, bool), "truncated": np.zeros(n, np.float32)})
        buf.sync()
        print(len(buf), sorted(buf.sample(16, seed=0)["rewards"].tolist())[0] >= 0)
        buf.release()
    """)
    assert run_python(code, str(tmp_path / "b.buffer")).stdout.split() == ["40", "True"]
    assert os.path.getsize(tmp_path / "b.buffer") > 0


CLIENT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import millpond

    address, name = sys.argv[1], sys.argv[2]
    seen = []
    for i in range(2):  # two connections; the reason is logged once
        client = millpond.connect(address)
        buf = client.create_buffer(f"{name}-{i}", capacity=64, obs_dim=2, act_dim=1)
        n = 10
        buf.push_batch(np.zeros((n, 2)), np.ones((n, 2)), np.zeros((n, 1)), np.arange(n, dtype=float),
                       np.zeros(n), np.zeros(n))
        batch = buf.sample(4, seed=0)
        seen.append({"transport": client.transport, "reason": client.connection.shm_reason,
                     "size": len(buf), "rows": len(batch["rewards"])})
        client.delete_buffer(f"{name}-{i}")
        client.close()
    try:
        millpond.connect(address, shm=True).transport
        required = "connected"
    except millpond.SharedMemoryError as exc:
        required = str(exc)
    print(json.dumps({"seen": seen, "required": required}))
""")


@pytest.mark.parametrize("case", [None, *TAKEN])
def test_a_client_without_them_uses_grpc_and_says_why_once(shared_server, case):
    code = without(TAKEN[case] if case else []) + CLIENT
    run = run_python(code, shared_server.address, case or "control")
    result = json.loads(run.stdout)
    sizes = [(s["size"], s["rows"]) for s in result["seen"]]
    assert sizes == [(10, 4), (10, 4)]
    if case is None:  # the control: nothing taken away, the fast path is used
        assert [s["transport"] for s in result["seen"]] == ["shm", "shm"]
        assert result["required"] == "connected" and "fast path" not in run.stderr
        return
    assert [s["transport"] for s in result["seen"]] == ["grpc", "grpc"]
    needed = [name for name in TAKEN[case] if name != "os.fdatasync"]
    for seen in result["seen"]:
        assert all(name in seen["reason"] for name in needed), seen["reason"]
    assert run.stderr.count("fast path is off") == 1, run.stderr
    assert all(name in run.stderr for name in needed)
    assert "shared memory was required but this system lacks" in result["required"]


def daemon_without(tmp_path, names: list[str], *args: str) -> ServerProcess:
    script = tmp_path / "daemon.py"
    script.write_text(without(names) + "import runpy\n"
                      "runpy.run_module('millpond_server', run_name='__main__', alter_sys=True)\n")
    return ServerProcess(tmp_path / "data", *args, script=script, log_file=tmp_path / "daemon.log")


@pytest.mark.daemon
@pytest.mark.parametrize("case", TAKEN)
def test_a_daemon_without_them_serves_over_grpc_and_says_why(tmp_path, case):
    needed = [name for name in TAKEN[case] if name != "os.fdatasync"]
    with daemon_without(tmp_path, TAKEN[case], "--sync", "always") as server:
        log = (tmp_path / "daemon.log").read_text()
        assert "shm fast path unavailable" in log and all(name in log for name in needed), log
        client = millpond.connect(server.address)
        assert client.transport == "grpc"
        reason = client.connection.shm_reason
        assert reason.startswith("unavailable on the server: this system lacks"), reason
        assert all(name in reason for name in needed), reason
        # past the hot tier: records go to the buffer file, allocated and synced without
        # posix_fallocate and fdatasync in that case
        buf = client.create_buffer("b", hot_capacity=8, total_capacity=64, obs_dim=2, act_dim=1)
        buf.push_batch(**transitions(0, 40))
        assert len(buf) == 40
        batch = buf.sample(16, seed=0)
        assert np.isin(batch["rewards"], np.arange(40)).all()
        with pytest.raises(millpond.SharedMemoryError, match="unavailable on the server"):
            _ = millpond.connect(server.address, shm=True).transport
        client.close()
