"""Who may call what: tokens, roles, TLS credentials, fast-path tickets.

Authentication is on when the daemon has a token (``MILLPOND_TOKEN``, the
``admin`` role, and/or ``--token-file``) or requires client certificates
(``--tls-client-ca``). A call then needs ``authorization: Bearer TOKEN``
metadata naming a configured token, or (mTLS) a verified client certificate,
which stands for ``admin`` unless the call also carries a token. Without any
of these configured, auth is off and every call may do everything.

Roles (:data:`METHOD_ROLES`): ``admin`` everything; ``actor`` pushes;
``learner`` samples (records, sequences, episodes), reads records, updates
priorities, sets beta and resets a buffer (``Reset``: an on-policy learner
empties the buffer it has trained on, as objectrl's ``reset()``; it drops
records like a queue's samples do, but never the buffer, its config or
file); an actor also ends its episodes; ``read`` only
``Info`` and ``List``. Every role may ``Negotiate``, and ``Create`` when it
only attaches to an existing buffer of the same config (the operations layer
enforces that under the registry's lock); creating a new buffer, ``Delete``, and the
operators' ``Checkpoint`` and ``Repair`` need ``admin``.

The shared-memory fast path authenticates its ``hello`` with the client's token
or, with mTLS on, only with a ticket that ``Negotiate`` handed out over the
certified channel (bound to that call's role): the fast path sees no
certificate, so a token alone must not get past mTLS there. Each of its ops
needs the roles of the RPC it mirrors (:data:`FASTPATH_OPS`). gRPC calls are
authenticated on their metadata before their body is read (:mod:`.edge`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import ssl
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

import grpc

from millpond.errors import AuthenticationError, PermissionDeniedError

from .config import TOKEN_ENV, ServeConfig
from .declared import ConfigError

log = logging.getLogger("millpond.auth")

ADMIN, ACTOR, LEARNER, READ = "admin", "actor", "learner", "read"
ROLES = (ADMIN, ACTOR, LEARNER, READ)
_ALL = frozenset(ROLES)
MIN_TOKEN_CHARS = 16

# RPC -> the roles that may call it. Create: every role, but only admin may make a new buffer.
METHOD_ROLES: dict[str, frozenset[str]] = {
    "Create": _ALL,
    "Delete": frozenset({ADMIN}),
    "Push": frozenset({ADMIN, ACTOR}),
    "PushBatch": frozenset({ADMIN, ACTOR}),
    "Sample": frozenset({ADMIN, LEARNER}),
    "UpdatePriorities": frozenset({ADMIN, LEARNER}),
    "SetBeta": frozenset({ADMIN, LEARNER}),
    "UpdateEpisodes": frozenset({ADMIN, ACTOR}),  # writers end their episodes, give meta
    "SampleSequences": frozenset({ADMIN, LEARNER}),
    "SampleEpisodes": frozenset({ADMIN, LEARNER}),
    "EpisodeCatalog": frozenset({ADMIN, LEARNER}),
    "Read": frozenset({ADMIN, LEARNER}),
    "Reset": frozenset({ADMIN, LEARNER}),  # drops the records, keeps the buffer (see above)
    "Info": _ALL,
    "List": _ALL,
    "Negotiate": _ALL,
    "Checkpoint": frozenset({ADMIN}),  # writes files on the daemon's host (--backup-dir)
    "Repair": frozenset({ADMIN}),
}
# Streams whose every message is a call of their unary method: that method's roles.
METHOD_ROLES.update({"PushBatchStream": METHOD_ROLES["PushBatch"],
                     "SampleStream": METHOD_ROLES["Sample"]})
# Fast-path op -> the RPCs it serves: it needs the roles of one of them (a
# segment serves the ops that use it). Releasing a segment is always allowed.
FASTPATH_OPS: dict[str, tuple[str, ...]] = {
    "push": ("PushBatch",),
    "sample": ("Sample",),
    "update_priorities": ("UpdatePriorities",),
    "set_beta": ("SetBeta",),
    "sample_sequences": ("SampleSequences",),
    "sample_n_step": ("Sample",),
    "read": ("Read",),
    "push_segment": ("PushBatch", "UpdatePriorities", "Read"),
    "result_segment": ("Sample", "SampleSequences", "Read"),
    "release": (),
}
_OP_ROLES = {op: frozenset().union(*(METHOD_ROLES[rpc] for rpc in rpcs)) if rpcs else _ALL
             for op, rpcs in FASTPATH_OPS.items()}
# Tickets live this long after their last use, and at most this many at once.
TICKET_TTL_S = 24 * 3600.0
MAX_TICKETS = 10_000
_FIX = (f"set {TOKEN_ENV}, give --token-file FILE, or require client certificates with "
        "--tls-client-ca FILE")


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


class Auth:
    """The daemon's credentials and role table; see the module docstring.

    ``tokens``: token -> role; ``mtls``: gRPC clients present certificates
    the TLS layer has verified (each such caller is ``admin`` by default).
    """

    def __init__(self, tokens: dict[str, str] | None = None, mtls: bool = False):
        self.mtls = mtls
        self.replace_tokens(tokens or {})
        self._tickets: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def replace_tokens(self, tokens: dict[str, str]) -> None:
        """Use ``tokens`` (token -> role) from now on (SIGHUP: see :func:`reload_tokens`).
        One reference swap: a call checks against the old table or the new one."""
        # Digests, so every comparison takes the same time whatever the lengths.
        digests = [(_digest(token), role) for token, role in tokens.items()]
        self.roles = sorted(role for _, role in digests)  # what a reload reports: no tokens
        self._tokens = digests
        self.enabled = bool(digests) or self.mtls

    # ---- who is calling -------------------------------------------------------------

    def token_role(self, token: str) -> str | None:
        """The role of ``token``, compared in constant time with every configured token."""
        given, found = _digest(token), None
        for digest, role in self._tokens:  # no early exit
            if hmac.compare_digest(given, digest):
                found = role
        return found

    def _role(self, token: str | None, certified: bool) -> str:
        if token is not None:
            role = self.token_role(token)
            if role is None:
                raise AuthenticationError("the token this call carries is not one the server knows")
            return role
        if certified:
            return ADMIN
        raise AuthenticationError(
            "this server requires authentication: pass token= to millpond.connect (or set "
            f"{TOKEN_ENV})" + (", or a TLS client certificate (tls_cert=, tls_key=)"
                               if self.mtls else ""))

    def call_role(self, method: str, metadata: Iterable[Any] | None) -> str:
        """The role of a gRPC call to ``method`` from its metadata (checked before its
        body is read), if it may call ``method``; else the typed error. With mTLS on,
        the TLS layer has already refused every connection without a certificate it
        verified, so a call without a token is a certified caller's."""
        if not self.enabled:
            return ADMIN
        role = self._role(bearer_token(metadata), self.mtls)
        self.check(role, METHOD_ROLES.get(method, frozenset({ADMIN})), method)
        return role

    @staticmethod
    def check(role: str, allowed: Iterable[str], what: str) -> None:
        if role not in allowed:
            raise PermissionDeniedError(f"the {role!r} role may not call {what}")

    # ---- the fast path --------------------------------------------------------------

    def session_role(self) -> str | None:
        """A fast-path session's role before its hello: admin with auth off, else none."""
        return None if self.enabled else ADMIN

    def hello_role(self, message: dict[str, Any]) -> str:
        """The role a fast-path hello authenticates as: its ticket's, or its token's.

        With client certificates required (mTLS) only a ticket will do: the fast path
        sees no certificate, and a ticket is what Negotiate gave a caller over a channel
        that presented one. A token alone would let a token's holder without a
        certificate in."""
        if not self.enabled:
            return ADMIN
        token, ticket = message.get("token"), message.get("ticket")
        if isinstance(ticket, str):
            role = self.ticket_role(ticket)
            if role is None:
                raise AuthenticationError("fast-path ticket unknown or expired; negotiate again")
            return role
        if self.mtls:
            raise AuthenticationError(
                "this server requires client certificates (--tls-client-ca): a fast-path hello "
                "must present the ticket Negotiate issued over the certified gRPC channel; a "
                "token alone is not accepted")
        if isinstance(token, str):
            return self._role(token, False)
        raise AuthenticationError("this server requires a token or ticket in the fast-path hello")

    def check_op(self, role: str | None, op: str) -> None:
        """May a session of ``role`` run fast-path ``op``? Unknown ops: admin only."""
        if role is None:
            raise AuthenticationError("fast-path session not authenticated: hello first")
        self.check(role, _OP_ROLES.get(op, frozenset({ADMIN})), f"the fast path's {op}")

    def issue_ticket(self, role: str) -> str:
        """An unguessable ticket a fast-path hello may present to act as ``role``."""
        ticket = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            while self._tickets and (len(self._tickets) >= MAX_TICKETS
                                     or next(iter(self._tickets.values()))[1] < now):
                self._tickets.popitem(last=False)
            self._tickets[_digest(ticket)] = (role, now + TICKET_TTL_S)
        return ticket

    def ticket_role(self, ticket: str) -> str | None:
        key, now = _digest(ticket), time.monotonic()
        with self._lock:
            entry = self._tickets.get(key)
            if entry is None or entry[1] < now:
                return None
            self._tickets[key] = (entry[0], now + TICKET_TTL_S)  # used: keep it longer
            self._tickets.move_to_end(key)
            return entry[0]


def bearer_token(metadata: Iterable[Any] | None) -> str | None:
    """The token of the call's ``authorization: Bearer TOKEN`` metadata, if any.

    A malformed authorization header is an authentication failure, not "no token".
    """
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthenticationError("authorization metadata must be 'Bearer TOKEN'")
            return token.strip()
    return None


# ---- start-up: configuration ---------------------------------------------------------

def _configured_tokens(cfg: ServeConfig) -> dict[str, str]:
    """token -> role from ``--token`` and ``--token-file``; ConfigError if bad."""
    tokens: dict[str, str] = {}
    if cfg.token is not None:
        _check_token(cfg.token, TOKEN_ENV)
        tokens[cfg.token] = ADMIN
    if cfg.token_file is not None:
        for role, token, where in read_token_file(cfg.token_file):
            if tokens.get(token, role) != role:
                raise ConfigError(f"{where}: this token is already given the {tokens[token]!r} "
                                  "role; each token has one role")
            tokens[token] = role
    return tokens


def reload_tokens(cfg: ServeConfig, auth: Auth) -> bool:
    """SIGHUP: read ``--token-file`` again and use its tokens from now on (a revoked
    token is refused at once, no restart). A file that does not load, or that would
    leave a daemon bound beyond loopback without authentication, changes nothing and
    is logged. Logs how many tokens of each role there are, never a token. Whether the
    tokens changed."""
    if cfg.token_file is None:
        log.warning("SIGHUP: no --token-file to reload; nothing changed")
        return False
    try:
        tokens = _configured_tokens(cfg)
    except (ConfigError, OSError) as exc:
        log.error("SIGHUP: the token file did not load; the tokens in use stay",
                  extra={"kv": {"error": exc}})
        return False
    if not tokens and not auth.mtls and not cfg.insecure and not is_loopback(cfg.host):
        log.error("SIGHUP: the token file holds no token; serving beyond loopback without "
                  "authentication is refused, the tokens in use stay")
        return False
    before = auth.roles
    auth.replace_tokens(tokens)
    log.info("tokens reloaded", extra={"kv": {
        "before": _role_counts(before), "after": _role_counts(auth.roles)}})
    return True


def _role_counts(roles: list[str]) -> str:
    return ",".join(f"{role}:{roles.count(role)}" for role in sorted(set(roles))) or "none"


def load_auth(cfg: ServeConfig) -> Auth:
    """The daemon's :class:`Auth`; ConfigError (exit 2) for bad or unsafe settings."""
    tokens = _configured_tokens(cfg)
    auth = Auth(tokens, mtls=cfg.tls_client_ca is not None)
    log.info("authentication", extra={"kv": {
        "on": auth.enabled, "tokens": len(tokens), "client_certificates": auth.mtls,
        "tls": cfg.tls_cert is not None}})
    if not auth.enabled and not cfg.insecure and not is_loopback(cfg.host):
        raise ConfigError(
            f"refusing to serve on {cfg.host} without authentication: anyone who can reach the "
            f"port could read, change and delete every buffer. To fix it, {_FIX}; or pass "
            "--insecure (MILLPOND_INSECURE=1) to serve unauthenticated anyway")
    if tokens and cfg.tls_cert is None and not is_loopback(cfg.host):
        # The daemon cannot see where its port is published: in a container it binds
        # 0.0.0.0 even when Docker publishes the port on the host's 127.0.0.1 only (the
        # recommended `docker run -p 127.0.0.1:...`). The operator says so.
        if cfg.published_loopback:
            log.info("tokens travel in clear text, on this host only: the port is published "
                     "on loopback (--published-loopback)", extra={"kv": {"host": cfg.host}})
        else:
            log.warning("tokens travel in clear text to this port: anyone on the network "
                        "between a client and it can read them", extra={"kv": {
                            "host": cfg.host, "fix": "clients on other hosts: add --tls-cert "
                            "and --tls-key; if the port is reachable from this host only (a "
                            "container's port published on 127.0.0.1), say so with "
                            "MILLPOND_PUBLISHED_LOOPBACK=1"}})
    return auth


# A token file's refused permission bits: read and write for its owner and read for its
# group are allowed. Group-readable, because a Kubernetes Secret volume under a pod's
# fsGroup is 0440 (the kubelet adds group read; root owns it, the fsGroup is its group):
# give the file's group to no one but the daemon. Execute bits mean nothing and are ignored.
TOKEN_FILE_REFUSED = ((0o004, "readable by every user"), (0o020, "writable by its group"),
                      (0o002, "writable by every user"))


def read_token_file(path: Path) -> list[tuple[str, str, str]]:
    """``(role, token, "FILE line N")`` of each ``ROLE TOKEN`` line of a token file.

    The file may be read and written by its owner and read by its group (0600, 0640,
    0400, 0440: a Kubernetes Secret volume with ``fsGroup`` is 0440). One that every
    user may read, or its group or every user may write, is refused (ConfigError),
    as is a malformed one, naming the line.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"--token-file {path}: cannot open it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        problems = [what for bit, what in TOKEN_FILE_REFUSED if mode & bit]
        if problems:
            raise ConfigError(
                f"--token-file {path} is {' and '.join(problems)} (mode {mode & 0o777:04o}); "
                "allowed: read and write for its owner, read for its group, nothing for other "
                f"users (chmod 600 {path}; 640 or 440 if only the daemon is in its group)")
        try:
            text = f.read().decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"--token-file {path} is not UTF-8 text") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--token-file {path} line {number}"
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{where}: expected 'ROLE TOKEN' (two words), got {len(parts)}")
        role, token = parts
        if role not in ROLES:
            raise ConfigError(f"{where}: unknown role {role[:20]!r}; roles: {', '.join(ROLES)}")
        _check_token(token, where)
        entries.append((role, token, where))
    if not entries:
        raise ConfigError(f"--token-file {path} holds no 'ROLE TOKEN' line")
    return entries


def _check_token(token: str, where: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{where}: the token has {len(token)} characters; tokens need at least "
            f"{MIN_TOKEN_CHARS} (make one with: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')")
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"{where}: tokens are printable ASCII without spaces")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this host only."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_credentials(cfg: ServeConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from ``--tls-cert``/``--tls-key`` (and ``--tls-client-ca``), or None."""
    if cfg.tls_cert is None and cfg.tls_key is None:
        if cfg.tls_client_ca is not None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS)")
        return None
    if cfg.tls_cert is None or cfg.tls_key is None:
        raise ConfigError("--tls-cert and --tls-key go together")
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # the stdlib's checks give clear errors where gRPC's would be obscure
        check.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--tls-cert {cfg.tls_cert} / --tls-key {cfg.tls_key}: {exc}") from None
    client_ca = None
    if cfg.tls_client_ca is not None:
        try:
            check.load_verify_locations(cfg.tls_client_ca)
            client_ca = cfg.tls_client_ca.read_bytes()
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--tls-client-ca {cfg.tls_client_ca}: {exc}") from None
    return grpc.ssl_server_credentials(
        [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())],
        root_certificates=client_ca, require_client_auth=client_ca is not None)
