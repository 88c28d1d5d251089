"""A millpond daemon with its storage work patched out: the ceiling of ``make bench``'s gRPC rows.

    python bench/no_storage.py serve ...   # the arguments of `millpond serve`

The daemon as shipped (gRPC server, handlers, checks, the client's side
unchanged), except:

* a push, once its request is split into fields, is neither decoded nor
  stored, once its buffer is full (the pushes that fill it are stored, so that
  samples have records);
* a sample returns again the reply its first real call of that buffer and
  size made.

A call to it costs what a call costs with no storage work at all: no engine
change can make the real daemon faster than this. For measurements only.
"""

from __future__ import annotations

import sys
from typing import Any

from millpond.core import TieredBuffer
from millpond_server import cli, service

_real_push = service.ReplayService._push_frames
_real_sample = service.ReplayService._sample_frames
_replies: dict[tuple[int, int], bytes] = {}


def _push_frames(self: service.ReplayService, buffer: TieredBuffer, batches: Any,
                 priorities: Any, updates: Any) -> tuple[int, int]:
    if len(buffer) < buffer.config.total_capacity:
        return _real_push(self, buffer, batches, priorities, updates)
    return len(buffer), buffer.pushed


def _sample_frames(self: service.ReplayService, buffer: TieredBuffer, batch_size: int,
                   seed: int | None) -> bytes:
    key = (id(buffer), batch_size)
    if key not in _replies:
        _replies[key] = bytes(_real_sample(self, buffer, batch_size, seed))
    return _replies[key]


if __name__ == "__main__":
    service.ReplayService._push_frames = _push_frames
    service.ReplayService._sample_frames = _sample_frames
    sys.exit(cli.main(sys.argv[1:]))
