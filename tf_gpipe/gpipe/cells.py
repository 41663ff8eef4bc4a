"""Which cells a PipelinedLayer's params ask for, and on which devices: nothing is built.

`cell_params` cuts `sub` into cells (given splits, or the partitioner's on layer costs) or takes
the user's `cell_tpl`; `device_rows` and `strategy_rows` give each replica's row of K devices.
"""

from tf_gpipe.gpipe import partition
from tf_gpipe.runtime import cluster, distribute
from tf_gpipe.sequential import SequentialLayer


def cell_params(p):
    """The partition params `p` asks for, nothing built: (each cell's params, the end
    index of each cell in `sub` or None, the flat `sub` or None when `cell_tpl` gives the
    cells). The trainer's inspect_model and FPropMeta read it."""
    if (p.cell_tpl is None) == (p.sub is None):
        raise ValueError(
            f'{p.name}: set exactly one of cell_tpl (a list of cell params) and '
            'sub (a list of layer params to partition).'
        )
    if p.cell_tpl is not None:
        if not p.cell_tpl:
            raise ValueError(f'{p.name}: cell_tpl is empty.')
        return (
            [c.Copy().Set(name=c.name or f'cell{i}') for i, c in enumerate(p.cell_tpl)],
            (None),
            None,
        )
    sub = list(p.sub)
    if not sub:
        raise ValueError(f'{p.name}: sub is empty.')
    if p.splits is not None:
        splits = partition.check_splits(list(p.splits), len(sub))
        cells_wanted = p.num_partitions * p.virtual_stages
        if p.num_partitions != 1 and len(splits) != cells_wanted:
            raise ValueError(
                f'{p.name}: splits={list(p.splits)} makes {len(splits)} cells, but '
                f'num_partitions={p.num_partitions} x virtual_stages={p.virtual_stages} '
                f'asks for {cells_wanted}. Give {cells_wanted} splits, or set '
                f'num_partitions={len(splits) // p.virtual_stages}.'
            )
    else:
        # Before costing: partition_by='time' would run every layer first.
        num_cells = p.num_partitions * p.virtual_stages
        partition.check_num_partitions(num_cells, len(sub))
        costs, crossing = partition.costs_and_crossing(
            sub, p.partition_by, p.input_shape, p.input_dtype
        )
        splits = partition.balance(costs, num_cells, crossing)
    cells = [
        SequentialLayer.Params().Set(name=f'cell{i}', sub=[q.Copy() for q in sub[a:b]])
        for i, (a, b) in enumerate(partition.blocks(splits))
    ]
    return cells, splits, sub


def device_rows(p, r_count, k):
    """R rows of K canonical device names."""
    if p.devices is None:
        rows = cluster.current_mesh().pipeline_devices(r_count, k)
    else:
        nested = all(isinstance(d, (list, tuple)) for d in p.devices)
        rows = [list(d) for d in p.devices] if nested else [list(p.devices)]
        if len(rows) != r_count:
            raise ValueError(
                f'{p.name}: num_replicas={r_count} needs {r_count} rows of devices, got '
                f'{len(rows)}: {p.devices}.'
            )
        for row in rows:
            if len(row) < k:
                raise ValueError(
                    f'{p.name}: {k} cells need {k} devices, got {len(row)}: {row}. Pass '
                    'one device per cell, or use fewer cells.'
                )
        rows = [row[:k] for row in rows]
    return [cluster.check_device_names(row) for row in rows]


def strategy_rows(p, k):
    """R rows of K device names from the strategy's mesh, for a pipeline built in its scope."""
    if p.num_replicas != 1 or p.devices is not None:
        raise ValueError(
            f'{p.name}: built inside mesh.strategy().scope(), the replicas and devices come '
            f'from the mesh; leave num_replicas=1 (got {p.num_replicas}) and devices=None '
            f'(got {p.devices}).'
        )
    mesh = distribute.current_mesh()
    return [cluster.check_device_names(mesh.stage_devices(k, r)) for r in range(mesh.num_replicas)]
