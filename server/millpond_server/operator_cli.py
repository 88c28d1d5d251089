"""The operator's commands of ``millpond``: ``delete``, ``export``, ``backup`` and ``repair``
(online: through the daemon at ``--address``) and ``restore`` (offline: into a data
directory no daemon is using).

The online ones find the daemon as ``info`` and ``health`` do (``--address``, else
``MILLPOND_ADDRESS``, ``MILLPOND_ADDRESS_FILE``, ``MILLPOND_PORT``) and authenticate as
clients do (``MILLPOND_TOKEN``, ``MILLPOND_TLS_*``): a daemon with authentication on
refuses them without an admin token (export: a learner's will do), and they say so.
Exit codes: 0 done; 1 refused or failed (the reason on stderr); 2 bad usage or settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

COMMANDS = ("delete", "export", "backup", "repair", "restore")
_ADDRESS_HELP = ("server HOST:PORT [env MILLPOND_ADDRESS; default: the address in "
                 "$MILLPOND_ADDRESS_FILE if that file exists, else 127.0.0.1:$MILLPOND_PORT or "
                 "127.0.0.1:50051]")
PROGRESS_EVERY_S = 1.0  # at most one progress line per second
# backup and repair: seconds to reach the daemon and look the buffer up, before the long call
CONTROL_TIMEOUT_S = 5.0


def add_operator_commands(sub: Any) -> None:
    """The operator's subcommands, on ``millpond``'s subparsers ``sub``."""
    online = {
        "delete": ("delete a buffer and its file (one held out of service too; admin)", 5.0),
        "export": ("write a buffer's records, oldest first, to a .npz file on this host "
                   "(learner or admin)", 60.0),
        "backup": ("have the daemon write a consistent snapshot of a live buffer under its "
                   "--backup-dir while actors push, with progress (admin)", None),
        "repair": ("serve a buffer held out of service again: its records that pass their "
                   "checks kept, the others dropped (admin)", 3600.0),
    }
    for name, (text, timeout) in online.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("name", metavar="NAME", help="the buffer")
        if name == "export":
            p.add_argument("path", metavar="PATH", help="the .npz file to write (on this host)")
        if name == "backup":
            p.add_argument("path", metavar="PATH",
                           help="the snapshot file, relative to the daemon's --backup-dir or "
                           "absolute inside it (.buffer appended if missing)")
        p.add_argument("--address", default=None, help=_ADDRESS_HELP)
        default = "none" if timeout is None else f"{timeout:g}"
        what = "the whole copy" if name == "backup" else (
            "each read" if name == "export" else "the answer")
        p.add_argument("--timeout", type=float, default=timeout,
                       help=f"seconds to wait for {what} (default {default})")
    text = ("put a snapshot (millpond backup) into a data directory no daemon is using, "
            "every record checked; a daemon started on it serves the buffer")
    p = sub.add_parser("restore", help=text, description=text)
    p.add_argument("snapshot", metavar="SNAPSHOT", help="the snapshot file (NAME.buffer)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="the daemon's data directory [env MILLPOND_DATA_DIR; default "
                   "./millpond-data]")
    p.add_argument("--name", default=None,
                   help="the buffer's name (default: the snapshot's file name without .buffer)")


def run_operator(args: argparse.Namespace, address: Callable[[], str]) -> int:
    """Run the operator's command ``args.command``; ``address()`` is the default address."""
    if args.command == "restore":
        return cmd_restore(args)
    from millpond.errors import InvalidConfigError, ReplayError

    where = args.address or address()
    long_call = args.command in ("backup", "repair")  # their --timeout is the long call's
    try:
        client = _client(where, CONTROL_TIMEOUT_S if long_call else args.timeout)
    except InvalidConfigError as exc:  # MILLPOND_TOKEN / MILLPOND_TLS_* unusable
        return _fail(args.command, str(exc), 2)
    try:
        with client:
            return _COMMANDS[args.command](client, args)
    except ReplayError as exc:
        return _refused(args.command, where, exc)


def _client(address: str, timeout: float) -> Any:
    import millpond

    return millpond.Client(address, timeout=timeout)


def _fail(command: str, message: str, code: int = 1) -> int:
    print(f"millpond {command}: {message}", file=sys.stderr)
    return code


def _refused(command: str, address: str, exc: Exception) -> int:
    """Say why the daemon refused or could not be reached (exit 1)."""
    from millpond.errors import (
        AuthenticationError,
        DeadlineExceededError,
        PermissionDeniedError,
        ServerUnavailableError,
    )

    if isinstance(exc, AuthenticationError):
        return _fail(command, f"the server at {address} refused: {exc}; set MILLPOND_TOKEN "
                     "(an admin token) and MILLPOND_TLS_* for TLS")
    if isinstance(exc, PermissionDeniedError):
        return _fail(command, f"the server at {address} refused: {exc}")
    if isinstance(exc, (ServerUnavailableError, DeadlineExceededError)):
        return _fail(command, f"cannot reach server at {address} ({type(exc).__name__}: {exc})")
    return _fail(command, f"{type(exc).__name__}: {exc}")


class _Progress:
    """Percent lines on stderr, at most one a second (and the last)."""

    def __init__(self, label: str, unit: str = "records"):
        self.label, self.unit = label, unit
        self.last = 0.0
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        percent = 100 if total <= 0 else min(100, 100 * done // total)
        now = time.monotonic()
        if percent == self.shown or (now - self.last < PROGRESS_EVERY_S and percent < 100):
            return
        self.last, self.shown = now, percent
        print(f"{self.label}: {percent}% ({done:,} of {total:,} {self.unit})", file=sys.stderr,
              flush=True)


# ---- the online commands ------------------------------------------------------------------

def cmd_delete(client: Any, args: argparse.Namespace) -> int:
    client.delete_buffer(args.name)
    print(f"deleted {args.name}")
    return 0


def cmd_export(client: Any, args: argparse.Namespace) -> int:
    handle = client.buffer(args.name)
    try:
        path = handle.export(args.path)
    finally:
        handle.release()
    print(f"exported {args.name} to {path}")
    return 0


def cmd_backup(client: Any, args: argparse.Namespace) -> int:
    client.info(args.name)  # reachable, and the buffer there (a typed error says why not)
    result = client.checkpoint(args.name, args.path, progress=_Progress(f"backup {args.name}"),
                               timeout=args.timeout)
    detail = f"seqs {result.first:,}-{result.pushed - 1:,}" if result.records else "empty"
    print(f"wrote {result.path}: {result.records:,} records ({detail}), {result.nbytes:,} bytes")
    if result.dropped:
        print(f"  {result.dropped:,} records live when the backup began were not copied: "
              f"evicted or taken before their turn, or failing their checks "
              f"({result.damaged:,})")
    return 0


def cmd_repair(client: Any, args: argparse.Namespace) -> int:
    client.info(args.name)  # reachable, and the buffer there (a typed error says why not)
    result = client.repair_buffer(args.name, timeout=args.timeout)
    if not result.repaired:
        print(f"{args.name} is served already: nothing to repair")
        return 0
    print(f"repaired {args.name}: {result.info.size:,} records served, {result.dropped:,} "
          "damaged records dropped")
    return 0


_COMMANDS: dict[str, Callable[[Any, argparse.Namespace], int]] = {
    "delete": cmd_delete, "export": cmd_export, "backup": cmd_backup, "repair": cmd_repair}


# ---- restore (offline) ----------------------------------------------------------------------

def cmd_restore(args: argparse.Namespace) -> int:
    from millpond.errors import ReplayError

    from .backups import restore
    from .registry import DataDirError, DataDirLockedError

    data_dir = args.data_dir or Path(os.environ.get("MILLPOND_DATA_DIR") or "./millpond-data")
    stages = {"copy": _Progress("restore: copying", "bytes"),
              "check": _Progress("restore: checking", "records")}
    try:
        done = restore(args.snapshot, data_dir, args.name,
                       progress=lambda stage, n, total: stages[stage](n, total))
    except DataDirLockedError:
        return _fail("restore", f"a daemon is using {data_dir}: stop it first (restore is "
                     "offline), or restore into another directory")
    except FileNotFoundError as exc:
        return _fail("restore", f"{exc.filename}: no such file")
    except (ReplayError, DataDirError, OSError) as exc:
        return _fail("restore", f"{type(exc).__name__}: {exc}")
    print(f"restored {done['name']} to {done['path']}: {done['records']:,} records; a daemon "
          f"started with --data-dir {data_dir} serves it")
    return 0
