"""Ring arithmetic shared by the tiers.

A record with sequence number ``seq`` lives at slot ``seq % capacity`` of a
ring. Copies between rings are done per contiguous chunk: a seq range is cut
wherever any of the rings involved wraps, so each chunk is one slice on every
side and a batch of n records costs a handful of slice copies, never a loop
over records.
"""

from __future__ import annotations


def ring_chunks(start: int, stop: int, *capacities: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into chunks that cross no wrap of any capacity.

    >>> ring_chunks(3, 9, 4)
    [(3, 4), (4, 8), (8, 9)]
    >>> ring_chunks(0, 6, 4, 3)
    [(0, 3), (3, 4), (4, 6)]
    """
    chunks = []
    pos = start
    while pos < stop:
        end = min([stop] + [(pos // cap + 1) * cap for cap in capacities])
        chunks.append((pos, end))
        pos = end
    return chunks
