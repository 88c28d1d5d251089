"""``--metrics-port`` (Prometheus), ``--log-format json``, and the Grafana dashboard."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support import ServerProcess

import millpond

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "grafana-dashboard.json"
FIELDS = {"x": ("int64", ())}


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """A daemon with metrics on a free port and JSON logs at debug level."""
    server = ServerProcess(tmp_path_factory.mktemp("metrics") / "data", "--metrics-port", "0",
                           "--log-format", "json", "--log-level", "debug")
    server.proc = subprocess.Popen(server.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=server.env)
    first = server.proc.stdout.readline().strip()
    assert first.startswith("metrics on 127.0.0.1:"), first
    server.metrics = first.rpartition(" ")[2]
    # Read on through the same buffered stream (a select() on its fd could miss a line
    # the first readline already buffered).
    second = server.proc.stdout.readline().strip()
    assert second.startswith("serving on "), second
    server.address = second.rpartition(" ")[2]
    yield server
    server.stop()


def scrape(server) -> dict[str, float]:
    """``{'name{labels}': value}`` of every sample the server exports."""
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_buffers_calls_waits_and_the_fast_path_are_counted(observed):
    for shm in (False, True):
        client = millpond.connect(observed.address, shm=shm)
        name = f"m-{'shm' if shm else 'grpc'}"
        buf = client.create_buffer(name, capacity=8, fields=FIELDS,
                                   rate_limiter=millpond.MinSize(4))
        buf.push_batch(x=np.arange(3))
        with pytest.raises(millpond.RateLimitTimeoutError):
            buf.sample(2, timeout=0.05)
        buf.push_batch(x=np.arange(7))  # 10 pushed into 8 slots: 2 evicted
        buf.sample(5)
    found = scrape(observed)
    for transport, name in (("grpc", "m-grpc"), ("shm", "m-shm")):
        assert found[f'millpond_buffer_size{{buffer="{name}"}}'] == 8
        assert found[f'millpond_buffer_capacity{{buffer="{name}",tier="total"}}'] == 8
        assert found[f'millpond_buffer_inserts_total{{buffer="{name}"}}'] == 10
        assert found[f'millpond_buffer_samples_total{{buffer="{name}"}}'] == 5
        assert found[f'millpond_buffer_bytes_in_total{{buffer="{name}"}}'] == 80
        assert found[f'millpond_buffer_bytes_out_total{{buffer="{name}"}}'] == 40
        assert found[f'millpond_buffer_evicted_records_total{{buffer="{name}"}}'] == 2
        assert found[f'millpond_rate_limiter_wait_seconds_count{{buffer="{name}",kind="sample"}}'] == 1
        assert found[f'millpond_rpc_duration_seconds_count{{buffer="{name}",method="Sample",'
                     f'transport="{transport}"}}'] == 2
        assert found[f'millpond_rpc_errors_total{{code="DEADLINE_EXCEEDED",method="Sample",'
                     f'transport="{transport}"}}'] == 1
        assert found[f'millpond_rpc_duration_seconds_count{{buffer="{name}",method="Create",'
                     'transport="grpc"}'] == 1
    assert found["millpond_ready"] == 1 and found["millpond_buffers"] == 2
    assert found["millpond_shm_sessions"] >= 1 and found["millpond_shm_bytes"] > 0
    # A gRPC client's stream of samples stays open: a call of one host, no request held.
    sampler = millpond.connect(observed.address, shm=False).buffer("m-grpc")
    sampler.sample(1)
    found = scrape(observed)
    assert found["millpond_grpc_calls_open"] >= 1 and found["millpond_grpc_client_hosts"] == 1
    assert found["millpond_grpc_inflight_bytes"] == 0


def test_the_process_its_version_and_each_buffers_memory_and_disk(observed):
    """The process's memory, CPU and open files (prometheus-client's collectors), the
    version, and per buffer the RAM its engine keeps resident and the disk its file takes."""
    buf = millpond.connect(observed.address).create_buffer(
        "sized", hot_capacity=64, total_capacity=4096, fields={"obs": ("float32", (16,))},
        prioritized=millpond.Prioritized(alpha=0.6, beta=0.4))
    buf.push_batch(obs=np.ones((100, 16), np.float32))
    found = scrape(observed)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total",
                 "process_open_fds", "process_max_fds", "process_start_time_seconds"):
        assert found[name] > 0, name
    assert found["process_open_fds"] < found["process_max_fds"]
    python = platform.python_version()
    assert found[f'millpond_build_info{{python="{python}",version="{millpond.__version__}"}}'] == 1
    assert any(key.startswith("python_info{") for key in found)
    assert found['millpond_buffer_memory_bytes{buffer="sized"}'] == buf.info()["memory_needed"] > 0
    file = observed.data_dir / "sized.buffer"
    before = file.stat().st_blocks * 512
    disk = scrape(observed)['millpond_buffer_disk_bytes{buffer="sized"}']
    # the blocks allocated (the file's extents may take a block more once written back)
    assert before <= disk <= file.stat().st_blocks * 512 and disk >= file.stat().st_size > 0


def test_calls_are_labelled_by_buffer_only_for_buffers_the_daemon_holds(observed):
    """A name no buffer has is no label (a client cannot grow the series by making names
    up), and the series of a deleted buffer go with it."""
    client = millpond.connect(observed.address, shm=False)
    for i in range(20):
        with pytest.raises(millpond.BufferNotFoundError):
            client.info(f"made-up-{i}")
    buf = client.create_buffer("short-lived", capacity=4, fields=FIELDS)
    buf.push_batch(x=np.arange(2))
    found = scrape(observed)
    assert not [key for key in found if "made-up" in key]
    assert found['millpond_rpc_duration_seconds_count{buffer="",method="Info",transport="grpc"}'] >= 20
    assert found['millpond_rpc_duration_seconds_count{buffer="short-lived",method="PushBatch",'
                 'transport="grpc"}'] == 1
    client.delete_buffer("short-lived")
    assert not [key for key in scrape(observed) if 'buffer="short-lived"' in key]


def exported_names(server) -> set[str]:
    """The metric families the server declares (``# TYPE`` lines: also those with no
    series now, e.g. buffers held out of service) and the names of its samples."""
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    return declared | {key.partition("{")[0] for key in scrape(server)}


def test_the_dashboard_plots_only_metrics_the_server_exports(observed):
    exported = exported_names(observed)
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b(millpond_\w+)", target["expr"])}
    assert len(queried) >= 15 and queried <= exported, queried - exported


def test_json_logs_name_the_buffer_method_and_peer(observed):
    client = millpond.connect(observed.address, shm=False)
    client.create_buffer("logged", capacity=4, fields=FIELDS).push_batch(x=np.arange(2))
    observed.stop()
    lines = [json.loads(line) for line in observed.proc.stderr.read().splitlines()]
    calls = [entry for entry in lines if entry["msg"] == "call"
             and entry.get("buffer") == "logged" and entry["method"] == "PushBatch"]
    assert calls and calls[0]["code"] == "OK" and calls[0]["peer"].startswith("ipv4:127.0.0.1:")
    assert all({"ts", "level", "logger", "msg"} <= set(entry) for entry in lines)


def test_metrics_without_prometheus_client_exit_2_saying_what_to_install(tmp_path):
    code = ("import sys; sys.modules['prometheus_client'] = None; "
            "from millpond_server.cli import main; "
            f"sys.exit(main(['serve', '--port', '0', '--metrics-port', '0', "
            f"'--data-dir', {str(tmp_path / 'data')!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert "millpond[metrics]" in result.stderr and "Traceback" not in result.stderr


def test_a_metrics_port_in_use_exits_1_saying_so(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "millpond_server", "serve", "--port", "0", "--metrics-port",
             str(port), "--data-dir", str(tmp_path / "data")],
            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"cannot bind the metrics port 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_metrics_host_binds_the_metrics_port_there_only(tmp_path):
    """``--host 0.0.0.0 --metrics-host 127.0.0.1``: gRPC on every interface, the metrics on
    loopback's 127.0.0.1 only (another loopback address, which a bind on every interface
    would answer at, is refused)."""
    import socket

    token = "metrics-host-test-token-0123456789"
    server = ServerProcess(tmp_path / "data", "--host", "0.0.0.0", "--metrics-port", "0",
                           "--metrics-host", "127.0.0.1", env={"MILLPOND_TOKEN": token})
    server.proc = subprocess.Popen(server.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=server.env)
    try:
        first = server.proc.stdout.readline().strip()
        assert first.startswith("metrics on 127.0.0.1:"), first or server.proc.stderr.read()
        port = int(first.rpartition(":")[2])
        second = server.proc.stdout.readline().strip()
        assert second.startswith("serving on 0.0.0.0:"), second
        grpc_port = int(second.rpartition(":")[2])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b"millpond_ready" in text
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=10).close()
        # The gRPC port does answer there: it is bound on every interface.
        client = millpond.connect(f"127.0.0.2:{grpc_port}", token=token, shm=False)
        assert client.list_buffers() == []
        client.close()
    finally:
        server.stop()
