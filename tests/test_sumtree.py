"""The sum tree against a plain array: updates, totals, minimums and prefix-sum search.

The model is a float64 array of leaf values (0 when unset) and a flag per leaf
for "set"; ``find`` is ``searchsorted(cumsum(values), prefix, side="right")``.
Values are multiples of 1/8 below 2**20, so every sum the tree or the model
computes is exact and the two must agree to the bit, boundaries included.
A separate test uses arbitrary floats and checks what rounding allows.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millpond.core.sumtree import SumTree

# (branching, top): from a flat array (depth 0) to a deep narrow tree.
SHAPES = [(16, 4096), (2, 1), (3, 2), (4, 5), (16, 3), (7, 8)]


class Model:
    def __init__(self, capacity: int):
        self.values = np.zeros(capacity)
        self.set = np.zeros(capacity, bool)

    def update(self, leaves, values, unset):
        for leaf, value, gone in zip(leaves, values, unset):  # in order: the last one wins
            self.values[leaf] = 0.0 if gone else value
            self.set[leaf] = not gone

    @property
    def total(self) -> float:
        return float(self.values.sum())

    @property
    def min(self) -> float:
        return float(self.values[self.set].min()) if self.set.any() else np.inf

    def find(self, prefix: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.cumsum(self.values), prefix, side="right")


exact_values = st.integers(0, 8 * 64).map(lambda k: k / 8)


@st.composite
def scenarios(draw, max_capacity=100):
    capacity = draw(st.integers(1, max_capacity))
    shape = draw(st.sampled_from(SHAPES))
    batches = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 2 * capacity))
        leaves = draw(st.lists(st.integers(0, capacity - 1), min_size=n, max_size=n))
        values = draw(st.lists(exact_values, min_size=n, max_size=n))
        unset = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
        batches.append((leaves, values, unset))
    return capacity, shape, batches


def boundary_prefixes(model: Model, rng: np.random.Generator) -> np.ndarray:
    """Prefixes in [0, total): every leaf boundary, just below each, and random ones."""
    cums = np.cumsum(model.values)
    total = cums[-1]
    edges = np.concatenate([[0.0], cums])
    below = np.nextafter(edges, -np.inf)
    random = rng.integers(0, int(total * 8), 64) / 8  # exact multiples of 1/8
    prefixes = np.concatenate([edges, below, random, [np.nextafter(total, 0)]])
    return prefixes[(prefixes >= 0) & (prefixes < total)]


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_the_tree_matches_a_plain_array(scenario, seed):
    capacity, (branching, top), batches = scenario
    tree, model = SumTree(capacity, branching, top), Model(capacity)
    rng = np.random.default_rng(seed)
    assert tree.capacity == capacity and tree.total == 0 and tree.min == np.inf
    for leaves, values, unset in batches:
        flags = unset if unset is not None else [False] * len(leaves)
        tree.update(np.array(leaves, np.int64), np.array(values, np.float64),
                    None if unset is None else np.array(unset, bool))
        model.update(leaves, values, flags)
        assert tree.total == model.total
        assert tree.min == model.min
        np.testing.assert_array_equal(tree.get(np.arange(capacity)), model.values)
        if model.total > 0:
            prefixes = boundary_prefixes(model, rng)
            found = tree.find(prefixes)
            np.testing.assert_array_equal(found, model.find(prefixes))
            assert (model.values[found] > 0).all()
            leaves_found, values_found = tree.find_values(prefixes)
            np.testing.assert_array_equal(leaves_found, found)
            np.testing.assert_array_equal(values_found, model.values[found])


@settings(max_examples=100, deadline=None)
@given(scenarios(max_capacity=40), st.integers(0, 2**32 - 1))
def test_prefixes_at_or_past_the_total_land_on_the_last_leaf_with_weight(scenario, seed):
    """rng.random() * total can round up to total: never a leaf without weight."""
    capacity, (branching, top), batches = scenario
    tree, model = SumTree(capacity, branching, top), Model(capacity)
    for leaves, values, unset in batches:
        flags = unset if unset is not None else [False] * len(leaves)
        tree.update(np.array(leaves, np.int64), np.array(values, np.float64),
                    None if unset is None else np.array(unset, bool))
        model.update(leaves, values, flags)
    if model.total > 0:
        last = np.flatnonzero(model.values)[-1]
        total = model.total
        prefixes = np.array([total, np.nextafter(total, np.inf), total * 1.5])
        np.testing.assert_array_equal(tree.find(prefixes), [last] * 3)


finite_values = st.one_of(
    st.just(0.0),
    st.floats(1e-300, 1e300, allow_nan=False, allow_infinity=False),
    st.floats(1e-6, 1e6),
)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.sampled_from(SHAPES), st.data())
def test_arbitrary_floats_find_a_leaf_with_weight_whose_range_holds_the_prefix(
        capacity, shape, data):
    tree = SumTree(capacity, *shape)
    values = np.array(data.draw(st.lists(finite_values, min_size=capacity, max_size=capacity)))
    # Magnitudes within 1e12 of each other: leaves far below the rounding of
    # the total have no range of their own anyway.
    values = np.where(values > 0, np.clip(values, values.max() / 1e12, None), 0.0)
    tree.update(np.arange(capacity), values)
    total = values.sum()
    np.testing.assert_allclose(tree.total, total, rtol=1e-12)
    if total == 0:
        return
    seed = data.draw(st.integers(0, 2**32 - 1))
    prefixes = np.random.default_rng(seed).random(200) * tree.total
    found = tree.find(prefixes)
    assert (values[found] > 0).all()
    cums = np.cumsum(values)
    slack = 1e-9 * total
    assert (cums[found] - values[found] - slack <= prefixes).all()
    assert (prefixes < cums[found] + slack).all()


def test_repeated_leaves_take_the_last_value_at_every_level():
    tree = SumTree(40, 2, 1)
    tree.update(np.array([5, 5, 5, 39, 39]), np.array([1.0, 2.0, 3.0, 4.0, 0.5]))
    assert tree.get([5, 39]).tolist() == [3.0, 0.5]
    assert tree.total == 3.5 and tree.min == 0.5
    tree.update(np.array([39, 39]), np.array([7.0, 1.0]), unset=np.array([False, True]))
    assert tree.total == 3.0 and tree.min == 3.0 and tree.get([39]).tolist() == [0.0]


def test_zero_counts_for_the_minimum_unless_unset():
    tree = SumTree(7)
    tree.update(np.arange(7), np.array([1, 0, 2, 0, 3, 0, 4], float))
    assert tree.total == 10 and tree.min == 0
    tree.update(np.array([1, 3, 5]), np.zeros(3), unset=np.ones(3, bool))
    assert tree.total == 10 and tree.min == 1
    tree.update(np.arange(7), np.zeros(7), unset=np.ones(7, bool))
    assert tree.total == 0 and tree.min == np.inf


def test_capacity_one():
    tree = SumTree(1)
    assert tree.total == 0 and tree.min == np.inf
    tree.update([0], [2.5])
    assert tree.total == 2.5 and tree.min == 2.5
    np.testing.assert_array_equal(tree.find([0.0, 1.0, 2.4999]), [0, 0, 0])
    tree.update([0], [0.0], unset=[True])
    assert tree.total == 0 and tree.min == np.inf


@pytest.mark.parametrize("capacity", [4097, 70_000, 1_000_003])
def test_default_shape_at_sizes_with_levels_below_the_top(capacity):
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity)
    values = rng.integers(0, 8, capacity) / 4  # exact sums
    values[-1000:] = 0  # trailing empty leaves, as after evictions
    tree.update(np.arange(capacity), values)
    assert tree.total == values.sum() and tree.min == 0
    changed = rng.integers(0, capacity, 5000)  # with repeats: the last one wins
    new = rng.integers(1, 8, 5000) / 4
    tree.update(changed, new)
    for leaf, value in zip(changed, new):
        values[leaf] = value
    assert tree.total == values.sum() and tree.min == values.min()
    cums = np.cumsum(values)
    prefixes = np.concatenate([rng.integers(0, int(cums[-1] * 4), 5000) / 4, cums[::97]])
    prefixes = prefixes[prefixes < cums[-1]]
    np.testing.assert_array_equal(tree.find(prefixes), np.searchsorted(cums, prefixes, "right"))
    assert (values[tree.find([np.nextafter(cums[-1], 0), cums[-1]])] > 0).all()


def test_out_of_range_leaves_are_refused():
    tree = SumTree(10)
    with pytest.raises(IndexError):
        tree.update([10], [1.0])
    with pytest.raises(IndexError):
        tree.update([-1], [1.0])
    assert tree.total == 0
