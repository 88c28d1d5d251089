"""Offline datasets served as read-only episodic buffers (rlox's ``OfflineDatasetBuffer``).

``buffer.py``: the handle; ``progress.py``: the progress bar of a long load. The file
loaders are :mod:`millpond.datasets`.
"""

from millpond.offline.buffer import OfflineDatasetBuffer

__all__ = ["OfflineDatasetBuffer"]
