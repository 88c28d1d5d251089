"""docker/kubernetes/: the manifests parse and fit together; every pod and container is
hardened; the NetworkPolicy lets clients reach gRPC and the monitoring namespace the
metrics, nothing else; the daemon reads its tokens from a Secret volume it accepts (0440)
and each client pod gets its own role's token only; the container command line is one
``millpond serve`` accepts (run as written); the README's commands make the Secrets the
manifests use.

Structural checks, on the parsed YAML: no Kubernetes API server here, and ``kubectl``
validates only against one (kubeconform is not installed). Where ``kubectl`` exists, its
offline ``create secret --dry-run=client`` runs the README's token commands.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_cli import DOCKERFILE, dockerfile_image_config

import millpond
from millpond_server.auth import MIN_TOKEN_CHARS, ROLES, TOKEN_FILE_REFUSED, read_token_file
from millpond_server.cli import build_parser
from millpond_server.config import SERVE_OPTIONS, ServeConfig, resolve_serve_config

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "docker" / "kubernetes"
README = KUBE / "README.md"
BIN = Path(sys.executable).parent
CLIENT_LABEL = ("millpond-client", "true")  # what the NetworkPolicy admits to gRPC
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
TOKENS_SECRET = "millpond-tokens"  # the daemon's token file
ROLE_SECRETS = {role: f"millpond-{role}" for role in ROLES}  # one token each, for clients
WORKLOADS = ("StatefulSet", "Deployment", "Job", "DaemonSet", "ReplicaSet")


# ---- reading the manifests --------------------------------------------------------------

def objects() -> dict[tuple[str, str], tuple[str, dict]]:
    """(kind, name) -> (file name, object), of every YAML file here."""
    found: dict[tuple[str, str], tuple[str, dict]] = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in found, f"{key} twice"
                found[key] = (path.name, doc)
    return found


def get(kind: str, name: str = "millpond") -> dict:
    return objects()[(kind, name)][1]


def in_file(name: str) -> set[tuple[str, str]]:
    return {key for key, (file, _) in objects().items() if file == name}


def pod_templates() -> Iterator[tuple[str, str, dict]]:
    """(file, "Kind/name", pod template) of every workload."""
    for (kind, name), (file, doc) in objects().items():
        if kind in WORKLOADS:
            yield file, f"{kind}/{name}", doc["spec"]["template"]
        elif kind == "CronJob":
            yield file, f"{kind}/{name}", doc["spec"]["jobTemplate"]["spec"]["template"]
        elif kind == "Pod":
            yield file, f"{kind}/{name}", doc


def all_containers(pod: dict) -> list[dict]:
    return [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]


def daemon_pod() -> dict:
    return get("StatefulSet")["spec"]["template"]


def container() -> dict:
    (only,) = daemon_pod()["spec"]["containers"]
    return only


def container_env(data_dir: Path | None = None) -> dict[str, str]:
    """The daemon container's environment: plain values only (no token variable)."""
    env = {}
    for item in container().get("env", []):
        assert "value" in item, f"{item['name']} comes from elsewhere"
        env[item["name"]] = str(item["value"])
    if data_dir is not None:
        env["MILLPOND_DATA_DIR"] = str(data_dir)
    return env


def serve_config() -> ServeConfig:
    """What the daemon resolves from the container's arguments, its environment and the
    image's."""
    _, image_env, _ = dockerfile_image_config()
    args = build_parser().parse_args(["serve", *container()["args"]])
    return resolve_serve_config(args, environ={**image_env, **container_env()})


def probe_port(probe: dict) -> int:
    port = probe["grpc"]["port"]
    return named_port(port) if isinstance(port, str) else port


def named_port(name: str) -> int:
    return next(p["containerPort"] for p in container()["ports"] if p["name"] == name)


def secrets_of(pod: dict) -> set[str]:
    """Every Secret a pod's containers can read: env, envFrom, volumes (projected too)."""
    names = set()
    for c in all_containers(pod):
        for item in c.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
        for item in c.get("envFrom", []):
            if "secretRef" in item:
                names.add(item["secretRef"]["name"])
    for volume in pod["spec"].get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    return names


def token_volume() -> tuple[dict, dict]:
    """The daemon's token Secret volume and its mount."""
    (volume,) = [v for v in daemon_pod()["spec"]["volumes"]
                 if v.get("secret", {}).get("secretName") == TOKENS_SECRET]
    (mount,) = [m for m in container()["volumeMounts"] if m["name"] == volume["name"]]
    return volume, mount


def token_file_in_pod() -> PurePosixPath:
    volume, mount = token_volume()
    (item,) = volume["secret"]["items"]
    return PurePosixPath(mount["mountPath"]) / item["path"]


# ---- the manifests ----------------------------------------------------------------------

def test_manifests_parse_and_fit_together():
    assert in_file("millpond.yaml") == {("Service", "millpond"), ("StatefulSet", "millpond"),
                                        ("PodDisruptionBudget", "millpond"),
                                        ("NetworkPolicy", "millpond")}
    assert in_file("secret.yaml") == {("Secret", TOKENS_SECRET)} | {
        ("Secret", name) for name in ROLE_SECRETS.values()}
    assert in_file("create-buffers-job.yaml") == {("Job", "millpond-create-buffers")}
    assert in_file("clients-example.yaml") == {("Deployment", "millpond-actor"),
                                               ("Job", "millpond-learner")}
    service, sts, pdb = get("Service"), get("StatefulSet"), get("PodDisruptionBudget")
    labels = daemon_pod()["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    for selector in (service["spec"]["selector"], sts["spec"]["selector"]["matchLabels"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    ports = {p["name"] for p in container()["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    volumes = {v["name"] for v in daemon_pod()["spec"]["volumes"]}
    assert set(mounts) == claims | volumes and not claims & volumes
    data_dir = PurePosixPath(serve_config().data_dir)
    assert any(PurePosixPath(mounts[c]) in data_dir.parents for c in claims)  # on a claim
    assert pdb["spec"]["maxUnavailable"] == 1
    resources = container()["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    for name in (TOKENS_SECRET, *ROLE_SECRETS.values()):  # no token in the repository
        assert set(get("Secret", name)["stringData"].values()) == {""}, name


def test_container_arguments_and_environment_are_what_serve_accepts():
    """Parsed by the CLI's own parser and resolved as the daemon does; the probes, the
    metrics port and the grace period agree with what it resolves to."""
    known = {opt.env for opt in SERVE_OPTIONS}
    env = container_env()
    assert set(env) <= known, set(env) - known
    cfg = serve_config()
    spec = daemon_pod()["spec"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe_port(container()[kind]) == cfg.port, kind
    assert named_port("grpc") == cfg.port and named_port("metrics") == cfg.metrics_port
    annotations = daemon_pod()["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == cfg.metrics_port
    assert spec["terminationGracePeriodSeconds"] > cfg.grace
    assert cfg.host == "0.0.0.0" and cfg.log_format == "json"
    # Metrics on the pod's interfaces, for the monitoring namespace (the NetworkPolicy).
    assert cfg.metrics_host == "0.0.0.0"
    # Every token, admin's too, from the token file: none in the environment.
    assert cfg.token is None and cfg.token_file == Path(token_file_in_pod())
    assert "[metrics]" in DOCKERFILE.read_text()  # the image can serve --metrics-port


def test_every_pod_and_container_is_hardened():
    """Non-root (the image's uid for the image's pods), no privilege escalation, no
    capabilities, a read-only root filesystem with an emptyDir for /tmp, the runtime's
    seccomp profile, no service-account token, nothing of the host's."""
    image_uid = int(re.search(r"--uid (\d+)", DOCKERFILE.read_text()).group(1))
    templates = list(pod_templates())
    assert {name for _, name, _ in templates} == {
        "StatefulSet/millpond", "Job/millpond-create-buffers", "Deployment/millpond-actor",
        "Job/millpond-learner"}
    for _, name, pod in templates:
        spec = pod["spec"]
        pod_sc = spec.get("securityContext", {})
        assert spec.get("automountServiceAccountToken") is False, name
        assert not any(spec.get(key) for key in ("hostNetwork", "hostPID", "hostIPC")), name
        emptydirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in all_containers(pod):
            where = f"{name} container {c['name']}"
            sc = c.get("securityContext", {})
            merged = {**pod_sc, **sc}  # the container's settings win over the pod's
            assert merged.get("runAsNonRoot") is True, where
            assert isinstance(merged.get("runAsUser"), int) and merged["runAsUser"] > 0, where
            if c["image"].split(":")[0].rsplit("/", 1)[-1] == "millpond":
                assert merged["runAsUser"] == image_uid, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("privileged", False) is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert merged.get("seccompProfile") == {"type": "RuntimeDefault"}, where
            assert pod_sc.get("seccompProfile") == {"type": "RuntimeDefault"}, where
            tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert [m["name"] for m in tmp] and tmp[0]["name"] in emptydirs, where


def test_the_daemon_writes_only_where_it_has_a_volume():
    """With a read-only root filesystem: the data directory is on the claim and the
    address file (the image's MILLPOND_ADDRESS_FILE) on the /tmp emptyDir."""
    cfg = serve_config()
    writable = {PurePosixPath(m["mountPath"]) for m in container()["volumeMounts"]
                if not m.get("readOnly")}
    for path in (cfg.data_dir, cfg.address_file):
        assert path is not None
        assert writable & set(PurePosixPath(path).parents), path
    assert daemon_pod()["spec"]["securityContext"]["fsGroup"] == \
        container()["securityContext"]["runAsGroup"]  # the claim is writable by the group


def test_the_network_policy_admits_clients_to_grpc_and_monitoring_to_metrics_only():
    policy = get("NetworkPolicy")["spec"]
    labels = daemon_pod()["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert "matchExpressions" not in policy["podSelector"]
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    assert not policy.get("egress")  # the daemon opens no connection

    def ports(rule: dict) -> set[int]:
        assert rule.get("ports"), "a rule without ports opens every port"
        found = set()
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP" and "endPort" not in port
            found.add(named_port(port["port"]) if isinstance(port["port"], str) else port["port"])
        return found

    cfg = serve_config()
    rules = {frozenset(ports(rule)): rule["from"] for rule in policy["ingress"]}
    assert set(rules) == {frozenset({cfg.port}), frozenset({cfg.metrics_port})}
    assert {p["containerPort"] for p in container()["ports"]} == {cfg.port, cfg.metrics_port}
    # gRPC: pods of this namespace with the client label; no other namespace, no address.
    assert rules[frozenset({cfg.port})] == [{"podSelector": {"matchLabels": dict([CLIENT_LABEL])}}]
    # Metrics: Prometheus pods of the monitoring namespace only.
    metrics = rules[frozenset({cfg.metrics_port})]
    assert metrics and all(set(peer) == {"namespaceSelector", "podSelector"} for peer in metrics)
    assert all(peer["namespaceSelector"] == {"matchLabels": MONITORING} for peer in metrics)
    assert all(peer["podSelector"].get("matchLabels") for peer in metrics)
    # Every client pod carries the label; the shards do not (they never call each other).
    for _, name, pod in pod_templates():
        client = pod["metadata"]["labels"].get(CLIENT_LABEL[0]) == CLIENT_LABEL[1]
        assert client == (name != "StatefulSet/millpond"), name


def test_the_token_file_comes_from_a_secret_mounted_0440_and_passed_as_token_file():
    """The kubelet makes a Secret volume's files 0440 under the pod's fsGroup (it adds group
    read to defaultMode): the daemon must accept that mode, and the manifest says it."""
    volume, mount = token_volume()
    mode = volume["secret"]["defaultMode"]
    assert mode == 0o440
    assert not [bit for bit, _ in TOKEN_FILE_REFUSED if (mode | 0o440) & bit]
    assert mount.get("readOnly") is True
    assert "subPath" not in mount  # an updated Secret reaches the pod (SIGHUP reloads it)
    (item,) = volume["secret"]["items"]
    assert item["key"] in get("Secret", TOKENS_SECRET)["stringData"]
    args = container()["args"]
    assert args[args.index("--token-file") + 1] == str(token_file_in_pod())
    assert secrets_of(daemon_pod()) == {TOKENS_SECRET}  # no MILLPOND_TOKEN, no role Secret


def test_each_client_pod_gets_only_its_roles_token():
    """An actor gets the actor token, a learner the learner token, as MILLPOND_TOKEN; no
    example client gets the admin token or the daemon's file. Only the job that creates
    the buffers gets the admin token."""
    examples = {name: pod for file, name, pod in pod_templates() if file == "clients-example.yaml"}
    assert {pod["metadata"]["labels"]["millpond-role"] for pod in examples.values()} == \
        {"actor", "learner"}
    for name, pod in examples.items():
        for c in all_containers(pod):
            assert not secrets_of({"spec": {"containers": [c]}}) & {ROLE_SECRETS["admin"],
                                                                      TOKENS_SECRET}, name
    admins = set()
    for _, name, pod in pod_templates():
        if name == "StatefulSet/millpond":
            continue
        role = pod["metadata"]["labels"]["millpond-role"]
        secret = ROLE_SECRETS[role]
        assert secrets_of(pod) == {secret}, name
        for c in all_containers(pod):
            (token,) = [item for item in c.get("env", []) if item["name"] == "MILLPOND_TOKEN"]
            assert token["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "token"}, name
        assert "token" in get("Secret", secret)["stringData"]
        if role == "admin":
            admins.add(name)
    assert admins == {"Job/millpond-create-buffers"}
    # The admin Job creates and keeps: release(), not close() (which deletes what it made).
    (job,) = get("Job", "millpond-create-buffers")["spec"]["template"]["spec"]["containers"]
    assert "create_buffer(" in job["args"][0] and ").release()" in job["args"][0]


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
    """The image's entrypoint with the container's arguments and environment, as written,
    the token file as the kubelet mounts it (mode 0440); a port another process holds on
    this shared host is swapped for a free one, the token file's path for the local file."""
    entrypoint, image_env, _ = dockerfile_image_config()
    args = [str(a) for a in container()["args"]]
    grpc_port, metrics_port = probe_port(container()["readinessProbe"]), named_port("metrics")
    for port in (grpc_port, metrics_port):
        if not _free(port):
            args[args.index(str(port))] = str(_any_port())
    tokens = {role: f"{role}-kubernetes-test-token-0123456789" for role in ROLES}
    token_file = tmp_path / "secret" / token_file_in_pod().name
    token_file.parent.mkdir()
    token_file.write_text("".join(f"{role} {token}\n" for role, token in tokens.items()))
    token_file.chmod(token_volume()[0]["secret"]["defaultMode"])
    args[args.index(str(token_file_in_pod()))] = str(token_file)
    cfg = resolve_serve_config(build_parser().parse_args(["serve", *args]), environ={})
    grpc_port, metrics_port = cfg.port, cfg.metrics_port
    env = {key: value for key, value in os.environ.items() if not key.startswith("MILLPOND_")}
    env = {**env, **image_env, **container_env(tmp_path / "data" / "millpond"),
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
        client = millpond.connect(f"127.0.0.1:{grpc_port}", token=tokens["read"], shm=False)
        assert client.list_buffers() == []  # the file's tokens are the ones served
        client.close()
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        grace = daemon_pod()["spec"]["terminationGracePeriodSeconds"]
        assert proc.wait(grace) == 0 and time.monotonic() - start < grace
        assert all(line.startswith("{") for line in proc.stderr.read().splitlines())  # json
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the README -------------------------------------------------------------------------

def test_the_readme_says_how_to_apply_scale_connect_and_restrict():
    text = README.read_text()
    for needle in ("kubectl apply", "kubectl scale", "dns:///", "kubectl create secret",
                   "--from-file=token=/dev/stdin", "MILLPOND_TOKEN", 'millpond-client: "true"',
                   "monitoring", "app.kubernetes.io/name: prometheus", "defaultMode: 0440",
                   "--metrics-host 127.0.0.1", "kill -s HUP 1"):
        assert needle in text, needle


def test_the_readme_table_names_every_object_and_its_file():
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `")]
    for (kind, name), (file, _) in objects().items():
        assert any(row.startswith(f"| `{file}` |") and f"`{kind}/{name}`" in row
                   for row in rows), f"{file}: {kind}/{name}"
    named = {m for row in rows for m in re.findall(r"`(\w+/[\w-]+)`", row)}
    assert named == {f"{kind}/{name}" for kind, name in objects()}  # nothing stale


SHIM = """#!{python}
# kubectl create secret generic NAME --from-file=KEY=SOURCE: the Secret as JSON, in
# $KUBECTL_OUT/NAME.json. With $REAL_KUBECTL, kubectl makes it (--dry-run=client: no
# cluster); else this script does.
import base64, json, os, subprocess, sys
args = sys.argv[1:]
if (args[:3] != ["create", "secret", "generic"] or len(args) != 5
        or not args[4].startswith("--from-file=")):
    sys.exit(f"kubectl shim: unexpected arguments {{args}}")
name, (key, _, source) = args[3], args[4][len("--from-file="):].partition("=")
if os.environ.get("REAL_KUBECTL"):
    made = subprocess.run([os.environ["REAL_KUBECTL"], *args, "--dry-run=client", "-o", "json"],
                          stdout=subprocess.PIPE, check=True)
    secret = json.loads(made.stdout)
else:
    with open(source, "rb") as f:
        secret = {{"kind": "Secret", "metadata": {{"name": name}},
                  "data": {{key: base64.b64encode(f.read()).decode()}}}}
with open(os.path.join(os.environ["KUBECTL_OUT"], name + ".json"), "w") as f:
    json.dump(secret, f)
"""


@pytest.mark.parametrize("kubectl", ["shim", "kubectl"])
def test_the_readmes_token_commands_make_the_secrets_the_manifests_use(tmp_path, kubectl):
    """The README's bash block, run: every role's Secret holds one token (no newline), and
    the daemon's token file, mounted 0440, holds each role's token on that role's line."""
    if shutil.which("bash") is None or shutil.which("openssl") is None:
        pytest.skip("needs bash and openssl")
    real = shutil.which("kubectl") if kubectl == "kubectl" else None
    if kubectl == "kubectl" and real is None:
        pytest.skip("no kubectl here (the shim's run checks the same)")
    (script,) = [block for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
                 if TOKENS_SECRET in block]
    shim = tmp_path / "bin" / "kubectl"
    shim.parent.mkdir()
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(stat.S_IRWXU)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
           "KUBECTL_OUT": str(out), **({"REAL_KUBECTL": real} if real else {})}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made: dict[str, dict[str, bytes]] = {}
    for path in out.glob("*.json"):
        secret: dict[str, Any] = json.loads(path.read_text())
        assert secret["kind"] == "Secret"
        made[secret["metadata"]["name"]] = {key: base64.b64decode(value)
                                           for key, value in secret["data"].items()}
    assert set(made) == {TOKENS_SECRET, *ROLE_SECRETS.values()}
    tokens = {}
    for role, name in ROLE_SECRETS.items():
        token = made[name]["token"].decode()
        assert len(token) >= MIN_TOKEN_CHARS and re.fullmatch(r"[!-~]+", token), (role, token)
        tokens[role] = token
    assert len(set(tokens.values())) == len(ROLES)
    volume, _ = token_volume()
    (item,) = volume["secret"]["items"]
    token_file = tmp_path / "tokens"
    token_file.write_bytes(made[TOKENS_SECRET][item["key"]])
    token_file.chmod(volume["secret"]["defaultMode"])
    assert sorted(entry[:2] for entry in read_token_file(token_file)) == sorted(tokens.items())
