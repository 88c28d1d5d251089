"""Helpers for tests that run the real daemon as a subprocess."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

import millpond

READY_PREFIX = "serving on "

# The test pytest is running (tests/conftest.py sets it); None outside pytest (bench/).
running_test = None


def check_marked_daemon() -> None:
    """Refuse to start a daemon for a test that is not marked ``daemon``: ``make test-fast``
    (``-m "not daemon and ..."``) must start none."""
    item = running_test
    if item is not None and item.get_closest_marker("daemon") is None:
        import pytest

        pytest.fail(f"{item.nodeid} starts a daemon but is not marked daemon "
                    "(pytest.mark.daemon, or one of the fixtures in tests/conftest.py)",
                    pytrace=False)


class ServerProcess:
    """A `millpond serve` subprocess on a free port (``--port 0``).

    The daemon prints ``serving on HOST:PORT`` on stdout once it accepts calls;
    ``start`` waits for that line (with a deadline), never for a fixed time.
    """

    def __init__(self, data_dir: Path, *extra_args: str, env: dict | None = None,
                 cgroup: "MemoryCgroup | None" = None, script: str | os.PathLike | None = None,
                 log_file: Path | None = None, preexec_fn: Callable[[], None] | None = None,
                 quiet: bool = True):
        """``script``: a daemon script to run instead of ``-m millpond_server`` (a patched
        daemon, taking the same arguments). ``log_file``: its log (stderr) goes there, to
        be read while it runs. ``preexec_fn``: run in the child before the daemon starts
        (a cgroup's is run first). ``quiet``: it logs at warning unless ``extra_args`` or
        ``env`` (or this environment) give a level: a test reads its stderr pipe only once
        it stopped, and a long-lived daemon's info lines (one per buffer created) could fill
        the pipe and block it. ``quiet=False``: at the daemon's own default (info)."""
        self.data_dir = Path(data_dir)
        self.cgroup = cgroup  # the daemon runs inside it
        self.args = [
            sys.executable, *(["-m", "millpond_server"] if script is None else [os.fspath(script)]),
            "serve",
            "--host", "127.0.0.1", "--port", "0", "--data-dir", str(self.data_dir),
            *extra_args,
        ]
        self.env = {**os.environ, **(env or {})}
        if quiet and "--log-level" not in extra_args:
            self.env.setdefault("MILLPOND_LOG_LEVEL", "warning")
        self.log_file = log_file
        self.preexec_fn = preexec_fn
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self, timeout: float = 30.0) -> "ServerProcess":
        check_marked_daemon()
        stderr = subprocess.PIPE if self.log_file is None else self.log_file.open("w")
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=self.env,
            preexec_fn=self._preexec if self.cgroup or self.preexec_fn else None,
        )
        if self.log_file is not None:
            stderr.close()  # the child has its own copy
        self.address = wait_for_ready(self.proc, timeout)
        return self

    def _preexec(self) -> None:
        if self.cgroup is not None:
            self.cgroup.enter()
        if self.preexec_fn is not None:
            self.preexec_fn()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` and wait for exit; SIGKILL if it does not stop in time."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_all(servers: list[ServerProcess], timeout: float = 30.0) -> list[ServerProcess]:
    """Start daemons in parallel (each still waits for its own ready line)."""
    check_marked_daemon()
    for server in servers:
        server.proc = subprocess.Popen(server.args, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=server.env)
    for server in servers:
        assert server.proc is not None
        server.address = wait_for_ready(server.proc, timeout)
    return servers


def wait_for_ready(proc: subprocess.Popen, timeout: float) -> str:
    """Read stdout until the ready line; return the address it names."""
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen = []
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            continue
        line = proc.stdout.readline()
        if not line:  # EOF: the daemon died
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"server exited ({proc.wait()}) before ready:\n{''.join(seen)}{err}")
        seen.append(line)
        if line.startswith(READY_PREFIX):
            return line[len(READY_PREFIX):].strip()
    proc.kill()
    raise TimeoutError(f"server not ready within {timeout}s:\n{''.join(seen)}")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01):
    """Poll ``predicate`` until it returns truthy or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met before the deadline")
        time.sleep(interval)


def without_stats(info: dict) -> dict:
    """``info()`` less its call statistics (inserts, samples, waits), which every
    sample changes: what a rejected request must leave exactly as it was."""
    from millpond.core.ratelimit import RateState

    return {k: v for k, v in info.items() if k not in RateState(None).stats()}


def engine(schema, hot: int, total: int, path=None, *, persistent: bool = False,
           sync_every_push: bool = False, **sampling):
    """An engine buffer: ``sampling`` holds the config's keywords (mode,
    max_times_sampled, rate_limiter, prioritized=True with alpha and beta)."""
    from millpond.core import BufferConfig, TieredBuffer

    config = BufferConfig.build(hot_capacity=hot, total_capacity=total, fields=schema, **sampling)
    return TieredBuffer(config, path, persistent=persistent, sync_every_push=sync_every_push)


class MemoryCgroup:
    """A child memory cgroup of this process's own, with a limit (cgroup v1 or v2).

    ``enter`` (a ``preexec_fn``) moves the calling process into it. Creating one
    needs root (CI runs as root); :meth:`create` says why when it cannot.
    """

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    @classmethod
    def create(cls, limit_bytes: int) -> "MemoryCgroup":
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, own = line.split(":", 2)
            if "memory" in controllers.split(","):
                base, v2 = Path("/sys/fs/cgroup/memory" + own), False
                break
        else:
            base, v2 = Path("/sys/fs/cgroup" + own_v2()), True
        path = base / f"millpond-test-{os.getpid()}-{time.monotonic_ns()}"
        path.mkdir()  # PermissionError / FileNotFoundError: no cgroup for us here
        group = cls(path, v2)
        group.write("memory.max" if v2 else "memory.limit_in_bytes", str(limit_bytes))
        if not v2:  # no swap either: over the limit is reclaim or the OOM killer
            try:
                group.write("memory.memsw.limit_in_bytes", str(limit_bytes))
            except OSError:
                pass
        return group

    def write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        if self.v2:
            stat = self.read("memory.events")
            key = "oom_kill "
        else:
            stat, key = self.read("memory.oom_control"), "oom_kill "
        return next((int(line.split()[1]) for line in stat.splitlines() if line.startswith(key)), 0)

    def peak(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int(self.read(name))
        except OSError:
            return 0

    def remove(self) -> None:
        for _ in range(50):  # processes may take a moment to leave
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def own_v2() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise FileNotFoundError("no cgroup v2 hierarchy")


# ---- the same calls on every transport (contract suites) ------------------------------------

def outcome(call):
    """What a call did: ("ok", comparable value) or ("error", exception type)."""
    try:
        value = call()
    except millpond.ReplayError as exc:
        return ("error", type(exc).__name__)
    return ("ok", comparable(value))


def comparable(value):
    """``value`` with every array as (dtype, nested lists), in dicts and lists too."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.tolist())
    return value


def state(buf) -> dict:
    """What a user can observe of a buffer, less timings and names."""
    info = dict(buf.info())
    for key in ("name", "path", "insert_wait_seconds", "sample_wait_seconds", "memory_needed"):
        info.pop(key)
    return info


def run_everywhere(bufs: dict, calls: list) -> None:
    """Run each call on every transport; assert the same outcomes (those of "local") and
    the same state."""
    for step, call in enumerate(calls):
        results = {transport: outcome(lambda b=buf, c=call: c(b)) for transport, buf in bufs.items()}
        for transport, result in results.items():
            assert result == results["local"], (step, transport, results)
    states = {transport: state(buf) for transport, buf in bufs.items()}
    for transport, found in states.items():
        assert found == states["local"], (transport, states)
