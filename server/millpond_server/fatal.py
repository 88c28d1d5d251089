"""Stopping the daemon when its storage fails.

A failed msync/fsync cannot be retried safely: the kernel may have dropped the
dirty pages it could not write, and a second call would report success. The
only honest reaction is to stop at once, loudly, before acknowledging more.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("millpond.server")

EXIT_STORAGE_ERROR = 74  # EX_IOERR


def fatal_storage_error(exc: BaseException) -> None:
    """Log, tell stderr, and exit the process now (no cleanup that could write)."""
    log.critical("storage I/O error, stopping", extra={"kv": {"error": exc}})
    print(f"millpond serve: writing buffer data to disk failed ({exc}); stopping",
          file=sys.stderr, flush=True)
    os._exit(EXIT_STORAGE_ERROR)
