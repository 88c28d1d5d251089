"""The ``millpond`` command: config layering, TOML, info/health, the Docker entrypoint."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path, PurePosixPath

import grpc
import numpy as np
import pytest
from support import ServerProcess, wait_for_ready

import millpond
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc
from millpond.wire.codec import encode_batch

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
BIN = Path(sys.executable).parent
TIMEOUT = 10.0

BUFFERS_TOML = """
[[buffers]]
name = "cartpole"
hot_capacity = 100
total_capacity = 1_000
obs_dim = 4
act_dim = 1

[[buffers]]
name = "atari"
capacity = 50
[buffers.fields]
obs = { dtype = "uint8", shape = [84, 84, 4] }
action = { dtype = "int64" }
reward = { dtype = "float32", shape = [] }
"""


def run_cli(*args, env=None, timeout=30):
    return subprocess.run([sys.executable, "-m", "millpond_server", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def list_buffers(address):
    with grpc.insecure_channel(address) as channel:
        reply = replay_pb2_grpc.ReplayStub(channel).List(pb.ListRequest(), timeout=TIMEOUT)
    return {b.name: b for b in reply.buffers}


@pytest.fixture
def toml_file(tmp_path):
    path = tmp_path / "buffers.toml"
    path.write_text(BUFFERS_TOML)
    return path


# ---- config --------------------------------------------------------------------------

@pytest.mark.daemon
def test_toml_buffers_exist_at_start(tmp_path, toml_file):
    with ServerProcess(tmp_path / "data", "--config", str(toml_file)) as srv:
        buffers = list_buffers(srv.address)
        assert set(buffers) == {"cartpole", "atari"}
        cp, at = buffers["cartpole"], buffers["atari"]
        assert (cp.config.hot_capacity, cp.config.total_capacity) == (100, 1000)
        assert [f.name for f in cp.config.fields] == [
            "obs", "next_obs", "actions", "rewards", "terminated", "truncated"]
        assert cp.path == "cartpole.buffer"
        assert os.path.exists(tmp_path / "data" / cp.path)
        assert (at.config.hot_capacity, at.config.total_capacity) == (50, 50)
        assert {f.name: (f.dtype, list(f.shape)) for f in at.config.fields} == {
            "obs": ("|u1", [84, 84, 4]), "action": ("<i8", []), "reward": ("<f4", [])}
        assert at.record_nbytes == 84 * 84 * 4 + 8 + 4


@pytest.mark.daemon
def test_toml_buffers_take_sampling_options(tmp_path):
    path = tmp_path / "sampling.toml"
    path.write_text("""
[[buffers]]
name = "work"
capacity = 100
mode = "queue"
[buffers.fields]
job = { dtype = "int64" }

[[buffers]]
name = "learner"
hot_capacity = 10
total_capacity = 100
obs_dim = 2
act_dim = 1
max_times_sampled = 4
prioritized = { alpha = 0.7, beta = 0.5 }
rate_limiter = { samples_per_insert = 8.0, min_size_to_sample = 20, error_buffer = [10, 200] }
""")
    with ServerProcess(tmp_path / "data", "--config", str(path)) as srv:
        client = millpond.connect(srv.address)
        assert client.buffer("work").info()["mode"] == "queue"
        learner = client.buffer("learner")
        info = learner.info()
        assert info["max_times_sampled"] == 4
        assert millpond.RateLimiter.from_dict(info["rate_limiter"]) == \
            millpond.SampleToInsertRatio(8.0, 20, (10, 200))
        assert isinstance(learner, millpond.PrioritizedBuffer)


@pytest.mark.daemon
@pytest.mark.parametrize("text,needle", [
    ("[[buffers]\nname = 'x'", "invalid TOML"),
    ("[[buffers]]\ncapacity = 10\nobs_dim = 1\nact_dim = 1", "missing 'name'"),
    ("[[buffers]]\nname = '../x'\ncapacity = 10\nobs_dim = 1\nact_dim = 1", "invalid buffer name"),
    ("[[buffers]]\nname = 'x'\nobs_dim = 1\nact_dim = 1", "total_capacity"),
    ("[[buffers]]\nname = 'x'\ncapacity = 10\nobs_dim = 1", "obs_dim and act_dim"),
    ("[[buffers]]\nname = 'x'\nhot_capacity = 20\ncapacity = 10\nobs_dim = 1\nact_dim = 1",
     "give capacity= or hot_capacity=/total_capacity=, not both"),
    ("[[buffers]]\nname = 'x'\nhot_capacity = 20\ntotal_capacity = 10\nobs_dim = 1\nact_dim = 1",
     "total_capacity (10) must be >= hot_capacity (20)"),
    ("[[buffers]]\nname = 'x'\ncapacity = 10\n[buffers.fields]\nobs = { dtype = 'object' }",
     "dtype"),
    ("[[buffers]]\nname = 'x'\ncapacity = 10\ncolour = 'red'\nobs_dim = 1\nact_dim = 1",
     "unknown keys ['colour']"),
    ("[[buffers]]\nname = 'x'\ncapacity = 1\nobs_dim = 1\nact_dim = 1\n"
     "[[buffers]]\nname = 'x'\ncapacity = 1\nobs_dim = 1\nact_dim = 1", "duplicate"),
    ("[[buffers]]\nname = 'x'\ncapacity = 10\nobs_dim = 1\nact_dim = 1\nmode = 'ring'", "mode"),
    ("[[buffers]]\nname = 'x'\ncapacity = 10\nobs_dim = 1\nact_dim = 1\n"
     "rate_limiter = { error_buffer = 3 }", "error_buffer needs samples_per_insert"),
    ("[[buffers]]\nname = 'x'\ncapacity = 10\nobs_dim = 1\nact_dim = 1\n"
     "rate_limiter = { samples_per_insert = -1.0, error_buffer = 3 }", "samples_per_insert"),
])
def test_bad_config_exits_2_with_a_clear_message(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = run_cli("serve", "--port", "0", "--data-dir", str(tmp_path / "d"), "--config", str(path))
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.daemon
@pytest.mark.parametrize("args,env,needle", [
    (["--config", "/nonexistent.toml"], {}, "not found"),
    (["--port", "70000"], {}, "--port"),
    ([], {"MILLPOND_GRACE": "soon"}, "MILLPOND_GRACE"),
    ([], {"MILLPOND_MAX_MESSAGE_MB": "0"}, "MILLPOND_MAX_MESSAGE_MB"),
    (["--log-level", "chatty"], {}, "--log-level"),
])
def test_bad_flags_and_env_exit_2(tmp_path, args, env, needle):
    result = run_cli("serve", "--port", "0", "--data-dir", str(tmp_path / "d"), *args, env=env)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


@pytest.mark.daemon
def test_port_in_use_exits_1(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = run_cli("serve", "--port", str(port), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 1, result.stderr
    assert f"cannot bind 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.daemon
def test_env_vars_are_honoured_and_flags_win(tmp_path, toml_file):
    env = {
        "MILLPOND_CONFIG": str(toml_file),        # env only: used
        "MILLPOND_MAX_MESSAGE_MB": "1",           # env only: used
        "MILLPOND_HOST": "192.0.2.1",             # flag --host 127.0.0.1 wins
        "MILLPOND_PORT": "1",                     # flag --port 0 wins
        "MILLPOND_DATA_DIR": str(tmp_path / "env-dir"),  # flag wins
        "MILLPOND_LOG_LEVEL": "info",
    }
    srv = ServerProcess(tmp_path / "data", env=env).start()
    try:
        assert srv.address.startswith("127.0.0.1:") and not srv.address.endswith(":1")
        buffers = list_buffers(srv.address)
        assert set(buffers) == {"cartpole", "atari"}
        assert (tmp_path / "data" / buffers["cartpole"].path).exists()
        assert not (tmp_path / "env-dir").exists()
        with grpc.insecure_channel(srv.address) as channel:
            stub = replay_pb2_grpc.ReplayStub(channel)
            for _ in range(2):  # 2 x 847 KB requests fit in 1 MiB, a 40-record reply does not
                stub.PushBatch(pb.PushBatchRequest(name="atari", batch=encode_batch({
                    "obs": np.zeros((30, 84, 84, 4), np.uint8), "action": np.zeros(30, np.int64),
                    "reward": np.zeros(30, np.float32)})), timeout=TIMEOUT)
            with pytest.raises(grpc.RpcError) as err:
                stub.Sample(pb.SampleRequest(name="atari", batch_size=40), timeout=TIMEOUT)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-message-mb 1 " in err.value.details()
        assert srv.stop() == 0
        stderr = srv.proc.stderr.read()
        assert "level=info" in stderr and "msg=serving" in stderr  # MILLPOND_LOG_LEVEL
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


# What the daemon logs at the default level (info): its lifecycle and the operators'
# changes, never a line per call.
LIFECYCLE = {"authentication", "open files limit", "fast-path limits", "recovery started",
             "recovery done", "serving", "buffer created", "buffer closed", "stopping",
             "server stopped", "buffers synced and released"}


@pytest.mark.daemon
def test_lifecycle_at_info_by_default_no_line_per_call_and_logs_are_key_value(tmp_path):
    srv = ServerProcess(tmp_path / "data", quiet=False).start()
    for shm in (True, False):
        client = millpond.connect(srv.address, shm=shm)
        buf = client.create_buffer(f"calls-{shm}", capacity=8, fields={"x": ("int64", ())})
        for _ in range(20):
            buf.push_batch(x=np.arange(3))
            buf.sample(2)
            client.list_buffers()
        client.delete_buffer(f"calls-{shm}")
        client.close()
    assert srv.stop(signal.SIGINT) == 0
    lines = srv.proc.stderr.read().splitlines()
    assert lines and all(line.startswith("ts=") and " level=info " in line for line in lines)
    said = [re.search(r' msg=("[^"]*"|\S+)', line).group(1).strip('"') for line in lines]
    assert set(said) == LIFECYCLE, set(said) ^ LIFECYCLE
    assert said.count("buffer created") == 2  # one line per creation, none per call
    assert any("msg=stopping" in line and "signal=SIGINT" in line for line in lines)
    # --log-level warning: nothing, on a healthy start and stop.
    srv = ServerProcess(tmp_path / "data", "--log-level", "warning").start()
    assert srv.stop() == 0
    assert srv.proc.stderr.read() == ""


PROGRESS_EVERY_CHUNK = """
import sys

from millpond_server import registry
from millpond_server.cli import main

registry.PROGRESS_LOG_S = 0.0  # a progress line for every chunk checked, not every 5 s
sys.exit(main())
"""


@pytest.mark.daemon
def test_recovery_logs_its_start_progress_and_end_at_the_default_level(tmp_path):
    """A buffer of 300,000 records is checked in 5 chunks of at most 65,536 records: a
    progress line after each of the first 4 (here after every chunk; a real daemon's at most
    every 5 s), between the start and the end, before ``serving``."""
    from support import engine

    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    buf = engine({"x": ("int64", ())}, 1_000, 300_000, data / "big.buffer", persistent=True)
    buf.push_batch({"x": np.arange(300_000)})
    buf.release()
    script = tmp_path / "progress_daemon.py"
    script.write_text(PROGRESS_EVERY_CHUNK)
    srv = ServerProcess(data, script=script, quiet=False).start()
    assert srv.stop() == 0
    lines = srv.proc.stderr.read().splitlines()

    def index(needle: str) -> int:
        return next(i for i, line in enumerate(lines) if needle in line)

    started = index('msg="recovery started"')
    assert "buffers=1" in lines[started]
    recovering = index('msg="recovering buffer" buffer=big progress=1/1')
    progress = [i for i, line in enumerate(lines) if 'msg="checking records" buffer=big' in line]
    checked = [int(re.search(r" checked=(\d+)", lines[i]).group(1)) for i in progress]
    assert checked == [65_536, 131_072, 196_608, 262_144], checked
    assert all("live=300000" in lines[i] for i in progress)
    assert re.search(r" percent=22\b", lines[progress[0]])
    recovered = index('msg="buffer recovered" buffer=big records=300000')
    done = index('msg="recovery done" buffers=1 held_out=0')
    serving = index("msg=serving")
    assert started < recovering < progress[0] and progress[-1] < recovered < done < serving
    assert all(" level=info " in lines[i] for i in (started, recovering, *progress, recovered))


@pytest.mark.daemon
def test_server_tunes_malloc_for_large_messages(tmp_path):
    for extra, expect in (({}, "malloc_tuned=True"), ({"MILLPOND_TUNE_MALLOC": "0"}, "malloc_tuned=False")):
        srv = ServerProcess(tmp_path / "data", "--log-level", "info", env=extra).start()
        assert srv.stop() == 0
        serving = [line for line in srv.proc.stderr.read().splitlines() if "msg=serving" in line]
        assert len(serving) == 1 and expect in serving[0], serving


# ---- info / health -------------------------------------------------------------------

@pytest.mark.daemon
def test_info_prints_an_aligned_table(tmp_path, toml_file):
    """Each buffer's state, mode, fill, counts, rate limiter, RAM and disk in a table that
    fits 100 columns; its hot capacity, record size and fields below; ``--json`` has every
    key of its info and the disk its file takes."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "junk.buffer").write_bytes(b"not a buffer file" * 300)  # held out of service
    with ServerProcess(data, "--config", str(toml_file)) as srv:
        client = millpond.connect(srv.address)
        x = {"x": ("int64", ())}
        apex = client.create_buffer("apex", hot_capacity=1_000, total_capacity=20_000, fields=x,
                                    prioritized=millpond.Prioritized(alpha=0.6, beta=0.4),
                                    rate_limiter=millpond.SampleToInsertRatio(8, 1_000, 400))
        apex.push_batch(x=np.arange(40))
        queue = client.create_buffer("queue", capacity=500, fields=x, mode="queue")
        queue.push_batch(x=np.arange(120))
        queue.sample(20)
        capped = client.create_buffer("capped", capacity=2_000, fields=x, max_times_sampled=8,
                                      rate_limiter=millpond.MinSize(100))
        capped.push_batch(x=np.arange(1_500))
        result = run_cli("info", "--address", srv.address)
        assert result.returncode == 0, result.stderr
        table, details, held = result.stdout.split("\n\n")
        lines = table.splitlines()
        assert lines[0].split() == ["NAME", "STATE", "MODE", "RECORDS", "PUSHED", "SAMPLED",
                                    "WAIT", "LIMITER", "MEMORY", "DISK"]
        assert max(len(line) for line in result.stdout.splitlines() if "held out" not in line) \
            <= 100
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        assert list(rows) == ["apex", "atari", "capped", "cartpole", "junk", "queue"]
        assert rows["apex"][:8] == ["apex", "ok", "prioritized", "40/20k", "40", "0", "0", "spi"]
        assert " spi 8 min 1k " in lines[1]
        assert rows["atari"][:7] == ["atari", "ok", "replay", "0/50", "0", "0", "0"]
        assert rows["queue"][:8] == ["queue", "ok", "queue", "100/500", "120", "20", "0", "queue"]
        assert rows["capped"][:8] == ["capped", "ok", "replay", "1.5k/2k", "1.5k", "0", "0", "min"]
        assert rows["junk"][:3] == ["junk", "unknown-format", "-"]
        files = {name: data / f"{name}.buffer" for name in rows}
        before = {name: path.stat().st_blocks * 512 for name, path in files.items()}
        infos = {info["name"]: info for info in json.loads(
            run_cli("info", "--address", srv.address, "--json").stdout)}
        after = {name: path.stat().st_blocks * 512 for name, path in files.items()}
        for name, row in rows.items():  # RAM and disk, as the JSON has them
            memory, disk = row[-2:]
            assert re.fullmatch(r"\d+(\.\d)?(B|KiB|MiB)", disk), row
            # the blocks allocated (a file's extents may take a block more once written back)
            assert before[name] <= infos[name]["disk_bytes"] <= after[name]
            assert infos[name]["disk_bytes"] >= files[name].stat().st_size > 0
            if name != "junk":
                assert infos[name]["memory_needed"] == client.info(name).memory_needed > 0
                assert re.fullmatch(r"\d+(\.\d)?(KiB|MiB)", memory), row
        assert infos["apex"]["rate_limiter"] == {"samples_per_insert": 8.0,
                                                 "min_size_to_sample": 1_000,
                                                 "min_diff": 7_600.0, "max_diff": 8_400.0}
        assert infos["apex"]["limiter"] == "spi 8 min 1k" and infos["atari"]["limiter"] == "-"
        assert infos["apex"]["prioritized"] == {"alpha": 0.6, "beta": 0.4}
        assert infos["atari"]["mode"] == "replay" and infos["atari"]["state"] == "ok"
        assert infos["junk"]["state"] == "unknown-format" and infos["junk"]["mode"] is None
        assert "not a millpond buffer file" in infos["junk"]["reason"]
        # aligned: every column starts (left-aligned) or ends (numbers) where its header does
        header = lines[0]
        for word in ("STATE", "MODE", "LIMITER"):
            col = header.index(word)
            assert all(line[col - 2: col] == "  " and line[col] != " " for line in lines[1:])
        for word in ("RECORDS", "PUSHED", "MEMORY", "DISK"):
            end = header.index(word) + len(word)
            assert all(line[end - 1] != " " and line[end: end + 1] in ("", " ")
                       for line in lines[1:])
        # below: what each buffer stores, and why one is held out of service
        # (wrapped at 100 columns, continued under the text)
        assert max(len(line) for line in details.splitlines()) <= 100
        detail = {entry.split()[0]: " ".join(entry.split()) for entry in
                  re.split(r"\n(?! )", details.strip("\n"))}
        assert list(detail) == ["apex", "atari", "capped", "cartpole", "queue"]
        assert detail["atari"] == ("atari hot 50, 28,236 bytes a record: obs:uint8[84,84,4] "
                                   "action:int64 reward:float32")
        assert "hot 100, " in detail["cartpole"] and "obs:float32[4]" in detail["cartpole"]
        assert detail["capped"].endswith("x:int64; at most 8 draws a record")
        assert held.strip().startswith("junk: held out of service (unknown-format): ")
        # MILLPOND_ADDRESS is the default address
        via_env = run_cli("info", env={"MILLPOND_ADDRESS": srv.address})
        assert via_env.stdout.split("\n\n")[1:] == result.stdout.split("\n\n")[1:]


def test_info_and_health_on_unreachable_server_exit_1():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    for command in ("info", "health"):
        result = run_cli(command, "--address", address, "--timeout", "3")
        assert result.returncode == 1
        err = result.stderr.strip().splitlines()
        assert len(err) == 1 and "cannot reach server at " + address in err[0]


def test_health_serving(server):
    result = run_cli("health", "--address", server.address)
    assert result.returncode == 0 and result.stdout.strip() == "SERVING"


def test_usage_errors_exit_2():
    assert run_cli().returncode == 2
    assert run_cli("frobnicate").returncode == 2
    help_ = run_cli("serve", "--help")
    assert help_.returncode == 0 and "MILLPOND_MAX_MESSAGE_MB" in help_.stdout


# ---- the Docker image's entrypoint ----------------------------------------------------

def _dockerfile_instructions() -> list[tuple[str, str]]:
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def dockerfile_image_config() -> tuple[list[str], dict[str, str], list[str]]:
    """(ENTRYPOINT, ENV of the final image, HEALTHCHECK CMD) as Docker would see them."""
    entrypoint, env, health = None, {}, None
    for keyword, rest in _dockerfile_instructions():
        if keyword == "FROM":
            entrypoint, env, health = None, {}, None
        elif keyword == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif keyword == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
        elif keyword == "HEALTHCHECK":
            health = json.loads(rest[rest.index("CMD") + 3:].strip())
    assert entrypoint and health, "Dockerfile must have exec-form ENTRYPOINT and HEALTHCHECK"
    return entrypoint, env, health


def test_dockerfile_agrees_with_the_cli():
    """What the image declares is what the server does: every variable it sets is one
    ``millpond serve`` reads, the port it exposes is the one it serves, the volume holds
    its data directory, it does not run as root, ``docker stop`` does not kill it, and
    the HEALTHCHECK finds it wherever it listens."""
    from millpond_server.config import SERVE_OPTIONS

    instructions = _dockerfile_instructions()
    _, env, _ = dockerfile_image_config()
    known = {opt.env: opt for opt in SERVE_OPTIONS}
    millpond_vars = {key for key in env if key.startswith("MILLPOND_")}
    assert millpond_vars and millpond_vars <= set(known), millpond_vars - set(known)
    port = env.get("MILLPOND_PORT", str(known["MILLPOND_PORT"].default))
    assert [rest for keyword, rest in instructions if keyword == "EXPOSE"] == [port]
    # The volume's root is world-writable and sticky, so any --user can create the data
    # directory (its own, kept from others) in a fresh named volume.
    volumes = [json.loads(rest) for keyword, rest in instructions if keyword == "VOLUME"]
    volume = str(PurePosixPath(env["MILLPOND_DATA_DIR"]).parent)
    assert volumes == [[volume]] and volume != "/"
    assert any(keyword == "RUN" and f"chmod 1777 {volume}" in rest
               for keyword, rest in instructions)
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")
    # In-flight calls get less than `docker stop`'s default 10 s, or Docker SIGKILLs it.
    assert float(env.get("MILLPOND_GRACE", known["MILLPOND_GRACE"].default)) <= 5
    _, _, health = dockerfile_image_config()
    assert env["MILLPOND_ADDRESS_FILE"].startswith("/tmp/") and "--address" not in health
    # Authentication stays on: no token baked in, no --insecure.
    assert "MILLPOND_TOKEN" not in env and "MILLPOND_INSECURE" not in env


def test_the_dockerfile_pins_its_base_image_by_digest():
    """``FROM ${BASE_IMAGE}``, whose default names the tag and the digest of the image it
    was reviewed as: a rebuild gets those bytes, not whatever the tag points to now."""
    instructions = _dockerfile_instructions()
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert froms == ["${BASE_IMAGE}"], froms
    args = [rest for keyword, rest in instructions if keyword == "ARG"]
    assert instructions.index(("ARG", args[0])) < instructions.index(("FROM", froms[0]))
    (default,) = [arg.partition("=")[2] for arg in args if arg.startswith("BASE_IMAGE=")]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", default), default


def _image_env(tmp_path: Path) -> dict[str, str]:
    """The image's environment, with its paths moved under ``tmp_path``."""
    _, image_env, _ = dockerfile_image_config()
    return {**os.environ, **image_env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "MILLPOND_DATA_DIR": str(tmp_path / "data" / "millpond"),  # /data/millpond
            "MILLPOND_ADDRESS_FILE": str(tmp_path / "millpond.address")}  # /tmp/...


@pytest.mark.daemon
@pytest.mark.parametrize("port_as", ["env", "argument"])
def test_docker_entrypoint_serves_answers_health_and_exits_0_on_sigterm(tmp_path, port_as):
    """``MILLPOND_PORT=N`` or ``--port N``: the HEALTHCHECK finds the server either way."""
    entrypoint, _, health_cmd = dockerfile_image_config()
    with socket.socket() as s:  # a free port, since the test host is shared
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "entrypoint-test-token"
    env = {**_image_env(tmp_path), "MILLPOND_TOKEN": token, "MILLPOND_PORT": str(port)}
    args = []
    if port_as == "argument":  # the flag wins; MILLPOND_PORT names a port nobody serves
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MILLPOND_PORT"] = str(s.getsockname()[1])
        args = ["--port", str(port)]
    address_file = Path(env["MILLPOND_ADDRESS_FILE"])
    proc = subprocess.Popen([*entrypoint, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        address = wait_for_ready(proc, 30)
        assert address == f"0.0.0.0:{port}"
        assert (tmp_path / "data" / "millpond").is_dir()
        assert address_file.read_text() == f"127.0.0.1:{port}\n"
        health = subprocess.run(health_cmd, env=env, capture_output=True, text=True, timeout=30)
        assert health.returncode == 0, health.stderr
        client = millpond.connect(f"127.0.0.1:{port}", token=token, timeout=TIMEOUT)
        assert client.list_buffers() == []
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert not address_file.exists()  # a clean stop removes it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.daemon
def test_docker_entrypoint_without_a_token_refuses_to_serve(tmp_path):
    entrypoint, _, _ = dockerfile_image_config()
    env = {**_image_env(tmp_path), "MILLPOND_PORT": "0"}
    env.pop("MILLPOND_TOKEN", None)
    result = subprocess.run(entrypoint, env=env, capture_output=True, text=True, timeout=30,
                            cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "MILLPOND_TOKEN" in result.stderr and "--insecure" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.daemon
@pytest.mark.parametrize("published_loopback", [False, True])
def test_docker_entrypoint_says_tokens_travel_in_clear_text_unless_published_on_loopback(
        tmp_path, published_loopback):
    """The image binds 0.0.0.0 and cannot see where Docker publishes its port: it warns that
    tokens travel in clear text, and how to say the port is on this host's loopback only
    (the docs' ``docker run -p 127.0.0.1:... -e MILLPOND_PUBLISHED_LOOPBACK=1``); then that
    is one info line and nothing is a warning. Authentication is required either way."""
    entrypoint, _, _ = dockerfile_image_config()
    env = {**_image_env(tmp_path), "MILLPOND_PORT": "0", "MILLPOND_TOKEN": "clear-text-test-token"}
    if published_loopback:
        env["MILLPOND_PUBLISHED_LOOPBACK"] = "1"
    proc = subprocess.Popen(entrypoint, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        wait_for_ready(proc, 30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = proc.stderr.read().splitlines()
    clear = [line for line in lines if "clear text" in line]
    assert len(clear) == 1, lines
    if published_loopback:
        assert " level=info " in clear[0] and "on this host only" in clear[0]
        assert not [line for line in lines if " level=warning " in line], lines
    else:
        assert " level=warning " in clear[0] and "host=0.0.0.0" in clear[0]
        assert "--tls-cert" in clear[0] and "MILLPOND_PUBLISHED_LOOPBACK=1" in clear[0]
    env.pop("MILLPOND_TOKEN")  # still refused without authentication
    refused = subprocess.run(entrypoint, env=env, capture_output=True, text=True, timeout=30,
                             cwd=tmp_path)
    assert refused.returncode == 2 and "MILLPOND_TOKEN" in refused.stderr


@pytest.mark.parametrize("host,expected", [
    ("0.0.0.0", "127.0.0.1:7"), ("::", "[::1]:7"), ("[::]", "[::1]:7"),
    ("127.0.0.1", "127.0.0.1:7"), ("::1", "[::1]:7"), ("192.0.2.1", "192.0.2.1:7"),
])
def test_address_file_names_where_a_local_client_reaches_the_bind(host, expected):
    from millpond_server.app import _local_address

    assert _local_address(host, 7) == expected
