"""A sum tree (and min tree) over a fixed number of leaves, updated and searched in batches.

Leaves hold non-negative priorities. A batch operation costs a few numpy
calls per level of the tree whatever the batch size, so the tree is wide and
shallow rather than binary (twenty levels for a million leaves):

* the *top* level (at most ``top`` nodes) is a flat array; its cumulative sum
  is recomputed when needed after an update, and ``find`` searches it with
  one ``searchsorted`` for the whole batch;
* below it, nodes come in rows of ``branching`` siblings (one row per node of
  the level above), and each row keeps the cumulative sums of its children:
  ``find`` picks the child for every prefix of the batch with one gather of
  rows, one comparison and one ``argmin``; ``update`` recomputes the
  cumulative sums of the rows it touched.

With ``top=8192``, 100k leaves take one row level of 15 below the top and a
million two. Every sum is recomputed from its children (never adjusted by a
difference), so no rounding error accumulates.
"""

from __future__ import annotations

import numpy as np

TOP = 8192
# Row widths tried, narrowest first: a row of b + 1 float64 is 1, 2 or 4 cache lines.
BRANCHINGS = (7, 15, 31)


class SumTree:
    """Sums and minimums of ``capacity`` leaves (unset leaves are 0 / +inf).

    ``branching`` (children per node below the top) defaults to the narrowest
    of :data:`BRANCHINGS` that needs the fewest levels.
    """

    def __init__(self, capacity: int, branching: int | None = None, top: int = TOP):
        if capacity < 1 or top < 1 or (branching is not None and branching < 2):
            raise ValueError("capacity and top must be >= 1, branching >= 2")
        self.capacity = capacity
        self.branching = b = branching or _branching(capacity, top)
        self.depth = depth = _depth(capacity, b, top)
        sizes = _level_sizes(capacity, b, depth)
        top_nodes = sizes[-1]
        self._values = [np.zeros(n, np.float64) for n in sizes]
        self._mins = [np.full(n, np.inf, np.float64) for n in sizes]
        # Row r of level k (one per node of level k + 1) is
        # [c_1, ..., c_{b-1}, +inf, 0], c_j the sum of the row's first j
        # children: the +inf ends every comparison, the 0 is the c_0 of the
        # next row.
        self._cums = []
        for n in sizes[1:]:
            cums = _aligned_zeros(n * (b + 1)).reshape(n, b + 1)
            cums[:, b - 1] = np.inf
            self._cums.append(cums)
        self._leaves = self._values[0]
        self._top_mins = self._mins[-1]
        self._top_cums = np.zeros(top_nodes + 1, np.float64)  # [0, c_1, ..., total]
        self._top_inner = self._top_cums[1:-1]  # what searchsorted compares with
        self._stale = False  # _top_cums and _min are out of date
        self._min = np.inf
        self._offsets = np.empty(0, np.int64)  # see find_values

    # ---- reads -------------------------------------------------------------------------

    def _refresh(self) -> None:
        np.cumsum(self._values[-1], out=self._top_cums[1:])
        self._min = float(self._top_mins.min())
        self._stale = False

    @property
    def total(self) -> float:
        if self._stale:
            self._refresh()
        return float(self._top_cums[-1])

    @property
    def min(self) -> float:
        if self._stale:
            self._refresh()
        return self._min

    def get(self, leaves: np.ndarray) -> np.ndarray:
        return self._leaves[leaves]

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """For each prefix sum in ``[0, total)``, the leaf whose range contains it."""
        return self.find_values(prefix)[0]

    def find_values(self, prefix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`find`, and the leaves' values (what :meth:`get` would return)."""
        if self._stale:
            self._refresh()
        prefix = np.asarray(prefix, np.float64).reshape(-1)
        # Child j of a node covers [c_j, c_{j+1}) of the node's range; the
        # last child also takes what rounding leaves past the end.
        nodes = self._top_inner.searchsorted(prefix, side="right")
        if self._cums:
            prefix = prefix - self._top_cums.take(nodes)
            column = prefix[:, None]  # a view: follows the in-place updates
            b = self.branching
            if len(self._offsets) != len(prefix):
                # Where c_j sits in a [batch, b + 1] block of rows, less one:
                # adding child j gives c_j (c_0: the previous row's 0).
                self._offsets = np.arange(-1, len(prefix) * (b + 1) - 1, b + 1)
            for level in range(self.depth - 1, -1, -1):
                rows = self._cums[level].take(nodes, axis=0)
                # The first c_j > prefix (the first False of <=) is child j.
                child = (rows <= column).argmin(1)
                nodes *= b
                nodes += child
                if level:
                    child += self._offsets
                    prefix -= rows.take(child)
        values = self._leaves.take(nodes)
        if np.count_nonzero(values) < len(values):
            nodes, values = self._step_back(nodes, values)
        return nodes, values

    def _step_back(self, leaves: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Float rounding walked into leaves without weight (or padding past the
        capacity): take the nearest leaf with weight before each instead."""
        empty = values <= 0
        nonzero = np.flatnonzero(self._leaves[: self.capacity] > 0)
        if len(nonzero):
            pos = np.searchsorted(nonzero, leaves[empty])
            leaves[empty] = nonzero[np.clip(pos - 1, 0, len(nonzero) - 1)]
        else:  # nothing has weight (the caller checks total > 0 first)
            leaves[empty] = np.minimum(leaves[empty], self.capacity - 1)
        return leaves, self._leaves.take(leaves)

    # ---- writes ------------------------------------------------------------------------

    def update(self, leaves: np.ndarray, values: np.ndarray, unset: np.ndarray | None = None) -> None:
        """Set ``leaves`` to ``values`` (the last one wins for repeated leaves).

        ``unset`` marks leaves to clear instead (sum 0, min +inf): records gone.
        """
        nodes = np.asarray(leaves, np.int64).reshape(-1)
        values = np.asarray(values, np.float64).reshape(-1)
        if len(nodes) == 0:
            return
        if nodes.min() < 0 or nodes.max() >= self.capacity:
            raise IndexError(f"leaves must be in [0, {self.capacity})")
        if unset is None:
            self._leaves[nodes] = values
            self._mins[0][nodes] = values
        else:
            unset = np.asarray(unset, bool).reshape(-1)
            self._leaves[nodes] = np.where(unset, 0.0, values)
            self._mins[0][nodes] = np.where(unset, np.inf, values)
        b = self.branching
        for level, cums in enumerate(self._cums):
            nodes = nodes // b  # the rows to redo: one per parent
            if len(nodes) > b:  # runs of siblings (a push): each row once
                keep = np.empty(len(nodes), bool)
                keep[0] = True
                np.not_equal(nodes[1:], nodes[:-1], out=keep[1:])
                nodes = nodes[keep]
            # A row listed twice is redone twice, to the same result: cheaper
            # than deduplicating. Rows are worked on transposed ([b, rows]),
            # so that each step is one long vector operation.
            sums = self._values[level].reshape(-1, b).take(nodes, axis=0).T.copy()
            for j in range(1, b):
                sums[j] += sums[j - 1]
            cums[nodes, : b - 1] = sums[: b - 1].T
            self._values[level + 1][nodes] = sums[b - 1]
            mins = self._mins[level].reshape(-1, b).take(nodes, axis=0).T.copy()
            self._mins[level + 1][nodes] = np.minimum.reduce(mins, axis=0)
        self._stale = True


def _branching(capacity: int, top: int) -> int:
    """The narrowest of BRANCHINGS that needs the fewest levels."""
    depth = _depth(capacity, BRANCHINGS[-1], top)
    return next(b for b in BRANCHINGS if _depth(capacity, b, top) == depth)


def _level_sizes(capacity: int, b: int, depth: int) -> list[int]:
    """Nodes per level: level 0 holds the leaves, level ``depth`` the top. Every
    row is full: the leaves are padded (0 / +inf) to top_nodes * b ** depth."""
    top_nodes = -(-capacity // b**depth)
    return [top_nodes * b ** (depth - k) for k in range(depth + 1)]


def tree_nbytes(capacity: int, top: int = TOP) -> int:
    """The memory a :class:`SumTree` of ``capacity`` leaves takes, before making one."""
    b = _branching(capacity, top)
    sizes = _level_sizes(capacity, b, _depth(capacity, b, top))
    values_and_mins = 2 * 8 * sum(sizes)
    row_sums = 8 * (b + 1) * sum(sizes[1:])
    return values_and_mins + row_sums + 8 * (sizes[-1] + 1)


def _depth(capacity: int, branching: int, top: int) -> int:
    """Row levels needed below a top of at most ``top`` nodes."""
    depth = 0
    while -(-capacity // branching**depth) > top:
        depth += 1
    return depth


def _aligned_zeros(n: int, align: int = 64) -> np.ndarray:
    """float64 zeros that start on a cache line (rows of 8, 16, 32 doubles stay on 1, 2, 4)."""
    raw = np.zeros(n + align // 8, np.float64)
    skip = (-raw.ctypes.data % align) // 8
    return raw[skip : skip + n]
