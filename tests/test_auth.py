"""Authentication and roles against a real daemon: tokens, the role table on every RPC
and on the fast path, the safe default, token files, the CLI, pickled clients."""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerProcess, without_stats

import millpond
from millpond.core import BufferConfig
from millpond.remote.grpc_transport import GrpcTransport
from millpond.remote.shm import protocol
from millpond.v1 import replay_pb2 as pb
from millpond.v1 import replay_pb2_grpc as pb_grpc
from millpond.wire.codec import encode_batch

T = 10.0  # seconds: the deadline of every call here
ROLES = ("admin", "actor", "learner", "read")
TOKENS = {role: f"{role}-{secrets.token_urlsafe(24)}" for role in ROLES}
WRONG = "not-" + secrets.token_urlsafe(24)
FIELDS = {"x": ("float32", (2,))}
CONFIG = BufferConfig.build(capacity=64, fields=FIELDS, prioritized=True)
SCHEMA = CONFIG.schema
ALL = set(ROLES)
# RPC -> the roles that may call it (the issue's table).
ALLOWED = {
    "CreateNew": {"admin"}, "CreateAttach": ALL, "Push": {"admin", "actor"},
    "PushBatch": {"admin", "actor"}, "Sample": {"admin", "learner"},
    "UpdatePriorities": {"admin", "learner"}, "SetBeta": {"admin", "learner"},
    "Delete": {"admin"}, "Info": ALL, "List": ALL, "Negotiate": ALL,
    "Reset": {"admin", "learner"},  # an on-policy learner empties what it trained on
}


def bearer(token: str | None):
    return None if token is None else (("authorization", f"Bearer {token}"),)


def write_token_file(path, lines: str, mode: int = 0o600):
    path.write_text(lines)
    path.chmod(mode)
    return path


def serve_cli(*args: str, env: dict | None = None, timeout: float = 60):
    """``millpond serve`` expected to refuse to start: its exit code and stderr."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MILLPOND_")}
    return subprocess.run([sys.executable, "-m", "millpond_server", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})})


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """A daemon with MILLPOND_TOKEN (admin) and a token file for the other roles."""
    tmp = tmp_path_factory.mktemp("auth")
    lines = "# roles of the test daemon\n\n" + "".join(
        f"{role} {TOKENS[role]}\n" for role in ("actor", "learner", "read"))
    token_file = write_token_file(tmp / "tokens", lines)
    with ServerProcess(tmp / "data", "--token-file", str(token_file),
                       env={"MILLPOND_TOKEN": TOKENS["admin"]}) as proc:
        yield proc


HEALTH_CHECK = "/grpc.health.v1.Health/Check"


class StatusRecorder(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Records the gRPC status of every call made through its channel: of a call sent
    as a message on a stream (PushBatch, Sample), OK per reply, or the status that
    ended the stream."""

    def __init__(self):
        self.codes: list[grpc.StatusCode] = []

    def intercept_unary_unary(self, continuation, details, request):
        outcome = continuation(details, request)
        if details.method != HEALTH_CHECK:  # (a client checks the server is reachable first)
            self.codes.append(outcome.code())
        return outcome

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return RecordedStream(continuation(details, request_iterator), self.codes)


class RecordedStream:
    """A stream's replies, each recorded as it comes (see StatusRecorder)."""

    def __init__(self, replies, codes: list):
        self.replies, self.codes = replies, codes

    def __iter__(self):
        return self

    def __next__(self):
        try:
            reply = next(self.replies)
        except grpc.RpcError as exc:
            self.codes.append(exc.code())
            raise
        self.codes.append(grpc.StatusCode.OK)
        return reply

    def cancel(self):
        return self.replies.cancel()


@pytest.fixture
def transport_as(auth_server):
    """``transport_as(token)``: the client's gRPC transport with that token, and its recorder."""
    channels = []

    def make(token):
        recorder = StatusRecorder()
        channel = grpc.insecure_channel(auth_server.address)
        channels.append(channel)
        return GrpcTransport(grpc.intercept_channel(channel, recorder), 64 << 20,
                             bearer(token)), recorder

    yield make
    for channel in channels:
        channel.close()


def fingerprint(admin: GrpcTransport, name: str):
    """What a refused call must leave as it was: info (less call statistics; with size,
    pushed, beta) and what a seeded sample draws (which depends on every record and
    priority)."""
    info = admin.info(name, T)
    drawn = admin.sample(name, SCHEMA, 8, 123, True, 0.0, T)
    return without_stats(dict(info)), {k: v.tolist() for k, v in drawn.items()}


def call(rpc: str, t: GrpcTransport, name: str, indices: np.ndarray):
    """Make ``rpc`` on buffer ``name``; return something to check on success."""
    if rpc == "CreateNew":
        return t.create(name + "-new", CONFIG, T)[1]
    if rpc == "CreateAttach":
        return t.create(name, CONFIG, T)[1]
    if rpc == "Push":
        record = pb.PushRequest(name=name, record=encode_batch({"x": np.ones(2, np.float32)}))
        return t.invoke(t.stub.Push, record, T).pushed
    if rpc == "PushBatch":
        return t.push_batch(name, SCHEMA, 3, {"x": np.ones((3, 2), np.float32)}, None, 0.0, T)
    if rpc == "Sample":
        return len(t.sample(name, SCHEMA, 4, 0, True, 0.0, T)["x"])
    if rpc == "UpdatePriorities":
        return t.update_priorities(name, indices, np.full(len(indices), 7.0), T)
    if rpc == "SetBeta":
        return t.set_beta(name, 0.9, T)
    if rpc == "Delete":
        return t.delete(name, T)
    if rpc == "Reset":
        return t.reset(name, T)
    if rpc == "Info":
        return t.info(name, T).size
    if rpc == "List":
        return [b.name for b in t.list(T)]
    assert rpc == "Negotiate"
    return t.negotiate(protocol.read_boot_id(), T).shm


@pytest.mark.parametrize("who", [None, "wrong", *ROLES])
@pytest.mark.parametrize("rpc", list(ALLOWED))
def test_every_rpc_obeys_the_role_table(transport_as, rpc, who, request):
    admin, _ = transport_as(TOKENS["admin"])
    name = f"t-{rpc}-{who}".lower()
    admin.create(name, CONFIG, T)
    admin.push_batch(name, SCHEMA, 10, {"x": np.arange(20, dtype=np.float32).reshape(10, 2)},
                     np.arange(1, 11, dtype=np.float64), 0.0, T)
    indices = admin.sample(name, SCHEMA, 4, 0, True, 0.0, T)["indices"]
    before = fingerprint(admin, name)
    token = {None: None, "wrong": WRONG}.get(who, TOKENS.get(who or ""))
    t, recorder = transport_as(token)

    if who in ALLOWED[rpc]:
        result = call(rpc, t, name, indices)
        assert recorder.codes[-1] == grpc.StatusCode.OK
        if rpc == "CreateNew":
            assert result is True  # created
            admin.delete(name + "-new", T)
        if rpc == "CreateAttach":
            assert result is False  # attached, never created
        if rpc == "Reset":
            assert admin.info(name, T).size == 0 and admin.info(name, T).pushed == 10
        if rpc == "Delete":
            with pytest.raises(millpond.BufferNotFoundError):
                admin.info(name, T)
            return
    else:
        expected, status = (
            (millpond.AuthenticationError, grpc.StatusCode.UNAUTHENTICATED) if who in (None, "wrong")
            else (millpond.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED))
        with pytest.raises(expected) as caught:
            call(rpc, t, name, indices)
        assert type(caught.value) is expected and isinstance(caught.value, millpond.ReplayError)
        assert recorder.codes == [status]  # refused at once, not retried
        if rpc == "CreateNew":
            with pytest.raises(millpond.BufferNotFoundError):
                admin.info(name + "-new", T)
        assert fingerprint(admin, name) == before  # the refused call changed nothing
    admin.delete(name, T)


def test_create_attach_needs_the_same_config(auth_server):
    admin = millpond.connect(auth_server.address, token=TOKENS["admin"], shm=False)
    admin.create_buffer("attach-cfg", capacity=16, fields=FIELDS)
    actor = millpond.connect(auth_server.address, token=TOKENS["actor"], shm=False)
    with pytest.raises(millpond.ConfigMismatchError, match="capacity"):  # not an attach
        actor.create_buffer("attach-cfg", capacity=32, fields=FIELDS)
    with pytest.raises(millpond.PermissionDeniedError, match="admin"):  # nor a creation
        actor.create_buffer("attach-cfg-new", capacity=32, fields=FIELDS)
    handle = actor.create_buffer("attach-cfg", capacity=16, fields=FIELDS)  # same: attaches
    handle.push_batch(x=np.ones((2, 2), np.float32))
    handle.close()  # only releases: an attached handle never deletes
    assert len(admin.buffer("attach-cfg")) == 2
    admin.delete_buffer("attach-cfg")


def test_the_classes_and_connect_take_the_token(auth_server, monkeypatch):
    address = auth_server.address
    monkeypatch.delenv("MILLPOND_TOKEN", raising=False)
    owner = millpond.MmapReplayBuffer(8, 16, obs_dim=2, act_dim=1, address=address, name="cls",
                                      token=TOKENS["admin"], create=True)  # (else: on a write)
    actor = millpond.MmapReplayBuffer(8, 16, obs_dim=2, act_dim=1, address=address, name="cls",
                                      token=TOKENS["actor"])
    actor.push(np.zeros(2), np.zeros(1), 1.0, False, False, np.ones(2))
    actor.flush()
    with pytest.raises(millpond.PermissionDeniedError):
        actor.sample(1)
    with pytest.raises(millpond.PermissionDeniedError):  # only admin creates
        millpond.ReplayBuffer(8, obs_dim=2, act_dim=1, address=address, name="cls-new",
                              token=TOKENS["learner"], create=True)
    missing = millpond.ReplayBuffer(8, obs_dim=2, act_dim=1, address=address, name="cls-new",
                                    token=TOKENS["learner"])  # create=None: on a write
    with pytest.raises(millpond.BufferNotFoundError):  # a read never creates
        missing.sample(1)
    with pytest.raises(millpond.PermissionDeniedError):  # its first write would
        missing.push_batch(np.zeros((1, 2)), np.ones((1, 2)), np.zeros((1, 1)), np.ones(1),
                           np.zeros(1), np.zeros(1))
    missing.release()
    with pytest.raises(millpond.AuthenticationError):  # no token at all
        millpond.ReplayBuffer(8, obs_dim=2, act_dim=1, address=address, name="cls")
    monkeypatch.setenv("MILLPOND_TOKEN", TOKENS["learner"])  # the default
    prio = millpond.PrioritizedReplayBuffer(8, obs_dim=2, act_dim=1, address=address,
                                            name="cls-prio", token=TOKENS["admin"], create=True)
    learner = millpond.PrioritizedReplayBuffer(8, obs_dim=2, act_dim=1, address=address,
                                               name="cls-prio")
    prio.push(np.zeros(2), np.zeros(1), 1.0, False, False, np.ones(2))
    prio.flush()
    assert learner.sample(1)["weights"].shape == (1,)
    assert len(owner) == 1
    owner.close()
    prio.close()


def test_pickled_clients_carry_their_token(auth_server, monkeypatch):
    monkeypatch.setenv("MILLPOND_TOKEN", TOKENS["actor"])
    client = millpond.connect(auth_server.address, shm=False)
    explicit = millpond.connect(auth_server.address, token=TOKENS["learner"], shm=False)
    monkeypatch.setenv("MILLPOND_TOKEN", TOKENS["read"])  # a child's environment may differ
    for original, role in ((client, "actor"), (explicit, "learner")):
        assert TOKENS[role] not in repr(original) and TOKENS[role] not in repr(original.credentials)
        clone = pickle.loads(pickle.dumps(original))
        assert clone.credentials.token == TOKENS[role]
        assert clone.list_buffers() is not None
    none = pickle.loads(pickle.dumps(millpond.connect(auth_server.address, token="", shm=False)))
    with pytest.raises(millpond.AuthenticationError):  # token="" sends none, env or not
        none.list_buffers()


# ---- the fast path -------------------------------------------------------------------

@pytest.fixture
def shm_buffer(auth_server):
    admin = millpond.connect(auth_server.address, token=TOKENS["admin"], shm=False)
    name = "shm-" + secrets.token_hex(4)
    buf = admin.create_buffer(name, capacity=64, fields=FIELDS, prioritized=True)
    buf.push_batch(x=np.ones((8, 2), np.float32))
    yield name, buf
    buf.close()


def test_the_fast_path_obeys_the_role_table(auth_server, shm_buffer):
    name, admin_buf = shm_buffer
    before = without_stats(dict(admin_buf.info()))
    handles = {}
    for role in ("actor", "learner", "read"):
        client = millpond.connect(auth_server.address, token=TOKENS[role], shm=True)
        assert client.transport == "shm"  # the hello's token was accepted
        handles[role] = (client, client.buffer(name))
    for role in ("learner", "read"):  # may not push, not even over shm
        client, buf = handles[role]
        with pytest.raises(millpond.PermissionDeniedError):
            buf.push_batch(x=np.zeros((2, 2), np.float32))
    client, buf = handles["read"]
    with pytest.raises(millpond.PermissionDeniedError):
        buf.sample(2)
    with pytest.raises(millpond.PermissionDeniedError):
        buf.set_beta(0.7)
    assert client.calls == {}  # refused over shm, and not retried over gRPC
    assert without_stats(dict(admin_buf.info())) == before
    client, buf = handles["learner"]
    batch = buf.sample(4)
    buf.update_priorities(batch["indices"], np.full(4, 3.0))
    assert client.calls[("shm", "sample")] == 1 and client.calls[("shm", "update_priorities")] == 1
    client, buf = handles["actor"]
    buf.push_batch(x=np.zeros((2, 2), np.float32))
    with pytest.raises(millpond.PermissionDeniedError):
        buf.sample(2)
    assert client.calls == {("shm", "push_batch"): 1}
    assert len(admin_buf) == 10


@pytest.fixture
def raw_session(auth_server):
    """``(socket, call)``: a raw fast-path connection offered to an admin Negotiate."""
    with grpc.insecure_channel(auth_server.address) as channel:
        offer = pb_grpc.ReplayStub(channel).Negotiate(
            pb.NegotiateRequest(boot_id=protocol.read_boot_id()), timeout=T,
            metadata=bearer(TOKENS["admin"]))
    assert offer.shm and not offer.ticket  # a caller with a token presents the token
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(T)
    sock.connect("\0" + offer.socket)

    def call(message):
        protocol.send(sock, message)
        reply, fds = protocol.recv(sock)
        protocol.close_fds(fds)
        return reply

    yield call
    sock.close()


@pytest.mark.parametrize("hello", [{}, {"token": WRONG}, {"ticket": "forged"}, None],
                         ids=["no-token", "wrong-token", "forged-ticket", "no-hello"])
def test_a_fast_path_session_needs_a_token_or_ticket(raw_session, shm_buffer, hello):
    name, admin_buf = shm_buffer
    if hello is not None:
        reply = raw_session({"op": "hello", "version": protocol.VERSION, **hello})
        assert reply["ok"] is False and reply["code"] == "UNAUTHENTICATED"
    for request in ({"op": "result_segment", "size": 1 << 20},
                    {"op": "set_beta", "buffer": name, "beta": 0.9},
                    {"op": "sample", "buffer": name, "segment": 1, "offset": 0, "batch_size": 1}):
        reply = raw_session(request)
        assert reply["ok"] is False and reply["code"] == "UNAUTHENTICATED", reply
    assert admin_buf.info()["beta"] == 0.4
    reply = raw_session({"op": "hello", "version": protocol.VERSION, "token": TOKENS["read"]})
    assert reply["ok"] is True
    reply = raw_session({"op": "set_beta", "buffer": name, "beta": 0.9})
    assert reply["ok"] is False and reply["code"] == "PERMISSION_DENIED"
    reply = raw_session({"op": "hello", "version": protocol.VERSION, "token": TOKENS["learner"]})
    assert raw_session({"op": "set_beta", "buffer": name, "beta": 0.9})["ok"] is True
    assert admin_buf.info()["beta"] == 0.9


# ---- Negotiate from another host, health -----------------------------------------------

def test_negotiate_from_another_host_reveals_nothing(auth_server):
    with grpc.insecure_channel(auth_server.address) as channel:
        stub = pb_grpc.ReplayStub(channel)
        reply = stub.Negotiate(pb.NegotiateRequest(boot_id="another-host"), timeout=T,
                               metadata=bearer(TOKENS["admin"]))
        assert reply == pb.NegotiateReply(shm=False)  # no socket, uid, boot id, reason
        same = stub.Negotiate(pb.NegotiateRequest(boot_id=protocol.read_boot_id()), timeout=T,
                              metadata=bearer(TOKENS["read"]))
        assert same.shm and same.socket and same.boot_id == protocol.read_boot_id()
        with pytest.raises(grpc.RpcError) as caught:  # and nothing at all without a token
            stub.Negotiate(pb.NegotiateRequest(boot_id=protocol.read_boot_id()), timeout=T)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_negotiate_from_another_host_without_auth_reveals_nothing(server):
    with grpc.insecure_channel(server.address) as channel:
        reply = pb_grpc.ReplayStub(channel).Negotiate(pb.NegotiateRequest(boot_id=""), timeout=T)
    assert reply == pb.NegotiateReply(shm=False)
    client = millpond.connect(server.address)  # and the same host still gets the fast path
    assert client.transport == "shm"


def test_health_stays_open_without_a_token(auth_server):
    with grpc.insecure_channel(auth_server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=T)
    assert reply == health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


# ---- the CLI ---------------------------------------------------------------------------

def run_cli(*args: str, env: dict):
    base = {k: v for k, v in os.environ.items() if not k.startswith("MILLPOND_")}
    return subprocess.run([sys.executable, "-m", "millpond_server", *args], capture_output=True,
                          text=True, timeout=60, env={**base, **env})


def test_info_and_health_take_the_token_from_the_environment(auth_server, shm_buffer):
    name, _ = shm_buffer
    address = ["--address", auth_server.address]
    info = run_cli("info", *address, env={"MILLPOND_TOKEN": TOKENS["read"]})
    assert info.returncode == 0, info.stderr
    assert name in info.stdout
    refused = run_cli("info", *address, env={})
    assert refused.returncode == 1
    assert "UNAUTHENTICATED" in refused.stderr and "MILLPOND_TOKEN" in refused.stderr
    wrong = run_cli("info", *address, env={"MILLPOND_TOKEN": WRONG})
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr
    assert WRONG not in wrong.stderr + wrong.stdout
    health = run_cli("health", *address, env={})
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"


# ---- start-up: the safe default and token files ---------------------------------------

FIX_HINTS = ("MILLPOND_TOKEN", "--token-file", "--tls-client-ca", "--insecure")


@pytest.mark.daemon
def test_serving_beyond_loopback_without_auth_is_refused(tmp_path):
    result = serve_cli("--host", "0.0.0.0", "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2
    assert all(hint in result.stderr for hint in FIX_HINTS), result.stderr
    assert not (tmp_path / "data").exists()  # refused before touching anything


@pytest.mark.daemon
@pytest.mark.parametrize("how", ["insecure", "token", "token-file"])
def test_serving_beyond_loopback_with_auth_or_insecure(tmp_path, how):
    args, env = ["--host", "0.0.0.0"], {}
    if how == "insecure":
        args.append("--insecure")
    elif how == "token":
        env["MILLPOND_TOKEN"] = TOKENS["admin"]
    else:
        args += ["--token-file", str(write_token_file(tmp_path / "t", f"read {TOKENS['read']}\n"))]
    with ServerProcess(tmp_path / "data", *args, env=env) as srv:
        assert srv.address.startswith("0.0.0.0:")
        port = srv.address.rsplit(":", 1)[1]
        client = millpond.connect(f"127.0.0.1:{port}", token=env.get("MILLPOND_TOKEN", ""))
        if how == "token-file":
            with pytest.raises(millpond.AuthenticationError):
                client.list_buffers()
        else:
            assert client.list_buffers() == []


# Owner read/write and group read are allowed (a Kubernetes Secret volume under fsGroup is
# 0440); read by every user, or write by the group or every user, is refused.
ALLOWED_MODES = [0o600, 0o400, 0o640, 0o440, 0o700]
REFUSED_MODES = {0o644: "readable by every user", 0o604: "readable by every user",
                 0o444: "readable by every user", 0o620: "writable by its group",
                 0o460: "writable by its group", 0o660: "writable by its group",
                 0o602: "writable by every user", 0o666: "readable by every user and writable "
                 "by its group and writable by every user"}


@pytest.mark.parametrize("mode", ALLOWED_MODES, ids=oct)
def test_a_token_file_its_owner_or_group_may_read_is_accepted(tmp_path, mode):
    from millpond_server.auth import read_token_file

    path = write_token_file(tmp_path / "tokens", f"admin {TOKENS['admin']}\n", mode)
    assert [entry[:2] for entry in read_token_file(path)] == [("admin", TOKENS["admin"])]


@pytest.mark.parametrize("mode", list(REFUSED_MODES), ids=oct)
def test_a_token_file_every_user_may_read_or_others_may_write_is_refused_in_process(tmp_path,
                                                                                      mode):
    from millpond_server.auth import read_token_file
    from millpond_server.declared import ConfigError

    path = write_token_file(tmp_path / "tokens", f"admin {TOKENS['admin']}\n", mode)
    with pytest.raises(ConfigError) as caught:
        read_token_file(path)
    assert f"is {REFUSED_MODES[mode]} (mode {mode:04o})" in str(caught.value)


@pytest.mark.daemon
@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o444, 0o460, 0o602], ids=oct)
def test_a_token_file_every_user_may_read_or_others_may_write_is_refused(tmp_path, mode):
    path = write_token_file(tmp_path / "tokens", f"admin {TOKENS['admin']}\n", mode)
    result = serve_cli("--token-file", str(path), "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2
    assert str(path) in result.stderr and f"{mode:04o}" in result.stderr
    # It says what is allowed, and how to get there.
    assert "allowed: read and write for its owner, read for its group" in result.stderr
    assert f"chmod 600 {path}" in result.stderr
    assert TOKENS["admin"] not in result.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.daemon
def test_a_group_readable_token_file_as_a_kubernetes_secret_volume_serves(tmp_path):
    """0440, as the kubelet leaves a Secret volume's file under the pod's fsGroup."""
    path = write_token_file(tmp_path / "tokens", f"read {TOKENS['read']}\n", 0o440)
    with ServerProcess(tmp_path / "data", "--token-file", str(path)) as srv:
        assert millpond.connect(srv.address, token=TOKENS["read"]).list_buffers() == []
        with pytest.raises(millpond.AuthenticationError):
            millpond.connect(srv.address, token=WRONG).list_buffers()


MALFORMED = {
    "short token": ("admin abc\n", "at least 16"),
    "unknown role": (f"boss {TOKENS['admin']}\n", "unknown role"),
    "three words": (f"admin {TOKENS['admin']} extra\n", "ROLE TOKEN"),
    "one word": (f"{TOKENS['admin']}\n", "ROLE TOKEN"),
    "no tokens": ("# nothing here\n\n", "no 'ROLE TOKEN' line"),
    "two roles": (f"actor {TOKENS['actor']}\nlearner {TOKENS['actor']}\n", "one role"),
}


@pytest.mark.daemon
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_token_file_is_refused(tmp_path, case):
    text, message = MALFORMED[case]
    path = write_token_file(tmp_path / "tokens", text)
    result = serve_cli("--token-file", str(path), "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2
    assert message in result.stderr and str(path) in result.stderr, result.stderr
    assert TOKENS["admin"] not in result.stderr and TOKENS["actor"] not in result.stderr


@pytest.mark.daemon
def test_a_short_millpond_token_or_a_missing_file_is_refused(tmp_path):
    result = serve_cli("--data-dir", str(tmp_path / "d1"), env={"MILLPOND_TOKEN": "short"})
    assert result.returncode == 2 and "MILLPOND_TOKEN" in result.stderr
    assert "at least 16" in result.stderr
    missing = serve_cli("--token-file", str(tmp_path / "absent"), "--data-dir", str(tmp_path / "d2"))
    assert missing.returncode == 2 and "cannot open" in missing.stderr


def test_tickets_are_bound_to_a_role_and_bounded():
    from millpond_server.auth import MAX_TICKETS, Auth

    auth = Auth(mtls=True)
    first = auth.issue_ticket("learner")
    assert auth.hello_role({"op": "hello", "ticket": first}) == "learner"
    auth.check_op("learner", "sample")
    with pytest.raises(millpond.PermissionDeniedError):
        auth.check_op("learner", "push")
    with pytest.raises(millpond.AuthenticationError):
        auth.hello_role({"op": "hello", "ticket": first + "x"})
    for _ in range(MAX_TICKETS):  # the oldest are forgotten first
        auth.issue_ticket("admin")
    assert auth.ticket_role(first) is None
