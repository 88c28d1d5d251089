"""The daemon's log lines: ``--log-format text`` (``ts=... level=... msg="..." key=value``)
or ``json`` (one object per line).

A line logged while a call is being served also names the call: its
``method``, ``peer`` and ``buffer`` (from :data:`CALL`, set per call by
:mod:`.observe` when it is installed: with ``--log-format json``,
``--log-level debug`` or ``--metrics-port``).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from typing import Any

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
FORMATS = ("text", "json")
# The call being served (an object with a ``fields()`` method), or None.
CALL: contextvars.ContextVar[Any] = contextvars.ContextVar("millpond_call", default=None)


# A value longer than this is cut (a client chooses what a buffer name holds).
MAX_VALUE_CHARS = 256
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    if c in _ESCAPES:
        return _ESCAPES[c]
    return c if c.isprintable() or c == " " else f"\\u{ord(c):04x}"


def _kv(key: str, value: Any) -> str:
    """``key=value``, quoted when needed; control characters (a terminal's escapes, a
    carriage return that would forge a line) are written as escapes, never raw."""
    text = str(value)
    if text == "" or not text.isprintable() or any(c in text for c in ' "='):
        text = '"' + "".join(_escape(c) for c in text) + '"'
    return f"{key}={text}"


def _bounded(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_VALUE_CHARS:
        return f"{value[:MAX_VALUE_CHARS]}...({len(value):,} characters)"
    return value


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's own key/values, then those of the call it was logged in."""
    fields = {key: _bounded(value) for key, value in (getattr(record, "kv", None) or {}).items()}
    call = CALL.get()
    if call is not None:
        for key, value in call.fields().items():
            fields.setdefault(key, _bounded(value))
    return fields


def _timestamp(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    return formatter.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}"


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=... logger=... msg="..." key=value ...`` (one line, then traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            _kv("ts", _timestamp(self, record)),
            _kv("level", record.levelname.lower()),
            _kv("logger", record.name),
            _kv("msg", record.getMessage()),
        ]
        for key, value in _fields(record).items():
            parts.append(_kv(key, value))
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, the line's
    keys, the call's ``method``, ``peer`` and ``buffer``, and ``exc`` (a traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"ts": _timestamp(self, record), "level": record.levelname.lower(),
                                 "logger": record.name, "msg": record.getMessage()}
        for key, value in _fields(record).items():
            entry.setdefault(key, _json_value(value))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


def setup_logging(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
