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


def _kv(key: str, value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return f"{key}={text}"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's own key/values, then those of the call it was logged in."""
    fields = dict(getattr(record, "kv", None) or {})
    call = CALL.get()
    if call is not None:
        for key, value in call.fields().items():
            fields.setdefault(key, value)
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
