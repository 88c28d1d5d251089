"""The ``millpond`` command: ``serve``, ``info``, ``health``, ``inspect`` (offline), and the
operator's ``delete``, ``export``, ``backup``, ``repair`` and ``restore`` (:mod:`.operator_cli`).

Exit codes: 0 success; 1 runtime failure (server unreachable, not serving,
cannot bind); 2 bad usage or configuration (flags, environment, TOML).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import textwrap
from typing import Any, Sequence

import grpc

from millpond._version import __version__

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
    parser.add_argument("--version", action="version", version=f"millpond {__version__}")
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
        if name == "info":
            p.add_argument("--json", action="store_true",
                           help="print a JSON list: every key of each buffer's info, and "
                           "disk_bytes")
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
            return cmd_info(address, args.timeout, args.json)
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
    for name, (dtype, shape) in config.schema.spec().items():
        dims = "" if not shape else "[" + ",".join(str(d) for d in shape) + "]"
        parts.append(f"{name}:{np.dtype(dtype).name}{dims}")
    return " ".join(parts)


def _short(value: float, unit: str) -> str:
    """``value`` (>= 1) in at most 3 digits: 2.7, 28, 886; then ``unit``."""
    return f"{value:.1f}".rstrip("0").rstrip(".") + unit if value < 10 else f"{value:,.0f}{unit}"


def _count(n: int) -> str:
    """``n`` in a few characters: 950, 1.5k, 28k, 100k, 2M (thousands, millions, billions)."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return _short(n / size, unit)
    return str(n)


def _nbytes(n: int) -> str:
    """``n`` bytes in powers of 1024: 512B, 48KiB, 2.7MiB, 120GiB."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return _short(n / size, unit)
    return f"{n}B"


def _mode_text(config: Any) -> str:
    if config is None:
        return "-"
    return "prioritized" if config.prioritized is not None else config.mode


def limiter_text(limiter: Any) -> str:
    """A rate limiter in a few words: ``-`` (none), ``min 1k`` (MinSize), ``queue 500``
    (Queue), ``spi 8 min 1k`` (SampleToInsertRatio: samples per insert, min size)."""
    if limiter is None:
        return "-"
    spi, size = limiter.samples_per_insert, limiter.min_size_to_sample
    unbounded = limiter.min_diff == -math.inf and limiter.max_diff == math.inf
    if spi == 1 and unbounded:
        return f"min {_count(size)}"
    if spi == 1 and size == 1 and limiter.min_diff == 0 and limiter.max_diff != math.inf:
        return f"queue {_count(int(limiter.max_diff))}"
    return f"spi {spi:g} min {_count(size)}"


INFO_COLUMNS = 100  # where the lines below the table wrap
INFO_HEADER = ("NAME", "STATE", "MODE", "RECORDS", "PUSHED", "SAMPLED", "WAIT", "LIMITER",
               "MEMORY", "DISK")


def format_table(buffers: list[tuple[Any, int]]) -> str:
    """``millpond info``'s table of ``(info, disk bytes)`` pairs, in 100 columns for names
    of up to about 12 characters: one row per buffer (counts in at most 3 digits and k, M,
    G; bytes in powers of 1024), then each served buffer's hot capacity, record size and
    fields, then why each buffer held out of service is."""
    rows, details, held = [], [], []
    for info, disk in buffers:
        config = info.config
        if info.ok:
            rows.append((info.name, info.state, _mode_text(config),
                         f"{_count(info.size)}/{_count(config.total_capacity)}",
                         _count(info.pushed), _count(info.samples),
                         _count(info.waiting_inserts + info.waiting_samples),
                         limiter_text(config.rate_limiter), _nbytes(info.memory_needed),
                         _nbytes(disk)))
            text = (f"hot {config.hot_capacity:,}, {config.schema.record_nbytes:,} bytes a "
                    f"record: {_fields_text(config)}")
            if config.max_times_sampled:
                text += f"; at most {config.max_times_sampled:,} draws a record"
            if config.episodes:
                text += "; episodes"
            details.append((info.name, text))
        else:  # held out of service: its state; why, below the table
            rows.append((info.name, info.state, _mode_text(config), "-", "-", "-", "-",
                         "-" if config is None else limiter_text(config.rate_limiter), "-",
                         _nbytes(disk)))
            held.append(f"{info.name}: held out of service ({info.state}): {info.reason}")
    widths = [max(len(r[i]) for r in [INFO_HEADER, *rows]) for i in range(len(INFO_HEADER))]
    right = {3, 4, 5, 6, 8, 9}  # numbers align right

    def line(row: Sequence[str]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    out = [line(r) for r in [INFO_HEADER, *rows]]
    if details:  # wrapped at 100 columns, under the text
        indent = " " * (max(len(name) for name, _ in details) + 2)
        out.append("")
        out += [textwrap.fill(text, INFO_COLUMNS, initial_indent=name.ljust(len(indent)),
                              subsequent_indent=indent, break_long_words=False,
                              break_on_hyphens=False) for name, text in details]
    if held:  # why, and what to do: millpond repair NAME / delete NAME
        out += ["", *held]
    return "\n".join(out)


def info_json(info: Any, disk: int) -> dict[str, Any]:
    """One buffer of ``millpond info --json``: its info's keys (the config's settings too;
    infinities as None), ``disk_bytes``, and ``limiter``, the table's words for it."""
    def plain(value: Any) -> Any:
        if isinstance(value, float) and math.isinf(value):
            return None
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value

    entry = {key: plain(info[key]) for key in info}
    entry["disk_bytes"] = disk
    entry["limiter"] = ("-" if info.config is None
                        else limiter_text(info.config.rate_limiter))
    return entry


def cmd_info(address: str, timeout: float, as_json: bool = False) -> int:
    from millpond.v1 import replay_pb2, replay_pb2_grpc
    from millpond.wire.codec import info_from_proto

    channel, metadata = _channel(address)
    with channel:
        try:
            reply = replay_pb2_grpc.ReplayStub(channel).List(
                replay_pb2.ListRequest(include_unavailable=True), timeout=timeout,
                metadata=metadata)
        except grpc.RpcError as exc:
            return _unreachable("info", address, exc)
    buffers = [(info_from_proto(message), message.disk_bytes) for message in reply.buffers]
    if as_json:
        print(json.dumps([info_json(info, disk) for info, disk in buffers], indent=2))
        return 0
    if not buffers:
        print(f"no buffers on {address}")
        return 0
    print(format_table(buffers))
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
        # a buffer with frames: its fields as pushed ("fields"), not as its tiers hold them
        fields = " ".join(f"{name}:{dtype}" + (f"[{','.join(map(str, shape))}]" if shape else "")
                          for name, (dtype, shape) in meta.get("fields", meta["schema"]).items())
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
        lines.append(f"DAMAGED   {len(bad):,} of {found.checked:,} records fail their {what} "
                     f"check: seqs {_listed(bad, limit)}")
    else:
        lines.append(f"checks    {found.checked:,} records checked ({what}): all pass")
    lines += _frame_lines(found, limit)
    lines.append("status    " + ("healthy" if found.status == 0 else "DAMAGED"))
    return "\n".join(lines)


def _frame_lines(found: Any, limit: int | None) -> list[str]:
    """The frame rings of a format 6 or 7 file, as ``millpond inspect`` reports them."""
    lines = []
    for ring in found.frames:
        shape = ",".join(map(str, ring.frame_shape))
        stack = (f"stacks of {ring.k} along axis {ring.axis}" if ring.axis is not None
                 else "one frame per value")
        nexts = f" (and {', '.join(ring.fields[1:])} next_of it)" if len(ring.fields) > 1 else ""
        check = "id and checksum" if ring.checksummed else "id; no checksums: not persistent"
        stored, what = f"ring of {ring.capacity:,} frames {ring.dtype}[{shape}]", "frames"
        if ring.codec is not None:  # a compressed ring (format 7): blobs in a ring of bytes
            check = ("id, offset, length and checksum" if ring.checksummed else
                     "id, offset and length; no checksums: not persistent")
            stored = (f"compressed ({ring.codec[0]}, level {ring.codec[1]}), {ring.capacity:,} "
                      f"frames {ring.dtype}[{shape}] as blobs in a ring of {ring.nbytes:,} "
                      f"bytes (up to {ring.limit:,})")
            what = "blobs"
        lines.append(f"frames    {ring.source}: {stack}{nexts}; {stored}")
        if len(ring.damaged):
            lines.append(f"DAMAGED   {len(ring.damaged):,} of {ring.referred:,} {what} of "
                         f"{ring.source} fail their {check} check: frames "
                         f"{_listed(ring.damaged, limit)}")
        else:
            lines.append(f"checks    {ring.referred:,} {what} of {ring.source} the records refer "
                         f"to checked ({check}): all pass")
    bad = found.frame_damaged
    if len(bad):
        lines.append(f"DAMAGED   {len(bad):,} records refer to a damaged frame (a reopen with "
                     f"skip-corrupt leaves them out): seqs {_listed(bad, limit)}")
    return lines


def _listed(values: Any, limit: int | None) -> str:
    """``values`` (seqs or frame ids) as ``millpond inspect`` lists them: the first
    ``limit`` (None: all), and how many more (``--all-seqs`` shows them)."""
    shown = values.tolist() if limit is None else values[:limit].tolist()
    more = "" if len(shown) == len(values) else f" ... (+{len(values) - len(shown):,}; --all-seqs)"
    return ", ".join(map(str, shown)) + more


if __name__ == "__main__":  # pragma: no cover
    logging.basicConfig()
    sys.exit(main())
