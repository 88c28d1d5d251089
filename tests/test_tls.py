"""TLS and mutual TLS against a real daemon, with certificates made here by ``openssl``."""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from support import ServerProcess

import millpond
from millpond.remote.shm import protocol
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

T = 10.0
ADMIN = "admin-" + secrets.token_urlsafe(24)
READ = "read-" + secrets.token_urlsafe(24)
FIELDS = {"x": ("float32", (2,))}


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=directory)


def make_cert(directory: Path, name: str, ca: str, san: str | None = None) -> None:
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    extra = []
    if san:
        (directory / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        extra = ["-extfile", f"{name}.ext"]
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *extra, cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A CA; a server certificate for localhost and 127.0.0.1; a client certificate it
    signed; and another CA that signed nothing here."""
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_ca(directory, "other-ca")
    make_cert(directory, "server", "ca", "DNS:localhost,IP:127.0.0.1")
    make_cert(directory, "client", "ca")
    return {f"{name}.{ext}": str(directory / f"{name}.{ext}")
            for name in ("ca", "other-ca", "server", "client") for ext in ("pem", "key")}


def token_file(directory: Path) -> str:
    path = directory / "tokens"
    path.write_text(f"read {READ}\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def tls_server(pki, tmp_path_factory):
    """TLS, and tokens: MILLPOND_TOKEN (admin), a read token."""
    tmp = tmp_path_factory.mktemp("tls")
    with ServerProcess(tmp / "data", "--tls-cert", pki["server.pem"], "--tls-key",
                       pki["server.key"], "--token-file", token_file(tmp),
                       env={"MILLPOND_TOKEN": ADMIN}) as proc:
        yield proc


@pytest.fixture(scope="module")
def mtls_server(pki, tmp_path_factory):
    """mTLS (client certificates signed by the CA: admin), and a read token."""
    tmp = tmp_path_factory.mktemp("mtls")
    with ServerProcess(tmp / "data", "--tls-cert", pki["server.pem"], "--tls-key",
                       pki["server.key"], "--tls-client-ca", pki["ca.pem"],
                       "--token-file", token_file(tmp), env={"MILLPOND_TOKEN": ""}) as proc:
        yield proc


def roundtrip(client: millpond.Client, name: str) -> None:
    buf = client.create_buffer(name, capacity=16, fields=FIELDS)
    buf.push_batch(x=np.arange(8, dtype=np.float32).reshape(4, 2))
    assert buf.sample(3, seed=0)["x"].shape == (3, 2)
    buf.close()  # created by this handle: deleted


@pytest.mark.parametrize("shm", [False, True], ids=["grpc", "shm"])
def test_a_tls_client_works(tls_server, pki, shm):
    client = millpond.connect(tls_server.address, tls_ca=pki["ca.pem"], token=ADMIN, shm=shm)
    roundtrip(client, f"tls-{shm}")
    assert client.transport == ("shm" if shm else "grpc")
    clone = pickle.loads(pickle.dumps(client))  # the settings travel, paths and token
    assert clone.credentials == client.credentials and clone.list_buffers() == []


def test_millpond_tls_ca_alone_turns_tls_on(tls_server, pki, monkeypatch):
    monkeypatch.setenv("MILLPOND_TLS_CA", pki["ca.pem"])
    monkeypatch.setenv("MILLPOND_TOKEN", ADMIN)
    client = millpond.connect(tls_server.address, shm=False)
    assert client.credentials.tls and client.credentials.tls_ca == pki["ca.pem"]
    roundtrip(client, "tls-env")
    plain = millpond.connect(tls_server.address, tls=False, shm=False, timeout=1)
    assert not plain.credentials.tls  # tls=False wins over the environment
    with pytest.raises(millpond.DeadlineExceededError):
        plain.list_buffers()


@pytest.mark.parametrize("how", ["plaintext", "unknown-ca"])
def test_a_client_that_cannot_speak_to_a_tls_server_fails_typed(tls_server, pki, how):
    settings = {"tls": False} if how == "plaintext" else {"tls_ca": pki["other-ca.pem"]}
    client = millpond.connect(tls_server.address, token=ADMIN, shm=False, timeout=1.5, **settings)
    started = time.monotonic()
    with pytest.raises(millpond.DeadlineExceededError, match="never reached") as caught:
        client.list_buffers()
    assert isinstance(caught.value, TimeoutError) and time.monotonic() - started < 5
    assert "TLS" in str(caught.value)


def test_mtls_without_a_client_certificate_is_refused(mtls_server, pki):
    client = millpond.connect(mtls_server.address, tls_ca=pki["ca.pem"], token=READ,
                              shm=False, timeout=1.5)
    with pytest.raises(millpond.DeadlineExceededError, match="never reached"):
        client.list_buffers()


def test_mtls_with_a_certificate_is_admin(mtls_server, pki):
    client = millpond.connect(mtls_server.address, tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"],
                              tls_key=pki["client.key"], token="", shm=False)
    roundtrip(client, "mtls-admin")  # creating and deleting need admin


def test_mtls_with_a_token_gets_the_tokens_role(mtls_server, pki):
    certs = dict(tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"], tls_key=pki["client.key"])
    admin = millpond.connect(mtls_server.address, token="", shm=False, **certs)
    owned = admin.create_buffer("mtls-read", capacity=16, fields=FIELDS)
    reader = millpond.connect(mtls_server.address, token=READ, shm=False, **certs)
    assert [b.name for b in reader.list_buffers()] == ["mtls-read"]
    with pytest.raises(millpond.PermissionDeniedError):
        reader.buffer("mtls-read").push_batch(x=np.zeros((1, 2), np.float32))
    with pytest.raises(millpond.PermissionDeniedError):
        reader.create_buffer("mtls-new", capacity=16, fields=FIELDS)
    wrong = millpond.connect(mtls_server.address, token="x" * 20, shm=False, **certs)
    with pytest.raises(millpond.AuthenticationError):  # a wrong token is not "no token"
        wrong.list_buffers()
    assert len(owned) == 0
    owned.close()


def test_a_certificate_alone_gets_the_fast_path_by_ticket(mtls_server, pki):
    certs = dict(tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"], tls_key=pki["client.key"])
    client = millpond.connect(mtls_server.address, token="", shm=True, **certs)
    buf = client.create_buffer("mtls-shm", capacity=16, fields=FIELDS)
    buf.push_batch(x=np.ones((4, 2), np.float32))
    assert buf.sample(2)["x"].shape == (2, 2)
    assert client.calls == {("shm", "push_batch"): 1, ("shm", "sample"): 1}
    buf.close()
    # With mTLS, Negotiate hands every caller a ticket, with a token or without.
    with grpc.secure_channel(mtls_server.address, grpc.ssl_channel_credentials(
            *(Path(pki[k]).read_bytes() for k in ("ca.pem", "client.key", "client.pem")))) as ch:
        stub = pb_grpc.ReplayStub(ch)
        request = pb.NegotiateRequest(boot_id=protocol.read_boot_id())
        offer = stub.Negotiate(request, timeout=T)
        with_token = stub.Negotiate(request, timeout=T, metadata=(("authorization", f"Bearer {READ}"),))
    assert offer.shm and len(offer.ticket) >= 32 and with_token.shm and len(with_token.ticket) >= 32
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(T)
        sock.connect("\0" + offer.socket)

        def call(message):
            protocol.send(sock, message)
            reply, fds = protocol.recv(sock)
            protocol.close_fds(fds)
            return reply

        hello = {"op": "hello", "version": protocol.VERSION}
        forged = offer.ticket[:-1] + ("A" if offer.ticket[-1] != "A" else "B")
        assert call({**hello, "ticket": forged})["code"] == "UNAUTHENTICATED"
        assert call({**hello, "ticket": offer.ticket})["ok"] is True
        assert call({"op": "result_segment", "size": 1 << 20})["ok"] is True  # admin's ticket


# ---- the CLI, and settings that cannot work --------------------------------------------

def run_cli(*args: str, env: dict):
    base = {k: v for k, v in os.environ.items() if not k.startswith("MILLPOND_")}
    return subprocess.run([sys.executable, "-m", "millpond_server", *args], capture_output=True,
                          text=True, timeout=60, env={**base, **env})


def test_info_and_health_take_the_tls_variables(tls_server, mtls_server, pki):
    tls_env = {"MILLPOND_TLS_CA": pki["ca.pem"]}
    info = run_cli("info", "--address", tls_server.address, env={**tls_env, "MILLPOND_TOKEN": ADMIN})
    assert info.returncode == 0 and "no buffers" in info.stdout, info.stderr
    health = run_cli("health", "--address", tls_server.address, env=tls_env)
    assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
    plain = run_cli("health", "--address", tls_server.address, "--timeout", "2", env={})
    assert plain.returncode == 1 and "cannot reach" in plain.stderr
    mtls_env = {**tls_env, "MILLPOND_TLS_CERT": pki["client.pem"],
                "MILLPOND_TLS_KEY": pki["client.key"]}
    info = run_cli("info", "--address", mtls_server.address, env=mtls_env)  # admin by certificate
    assert info.returncode == 0, info.stderr
    bad = run_cli("info", "--address", mtls_server.address,
                  env={**tls_env, "MILLPOND_TLS_CERT": pki["client.pem"]})
    assert bad.returncode == 2 and "MILLPOND_TLS_KEY" in bad.stderr


def test_client_tls_settings_are_checked_at_connect(pki, tmp_path):
    with pytest.raises(millpond.InvalidConfigError, match="go together"):
        millpond.connect("localhost:1", tls_cert=pki["client.pem"])
    with pytest.raises(millpond.InvalidConfigError, match="contradicts"):
        millpond.connect("localhost:1", tls=False, tls_ca=pki["ca.pem"])
    with pytest.raises(millpond.InvalidConfigError, match="TLS files"):
        millpond.connect("localhost:1", tls_ca=tmp_path / "absent.pem")
    with pytest.raises(millpond.InvalidConfigError, match="TLS files"):  # key of another cert
        millpond.connect("localhost:1", tls_cert=pki["client.pem"], tls_key=pki["server.key"])


def serve(*args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MILLPOND_")}
    return subprocess.run([sys.executable, "-m", "millpond_server", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=60, env=base)


@pytest.mark.daemon
@pytest.mark.parametrize("case", ["cert-alone", "ca-alone", "wrong-key", "tls-is-not-auth"])
def test_the_server_refuses_tls_settings_that_cannot_work(pki, tmp_path, case):
    args = {
        "cert-alone": ["--tls-cert", pki["server.pem"]],
        "ca-alone": ["--tls-client-ca", pki["ca.pem"]],
        "wrong-key": ["--tls-cert", pki["server.pem"], "--tls-key", pki["client.key"]],
        # TLS protects the channel but authenticates nobody: beyond loopback it needs more.
        "tls-is-not-auth": ["--host", "0.0.0.0", "--tls-cert", pki["server.pem"], "--tls-key",
                            pki["server.key"]],
    }[case]
    result = serve(*args, "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2, result.stderr
    expected = {"cert-alone": "go together", "ca-alone": "--tls-client-ca needs",
                "wrong-key": "--tls-key", "tls-is-not-auth": "--tls-client-ca"}[case]
    assert expected in result.stderr
