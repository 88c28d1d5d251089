"""``dns:///NAME:PORT`` targets: the shard addresses a name stands for (no other I/O).

See :func:`resolve`; :mod:`millpond.sharded.client` uses it when connecting.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, Sequence

from millpond.errors import InvalidConfigError, ServerUnavailableError

DNS_SCHEME = "dns:///"
NAME_TIMEOUT = 2.0  # seconds the reverse lookups of a target's addresses may take


def resolve(target: str) -> list[str]:
    """``dns:///NAME:PORT`` -> the shards' ``host:port``: the names of NAME's addresses
    (:func:`stable_names`) in natural order if each has its own, else the addresses
    sorted (IPv4 before IPv6, numerically)."""
    rest = target[len(DNS_SCHEME):]
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise InvalidConfigError(f"expected 'dns:///NAME:PORT', got {target!r}")
    try:
        found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ServerUnavailableError(f"cannot resolve {host!r} ({target}): {exc}") from None
    ips = sorted({ipaddress.ip_address(str(entry[4][0]).split("%")[0]) for entry in found},
                 key=lambda ip: (ip.version, int(ip)))
    names = stable_names(ips)
    if names is not None:
        return [f"{name}:{port}" for name in sorted(names, key=_natural)]
    return [f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}" for ip in ips]


def stable_names(ips: Sequence[Any], timeout: float = NAME_TIMEOUT) -> list[str] | None:
    """Each address's own name (reverse DNS that resolves back to that address), or
    None if any address has none, two share one, or the lookups take over ``timeout``
    seconds (a resolver that does not answer must not hold up connecting)."""
    def own_name(ip: Any) -> str | None:
        try:
            name = socket.gethostbyaddr(str(ip))[0]
            back = {entry[4][0] for entry in socket.getaddrinfo(name, None)}
        except OSError:
            return None
        return name if str(ip) in back else None

    pool = ThreadPoolExecutor(max_workers=min(16, len(ips)) or 1)
    try:
        futures = [pool.submit(own_name, ip) for ip in ips]
        deadline = time.monotonic() + timeout
        names = [f.result(max(0.0, deadline - time.monotonic())) for f in futures]
    except FuturesTimeout:
        return None
    finally:
        pool.shutdown(wait=False)
    if any(name is None for name in names) or len(set(names)) != len(names):
        return None
    return [name for name in names if name is not None]


def _natural(name: str) -> list:
    """Sort key: digit runs as numbers (``millpond-10`` after ``millpond-9``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
