"""The daemon's log lines: ``ts=... level=... logger=... msg="..." key=value ...``."""

from __future__ import annotations

import logging
import sys
from typing import Any


_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _kv(key: str, value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return f"{key}={text}"


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=... logger=... msg="..." key=value ...`` (one line, then traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            _kv("ts", self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}"),
            _kv("level", record.levelname.lower()),
            _kv("logger", record.name),
            _kv("msg", record.getMessage()),
        ]
        for key, value in (getattr(record, "kv", None) or {}).items():
            parts.append(_kv(key, value))
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
