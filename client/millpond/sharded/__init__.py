"""One buffer over several daemons (shards), composed by the client.

``client.py``: :class:`ShardedClient` (shard health); ``buffer.py``: :class:`ShardedBuffer`
(``reads.py``: its episodic calls, reads and reset); ``placement.py``: capacity split,
per-shard draws, weights and indices; ``names.py``: ``dns:///`` targets.
"""

from millpond.sharded.buffer import ShardedBuffer
from millpond.sharded.client import ShardedClient

__all__ = ["ShardedBuffer", "ShardedClient"]
