"""The ``millpond`` command: ``serve``, ``info``, ``health``, and the operator's ``delete``,
``export``, ``backup``, ``repair`` and ``restore`` (:mod:`.operator_cli`).

Exit codes: 0 success; 1 runtime failure (server unreachable, not serving,
cannot bind); 2 bad usage or configuration (flags, environment, TOML).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

import grpc

from .config import ConfigError, add_serve_arguments, resolve_serve_config
from .logs import setup_logging
from .operator_cli import COMMANDS as OPERATOR_COMMANDS
from .operator_cli import add_operator_commands, run_operator

DEFAULT_PORT = 50051
CLIENT_TIMEOUT_S = 5.0


def _default_address() -> str:
    if os.environ.get("MILLPOND_ADDRESS"):
        return os.environ["MILLPOND_ADDRESS"]
    if os.environ.get("MILLPOND_ADDRESS_FILE"):  # written by `serve --address-file`
        try:
            with open(os.environ["MILLPOND_ADDRESS_FILE"]) as f:
                address = f.read().strip()
        except OSError:  # not serving (yet): no file
            address = ""
        if address:
            return address
    port = os.environ.get("MILLPOND_PORT") or DEFAULT_PORT
    return f"127.0.0.1:{port}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="millpond", description="millpond experience-replay server"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the replay daemon",
                           description="Run the replay daemon. Every flag can also be set "
                           "as MILLPOND_<FLAG> (flag > environment > default).")
    add_serve_arguments(serve)
    for name, text in (("info", "print the server's buffers as a table"),
                       ("health", "exit 0 if the server reports SERVING, else 1")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--address", default=None,
                       help="server HOST:PORT [env MILLPOND_ADDRESS; default: the address in "
                       "$MILLPOND_ADDRESS_FILE if that file exists, else 127.0.0.1:$MILLPOND_PORT "
                       "or 127.0.0.1:50051]")
        p.add_argument("--timeout", type=float, default=CLIENT_TIMEOUT_S,
                       help=f"seconds to wait for the answer (default {CLIENT_TIMEOUT_S})")
    add_operator_commands(sub)  # delete, export, backup, repair, restore
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command in OPERATOR_COMMANDS:
        return run_operator(args, _default_address)
    from millpond.errors import InvalidConfigError

    address = args.address or _default_address()
    try:
        if args.command == "info":
            return cmd_info(address, args.timeout)
        return cmd_health(address, args.timeout)
    except InvalidConfigError as exc:  # MILLPOND_TOKEN / MILLPOND_TLS_* unusable
        print(f"millpond {args.command}: {exc}", file=sys.stderr)
        return 2


# ---- serve ----------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from millpond.errors import InvalidConfigError, ReplayError

    from .app import run

    try:
        cfg = resolve_serve_config(args)
    except ConfigError as exc:
        print(f"millpond serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    try:
        return run(cfg)
    except (InvalidConfigError, ConfigError) as exc:  # e.g. unsafe or bad auth/TLS settings
        print(f"millpond serve: {exc}", file=sys.stderr)
        return 2
    except (ReplayError, OSError) as exc:
        print(f"millpond serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # signal before the handlers were installed
        return 0


# ---- info -----------------------------------------------------------------------

def _unreachable(command: str, address: str, exc: grpc.RpcError) -> int:
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    code = exc.code().name if hasattr(exc, "code") else "ERROR"
    if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        print(f"millpond {command}: the server at {address} refused ({code}: {detail}); "
              "set MILLPOND_TOKEN (and MILLPOND_TLS_* for TLS)", file=sys.stderr)
        return 1
    print(f"millpond {command}: cannot reach server at {address} ({code}: {detail})",
          file=sys.stderr)
    return 1


def _channel(address: str) -> tuple[Any, Any]:
    """``(channel, metadata)`` from MILLPOND_TOKEN and MILLPOND_TLS_*, as connect() reads them."""
    from millpond.remote.security import Credentials

    credentials = Credentials.resolve()
    return credentials.channel(address, []), credentials.metadata()


def _fields_text(config: Any) -> str:
    import numpy as np

    parts = []
    for f in config.fields:
        dtype = np.dtype(f.dtype).name
        shape = "" if not f.shape else "[" + ",".join(str(d) for d in f.shape) + "]"
        parts.append(f"{f.name}:{dtype}{shape}")
    return " ".join(parts)


def format_table(buffers: list[Any]) -> str:
    header = ("NAME", "SIZE", "HOT/TOTAL", "PUSHED", "SAMPLED", "SAMPLES/INSERT", "WAITING",
              "RECORD_BYTES", "FIELDS")
    rows = [
        (b.name, f"{b.size:,}", f"{b.config.hot_capacity:,}/{b.config.total_capacity:,}",
         f"{b.pushed:,}", f"{b.samples:,}", f"{b.samples_per_insert:.2f}",
         f"{b.waiting_inserts + b.waiting_samples:,}", f"{b.record_nbytes:,}",
         _fields_text(b.config))
        if b.state in ("", "ok") else  # held out of service: its state, the reason below
        (b.name, *["-"] * (len(header) - 2), f"HELD OUT OF SERVICE ({b.state})")
        for b in buffers
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = set(range(1, len(header) - 1))  # numbers align right

    def line(row: Sequence[str]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join(line(r) for r in [header, *rows])


def cmd_info(address: str, timeout: float) -> int:
    from millpond.v1 import replay_pb2, replay_pb2_grpc

    channel, metadata = _channel(address)
    with channel:
        try:
            reply = replay_pb2_grpc.ReplayStub(channel).List(
                replay_pb2.ListRequest(include_unavailable=True), timeout=timeout,
                metadata=metadata)
        except grpc.RpcError as exc:
            return _unreachable("info", address, exc)
    if not reply.buffers:
        print(f"no buffers on {address}")
        return 0
    print(format_table(reply.buffers))
    held = [b for b in reply.buffers if b.state not in ("", "ok")]
    if held:  # why, and what to do: millpond repair NAME / delete NAME
        print()
        for b in held:
            print(f"{b.name}: held out of service ({b.state}): {b.reason}")
    return 0


# ---- health ---------------------------------------------------------------------

def cmd_health(address: str, timeout: float) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel, _ = _channel(address)  # TLS if set; health needs no token
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as exc:
            return _unreachable("health", address, exc)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":  # pragma: no cover
    logging.basicConfig()
    sys.exit(main())
