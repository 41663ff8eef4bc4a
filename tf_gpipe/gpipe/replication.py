"""Data parallelism over R copies of the pipeline: who gets which rows, which randomness, and
the sum of their gradients.

The batch is cut into R*M micro-batches (sizes differing by at most one) and replica r takes
micro-batches r*M .. r*M+M-1, which it numbers r*M + m when it draws randomness (dropout
masks): R replicas x M micro-batches draw exactly what one pipeline with R*M micro-batches
draws, so results do not depend on R.
"""

import tensorflow as tf

from tf_gpipe.gpipe import microbatch, ownership
from tf_gpipe.runtime import distribute


def shard(structure, num_replicas, num_micro_batches, batch_dim, first_devices):
    """Per replica: its micro-batches (a list, possibly shorter than M or empty for a batch
    smaller than R*M). Replica r's rows are split off on `first_devices[r]`."""
    size = microbatch.batch_size(structure, batch_dim)
    per_replica = _micro_batch_sizes(size, num_replicas, num_micro_batches)
    if num_replicas == 1:
        shards = [structure]
    else:
        totals = [sum(s) if s else 0 for s in per_replica]
        with distribute.on(first_devices[0]):
            shards = microbatch.split_sizes(structure, totals, batch_dim)
    out = []
    for r, (piece_sizes, rows) in enumerate(zip(per_replica, shards)):
        if not piece_sizes:
            out.append([])
            continue
        with distribute.on(first_devices[r]):
            out.append(microbatch.split_sizes(rows, piece_sizes, batch_dim))
    return out


def split_for_replicas(structure, num_replicas, num_micro_batches, batch_dim=0):
    """The rows of each of R replicas under a tf.distribute strategy: replica r gets global
    micro-batches r*M .. r*M+M-1 of R*M (what `shard` gives in-graph replica r), so that its
    pipeline numbers them as one pipeline with R*M micro-batches would."""
    size = microbatch.batch_size(structure, batch_dim)
    if isinstance(size, int) and size < num_replicas * num_micro_batches:
        raise ValueError(
            f'A batch of {size} cannot feed {num_replicas} replicas x {num_micro_batches} '
            f'micro-batches: use a batch of at least {num_replicas * num_micro_batches}, or '
            'fewer replicas or micro-batches.'
        )
    totals = [sum(s) for s in _micro_batch_sizes(size, num_replicas, num_micro_batches)]
    return microbatch.split_sizes(structure, totals, batch_dim)


def _micro_batch_sizes(size, num_replicas, num_micro_batches):
    """Per replica, the sizes of its micro-batches: replica r's are global micro-batches
    r*M .. r*M+M-1 of min(R*M, N) (a list shorter than M, or empty, for a small batch)."""
    sizes = microbatch.sizes(size, microbatch.num_pieces(size, num_replicas * num_micro_batches))
    return [sizes[r * num_micro_batches : (r + 1) * num_micro_batches] for r in range(num_replicas)]


def sum_over_replicas(per_replica_sums, per_replica_variables, scale=None):
    """All-reduce: every replica's copy of a variable gets the sum over replicas (times scale).

    The sum is made on replica 0's copy's device and copied to the other copies' devices.
    Returns, per replica, gradients lined up with its variables (None where nothing reached).
    """
    out = [[] for _ in per_replica_sums]
    for copies in zip(*per_replica_variables):
        grads = [sums.Total(v, scale) for sums, v in zip(per_replica_sums, copies)]
        total = ownership.add(grads, copies[0].device)
        for r, v in enumerate(copies):
            if total is None or len(copies) == 1:
                out[r].append(total)
                continue
            with distribute.on(v.device):
                out[r].append(tf.nest.map_structure(tf.identity, total, expand_composites=True))
    return out


def pool_replica_sums(replica_cells):
    """Before the once-per-step update: every replica's copy of each layer's `ReplicaSums()`
    (batch-norm statistics) becomes the sum over all replicas, so every copy moves with the
    whole batch's statistics."""
    if len(replica_cells) < 2:
        return
    groups = zip(*[[layer for c in cells for layer in c.AllLayers()] for cells in replica_cells])
    for group in groups:
        for copies in zip(*[layer.ReplicaSums() for layer in group]):
            total = tf.add_n([v.read_value() for v in copies])
            for v in copies:
                v.assign(total)
