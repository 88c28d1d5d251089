"""A sum tree (and min tree) over a fixed number of leaves, updated and searched in batches.

Leaves hold non-negative priorities. ``update`` sets many leaves and repairs
their ancestors level by level; ``find`` descends for many prefix sums at
once. Both loop over the tree's levels (about 20 for a million leaves), never
over items, so a batch costs a few dozen numpy operations.
"""

from __future__ import annotations

import numpy as np


class SumTree:
    """Sums and minimums of ``capacity`` leaves (unset leaves are 0 / +inf)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.size = 1 << max(0, (capacity - 1).bit_length())  # leaves, a power of two
        self.depth = self.size.bit_length() - 1
        self.sums = np.zeros(2 * self.size, np.float64)
        self.mins = np.full(2 * self.size, np.inf, np.float64)

    @property
    def total(self) -> float:
        return float(self.sums[1])

    @property
    def min(self) -> float:
        return float(self.mins[1])

    def get(self, leaves: np.ndarray) -> np.ndarray:
        return self.sums[self.size + np.asarray(leaves)]

    def update(self, leaves: np.ndarray, values: np.ndarray, unset: np.ndarray | None = None) -> None:
        """Set ``leaves`` to ``values`` (the last one wins for repeated leaves).

        ``unset`` marks leaves to clear instead (sum 0, min +inf): records gone.
        """
        nodes = self.size + np.asarray(leaves, np.int64)
        values = np.asarray(values, np.float64)
        self.sums[nodes] = values
        self.mins[nodes] = values if unset is None else np.where(unset, np.inf, values)
        # Repair the ancestors one level at a time. A parent listed twice gets
        # the same value twice, which is cheaper than deduplicating.
        for _ in range(self.depth):
            nodes >>= 1
            left = nodes << 1
            self.sums[nodes] = self.sums[left] + self.sums[left + 1]
            self.mins[nodes] = np.minimum(self.mins[left], self.mins[left + 1])

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """For each prefix sum in ``[0, total)``, the leaf whose range contains it."""
        prefix = np.asarray(prefix, np.float64).copy()
        nodes = np.ones(len(prefix), np.int64)
        for _ in range(self.depth):
            nodes <<= 1
            left = self.sums[nodes]
            right = prefix >= left
            prefix -= left * right
            nodes += right
        # Float rounding may walk into an empty leaf at the very end: step back
        # to the nearest leaf with weight.
        leaves = np.minimum(nodes - self.size, self.capacity - 1)
        empty = self.sums[self.size + leaves] <= 0
        if empty.any():
            nonzero = np.flatnonzero(self.sums[self.size : self.size + self.capacity] > 0)
            pos = np.searchsorted(nonzero, leaves[empty])
            leaves[empty] = nonzero[np.clip(pos - 1, 0, len(nonzero) - 1)]
        return leaves
