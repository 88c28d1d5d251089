"""A pytest plugin that runs TorchRL's own replay-buffer tests over millpond's parts.

Not part of the suite (TorchRL's tests are not on PyPI: its wheels and sdists
ship none). With a checkout of pytorch/rl, from its ``test/rb`` directory::

    PYTHONPATH=/path/to/millpond/tests pytest -p torchrl_upstream test_composable.py
    MILLPOND_ADDRESS=127.0.0.1:50051 PYTHONPATH=... pytest -p torchrl_upstream ...  # a daemon

Before the test modules are imported, TorchRL's ``ListStorage``,
``LazyTensorStorage`` and ``LazyMemmapStorage`` become ``MillpondStorage`` (a
fresh buffer each, closed after each test), ``RandomSampler`` becomes
``MillpondSampler``, ``PrioritizedSampler`` ``MillpondPrioritizedSampler`` and
``SliceSampler`` ``MillpondSliceSampler``, wherever the tests name them. What
fails then is what the adapter does not support (see
``millpond.integrations.torchrl``), or a test of a TorchRL storage's or sampler's
own internals; ``tests/test_integrations_torchrl.py`` ports the cases that apply.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torchrl.data as data_module
import torchrl.data.replay_buffers as rb_module
import torchrl.data.replay_buffers.samplers as sampler_module
import torchrl.data.replay_buffers.storages as storage_module

from millpond.integrations.torchrl import (
    MillpondPrioritizedSampler,
    MillpondSampler,
    MillpondSliceSampler,
    MillpondStorage,
)

_names = itertools.count()
_made: list[MillpondStorage] = []
ADDRESS = os.environ.get("MILLPOND_ADDRESS")


class Storage(MillpondStorage):
    """TorchRL's storages' arguments; ``max_size=None`` (an unbounded list) is 1,000."""

    def __init__(self, max_size: int | None = None, *args: Any, compilable: bool = False,
                 device: Any = "cpu", ndim: int = 1, **kwargs: Any):
        if ndim != 1:
            raise NotImplementedError("MillpondStorage has ndim 1")
        where = {} if ADDRESS is None else {"address": ADDRESS,
                                            "name": f"upstream-{os.getpid()}-{next(_names)}"}
        super().__init__(max_size or 1000, device="cpu" if device == "auto" else device, **where)
        _made.append(self)


class Prioritized(MillpondPrioritizedSampler):
    """TorchRL's ``PrioritizedSampler`` arguments (``max_capacity`` first)."""

    def __init__(self, max_capacity: int | None = None, alpha: float = 0.6, beta: float = 0.4,
                 eps: float = 1e-8, dtype: Any = None, reduction: str = "max",
                 max_priority_within_buffer: bool = False, device: Any = None):
        super().__init__(alpha, beta, eps, reduction)


for _module in (data_module, rb_module, storage_module):
    for _name in ("ListStorage", "LazyTensorStorage", "LazyMemmapStorage"):
        if hasattr(_module, _name):
            setattr(_module, _name, Storage)
for _module in (data_module, rb_module, sampler_module):
    for _name, _cls in (("RandomSampler", MillpondSampler), ("PrioritizedSampler", Prioritized),
                        ("SliceSampler", MillpondSliceSampler)):
        if hasattr(_module, _name):
            setattr(_module, _name, _cls)


def pytest_runtest_teardown(item: Any, nextitem: Any) -> None:
    """Close (delete) every storage the test made: a daemon holds at most --max-buffers."""
    while _made:
        try:
            _made.pop().close()
        except Exception:  # a test may have closed it, or left it half made
            pass
