"""numpy results as torch tensors: the ``device=`` of every sampling call and iterator.

torch is optional (``pip install 'millpond[torch]'``): it is imported only
when a call asks for a device, and a clear InvalidArgumentError says what to
install if it is missing. numpy stays the default (``device=None``).

On the CPU the tensors share the arrays' memory (``torch.from_numpy``: no
copy; the arrays a sample returns are new and the caller's alone). For a
CUDA device each array is copied once into pinned (page-locked) host memory
and from there with ``non_blocking=True``, so the host-to-device copy can
overlap the caller's work; the copy is ordered on the current stream, so
the tensors are ready for kernels queued after it.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from millpond.errors import InvalidArgumentError


def torch_module() -> Any:
    """``torch``, or InvalidArgumentError saying how to get it."""
    try:
        import torch
    except ImportError:
        raise InvalidArgumentError(
            "device= returns torch tensors, and torch is not installed: "
            "pip install 'millpond[torch]' (or torch), or leave device=None for numpy") from None
    return torch


def check_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` (None stays None: numpy results)."""
    if device is None:
        return None
    torch = torch_module()
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"device must name a torch device, got {device!r}: {exc}"
                                   ) from None


def to_device(batch: Mapping[str, np.ndarray], device: Any) -> dict[str, Any]:
    """``batch``'s arrays as tensors on ``device`` (None: ``batch`` unchanged, as a dict)."""
    target = check_device(device)
    if target is None:
        return dict(batch)
    torch = torch_module()
    pin = target.type == "cuda"
    out = {}
    for name, array in batch.items():
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array)  # torch shares memory only with writable C arrays
        tensor = torch.from_numpy(array)
        if pin:
            tensor = tensor.pin_memory()
        out[name] = tensor.to(target, non_blocking=pin)
    return out
