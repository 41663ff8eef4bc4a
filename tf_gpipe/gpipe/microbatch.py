"""Split a batch (a tensor or a nested structure) into M micro-batches, and merge them back."""

import tensorflow as tf

from tf_gpipe.nested_map import NestedMap


def _path_names(structure):
    return [p for p, _ in NestedMap(x=structure).FlattenItems()]


def check_divisible(structure, num_micro_batches, batch_dim=0):
    """Raises a ValueError when a statically known batch size is not a multiple of M."""
    for path, leaf in zip(_path_names(structure), tf.nest.flatten(structure)):
        shape = getattr(leaf, 'shape', None)
        if shape is None:
            continue
        if shape.rank is not None and shape.rank <= batch_dim:
            raise ValueError(
                f"Input '{path[2:] or 'x'}' has shape {shape}, no batch dimension {batch_dim} "
                'to split into micro-batches; every input must carry the batch.'
            )
        size = shape[batch_dim] if shape.rank is not None else None
        if size is not None and size % num_micro_batches:
            raise ValueError(
                f'A batch of {size} examples cannot be split into {num_micro_batches} equal '
                f'micro-batches (input {path[2:] or "x"!r}, shape {shape}). Use a batch size '
                f'that is a multiple of num_micro_batches, e.g. '
                f'{(size // num_micro_batches + 1) * num_micro_batches}, or another '
                'num_micro_batches that divides it.'
            )


def split(structure, num_micro_batches, batch_dim=0):
    """[structure of micro-batch 0, ..., M-1]: every tensor leaf split along batch_dim."""
    check_divisible(structure, num_micro_batches, batch_dim)
    leaves = tf.nest.flatten(structure)
    if num_micro_batches == 1:
        return [structure]
    pieces = []
    for leaf in leaves:
        size = tf.shape(leaf)[batch_dim]
        with tf.control_dependencies(
            [
                tf.debugging.assert_equal(
                    size % num_micro_batches,
                    0,
                    message=(
                        f'batch size is not a multiple of num_micro_batches={num_micro_batches}. '
                        'Use batch sizes that are multiples of it, and drop or pad a last partial '
                        'batch (tf.data: .batch(n, drop_remainder=True))'
                    ),
                )
            ]
        ):
            pieces.append(tf.split(leaf, num_micro_batches, axis=batch_dim))
    return [
        tf.nest.pack_sequence_as(structure, [p[m] for p in pieces])
        for m in range(num_micro_batches)
    ]


def merge(micro_batches, batch_dim=0):
    """Inverse of split: concatenates the leaves of the micro-batch structures in order.

    None leaves (no gradient, e.g. for integer inputs) stay None.
    """
    if len(micro_batches) == 1:
        return micro_batches[0]

    def concat(*xs):
        return None if xs[0] is None else tf.concat(xs, axis=batch_dim)

    return tf.nest.map_structure(concat, *micro_batches)
