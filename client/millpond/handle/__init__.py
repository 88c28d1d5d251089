"""The buffer handle users hold (:class:`Buffer`): the reference API over any backend.

``buffer.py``: the handle (its episodic calls in ``episodes.py``, its learner-side reads
in ``learner.py``); ``sampler.py``, ``dataloader.py``: iterators over samples;
``episode_writer.py``: episodes written step by step; ``export.py``: ``.npz`` exports;
``devices.py``: torch tensors on a device.
"""

from millpond.handle.buffer import Buffer, PrioritizedBuffer, handle_for

__all__ = ["Buffer", "PrioritizedBuffer", "handle_for"]
