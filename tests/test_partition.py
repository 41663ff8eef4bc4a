"""Partitioner: exact balance (against brute force), costs from FPropMeta, errors, table."""

import itertools
import random

import numpy as np
import pytest

from tf_gpipe import layers
from tf_gpipe.gpipe import partition


def _brute_force(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        ends = list(cuts) + [n]
        starts = [0] + list(cuts)
        worst = max(sum(costs[a:b]) for a, b in zip(starts, ends))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize('seed', range(12))
def test_balance_is_optimal(seed):

    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [rng.choice([0.0, 1.0, 2.0, 5.0, 13.0]) for _ in range(n)]
    splits = partition.balance(costs, k)
    assert len(splits) == k and splits[-1] == n
    blocks = partition.blocks(splits)
    assert all(b > a for a, b in blocks)  # never an empty cell
    assert max(sum(costs[a:b]) for a, b in blocks) == _brute_force(costs, k)


def test_k_larger_than_layers():
    with pytest.raises(ValueError, match='larger than the number of layers'):
        partition.balance([1, 1], 3)


@pytest.mark.parametrize('seed', range(30))
def test_ties_go_to_the_cuts_that_carry_least(seed):
    """Among the splits with the optimal largest cost, the fewest activations cross the cuts
    (against brute force over every split)."""
    rng = np.random.RandomState(seed)
    n, k = rng.randint(2, 9), rng.randint(1, 5)
    k = min(k, n)
    costs = [float(rng.choice([0.0, 1.0, 2.0])) for _ in range(n)]
    crossing = [int(rng.randint(1, 100)) for _ in range(n)]
    splits = partition.balance(costs, k, crossing)
    best = _brute_force(costs, k)

    def carried(ends):
        return sum(crossing[e - 1] for e in ends[:-1])

    def worst(ends):
        return max(sum(costs[a:b]) for a, b in partition.blocks(ends))

    every = [list(c) + [n] for c in itertools.combinations(range(1, n), k - 1)]
    assert worst(splits) == best
    assert carried(splits) == min(carried(e) for e in every if worst(e) == best)


def test_costs_from_fprop_meta():
    fc = layers.FCLayer.Params()
    sub = [
        fc.Copy().Set(name='a', input_dim=4, output_dim=64),
        fc.Copy().Set(name='b', input_dim=64, output_dim=64),
        fc.Copy().Set(name='c', input_dim=64, output_dim=4),
    ]
    params = partition.layer_costs(sub, 'params', (8, 4))
    assert params == [4 * 64 + 64, 64 * 64 + 64, 64 * 4 + 4]
    flops = partition.layer_costs(sub, 'flops', (8, 4))
    assert flops[1] > flops[0] and flops[1] > flops[2]
    assert partition.layer_costs(sub, 'uniform') == [1.0, 1.0, 1.0]
    times = partition.layer_costs(sub, 'time', (8, 4))
    assert len(times) == 3 and all(t > 0 for t in times)
    with pytest.raises(ValueError, match='needs the input shape'):
        partition.layer_costs(sub, 'flops')
    with pytest.raises(ValueError, match='partition_by must be one of'):
        partition.layer_costs(sub, 'flop', (8, 4))


def test_check_splits():
    assert partition.check_splits([2, 5], 5) == [2, 5]
    with pytest.raises(ValueError, match='strictly increasing'):
        partition.check_splits([3, 2, 5], 5)
    with pytest.raises(ValueError, match='number of layers'):
        partition.check_splits([2, 4], 5)


def test_partition_table():
    fc = layers.FCLayer.Params().Set(input_dim=4, output_dim=4)
    sub = [fc.Copy().Set(name=f'fc{i}') for i in range(3)]
    table = partition.partition_table(sub, [1, 3], ['/cpu:0', '/cpu:1'], (2, 4))
    lines = table.splitlines()
    assert lines[0].split() == ['cell', 'layers', 'params', 'flops', 'act', 'bytes', 'device']
    assert 'fc1 .. fc2 (2)' in lines[3] and '40' in lines[3] and '/cpu:1' in lines[3]


def test_large_cases_reach_the_same_optimum_fast():
    """Above the DP's size the bisection is used: the same largest-block cost as the exact DP
    on random small cases, and a paper-scale cut (1663 layers into 128 cells, minutes for the
    DP) that is balanced."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 14)
        k = rng.randint(1, n)
        costs = [rng.choice([1.0, 2.0, 3.0, 5.0, rng.random() * 10]) for _ in range(n)]

        def largest(splits, costs=costs):
            return max(sum(costs[a:b]) for a, b in partition.blocks(splits))

        fast = partition._balance_large(costs, k)
        assert len(fast) == k and fast[-1] == n and fast == sorted(set(fast)), (costs, k, fast)
        assert largest(fast) == pytest.approx(largest(partition.balance(costs, k))), (costs, k)
    costs = [1.0] + [3.0] * 1661 + [2.0]
    splits = partition.balance(costs, 128)
    assert len(splits) == 128 and max(b - a for a, b in partition.blocks(splits)) == 13
