"""What a reply may be, checked the same way whatever the transport.

The client trusts no reply: one that cannot be the answer to its request
raises :class:`~millpond.errors.ProtocolError` naming the server, never a
wrong result or a raw ``KeyError``. The checks live here, so that every
transport that decodes a reply of a kind checks it alike: both gRPC
transports (blocking, :mod:`millpond.remote.grpc_transport`, and asyncio,
:mod:`millpond.remote.aio_transport`) use every check below; shared memory
checks its own replies in one place (:meth:`ShmSession._reply
<millpond.remote.shm.session.ShmSession._reply>`) and the counts here.

* columns (samples of every kind, reads, catalogs; :func:`columns`): exactly the
  names, dtypes and whole shapes the engine returns for the request, as
  :mod:`millpond.core.sequences` describes them; episodes (:func:`episodes`) no
  wider than the buffer, a catalog (:func:`catalog`) whose lengths add up to its
  records;
* samples sent in the stored form (:func:`rebuilt`): rebuilt, every index, length,
  codec and decompressed size checked first, then checked as columns;
* a BufferInfo (:func:`info`): counts that are possible; a Create's (:func:`created`)
  with the config asked for;
* a push of ``n`` records answers ``(size, pushed)`` after it:
  ``min(n, capacity) <= size <= min(capacity, pushed)`` and ``pushed >= n``
  (the records just stored are live and counted); on one ordered stream of a
  buffer's pushes, where nothing else lowers ``pushed`` (any mode but a
  stack, whose pops lower it), each reply's ``pushed`` is at least the one
  before it plus ``n``. Across calls the client cannot know (another client
  may have deleted and made the buffer again, a restarted daemon's undeclared
  buffer starts anew), so nothing is asked there;
* ``update_priorities`` of ``n`` indices answers how many were live: ``0..n``.

Names, dtypes, shapes, integers and comparisons: no check reads the data, but
for a catalog's lengths (one per episode), which are summed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from millpond.core.config import BufferConfig
from millpond.core.info import BufferInfo
from millpond.core.schema import Schema
from millpond.core.sequences import Spec, catalog_specs, episode_specs
from millpond.core.stored import StoredBatch, StoredFormError
from millpond.errors import ProtocolError


def refused(server: str, what: str, detail: str) -> ProtocolError:
    """The error for a reply from ``server`` to ``what`` that is not possible: ``detail``."""
    return ProtocolError(f"the server at {server or '?'} answered {what} with {detail}")


def count(value: Any, most: int, server: str, what: str) -> int:
    """``value`` if it is an integer in ``[0, most]``; else ProtocolError."""
    if not _integer(value) or not 0 <= value <= most:
        raise refused(server, what, f"a count of {value!r}, not one in [0, {most:,}]")
    return value


def pushed(size: Any, pushed: Any, n: int, capacity: int | None, after: int | None,
           server: str) -> int:
    """``pushed`` of the reply ``(size, pushed)`` to a push of ``n`` records into a buffer
    of ``capacity`` records (None: not known here), if possible (see the module
    docstring); ``after``: the ``pushed`` of the reply before it on the same ordered
    stream, if known. Else ProtocolError."""
    most = pushed if capacity is None else min(capacity, pushed)
    if not (_integer(size) and _integer(pushed) and n <= pushed
            and min(n, most) <= size <= most):
        raise refused(server, f"a push of {n:,} records",
                      f"{size!r} records held and {pushed!r} ever pushed"
                      + ("" if capacity is None else f", in a buffer of {capacity:,}"))
    if after is not None and pushed < after + n:
        raise refused(server, f"a push of {n:,} records",
                      f"{pushed:,} records ever pushed, after {after:,} in the reply before "
                      "it on the same stream")
    return pushed


def columns(columns: dict[str, np.ndarray], specs: Spec, what: str, server: str
            ) -> dict[str, np.ndarray]:
    """``columns`` if they are exactly the arrays of ``specs`` (name, dtype, whole
    shape: what the engine returns for the request, as :mod:`millpond.core.sequences`
    describes it); else ProtocolError. No more, no fewer names; each array of that
    dtype and shape, rows included. A few comparisons per column: it runs on every
    sample."""
    if len(columns) != len(specs) or any(name not in columns for name, _, _ in specs):
        raise refused(server, what, f"columns {sorted(columns)[:20]}, not "
                      f"{sorted(name for name, _, _ in specs)}")
    for name, dtype, shape in specs:
        column = columns[name]
        if column.dtype != dtype or column.shape != shape:
            raise refused(server, what, f"{name} {column.dtype}"
                          f"{list(column.shape)}, not {np.dtype(dtype)}{list(shape)}")
    return columns


def rebuilt(found: dict[str, np.ndarray], schema: Schema, what: str, server: str
            ) -> dict[str, np.ndarray]:
    """The arrays of a sample reply: ``found`` itself if plain, else the arrays rebuilt
    from its stored form (:class:`millpond.core.stored.StoredBatch`: distinct frames
    once, indices into them), every index, length, codec and decompressed size
    checked: ProtocolError if any does not fit. The result is for :func:`columns` to
    check like any reply."""
    try:
        batch = StoredBatch.from_columns(found)
        return found if batch is None else batch.rebuild(schema)
    except StoredFormError as exc:
        raise refused(server, what, f"a stored-form sample that cannot be rebuilt: {exc}"
                      ) from None


def episodes(found: dict[str, np.ndarray], config: BufferConfig, batch_size: int,
             max_len: int | None, server: str) -> dict[str, np.ndarray]:
    """The columns of a sample_episodes reply, checked: ``max_len`` wide, or (None) as wide
    as the longest episode drawn, which the buffer could hold."""
    what, width = f"sample_episodes({batch_size})", max_len
    if width is None:  # the longest drawn: no longer than the buffer holds
        mask = found.get("mask")
        width = mask.shape[1] if mask is not None and mask.ndim == 2 else 0
        if not 0 < width <= config.total_capacity:
            raise refused(server, what, f"episodes {width:,} steps wide, "
                          f"in a buffer of {config.total_capacity:,} records")
    return columns(found, episode_specs(config, batch_size, width), what, server)


def catalog(found: dict[str, np.ndarray], config: BufferConfig, server: str
            ) -> dict[str, np.ndarray]:
    """The columns of an episode_catalog reply, checked: its episodes' lengths add up to
    its records, at most the buffer's capacity."""
    lens, seqs = found.get("lens"), found.get("seqs")
    n_episodes, records = (len(a) if a is not None and a.ndim else 0 for a in (lens, seqs))
    columns(found, catalog_specs(config, n_episodes, records), "episode_catalog", server)
    assert lens is not None  # (checked)
    # Not a learner's hot call: the lengths (one per episode) are summed.
    if records > config.total_capacity or (n_episodes and (
            lens.min() < 1 or int(lens.sum()) != records)):
        raise refused(server, "episode_catalog", f"{n_episodes:,} episodes "
                      f"of {records:,} records in all, their lengths summing to "
                      f"{int(lens.sum()):,}, in a buffer of "
                      f"{config.total_capacity:,} records")
    return found


def info(info: BufferInfo, server: str) -> BufferInfo:
    """``info`` (decoded from a reply), if its counts are possible; else ProtocolError (a
    size or a priority mass beyond belief would skew every draw over shards). Possible:
    ``0 <= size <= min(total_capacity, pushed)``; complete episodes and episodes
    in progress (each has a live record) at most ``total_capacity`` together;
    priority total finite, it and the minimum not negative (nor NaN). A buffer held out
    of service has no numbers to check."""
    if not info.ok:
        return info
    n_episodes = (info.episodes, info.episodes_in_progress)
    total, least = info.priority_total, info.priority_min
    if not (0 <= info.size <= min(info.total_capacity, info.pushed)
            and min(n_episodes) >= 0 and sum(n_episodes) <= info.total_capacity
            and (total is None or 0 <= total < math.inf)
            and (least is None or 0 <= least)):  # (inf when empty; never NaN)
        raise ProtocolError(
            f"the server at {server or '?'} reported buffer {info.name!r} holding "
            f"{info.size:,} records, {info.episodes:,} complete episodes and "
            f"{info.episodes_in_progress:,} in progress, priority total and minimum "
            f"{info.priority_total} and {info.priority_min}, with capacity "
            f"{info.total_capacity:,} and {info.pushed:,} pushed")
    return info


def created(info: BufferInfo, config: BufferConfig, name: str, server: str) -> BufferInfo:
    """The (checked) info of a Create of ``name`` with ``config``, if it has that config
    (a buffer is made with it, or attached where it is equal); else ProtocolError:
    handles check every later reply against it."""
    if info.config is None:  # (only a held buffer's info lacks one, and Create refuses those)
        raise refused(server, f"Create of buffer {name!r}", "no config")
    if info.config != config:
        raise refused(server, f"Create of buffer {name!r}", "its config " + "; ".join(
            f"{setting}: {has}, asked for {wants}"
            for setting, has, wants in info.config.differences(config)))
    return info


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
