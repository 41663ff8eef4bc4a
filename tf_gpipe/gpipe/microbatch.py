"""Split a batch (a tensor or a nested structure) into micro-batches, and merge them back.

Any batch size works: N examples become min(M, N) micro-batches (M when N is not known while
tracing) whose sizes differ by at most one, the larger first — as torchgpipe does. The pipeline
weights each micro-batch's loss by its size, so loss and gradients equal the full batch's.
"""

import tensorflow as tf

from tf_gpipe.nested_map import NestedMap


def _path_names(structure):
    return [p for p, _ in NestedMap(x=structure).FlattenItems()]


def batch_size(structure, batch_dim=0):
    """The batch size: a Python int when every leaf's shape knows it, else a scalar tensor.

    Raises ValueError for a leaf without a batch dimension or leaves that disagree.
    """
    static, first = set(), None
    for path, leaf in zip(_path_names(structure), tf.nest.flatten(structure)):
        shape = getattr(leaf, 'shape', None)
        if shape is None:
            continue
        if shape.rank is not None and shape.rank <= batch_dim:
            raise ValueError(
                f"Input '{path[2:] or 'x'}' has shape {shape}, no batch dimension {batch_dim} "
                'to split into micro-batches; every input must carry the batch.'
            )
        if first is None:
            first = leaf
        if shape.rank is not None and shape[batch_dim] is not None:
            static.add(int(shape[batch_dim]))
    if len(static) > 1:
        raise ValueError(
            f'The inputs disagree on the batch size (dimension {batch_dim}): {sorted(static)}.'
        )
    if static:
        return static.pop()
    if first is None:
        raise ValueError('The inputs hold no tensor to split into micro-batches.')
    return tf.shape(first)[batch_dim]


def num_pieces(size, num_micro_batches):
    """How many micro-batches a batch of `size` becomes: min(M, N) when N is known, else M."""
    return min(num_micro_batches, size) if isinstance(size, int) else num_micro_batches


def sizes(size, num_pieces_):
    """Micro-batch sizes (Python ints for a known batch size, else int32 tensors)."""
    if isinstance(size, int):
        base, extra = divmod(size, num_pieces_)
        return [base + (i < extra) for i in range(num_pieces_)]
    base, extra = size // num_pieces_, size % num_pieces_
    return [base + tf.cast(i < extra, size.dtype) for i in range(num_pieces_)]


def split(structure, num_pieces_, batch_dim=0):
    """[structure of piece 0, ..., piece n-1]: every tensor leaf split along batch_dim into
    pieces whose sizes differ by at most one (larger first)."""
    if num_pieces_ == 1:
        return [structure]
    return split_sizes(structure, sizes(batch_size(structure, batch_dim), num_pieces_), batch_dim)


def split_sizes(structure, piece_sizes, batch_dim=0):
    """[structure of each piece]: every tensor leaf split along batch_dim into `piece_sizes`
    (ints, or scalar tensors)."""
    if len(piece_sizes) == 1:
        return [structure]
    if not all(isinstance(n, int) for n in piece_sizes):
        piece_sizes = tf.stack([tf.cast(n, tf.int32) for n in piece_sizes])
    count = len(piece_sizes) if isinstance(piece_sizes, list) else int(piece_sizes.shape[0])
    leaves = tf.nest.flatten(structure)
    pieces = [tf.split(leaf, piece_sizes, axis=batch_dim, num=count) for leaf in leaves]
    return [tf.nest.pack_sequence_as(structure, [p[i] for p in pieces]) for i in range(count)]


def merge(micro_batches, batch_dim=0):
    """Inverse of split: concatenates the leaves of the micro-batch structures in order.

    None leaves (no gradient, e.g. for integer inputs) stay None.
    """
    if len(micro_batches) == 1:
        return micro_batches[0]

    def concat(*xs):
        return None if xs[0] is None else tf.concat(xs, axis=batch_dim)

    return tf.nest.map_structure(concat, *micro_batches)
