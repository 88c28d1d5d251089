"""Operating a daemon: every buffer on its own, backups taken while actors push, the
operator's CLI. Against real daemons (the engine's snapshots: tests/test_snapshot.py).

* A bad buffer file (unreadable, damaged records, truncated, a garbage header, not a
  millpond file, another format version) used to stop the daemon from starting; now the
  daemon serves every other buffer and holds that one out of service, listed with its
  state and reason, logged, in the metrics; calls on it get BufferDamagedError; an admin
  repairs or deletes it online.
* ``cp`` of a buffer file while an actor pushed gave a copy that failed its checks; a
  checkpoint is consistent and checked while actors push, and a daemon serves it.
* ``millpond delete|export|backup|repair|restore`` through the real CLI.
"""

from __future__ import annotations

import os
import re
import secrets
import struct
import subprocess
import sys
import threading
import urllib.request
import zlib
from pathlib import Path

import grpc
import numpy as np
import pytest
from support import ServerProcess, start_all, wait_until
from test_durability import CRASH_FIELDS, crash_records, flip_byte, valid

import millpond
from millpond.remote.buffer import RemoteBuffer
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc
from millpond_server.backups import restore

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
        flip_byte(path, "actor", 5, hot=False)  # seq 5
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


DROP_AND_SERVE = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
os.execv(sys.executable, [sys.executable, "-m", "millpond_server", *sys.argv[1:]])
"""


def no_file_override(tmp_path: Path) -> Path | None:
    """A daemon ``script`` under which a daemon run by root obeys file modes: it drops
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from its capability bounding set, then execs
    the daemon (in a process of its own: a ``preexec_fn`` in this threaded test process
    could deadlock or abort the child). None if not root; skips the test where
    capabilities cannot be dropped."""
    if os.geteuid() != 0:
        return None
    script = tmp_path / "drop_and_serve.py"
    script.write_text(DROP_AND_SERVE)
    probe = subprocess.run([sys.executable, os.fspath(script), "--help"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here: root would read a file of mode 000")
    return script


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
    script = no_file_override(tmp_path) if kind == "unreadable" else None
    server = ServerProcess(data, "--metrics-port", "0", "--log-level", "info",
                           log_file=tmp_path / "log", script=script).start()
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
    flip_byte(data / "hurt.buffer", "actor", 5, hot=False)
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
    flip_byte(data / "hurt.buffer", "actor", 5, hot=False)
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
    with ServerProcess(data, script=no_file_override(tmp_path)) as server:
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
    flip_byte(data / "hurt.buffer", "payload", 33, hot=True)
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


# ---- B: backups taken while actors push ---------------------------------------------------

WIDE = {"actor": ("int32", ()), "seq": ("int64", ()), "payload": ("uint8", (2048,)),
        "crc": ("uint32", ())}  # 2 KiB records: a snapshot step copies ~2,000 of them


def wide_records(actor: int, start: int, n: int) -> dict[str, np.ndarray]:
    seqs = np.arange(start, start + n, dtype=np.int64)
    payload = ((seqs[:, None] * 7 + np.arange(2048) + actor) % 251).astype(np.uint8)
    crc = np.array([zlib.crc32(struct.pack("<iq", actor, s) + p.tobytes())
                    for s, p in zip(seqs.tolist(), payload)], np.uint32)
    return {"actor": np.full(n, actor, np.int32), "seq": seqs, "payload": payload, "crc": crc}


def test_a_backup_taken_while_actors_push_is_consistent_and_a_daemon_serves_it(tmp_path):
    backups = tmp_path / "backups"
    batch = 100
    with ServerProcess(tmp_path / "data", "--backup-dir", str(backups)) as server:
        client = millpond.connect(server.address)
        client.create_buffer("live", hot_capacity=2_000, total_capacity=10_000, fields=WIDE)
        acked = {1: 0, 2: 0}
        stop, errors = threading.Event(), []

        def actor(a: int) -> None:
            buf = millpond.connect(server.address).buffer("live")
            try:
                while not stop.is_set():
                    buf.push_batch(**wide_records(a, acked[a], batch))
                    acked[a] += batch  # acknowledged: stored
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=actor, args=(a,)) for a in acked]
        for thread in threads:
            thread.start()
        try:
            live = client.buffer("live")
            while live.info().pushed < 12_000:  # full, and evicting as the actors go on
                threading.Event().wait(0.05)
            before = dict(acked)
            seen: list[tuple[int, int]] = []
            result = client.checkpoint("live", "nightly/live",
                                       progress=lambda c, t: seen.append((c, t)))
            after = dict(acked)
            pushed_meanwhile = live.info().pushed - result.pushed
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert not errors, errors  # the actors went on pushing throughout
    assert result.path == str(backups / "nightly" / "live.buffer")
    assert result.records + result.dropped == 10_000 and result.records >= 2_000
    assert result.damaged == 0 and pushed_meanwhile > 0
    assert seen and all(total == 10_000 for _, total in seen)
    assert [c for c, _ in seen] == sorted(c for c, _ in seen)

    restore(result.path, tmp_path / "restored")  # offline, every record checked
    with ServerProcess(tmp_path / "restored") as server:  # --recover fail: it all checks
        client = millpond.connect(server.address)
        info = client.info("live")
        assert (info.state, info.size, info.pushed) == ("ok", result.records, result.pushed)
        records = client.buffer("live").sample_all()
    assert valid(records).all()
    for a in acked:  # each actor's records: one unbroken run, in push order, ending where
        mine = records["seq"][records["actor"] == a]  # the cut did
        assert len(mine) and (np.diff(mine) == 1).all()
        assert before[a] <= mine[-1] + 1 <= after[a] + batch  # everything acked before it


def test_checkpoints_stay_inside_the_backup_dir(tmp_path):
    backups, outside = tmp_path / "backups", tmp_path / "outside"
    backups.mkdir(mode=0o700)
    outside.mkdir()
    (backups / "link").symlink_to(outside)
    with ServerProcess(tmp_path / "data", "--backup-dir", str(backups)) as server:
        client = millpond.connect(server.address)
        client.create_buffer("b", capacity=50, obs_dim=2, act_dim=1).push_batch(
            np.zeros((20, 2)), np.zeros((20, 2)), np.zeros((20, 1)), np.zeros(20),
            np.zeros(20), np.zeros(20))
        for path in ("../escape", str(outside / "x"), "link/x", "a/../../x", ""):
            with pytest.raises(millpond.InvalidArgumentError):
                client.checkpoint("b", path)
        assert os.listdir(outside) == [] and not (tmp_path / "escape.buffer").exists()
        assert client.checkpoint("b", "deep/er/b").path == str(backups / "deep/er/b.buffer")
        assert client.checkpoint("b", str(backups / "abs.buffer")).records == 20
        with pytest.raises(millpond.FileConflictError):
            client.checkpoint("b", "abs")
        with pytest.raises(millpond.BufferNotFoundError):
            client.checkpoint("nope", "x")
        assert sorted(p.name for p in backups.iterdir()) == ["abs.buffer", "deep", "link"]
    with ServerProcess(tmp_path / "data") as server:  # no --backup-dir: refused, saying so
        with pytest.raises(millpond.PermissionDeniedError, match="--backup-dir"):
            millpond.connect(server.address).checkpoint("b", "x")
    inside = cli("serve", "--port", "0", "--data-dir", tmp_path / "data",
                 "--backup-dir", tmp_path / "data" / "backups", timeout=60)
    assert inside.returncode == 2 and "data directory" in inside.stderr


def test_a_cancelled_backup_leaves_no_file_behind(tmp_path):
    backups = tmp_path / "backups"
    with ServerProcess(tmp_path / "data", "--backup-dir", str(backups)) as server:
        client = millpond.connect(server.address)
        buf = client.create_buffer("b", hot_capacity=500, total_capacity=4_000, fields=WIDE)
        for start in range(0, 4_000, 500):
            buf.push_batch(**wide_records(1, start, 500))

        class Interrupted(Exception):
            pass

        def interrupt(copied: int, total: int) -> None:
            raise Interrupted  # as a Ctrl-C of `millpond backup` would

        with pytest.raises(Interrupted):
            client.checkpoint("b", "x", progress=interrupt)
        wait_until(lambda: not [p for p in backups.rglob("*") if p.is_file()])
        assert len(buf) == 4_000 and client.checkpoint("b", "x").records == 4_000


def test_only_an_admin_may_back_up_or_repair(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"actor {ACTOR}\n")
    tokens.chmod(0o600)
    with ServerProcess(tmp_path / "data", "--backup-dir", str(tmp_path / "backups"),
                       "--token-file", str(tokens), env={"MILLPOND_TOKEN": ADMIN}) as server:
        admin = millpond.connect(server.address, token=ADMIN)
        admin.create_buffer("b", capacity=8, obs_dim=2, act_dim=1)
        actor = millpond.connect(server.address, token=ACTOR)
        with pytest.raises(millpond.PermissionDeniedError, match="Checkpoint"):
            actor.checkpoint("b", "x")
        with pytest.raises(millpond.PermissionDeniedError, match="Repair"):
            actor.repair_buffer("b")
        with pytest.raises(millpond.AuthenticationError):
            millpond.connect(server.address, token=None).checkpoint("b", "x")
        assert admin.checkpoint("b", "x").records == 0
        assert not admin.repair_buffer("b").repaired


def test_a_sharded_buffer_backs_up_one_file_per_shard(tmp_path):
    servers = start_all([ServerProcess(tmp_path / f"data{i}", "--backup-dir",
                                       str(tmp_path / f"backups{i}")) for i in range(2)])
    try:
        sharded = millpond.connect([s.address for s in servers])
        writers = [sharded.create_buffer("s", hot_capacity=20, total_capacity=200,
                                         fields=CRASH_FIELDS) for _ in range(2)]
        for i, writer in enumerate(writers):  # each handle writes to its own shard
            writer.push_batch(**crash_records(i, 0, 30 + 10 * i))
        seen = []
        result = sharded.checkpoint("s", "nightly/s", progress=lambda c, t: seen.append(t))
        assert len(result.shards) == 2 and result.records == 70 and seen[-1] == 70
        parts = [tmp_path / f"backups{i}" / "nightly" / f"s-shard{i}.buffer" for i in range(2)]
        assert [part.path for part in result.shards] == [str(p) for p in parts]
        before = writers[0].sample_all()
    finally:
        for server in servers:
            server.stop()
    for i, part in enumerate(parts):
        restore(part, tmp_path / f"restored{i}", "s")
    servers = start_all([ServerProcess(tmp_path / f"restored{i}") for i in range(2)])
    try:
        after = millpond.connect([s.address for s in servers]).buffer("s").sample_all()
        assert sorted(zip(after["actor"].tolist(), after["seq"].tolist())) == \
            sorted(zip(before["actor"].tolist(), before["seq"].tolist()))
    finally:
        for server in servers:
            server.stop()


# ---- C: the operator's CLI ----------------------------------------------------------------

def test_the_operators_commands(tmp_path):
    backups = tmp_path / "backups"
    env = {"MILLPOND_TOKEN": ADMIN}
    with ServerProcess(tmp_path / "data", "--backup-dir", str(backups), env=env) as server:
        address = {"MILLPOND_ADDRESS": server.address}
        client = millpond.connect(server.address, token=ADMIN)
        for name in ("keep", "drop"):
            client.create_buffer(name, hot_capacity=10, total_capacity=100,
                                 fields=CRASH_FIELDS).push_batch(**crash_records(1, 0, 70))

        refused = cli("delete", "drop", "--address", server.address)  # no token
        assert refused.returncode == 1 and "MILLPOND_TOKEN" in refused.stderr
        done = cli("delete", "drop", env={**env, **address})  # the address from the environment
        assert done.returncode == 0 and done.stdout.strip() == "deleted drop", done.stderr
        assert [info.name for info in client.list_buffers()] == ["keep"]
        missing = cli("delete", "drop", env={**env, **address})
        assert missing.returncode == 1 and "BufferNotFoundError" in missing.stderr

        exported = cli("export", "keep", tmp_path / "keep", "--address", server.address, env=env)
        assert exported.returncode == 0, exported.stderr
        with np.load(tmp_path / "keep.npz") as npz:
            assert npz["seq"].tolist() == list(range(70)) and valid(dict(npz)).all()

        backup = cli("backup", "keep", "nightly/keep", "--address", server.address, env=env)
        assert backup.returncode == 0, backup.stderr
        assert "backup keep: 100% (70 of 70 records)" in backup.stderr
        snapshot = backups / "nightly" / "keep.buffer"
        assert backup.stdout.startswith(f"wrote {snapshot}: 70 records (seqs 0-69)")
        outside = cli("backup", "keep", "../x", "--address", server.address, env=env)
        assert outside.returncode == 1 and "InvalidArgumentError" in outside.stderr

        served = cli("repair", "keep", "--address", server.address, env=env)
        assert served.returncode == 0 and "served already" in served.stdout

    restored = cli("restore", snapshot, "--data-dir", tmp_path / "second", "--name", "copy")
    assert restored.returncode == 0, restored.stderr
    assert "restored copy" in restored.stdout and "70 records" in restored.stdout
    again = cli("restore", snapshot, "--data-dir", tmp_path / "second", "--name", "copy")
    assert again.returncode == 1 and "exists" in again.stderr
    with ServerProcess(tmp_path / "second") as server:
        records = millpond.connect(server.address).buffer("copy").sample_all()
        assert records["seq"].tolist() == list(range(70)) and valid(records).all()
        busy = cli("restore", snapshot, "--data-dir", tmp_path / "second", "--name", "other")
        assert busy.returncode == 1 and "a daemon is using" in busy.stderr
    damaged = tmp_path / "damaged.buffer"
    damaged.write_bytes(snapshot.read_bytes())
    flip_byte(damaged, "payload", 2, hot=False)
    refused = cli("restore", damaged, "--data-dir", tmp_path / "third")
    assert refused.returncode == 1 and "fail their checks" in refused.stderr
    assert not any(p.name.endswith(".buffer") or p.name.endswith(".tmp")
                   for p in (tmp_path / "third").iterdir())


def test_info_shows_a_held_buffer_and_repair_brings_it_back(tmp_path):
    data = tmp_path / "data"
    make(data, "hurt", "ok")
    flip_byte(data / "hurt.buffer", "actor", 5, hot=False)
    with ServerProcess(data) as server:
        info = cli("info", "--address", server.address)
        assert info.returncode == 0, info.stderr
        row = next(line for line in info.stdout.splitlines() if line.startswith("hurt"))
        assert row.split()[1:4] == ["damaged", "replay", "-"]  # its state; no numbers
        assert f"hurt: held out of service (damaged): {data / 'hurt.buffer'}: 1 of 40" in \
            info.stdout
        repaired = cli("repair", "hurt", "--address", server.address)
        assert repaired.returncode == 0, repaired.stderr
        assert repaired.stdout.strip() == ("repaired hurt: 39 records served, 1 damaged "
                                           "records dropped")
        info = cli("info", "--address", server.address)
        assert "held out" not in info.stdout and "damaged" not in info.stdout
        row = next(line for line in info.stdout.splitlines() if line.startswith("hurt"))
        assert row.split()[1:4] == ["ok", "replay", "39/60"]
