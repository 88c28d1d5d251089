"""A millpond daemon whose replies lie, for the tests of a client that trusts no reply.

    python tests/lying_daemon.py serve ...   # the arguments of `millpond serve`

``MILLPOND_LIE`` says how: ``rows`` (a sample reply with twice the rows asked for),
``dtype`` (its float32 columns sent as float64), ``extra`` (one more column),
``missing`` (a column left out), ``size`` (Info claims 2**62 records). For tests only.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from millpond.core import TieredBuffer
from millpond.wire.frames import SAMPLE_BATCH_FIELD, encode_with_batch
from millpond_server import cli, operations, service

LIE = os.environ.get("MILLPOND_LIE", "")
_real_sample = service.ReplayService._sample_frames
_real_info = operations.Operations.info


def _lying_sample(self: service.ReplayService, buffer: TieredBuffer, batch_size: int,
                  seed: int | None) -> bytes:
    columns = dict(self.ops.sample(buffer, batch_size, seed))
    if LIE == "rows":
        columns = {name: np.concatenate([column, column]) for name, column in columns.items()}
    elif LIE == "dtype":
        columns = {name: column.astype(np.float64) if column.dtype == np.float32 else column
                   for name, column in columns.items()}
    elif LIE == "extra":
        columns["surprise"] = np.zeros(batch_size, np.int8)
    elif LIE == "missing":
        columns.pop(next(iter(columns)))
    return encode_with_batch(SAMPLE_BATCH_FIELD, columns)


def _lying_info(self: operations.Operations, name: str, buffer: Any = None,
                include_unavailable: bool = False) -> Any:
    info = _real_info(self, name, buffer, include_unavailable)
    if LIE == "size":
        import dataclasses

        return dataclasses.replace(info, size=2**62)
    return info


if __name__ == "__main__":
    service.ReplayService._sample_frames = _lying_sample  # type: ignore[method-assign]
    operations.Operations.info = _lying_info  # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[1:]))
