"""millpond_server: the daemon serving named millpond buffers.

Layers (see docs/ARCHITECTURE.md): :mod:`.registry` (named buffers and their
files, no gRPC), :mod:`.operations` (what clients may ask, for every
transport: errors, readiness, rate-limit waits), :mod:`.service` (the gRPC
service: decode, operate, encode) and :mod:`.fastpath` (the same-host
shared-memory sessions), :mod:`.app` (lifecycle, signals), :mod:`.config` and
:mod:`.cli` (flags, environment, TOML).
"""

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from .cli import main as _main

    return _main(argv)
