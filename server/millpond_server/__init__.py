"""millpond_server: the gRPC daemon serving named millpond buffers.

Layers (DESIGN.md section 2): :mod:`.registry` (named buffers, no gRPC),
:mod:`.service` (grpc.aio handlers: decode -> engine -> encode, one error
translator), :mod:`.app` (server lifecycle, signals), :mod:`.config` and
:mod:`.cli` (flags, environment, TOML).
"""

__all__ = ["main"]


def main(argv=None) -> int:
    from .cli import main as _main

    return _main(argv)
