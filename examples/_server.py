"""Shared by the examples: start a throwaway ``millpond serve`` when no address is given."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Iterator


@contextlib.contextmanager
def millpond_server(address: str | None, workers: int = 2) -> Iterator[str]:
    """Yield ``address``, or start a daemon on a free local port (stopped on exit)."""
    if address:
        yield address
        return
    data_dir = tempfile.mkdtemp(prefix="millpond-example-")
    # `millpond serve`, run as the module of this interpreter's install.
    proc = subprocess.Popen(
        [sys.executable, "-m", "millpond_server", "serve", "--port", "0",
         "--data-dir", data_dir, "--workers", str(workers)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "MILLPOND_SYNC": "none"})
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the daemon prints "serving on HOST:PORT" once ready
            if line.startswith("serving on "):
                break
        else:
            raise RuntimeError(f"millpond serve exited with {proc.wait()}")
        # Keep reading its output, so that it never blocks on a full pipe.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield line.split()[-1]
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
