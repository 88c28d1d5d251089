"""What a client presents to a server: a token, and TLS settings for its channel.

``connect(address, token=..., tls=..., tls_ca=..., tls_cert=..., tls_key=...)``
resolves them once (:meth:`Credentials.resolve`), environment included:

* ``token``: sent as ``authorization: Bearer TOKEN`` on every call (and in the
  fast path's hello). Default: ``MILLPOND_TOKEN``; ``token=""`` sends none.
* TLS: ``tls=True`` verifies the server against the system's roots, or
  against ``tls_ca`` (a PEM file); ``tls_cert`` + ``tls_key`` add a client
  certificate (servers run with ``--tls-client-ca``). Defaults:
  ``MILLPOND_TLS_CA``, ``MILLPOND_TLS_CERT``, ``MILLPOND_TLS_KEY``; any of
  them turns TLS on. ``tls=False`` is plaintext whatever the environment says.

Files are checked here, so a bad path or a key that does not match its
certificate fails at ``connect()`` with a clear message, and read again when
each process opens its channel. The token and the paths travel when a client
is pickled (see :meth:`Credentials.settings`); the files' contents do not.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import Any, Mapping

import grpc

from millpond.errors import InvalidConfigError

TOKEN_ENV = "MILLPOND_TOKEN"
TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV = "MILLPOND_TLS_CA", "MILLPOND_TLS_CERT", "MILLPOND_TLS_KEY"


@dataclass(frozen=True)
class Credentials:
    """A client's resolved token and TLS settings (the token never shows in its repr)."""

    token: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def resolve(cls, token: str | None = None, tls: bool | None = None,
                tls_ca: Any = None, tls_cert: Any = None, tls_key: Any = None,
                environ: Mapping[str, str] = os.environ) -> "Credentials":
        """Arguments first, then the ``MILLPOND_*`` environment; checked (InvalidConfigError)."""
        if token is None:
            token = environ.get(TOKEN_ENV) or None
        elif not isinstance(token, str):
            raise InvalidConfigError(f"token must be a string, got {type(token).__name__}")
        token = token or None
        if token is not None and not all("!" <= c <= "~" for c in token):
            raise InvalidConfigError("token must be printable ASCII without spaces")
        if tls not in (None, True, False):
            raise InvalidConfigError(f"tls must be True, False or None, got {tls!r}")
        paths = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
        if tls is False:
            given = [key for key, value in paths.items() if value is not None]
            if given:
                raise InvalidConfigError(f"tls=False contradicts {', '.join(given)}")
            return cls(token)
        envs = {"tls_ca": TLS_CA_ENV, "tls_cert": TLS_CERT_ENV, "tls_key": TLS_KEY_ENV}
        found = {key: os.fspath(value) if value is not None else environ.get(envs[key]) or None
                 for key, value in paths.items()}
        if (found["tls_cert"] is None) != (found["tls_key"] is None):
            raise InvalidConfigError("tls_cert and tls_key (MILLPOND_TLS_CERT, MILLPOND_TLS_KEY) "
                                     "go together")
        creds = cls(token, bool(tls) or any(found.values()), **found)
        creds._check_files()
        return creds

    def _check_files(self) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:  # the stdlib's checks give clear errors where gRPC's would come later and vaguer
            if self.tls_ca is not None:
                context.load_verify_locations(self.tls_ca)
            if self.tls_cert is not None:
                context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            files = ", ".join(f"{key}={value}" for key, value in self.settings().items()
                              if key.startswith("tls_") and value)
            raise InvalidConfigError(f"TLS files ({files}): {exc}") from None

    def settings(self) -> dict[str, Any]:
        """Keyword arguments of ``connect`` that rebuild these credentials (for pickling)."""
        return {"token": self.token or "", "tls": self.tls, "tls_ca": self.tls_ca,
                "tls_cert": self.tls_cert, "tls_key": self.tls_key}

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The metadata every call carries: the token, if any."""
        return None if self.token is None else (("authorization", f"Bearer {self.token}"),)

    def hello(self) -> dict[str, str]:
        """What the fast path's hello presents when Negotiate gave no ticket: the token, if any."""
        return {} if self.token is None else {"token": self.token}

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A new channel to ``address``: TLS when configured, else plaintext."""
        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._tls_credentials(), options=options)

    def aio_channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """:meth:`channel`'s asyncio twin (for :mod:`millpond.aio`; made in its event loop)."""
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self._tls_credentials(), options=options)

    def _tls_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(
            read(self.tls_ca), read(self.tls_key), read(self.tls_cert))
