"""inspect_model: a params' partition table, parameter count and memory per cell, nothing
built (the trainer's --mode=inspect_model, and the planner's optimizer slots)."""

from tf_gpipe.gpipe import PipelinedLayer, partition
from tf_gpipe.trainer import checks


def InspectModel(task_p, input_p=None):
    """The partition table, parameter count and a memory estimate per cell — nothing built.

    With the training input's params, activations are estimated for its real batch shape.
    """
    checks.CheckParams(task_p, {'input': input_p} if input_p is not None else None)
    network_p = task_p.cls.NetworkParams(task_p).Copy()
    if input_p is not None and task_p.cls.InputShape(task_p, input_p) is not None:
        network_p.input_shape = task_p.cls.InputShape(task_p, input_p)
    cells, splits, sub = PipelinedLayer.CellParams(network_p)
    if sub is None:
        sub, splits = [c for c in cells], list(range(1, len(cells) + 1))
    metas = partition.layer_metas(sub, network_p.input_shape)
    rows = [('cell', 'layers', 'params', 'param+opt MB', 'act MB/micro-batch')]
    total = 0
    m = network_p.num_micro_batches
    slots = OptimizerSlots(task_p.train.learner)
    for k, (a, b) in enumerate(partition.blocks(splits)):
        params = sum(meta.param_count for meta in metas[a:b])
        total += params
        # Weights, the gradient sums and the optimizer's slots, float32.
        param_mb = params * 4 * (2 + slots) / 2**20
        act_mb = sum(meta.activation_bytes for meta in metas[a:b]) / max(m, 1) / 2**20
        rows.append(
            (
                str(k),
                partition.block_label(sub, a, b),
                f'{params:,}',
                f'{param_mb:.1f}',
                f'{act_mb:.2f}',
            )
        )
    lines = [partition.format_table(rows)]
    shape = network_p.input_shape
    shape = {k: tuple(v) for k, v in shape.items()} if isinstance(shape, dict) else tuple(shape)
    lines.append(f'total parameters: {total:,}  (activation estimate for input shape {shape})')
    lines.append(
        f'param+opt: weights, gradient sums and {slots} {task_p.train.learner.optimizer} slot(s) '
        'per '
        'parameter, float32'
    )
    return '\n'.join(lines), total


def OptimizerSlots(learner_p):
    """Variables the optimizer keeps per parameter (Keras 3): adam 2, momentum 1, rmsprop 1 (2
    with momentum), sgd 0."""
    return {
        'sgd': 0,
        'momentum': 1,
        'adam': 2,
        'rmsprop': 1 + (learner_p.momentum > 0),
    }[learner_p.optimizer]
