"""Cut a layer sequence into K contiguous cells of balanced cost.

Costs per layer come from FPropMeta (flops, params, activation bytes), a uniform count, or
measured time. The split minimises the largest cell cost exactly (dynamic programming over
contiguous blocks), and never leaves a cell empty.
"""

import time

import numpy as np
import tensorflow as tf

from tf_gpipe import fprop_context

PARTITION_BY = ('flops', 'params', 'activation_bytes', 'uniform', 'time')
_META_FIELD = {'flops': 'flops', 'params': 'param_count', 'activation_bytes': 'activation_bytes'}


def layer_metas(sub, input_shape):
    """FPropMeta of each layer of `sub`, fed the previous layer's output shapes."""
    shapes = (
        input_shape
        if isinstance(input_shape, tuple) and _is_shape_tuple(input_shape)
        else (input_shape,)
    )
    metas = []
    for p in sub:
        try:
            meta = p.cls.FPropMeta(p, *shapes)
        except NotImplementedError as e:
            raise ValueError(
                f'Layer {p.name!r} ({p.cls.__name__}) has no FPropMeta, so it cannot be '
                "partitioned by cost; use partition_by='uniform' or 'time', or explicit splits."
            ) from e
        metas.append(meta)
        shapes = meta.out_shapes
    return metas


def _is_shape_tuple(value):
    """A tuple of several input shapes (not one shape written as a tuple of ints)."""
    return bool(value) and all(not isinstance(v, (int, type(None))) for v in value)


def layer_costs(sub, partition_by, input_shape=None, input_dtype=tf.float32):
    """One non-negative cost per layer of `sub`."""
    if partition_by not in PARTITION_BY:
        raise ValueError(f'partition_by must be one of {PARTITION_BY}, got {partition_by!r}.')
    if partition_by == 'uniform':
        return [1.0] * len(sub)
    if input_shape is None:
        raise ValueError(
            f"partition_by='{partition_by}' needs the input shape: set input_shape (the batch "
            "shape the pipeline receives), or use partition_by='uniform' or explicit splits."
        )
    if partition_by == 'time':
        return measure_times(sub, input_shape, input_dtype)
    return meta_costs(layer_metas(sub, input_shape), partition_by)


def meta_costs(metas, partition_by):
    """One cost per layer from its FPropMeta ('flops', 'params' or 'activation_bytes')."""
    return [float(getattr(m, _META_FIELD[partition_by])) for m in metas]


def measure_times(sub, input_shape, input_dtype=tf.float32, repeats=3):
    """Seconds per layer of a forward + backward on zeros of `input_shape` (median of repeats)."""
    x = tf.zeros(input_shape, input_dtype)
    args = (x,)
    costs = []
    with fprop_context.scope(step=0):
        for p in sub:
            layer = p.Instantiate()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                with tf.GradientTape() as tape:
                    tape.watch([a for a in tf.nest.flatten(args) if a.dtype.is_floating])
                    out = layer.FProp(*args)
                floats = [o for o in tf.nest.flatten(out) if o.dtype.is_floating]
                if layer.trainable_variables and floats:
                    tape.gradient(floats, layer.trainable_variables)
                times.append(time.perf_counter() - start)
            costs.append(float(np.median(times)))
            args = out if isinstance(out, tuple) else (out,)
    return costs


def check_num_partitions(num_partitions, num_layers):
    """Raises unless 1 <= num_partitions <= num_layers (a cell needs at least one layer)."""
    if not isinstance(num_partitions, int) or num_partitions < 1:
        raise ValueError(f'num_partitions must be a positive int, got {num_partitions!r}.')
    if num_partitions > num_layers:
        raise ValueError(
            f'num_partitions={num_partitions} is larger than the number of layers '
            f'({num_layers}): every cell needs at least one layer. Use num_partitions <= '
            f'{num_layers}.'
        )


# Above this many steps (K x n^2) the exact dynamic programme below takes seconds in Python;
# the bisection on the largest block cost (`_balance_large`) reaches the same optimum instantly
# (a paper-scale Transformer: 1663 layers into 128 cells), without the crossing tie-break.
_DP_LIMIT = 2_000_000


def balance(costs, num_partitions, crossing=None):
    """Ending indices of K contiguous blocks minimising the largest block cost (exact); among
    the splits that reach that cost, the one whose cuts carry the fewest activations
    (`crossing[i]`: the size of what layer i passes on; a cut after layer i carries it).
    Very large cases (K x n^2 > 2e6) get an optimal split without that tie-break."""
    n = len(costs)
    check_num_partitions(num_partitions, n)
    if num_partitions * n * n > _DP_LIMIT:
        return _balance_large(costs, num_partitions)
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)])
    inf = float('inf')
    # best[k][i]: the smallest possible max-cost of splitting layers [0, i) into k blocks.
    best = np.full((num_partitions + 1, n + 1), inf)
    choice = np.zeros((num_partitions + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for k in range(1, num_partitions + 1):
        for i in range(k, n - (num_partitions - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], choice[k][i] = value, j
    if crossing is not None:
        # Second pass: every block within the optimum, the fewest activations across cuts.
        # (A lexicographic (max, crossing) DP in one pass would not be exact.)
        limit = best[num_partitions][n] * (1 + 1e-9) + 1e-12
        carried = np.full((num_partitions + 1, n + 1), inf)
        carried[0][0] = 0.0
        for k in range(1, num_partitions + 1):
            for i in range(k, n - (num_partitions - k) + 1):
                for j in range(k - 1, i):
                    if prefix[i] - prefix[j] > limit or carried[k - 1][j] == inf:
                        continue
                    value = carried[k - 1][j] + (float(crossing[j - 1]) if j > 0 else 0.0)
                    if value < carried[k][i]:
                        carried[k][i], choice[k][i] = value, j
    splits, i = [], n
    for k in range(num_partitions, 0, -1):
        splits.append(i)
        i = choice[k][i]
    return sorted(splits)


def _balance_large(costs, num_partitions):
    """The smallest largest-block cost T by bisection (is there a packing into K blocks of at
    most T each?), then a packing at T: each block as long as T allows while leaving a layer
    for every block after it."""
    n, k = len(costs), num_partitions
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)])

    def pack(limit):
        splits, start = [], 0
        for b in range(k):
            later = k - b - 1
            end = n if later == 0 else int(np.searchsorted(prefix, prefix[start] + limit, 'right'))
            end = max(min(end - (later > 0), n - later), start + 1) if later else end
            if prefix[end] - prefix[start] > limit:
                return None
            splits.append(end)
            start = end
        return splits

    lo, hi = float(max(costs)), float(prefix[-1])
    for _ in range(100):  # float bisection: the optimum to within rounding
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if pack(mid) is None:
            lo = mid
        else:
            hi = mid
    return pack(hi) if pack(hi) is not None else pack(hi * (1 + 1e-12))


def costs_and_crossing(sub, partition_by, input_shape=None, input_dtype=tf.float32):
    """(layer_costs, crossing sizes or None) with each layer's FPropMeta computed once."""
    metas = None
    if input_shape is not None and partition_by in _META_FIELD:
        metas = layer_metas(sub, input_shape)
    elif input_shape is not None and partition_by in PARTITION_BY:
        try:  # only for the tie-break: a layer without a usable FPropMeta just goes without
            metas = layer_metas(sub, input_shape)
        except Exception:  # noqa: BLE001
            metas = None
    if partition_by in _META_FIELD and metas is not None:
        costs = meta_costs(metas, partition_by)
    else:
        costs = layer_costs(sub, partition_by, input_shape, input_dtype)
    return costs, (None if metas is None else [passed_on(m) for m in metas])


def passed_on(meta):
    """Elements per example a layer passes on: its whole output state, so a skip
    connection's tensors count at every cut they cross."""
    total = 0
    for shape in tf.nest.flatten(meta.out_shapes):
        dims = tf.TensorShape(shape).as_list()[1:] if tf.TensorShape(shape).rank else []
        total += int(np.prod([d or 1 for d in dims]))
    return total


def check_splits(splits, num_layers):
    """Validates explicit ending indices (Lingvo's `splits`)."""
    if not splits or list(splits) != sorted(set(splits)) or splits[0] <= 0:
        raise ValueError(
            f'splits must be strictly increasing positive ending indices, got {splits!r}.'
        )
    if splits[-1] != num_layers:
        raise ValueError(
            f'The last split must be the number of layers ({num_layers}), got {splits!r}.'
        )
    return list(splits)


def blocks(splits):
    """[(start, end)] of each cell for ending indices `splits`."""
    starts = [0] + list(splits[:-1])
    return list(zip(starts, splits))


def block_label(sub, start, end):
    """'first .. last (n)' naming the layers sub[start:end] of a cell."""
    names = sub[start].name if end - start == 1 else f'{sub[start].name} .. {sub[end - 1].name}'
    return f'{names} ({end - start})'


def partition_table(sub, splits, devices=None, input_shape=None):
    """A printable table: cell, layers, params, flops, activation bytes, device."""
    metas = None
    if input_shape is not None:
        try:
            metas = layer_metas(sub, input_shape)
        except (ValueError, NotImplementedError):
            metas = None
    rows = [('cell', 'layers', 'params', 'flops', 'act bytes', 'device')]
    for k, (a, b) in enumerate(blocks(splits)):
        label = block_label(sub, a, b)
        if metas:
            block = metas[a:b]
            stats = [
                f'{sum(m.param_count for m in block):,}',
                f'{sum(m.flops for m in block):,}',
                f'{sum(m.activation_bytes for m in block):,}',
            ]
        else:
            stats = ['?', '?', '?']
        rows.append((str(k), label, *stats, devices[k] if devices else '-'))
    return format_table(rows)


def format_table(rows):
    """Left-aligned columns, a rule under the header row."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)
