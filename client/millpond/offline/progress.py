"""A one-line progress bar for long loads, drawn only on a terminal.

No dependency: the bar is ``\\r``-redrawn text on ``stderr``, and only when
``stderr`` is a terminal (a log file or a pipe gets nothing), only once the
work has taken ``delay`` seconds (short loads stay silent), at most every
``interval`` seconds. Used by :mod:`millpond.datasets` while reading files
and by the offline datasets while storing them.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

WIDTH = 30  # characters of the bar itself


class ProgressBar:
    """``bar(done)`` reports progress out of ``total`` (units named ``unit``);
    ``close()`` (or leaving a ``with`` block) ends the line if one was drawn."""

    def __init__(self, total: int, label: str, unit: str = "records", *,
                 stream: IO[str] | None = None, delay: float = 0.5, interval: float = 0.1):
        self.total = max(int(total), 0)
        self.label, self.unit = label, unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = _is_terminal(self.stream)
        self.delay, self.interval = delay, interval
        self.start = time.monotonic()
        self.last_draw: float | None = None
        self.done = 0

    def __call__(self, done: int) -> None:
        self.done = done
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay:
            return
        if self.last_draw is not None and now - self.last_draw < self.interval \
                and done < self.total:
            return
        self.last_draw = now
        self._draw()

    def _draw(self) -> None:
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = int(fraction * WIDTH)
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] "
                          f"{fraction:4.0%} {self.done:,}/{self.total:,} {self.unit}")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line, if the bar was shown at all."""
        if self.last_draw is not None:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.last_draw = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
