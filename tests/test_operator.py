"""Operating a daemon: every buffer on its own. Against real daemons.

* A bad buffer file (unreadable, damaged records, truncated, a garbage header, not a
  millpond file, another format version) used to stop the daemon from starting; now the
  daemon serves every other buffer and holds that one out of service, listed with its
  state and reason, logged, in the metrics; calls on it get BufferDamagedError; an admin
  repairs or deletes it online.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import struct
import subprocess
import sys
import urllib.request

import grpc
import pytest
from support import ServerProcess
from test_durability import CRASH_FIELDS, crash_records, flip_byte, valid

import millpond
from millpond.remote.buffer import RemoteBuffer
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc

pytestmark = pytest.mark.daemon

T = 10.0
# How each kind of bad file is reported (BufferInfo.state).
KINDS = {"damaged-records": "damaged", "truncated": "damaged", "garbage-header": "damaged",
         "not-millpond": "unknown-format", "other-version": "unknown-format",
         "unreadable": "unreadable"}
ADMIN = "admin-" + secrets.token_urlsafe(24)
ACTOR = "actor-" + secrets.token_urlsafe(24)


def make(data, *names: str, records: int = 40) -> None:
    """Buffers ``names`` in ``data``, each with ``records`` self-checking records."""
    with ServerProcess(data) as server:
        client = millpond.connect(server.address)
        for name in names:
            client.create_buffer(name, hot_capacity=10, total_capacity=60,
                                 fields=CRASH_FIELDS).push_batch(**crash_records(1, 0, records))


def damage(path, kind: str) -> None:
    raw = bytearray(path.read_bytes())
    if kind == "damaged-records":
        flip_byte(path, "actor", slot=5, hot=False)  # seq 5
        return
    if kind == "truncated":
        del raw[len(raw) // 2:]
    elif kind == "garbage-header":
        raw[128:400] = b"\xff" * 272  # the JSON metadata
    elif kind == "not-millpond":
        raw[:8] = b"NOTMILLP"
    elif kind == "other-version":
        struct.pack_into("<I", raw, 8, 99)
    elif kind == "unreadable":
        path.chmod(0)
        return
    path.write_bytes(bytes(raw))


def no_file_override():
    """A ``preexec_fn`` under which a daemon run by root obeys file modes (it drops
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from its capability bounding set before exec);
    None if not root. Skips the test where capabilities cannot be dropped."""
    if os.geteuid() != 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    probe = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: _drop(libc),
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here: root would read a file of mode 000")
    return lambda: _drop(libc)


def _drop(libc) -> None:
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def logged(server: ServerProcess) -> str:
    return server.log_file.read_text()


def scrape(server: ServerProcess) -> dict[str, float]:
    """Its metrics (``--metrics-port 0 --log-level info``: the address is logged)."""
    address = re.search(r"msg=metrics address=(\S+)", logged(server)).group(1)
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=T).read().decode()
    return {key: float(value) for key, _, value in
            (line.rpartition(" ") for line in text.splitlines() if line and line[0] != "#")}


def cli(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``millpond ARGS`` with no MILLPOND_* from this environment but ``env``'s."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MILLPOND_")}
    return subprocess.run([sys.executable, "-m", "millpond_server", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**base, **(env or {})})


# ---- A: every buffer on its own -----------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_buffer_file_no_longer_stops_the_daemon(tmp_path, kind):
    data = tmp_path / "data"
    make(data, "bad", "good")
    damage(data / "bad.buffer", kind)
    state = KINDS[kind]
    preexec = no_file_override() if kind == "unreadable" else None
    server = ServerProcess(data, "--metrics-port", "0", "--log-level", "info",
                           log_file=tmp_path / "log", preexec_fn=preexec).start()
    try:
        client = millpond.connect(server.address)
        good = client.buffer("good")  # every healthy buffer is served
        assert len(good) == 40 and valid(good.sample(40, seed=1)).all()
        good.push_batch(**crash_records(1, 40, 5))
        infos = {info.name: info for info in client.list_buffers()}
        assert infos["good"].state == "ok" and infos["good"].size == 45
        bad = infos["bad"]
        assert bad.state == state and not bad.ok and str(data / "bad.buffer") in bad.reason
        assert client.info("bad").reason == bad.reason
        if state == "unreadable":
            assert "Permission denied" in bad.reason and "not a regular file" not in bad.reason
        if kind == "damaged-records":
            assert "1 of 40 live records fail their checks (seqs [5])" in bad.reason
            assert bad.total_capacity == 60  # its header is sound: its config is known
        fix = "repair bad" if state != "unknown-format" else "delete bad"
        with pytest.raises(millpond.BufferDamagedError, match=re.escape(fix)):
            client.buffer("bad")
        with pytest.raises(millpond.BufferDamagedError):  # no new buffer over it either
            client.create_buffer("bad", hot_capacity=10, total_capacity=60, fields=CRASH_FIELDS)
        with grpc.insecure_channel(server.address) as channel:  # a client from before states
            stub = pb_grpc.ReplayStub(channel)
            assert [b.name for b in stub.List(pb.ListRequest(), timeout=T).buffers] == ["good"]
            with pytest.raises(grpc.RpcError) as raised:
                stub.Sample(pb.SampleRequest(name="bad", batch_size=1), timeout=T)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert ("millpond-error-code", "BUFFER_DAMAGED") in raised.value.trailing_metadata()
        metrics = scrape(server)
        assert metrics[f'millpond_buffer_damaged{{buffer="bad",state="{state}"}}'] == 1
        assert metrics["millpond_buffers"] == 1 and metrics["millpond_ready"] == 1
    finally:
        assert server.stop() == 0
    line = next(line for line in logged(server).splitlines()
                if 'msg="buffer held out of service"' in line)
    assert "level=error" in line and "buffer=bad" in line and f"state={state}" in line
    assert f"file={data / 'bad.buffer'}" in line and "reason=" in line and "fix=" in line


def test_a_held_buffer_refuses_the_fast_path_too_and_a_declaration_does_not_stop_the_start(
        tmp_path):
    data = tmp_path / "data"
    make(data, "hurt", "ok")
    flip_byte(data / "hurt.buffer", "actor", slot=5, hot=False)
    toml = tmp_path / "buffers.toml"
    toml.write_text('[[buffers]]\nname = "hurt"\ncapacity = 8\nobs_dim = 2\nact_dim = 1\n')
    with ServerProcess(data, "--config", str(toml)) as server:  # declared, and held: starts
        client = millpond.connect(server.address, shm=True)
        ok = client.buffer("ok")
        assert len(ok.sample(4)["seq"]) == 4 and client.transport == "shm"
        with pytest.raises(millpond.BufferDamagedError):
            client.buffer("hurt")
        info = client.info("hurt")
        assert info.state == "damaged"
        handle = RemoteBuffer(client, "hurt", info.checked_config())  # as one made before
        with pytest.raises(millpond.BufferDamagedError, match="repair hurt"):
            handle.sample(4)  # over shared memory
        with pytest.raises(millpond.BufferDamagedError):
            handle.push_batch(crash_records(1, 0, 2))


def test_repair_online_serves_the_intact_records_for_good(tmp_path):
    data = tmp_path / "data"
    make(data, "hurt", "cut")
    flip_byte(data / "hurt.buffer", "actor", slot=5, hot=False)
    damage(data / "cut.buffer", "truncated")
    with ServerProcess(data) as server:
        client = millpond.connect(server.address)
        assert client.info("hurt").state == "damaged"
        result = client.repair_buffer("hurt")
        assert result.repaired and result.dropped == 1
        assert (result.info.state, result.info.size, result.info.pushed) == ("ok", 39, 40)
        hurt = client.buffer("hurt")
        records = hurt.sample_all()
        assert len(records["seq"]) == 39 and valid(records).all()
        assert 5 not in records["seq"].tolist()
        hurt.push_batch(**crash_records(1, 40, 3))
        assert client.repair_buffer("hurt").repaired is False  # served: nothing to do
        with pytest.raises(millpond.BufferDamagedError, match="truncated"):
            client.repair_buffer("cut")  # nothing to serve: still held, still says why
        assert client.info("cut").state == "damaged"
        with pytest.raises(millpond.BufferNotFoundError):
            client.repair_buffer("never")
    with ServerProcess(data) as server:  # the default --recover fail: the repair lasted
        client = millpond.connect(server.address)
        assert client.info("hurt").state == "ok" and len(client.buffer("hurt")) == 42


def test_an_unreadable_file_made_readable_is_repaired_without_loss(tmp_path):
    data = tmp_path / "data"
    make(data, "locked")
    damage(data / "locked.buffer", "unreadable")
    with ServerProcess(data, preexec_fn=no_file_override()) as server:
        client = millpond.connect(server.address)
        assert client.info("locked").state == "unreadable"
        with pytest.raises(millpond.BufferDamagedError, match="Permission denied"):
            client.repair_buffer("locked")  # still unreadable
        (data / "locked.buffer").chmod(0o600)
        result = client.repair_buffer("locked")
        assert (result.repaired, result.dropped, result.info.size) == (True, 0, 40)
        assert valid(client.buffer("locked").sample_all()).all()


def test_delete_online_removes_a_held_buffer_and_frees_its_name(tmp_path):
    data = tmp_path / "data"
    make(data, "gone", "kept")
    damage(data / "gone.buffer", "not-millpond")
    with ServerProcess(data) as server:
        client = millpond.connect(server.address)
        client.delete_buffer("gone")
        assert not (data / "gone.buffer").exists()
        assert [info.name for info in client.list_buffers()] == ["kept"]
        with pytest.raises(millpond.BufferNotFoundError):
            client.info("gone")
        fresh = client.create_buffer("gone", capacity=8, obs_dim=2, act_dim=1)
        assert fresh.info().state == "ok"


def test_skip_corrupt_repairs_damaged_records_at_start(tmp_path):
    data = tmp_path / "data"
    make(data, "hurt", "cut")
    flip_byte(data / "hurt.buffer", "payload", slot=3, hot=True)  # seq 33
    damage(data / "cut.buffer", "garbage-header")
    with ServerProcess(data, "--recover", "skip-corrupt", "--log-level", "info",
                       log_file=tmp_path / "log") as server:
        client = millpond.connect(server.address)
        infos = {info.name: info for info in client.list_buffers()}
        assert (infos["hurt"].state, infos["hurt"].size, infos["hurt"].damaged) == ("ok", 39, 0)
        assert infos["cut"].state == "damaged"  # nothing to repair it from: held, as with fail
    assert 'msg="buffer rewritten without its damaged records" buffer=hurt dropped=1' in \
        logged(server)
    with ServerProcess(data) as server:  # rewritten: the default --recover fail serves it
        records = millpond.connect(server.address).buffer("hurt").sample_all()
        assert len(records["seq"]) == 39 and valid(records).all()
