"""Helpers for tests that run the real daemon as a subprocess."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_PREFIX = "serving on "


class ServerProcess:
    """A `millpond serve` subprocess on a free port (``--port 0``).

    The daemon prints ``serving on HOST:PORT`` on stdout once it accepts calls;
    ``start`` waits for that line (with a deadline), never for a fixed time.
    """

    def __init__(self, data_dir: Path, *extra_args: str, env: dict | None = None):
        self.data_dir = Path(data_dir)
        self.args = [
            sys.executable, "-m", "millpond_server", "serve",
            "--host", "127.0.0.1", "--port", "0", "--data-dir", str(self.data_dir),
            *extra_args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self, timeout: float = 30.0) -> "ServerProcess":
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env
        )
        self.address = wait_for_ready(self.proc, timeout)
        return self

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
