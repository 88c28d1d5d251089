"""docker/kubernetes/: the manifests parse and fit together, their container command line
is one ``millpond serve`` accepts (run as written), and the probes target the ports it opens."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path, PurePosixPath

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_cli import DOCKERFILE, dockerfile_image_config

from millpond_server.cli import build_parser
from millpond_server.config import SERVE_OPTIONS, TOKEN_ENV, resolve_serve_config

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "docker" / "kubernetes"
TOKEN = "kubernetes-test-token-0123456789"
BIN = Path(sys.executable).parent


def manifests() -> dict[str, dict]:
    found = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert doc["kind"] not in found, doc["kind"]
                found[doc["kind"]] = doc
    return found


def container() -> dict:
    (only,) = manifests()["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return only


def container_env(data_dir: Path | None = None) -> dict[str, str]:
    """The container's environment as the pod gets it (the Secret's token filled in)."""
    docs = manifests()
    env = {}
    for item in container()["env"]:
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        secret = docs["Secret"]
        assert secret["metadata"]["name"] == ref["name"] and ref["key"] in secret["stringData"]
        env[item["name"]] = TOKEN
    if data_dir is not None:
        env["MILLPOND_DATA_DIR"] = str(data_dir)
    return env


def probe_port(probe: dict) -> int:
    port = probe["grpc"]["port"]
    if isinstance(port, str):  # a named port
        port = next(p["containerPort"] for p in container()["ports"] if p["name"] == port)
    return port


def named_port(name: str) -> int:
    return next(p["containerPort"] for p in container()["ports"] if p["name"] == name)


def test_manifests_parse_and_fit_together():
    docs = manifests()
    assert set(docs) == {"Service", "StatefulSet", "PodDisruptionBudget", "Secret"}
    service, sts, pdb = docs["Service"], docs["StatefulSet"], docs["PodDisruptionBudget"]
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    for selector in (service["spec"]["selector"], sts["spec"]["selector"]["matchLabels"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    ports = {p["name"] for p in container()["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    assert set(mounts) == claims  # one PersistentVolumeClaim per shard holds the data dir
    data_dir = PurePosixPath(container_env()["MILLPOND_DATA_DIR"])
    assert any(PurePosixPath(m) in data_dir.parents for m in mounts.values())
    assert pdb["spec"]["maxUnavailable"] == 1
    resources = container()["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    assert docs["Secret"]["stringData"]["token"] == ""  # no token in the repository


def test_container_arguments_and_environment_are_what_serve_accepts(tmp_path):
    """Parsed by the CLI's own parser and resolved as the daemon does; the probes, the
    metrics port and the grace period agree with what it resolves to."""
    known = {opt.env for opt in SERVE_OPTIONS} | {TOKEN_ENV}
    env = container_env()
    assert set(env) <= known, set(env) - known
    args = build_parser().parse_args(["serve", *container()["args"]])
    _, image_env, _ = dockerfile_image_config()
    cfg = resolve_serve_config(args, environ={**image_env, **env})
    spec = manifests()["StatefulSet"]["spec"]["template"]["spec"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_port(container()[kind]) == cfg.port, kind
    assert named_port("grpc") == cfg.port and named_port("metrics") == cfg.metrics_port
    annotations = manifests()["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == cfg.metrics_port
    assert spec["terminationGracePeriodSeconds"] > cfg.grace
    assert cfg.host == "0.0.0.0" and cfg.token == TOKEN and cfg.log_format == "json"
    assert "[metrics]" in DOCKERFILE.read_text()  # the image can serve --metrics-port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _any_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.daemon
def test_the_container_command_line_serves_and_answers_its_probes(tmp_path):
    """The image's entrypoint with the container's arguments and environment, as written
    (a port another process holds on this shared host is swapped for a free one)."""
    entrypoint, image_env, _ = dockerfile_image_config()
    args = [str(a) for a in container()["args"]]
    grpc_port, metrics_port = probe_port(container()["readinessProbe"]), named_port("metrics")
    for port in (grpc_port, metrics_port):
        if not _free(port):
            args[args.index(str(port))] = str(_any_port())
    cfg = resolve_serve_config(build_parser().parse_args(["serve", *args]), environ={})
    grpc_port, metrics_port = cfg.port, cfg.metrics_port
    env = {**os.environ, **image_env, **container_env(tmp_path / "data" / "millpond"),
           "MILLPOND_ADDRESS_FILE": str(tmp_path / "address"),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([*entrypoint, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"metrics on 0.0.0.0:{metrics_port}"
        assert proc.stdout.readline().strip() == f"serving on 0.0.0.0:{grpc_port}"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # the probes' check
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=10).read().decode()
        assert "millpond_ready 1.0" in text
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        grace = manifests()["StatefulSet"]["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"]
        assert proc.wait(grace) == 0 and time.monotonic() - start < grace
        assert all(line.startswith("{") for line in proc.stderr.read().splitlines())  # json
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("doc", ["README.md"])
def test_the_readme_says_how_to_apply_scale_and_connect(doc):
    text = (KUBE / doc).read_text()
    for needle in ("kubectl apply", "kubectl scale", "dns:///", "kubectl create secret"):
        assert needle in text, needle
