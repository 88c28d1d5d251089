"""The ``millpond`` command: ``serve``, ``info``, ``health``, ``inspect`` (offline), and the
operator's ``delete``, ``export``, ``backup``, ``repair`` and ``restore`` (:mod:`.operator_cli`).

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
    add_inspect_parser(sub)
    add_operator_commands(sub)  # delete, export, backup, repair, restore
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "inspect":
        return cmd_inspect(args)
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


# ---- inspect --------------------------------------------------------------------

INSPECT_TEXT = ("check a buffer file offline (no daemon; nothing written): print its header, "
                "both commit slots and the records that fail their checks; exit 0 if it is "
                "healthy, 1 if it is damaged, 2 if it cannot be read")


def add_inspect_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="check a buffer file offline", description=INSPECT_TEXT)
    p.add_argument("file", help="a buffer file (<data-dir>/<name>.buffer)")
    p.add_argument("--all-seqs", action="store_true",
                   help="list every damaged seq (default: the first 20)")


def cmd_inspect(args: argparse.Namespace) -> int:
    from millpond.core.inspect import inspect

    found = inspect(args.file)
    print(format_inspection(found, limit=None if args.all_seqs else 20))
    return found.status


def format_inspection(found: Any, limit: int | None = 20) -> str:
    """The report of :func:`millpond.core.inspect.inspect`, as ``millpond inspect`` prints it."""
    lines = [f"file      {found.path}"]
    if found.version is not None:
        lines.append(f"format    version {found.version}" + (
            " (millpond 0.1.0's first files: no metadata checksum, 16-bit record checksums)"
            if found.version == 4 else ""))
    meta = found.meta
    if meta is not None:
        spare = f" (+{meta['spare']:,} spare)" if meta.get("spare") else ""
        fields = " ".join(f"{name}:{dtype}" + (f"[{','.join(map(str, shape))}]" if shape else "")
                          for name, (dtype, shape) in meta["schema"].items())
        lines += [
            f"schema    {fields}",
            f"capacity  hot {meta['hot_capacity']:,}{spare}, cold {meta['cold_capacity']:,}, "
            f"total {meta['total_capacity']:,}; "
            + ("persistent" if meta["persistent"] else "not persistent (hot records in RAM)"),
            "sampling  " + ", ".join(f"{key} {meta[key]}" for key in
                                     ("mode", "max_times_sampled", "prioritized", "episodes")
                                     if meta.get(key) not in (None, False)),
        ]
    for slot in found.slots:
        lines.append(f"commit {slot.name}  generation {slot.generation:,}, pushed {slot.pushed:,}, "
                     f"first {slot.first:,}, hot from {slot.hot_lo:,}: "
                     + ("sound" if slot.sound else "DAMAGED") + (", used" if slot.used else ""))
    lines += [f"note      {note}" for note in found.notes]
    if found.error is not None:
        lines.append(f"UNREADABLE  {found.error}")
        return "\n".join(lines)
    live = found.pushed - found.first
    lines.append(f"records   {live:,} live (seqs {found.first:,} to {found.pushed - 1:,}): "
                 f"{found.hot_lo - found.first:,} cold, {found.pushed - found.hot_lo:,} hot"
                 if live else "records   none live")
    what = "seq and checksum" if found.checksummed else "seq; cold only, no checksums: not persistent"
    bad = found.damaged
    if len(bad):
        shown = bad.tolist() if limit is None else bad[:limit].tolist()
        more = "" if len(shown) == len(bad) else f" ... (+{len(bad) - len(shown):,}; --all-seqs)"
        lines.append(f"DAMAGED   {len(bad):,} of {found.checked:,} records fail their {what} "
                     f"check: seqs {', '.join(map(str, shown))}{more}")
    else:
        lines.append(f"checks    {found.checked:,} records checked ({what}): all pass")
    lines.append("status    " + ("healthy" if found.status == 0 else "DAMAGED"))
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    logging.basicConfig()
    sys.exit(main())
