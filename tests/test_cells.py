"""cells: the cells a pipeline's params ask for and their devices, decided without building."""

import pytest

from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import cells


def _params(**kw):
    fc = layers.FCLayer.Params().Set(input_dim=8, output_dim=8)
    sub = [fc.Copy().Set(name=f'fc{i}') for i in range(6)]
    return gpipe.PipelinedLayer.Params().Set(name='pipe', sub=sub, **kw)


def test_splits_cut_sub_into_sequences_of_its_layers():
    cell_params, splits, sub = cells.cell_params(_params(num_partitions=3, splits=[1, 5, 6]))
    assert splits == [1, 5, 6] and len(sub) == 6
    assert [[q.name for q in c.sub] for c in cell_params] == [
        ['fc0'],
        ['fc1', 'fc2', 'fc3', 'fc4'],
        ['fc5'],
    ]
    assert all(c.cls is layers.SequentialLayer for c in cell_params)


def test_the_partitioner_balances_by_cost_when_no_splits_are_given():
    _, splits, _ = cells.cell_params(_params(num_partitions=3, partition_by='uniform'))
    assert splits == [2, 4, 6]


def test_cell_tpl_is_taken_as_given():
    seq = layers.SequentialLayer.Params().Set(sub=[layers.FCLayer.Params().Set(name='fc')])
    p = gpipe.PipelinedLayer.Params().Set(name='pipe', cell_tpl=[seq, seq.Copy()])
    cell_params, splits, sub = cells.cell_params(p)
    assert [c.name for c in cell_params] == ['cell0', 'cell1'] and splits is None and sub is None


def test_device_rows_name_what_is_missing():
    p = _params(devices=['/device:CPU:0'])
    with pytest.raises(ValueError, match='2 cells need 2 devices, got 1'):
        cells.device_rows(p, 1, 2)
    with pytest.raises(ValueError, match='num_replicas=2 needs 2 rows of devices, got 1'):
        cells.device_rows(p, 2, 1)
    assert cells.device_rows(_params(devices=['/cpu:1', '/cpu:0']), 1, 2) == [
        ['/device:CPU:1', '/device:CPU:0']
    ]
