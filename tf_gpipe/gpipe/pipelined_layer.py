"""PipelinedLayer: K cells on K devices, M micro-batches, recompute, gradient accumulation.

In training, FProp is one custom-gradient op over the whole pipeline. Its forward runs GPipe's
forward wave and keeps, per cell and micro-batch, only the cell's boundary input. Its gradient
runs the backward wave: each cell re-runs its forward from that input (recompute) and returns
d_input for the previous cell and d_variables, summed over micro-batches on the cell's device.
So `tape.gradient(loss, pipe.trainable_variables)` is exactly the gradient of the plain layer
sequence applied micro-batch by micro-batch (for layers that do not mix examples — all but
batch norm — that is the full-batch gradient).
"""

import tensorflow as tf

from tf_gpipe import base_layer, cluster, fprop_context
from tf_gpipe.gpipe import microbatch, partition, schedule, trace
from tf_gpipe.gpipe.recompute import CellRunner
from tf_gpipe.layers.normalization import BatchNormLayer
from tf_gpipe.layers.sequential import SequentialLayer, chain_meta

try:  # Pauses every active tape (public equivalent: none for all tapes at once).
    from tensorflow.python.eager.record import stop_recording as _stop_recording
except ImportError:  # Older TF.
    from tensorflow.python.eager.tape import stop_recording as _stop_recording

RECOMPUTE_POLICIES = ('always', 'except_last', 'never')


class PipelinedLayer(base_layer.BaseLayer):
    """GPipe: a layer sequence cut into K cells on K devices, fed M micro-batches."""

    _SEED_CONTAINER = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('cell_tpl', None, 'List of K cell params (usually SequentialLayers); or use sub.')
        p.Define('sub', None, 'Flat list of layer params, cut into num_partitions cells.')
        p.Define('num_partitions', 1, 'K, the number of cells when sub is given.')
        p.Define('partition_by', 'flops', f'Cost for balancing sub: {partition.PARTITION_BY}.')
        p.Define('splits', None, 'Explicit ending layer indices of the cells (overrides K).')
        p.Define('input_shape', None, 'Batch input shape, for partition_by flops/params/...')
        p.Define('input_dtype', tf.float32, "Input dtype, for partition_by='time'.")
        p.Define('num_micro_batches', 1, 'M: micro-batches per batch (must divide the batch).')
        p.Define('batch_dim', 0, 'The batch dimension of every input and output tensor.')
        p.Define('recompute', 'except_last', f'Re-materialisation policy: {RECOMPUTE_POLICIES}.')
        p.Define('num_replicas', 1, 'R: data-parallel replicas of the K-stage pipeline.')
        p.Define(
            'devices',
            None,
            'K device names, or R lists of K (one per replica); None: cluster.current_mesh().',
        )
        p.Define('jit_compile', False, "Compile each cell's forward and backward with XLA.")
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        if p.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f'recompute must be one of {RECOMPUTE_POLICIES}, got {p.recompute!r}.')
        base_layer.check_positive(p, 'num_micro_batches')
        base_layer.check_positive(p, 'num_replicas')
        cell_params, self._splits, self._sub = self._CellParams(p)
        k, r_count = len(cell_params), p.num_replicas
        self._replica_devices = self._DeviceRows(p, r_count, k)
        self._devices = self._replica_devices[0]
        # Replica 0's cells are `cell<k>`; replica r's are `replica<r>_cell<k>`, copies that start
        # equal and receive the same all-reduced gradients, so they stay equal.
        self._replica_cells, self._runners = [], []
        for r, row in enumerate(self._replica_devices):
            cells = []
            for i, (cp, device) in enumerate(zip(cell_params, row)):
                name = f'cell{i}' if r == 0 else f'replica{r}_cell{i}'
                with tf.device(device):
                    cells.append(self.CreateChild(name, cp))
            self._replica_cells.append(cells)
            self._runners.append(
                [CellRunner(c, d, i, p.jit_compile) for i, (c, d) in enumerate(zip(cells, row))]
            )
        self._cells = self._replica_cells[0]
        for cells in self._replica_cells[1:]:
            for src, dst in zip(self._cells, cells):
                for a, b in zip(src.variables, dst.variables):
                    b.assign(a)
        with tf.device(self._devices[0]):
            self.CreateVariable(
                'step', [], init=base_layer.WeightInit.Constant(0), dtype=tf.int64, trainable=False
            )

    @staticmethod
    def _DeviceRows(p, r_count, k):
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

    @staticmethod
    def _CellParams(p):
        """(cell params, splits or None, flat sub or None)."""
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
        else:
            # Before costing: partition_by='time' would run every layer first.
            partition.check_num_partitions(p.num_partitions, len(sub))
            costs = partition.layer_costs(sub, p.partition_by, p.input_shape, p.input_dtype)
            splits = partition.balance(costs, p.num_partitions)
        cells = [
            SequentialLayer.Params().Set(name=f'cell{i}', sub=[q.Copy() for q in sub[a:b]])
            for i, (a, b) in enumerate(partition.blocks(splits))
        ]
        return cells, splits, sub

    # ---- introspection -----------------------------------------------------------------------

    @property
    def num_cells(self):
        return len(self._cells)

    @property
    def cells(self):
        return list(self._cells)

    @property
    def devices(self):
        """Replica 0's K devices."""
        return list(self._devices)

    @property
    def replica_devices(self):
        """R lists of K devices."""
        return [list(row) for row in self._replica_devices]

    @property
    def num_replicas(self):
        return len(self._replica_devices)

    @property
    def splits(self):
        """Ending layer indices of the cells (None when built from cell_tpl)."""
        return self._splits

    def PartitionTable(self):
        """The cells as a table: layers, params, flops, activation bytes, device."""
        p = self.params
        if self._sub is not None:
            return partition.partition_table(self._sub, self._splits, self._devices, p.input_shape)
        sub = [c.params for c in self._cells]
        return partition.partition_table(
            sub, list(range(1, len(sub) + 1)), self._devices, p.input_shape
        )

    # ---- running -----------------------------------------------------------------------------

    def _Step(self):
        ctx = fprop_context.current()
        if ctx.step is not None:
            return tf.cast(ctx.step, tf.int64)
        if not ctx.training:
            return tf.constant(0, tf.int64)
        with tf.device(self._devices[0]):
            return self.vars.step.assign_add(1) - 1

    def FProp(self, *inputs):
        p = self.params
        ctx = fprop_context.current()
        step = self._Step()
        r_count, m_count = self.num_replicas, p.num_micro_batches
        microbatch.check_divisible(inputs, r_count * m_count, p.batch_dim)
        if not ctx.training:
            outs = [
                self._Eval(runners, micro, step)
                for runners, micro in zip(self._runners, self._MicroBatches(inputs))
            ]
            with tf.device(self._devices[-1]):
                return self._Unpack(microbatch.merge(outs, p.batch_dim))
        flat_inputs = tf.nest.flatten(inputs)
        out_structure = []

        @tf.custom_gradient
        def pipeline(*flat):
            replica_micro = self._MicroBatches(tf.nest.pack_sequence_as(inputs, list(flat)))
            replica_outs, saved = [], []
            for runners, micro in zip(self._runners, replica_micro):
                outputs, state = self._ForwardWave(runners, micro, step)
                with tf.device(runners[-1].device):
                    replica_outs.append(microbatch.merge(outputs, p.batch_dim))
                saved.append(state)
            with tf.device(self._devices[-1]):
                merged = microbatch.merge(replica_outs, p.batch_dim)
            out_structure.append(merged)

            def grad(*dys, variables=None):
                d_flat, var_grads = self._Backward(saved, replica_outs, merged, dys, step, flat)
                by_ref = {v.ref(): g for v, g in var_grads}
                return d_flat, [by_ref.get(v.ref()) for v in variables or []]

            return tf.nest.flatten(merged), grad

        # tf.custom_gradient joins inputs, outputs and variables in one IdentityN op: on the
        # last stage, where the outputs are, rather than wherever the caller's scope says
        # (on a TF cluster the client, which would pull the whole batch through it).
        with tf.device(self._devices[-1]):
            flat_out = pipeline(*flat_inputs)
        return self._Unpack(tf.nest.pack_sequence_as(out_structure[0], list(flat_out)))

    def _MicroBatches(self, inputs):
        """[per replica: [per micro-batch: inputs]], split on each replica's first stage.

        Every split is placed: on a TF cluster an unplaced one runs on the client, and the
        batch would travel there and back before the first cell could start.
        """
        p = self.params
        with tf.device(self._devices[0]):
            shards = microbatch.split(inputs, self.num_replicas, p.batch_dim)
        out = []
        for runners, shard in zip(self._runners, shards):
            with tf.device(runners[0].device):
                out.append(microbatch.split(shard, p.num_micro_batches, p.batch_dim))
        return out

    def _Backward(self, saved, replica_outs, merged, dys, step, flat_inputs):
        """Backward waves of every replica, then the replicas' gradients summed per stage."""
        p = self.params
        with tf.device(self._devices[-1]):
            dys = [
                tf.zeros_like(y) if dy is None and y.dtype.is_floating else dy
                for y, dy in zip(tf.nest.flatten(merged), dys)
            ]
            d_shards = microbatch.split(
                tf.nest.pack_sequence_as(merged, dys), self.num_replicas, p.batch_dim
            )
        d_inputs, sums = [], []
        for runners, state, out, d_out in zip(self._runners, saved, replica_outs, d_shards):
            d_in, var_sums = self._BackwardWave(runners, state, out, d_out, step)
            d_inputs.append(d_in)
            sums.append(var_sums)
        with tf.device(self._devices[0]):
            d_merged = microbatch.merge(d_inputs, p.batch_dim)
        d_flat = [
            g if x.dtype.is_floating else None
            for x, g in zip(flat_inputs, tf.nest.flatten(d_merged))
        ]
        var_grads = []
        for k in range(self.num_cells):
            per_replica = [s[k] for s in sums]
            if len(per_replica) > 1:
                # All-reduce: sum on replica 0's stage-k device, a copy to each replica's device.
                with tf.device(self._devices[k]):
                    totals = [tf.add_n(list(gs)) for gs in zip(*per_replica)]
                per_replica = []
                for runners in self._runners:
                    with tf.device(runners[k].device):
                        per_replica.append([tf.identity(t) for t in totals])
            for runners, grads in zip(self._runners, per_replica):
                var_grads.extend(zip(runners[k].variables, grads))
        return d_flat, var_grads

    @staticmethod
    def _Unpack(outputs):
        return outputs[0] if isinstance(outputs, tuple) and len(outputs) == 1 else outputs

    def _Policy(self, m):
        """True when micro-batch m is recomputed in the backward pass."""
        policy = self.params.recompute
        last = m == self.params.num_micro_batches - 1
        return policy == 'always' or (policy == 'except_last' and not last)

    def _ForwardWave(self, runners, micro_inputs, step):
        """One replica's forward schedule: (outputs per micro-batch, what backward needs)."""
        k_cells, m_count = self.num_cells, self.params.num_micro_batches
        acts = {(0, m): micro_inputs[m] for m in range(m_count)}  # (cell, m) -> cell input
        kept = {}
        last_op = [None] * k_cells  # Each device runs its actions in schedule order.
        for action in schedule.forward_schedule(k_cells, m_count):
            k, m = action.stage, action.micro_batch
            runner = runners[k]
            with tf.device(runner.device):
                x = _ordered(acts[(k, m)], last_op[k])
                mb = tf.constant(m, tf.int64)
                t0 = trace.start(x)
                if self._Policy(m):
                    with _stop_recording():
                        y = runner.Forward(x, step, mb)
                else:
                    y, kept[(k, m)] = runner.ForwardKeep(x, step, mb)
                trace.end(t0, schedule.FORWARD, k, m, y)
            last_op[k] = y
            acts[(k + 1, m)] = y
        outputs = [self._Unpack(acts[(k_cells, m)]) for m in range(m_count)]
        return outputs, (acts, kept, last_op)

    def _BackwardWave(self, runners, saved, outputs, d_outputs, step):
        """One replica's backward schedule: (d_inputs, per-cell sums of d_variables)."""
        p = self.params
        acts, kept, last_op = saved
        k_cells, m_count = self.num_cells, p.num_micro_batches
        with tf.device(runners[-1].device):
            d_out = microbatch.split(d_outputs, m_count, p.batch_dim)
        grads = {(k_cells, m): _as_tuple(d_out[m]) for m in range(m_count)}
        var_sums = [None] * k_cells
        for action in schedule.backward_schedule(k_cells, m_count):
            k, m = action.stage, action.micro_batch
            runner, x = runners[k], acts[(k, m)]
            with tf.device(runner.device):
                dy = _ordered(grads.pop((k + 1, m)), last_op[k])
                t0 = trace.start(dy)
                if (k, m) in kept:
                    d_x, d_vars = runner.BackwardKept(kept.pop((k, m)), dy)
                else:
                    d_x, d_vars = runner.Backward(x, dy, step, tf.constant(m, tf.int64))
                trace.end(t0, schedule.BACKWARD, k, m, (d_x, d_vars))
                # Accumulate d_variables over micro-batches on the cell's device.
                if var_sums[k] is None:
                    var_sums[k] = list(d_vars)
                else:
                    var_sums[k] = [a + b for a, b in zip(var_sums[k], d_vars)]
            last_op[k] = d_x + var_sums[k] if (d_x or var_sums[k]) else last_op[k]
            grads[(k, m)] = _pack_float_grads(x, d_x)
        with tf.device(runners[0].device):
            d_inputs = microbatch.merge([grads[(0, m)] for m in range(m_count)], p.batch_dim)
        return d_inputs, var_sums

    def _Eval(self, runners, micro_inputs, step):
        """Forward only, no tapes, still one device after another in schedule order."""
        k_cells, m_count = self.num_cells, self.params.num_micro_batches
        acts = {(0, m): micro_inputs[m] for m in range(m_count)}
        last_op = [None] * k_cells
        for action in schedule.forward_schedule(k_cells, m_count):
            k, m = action.stage, action.micro_batch
            runner = runners[k]
            with tf.device(runner.device):
                x = _ordered(acts[(k, m)], last_op[k])
                y = runner.Forward(x, step, tf.constant(m, tf.int64), training=False)
            last_op[k] = acts[(k + 1, m)] = y
        with tf.device(runners[-1].device):
            return microbatch.merge(
                [acts[(k_cells, m)] for m in range(m_count)], self.params.batch_dim
            )

    def PostTrainingStepUpdate(self):
        """Replicas first pool their batch-norm sums, so every copy moves with the global batch."""
        if self.num_replicas > 1:
            groups = zip(
                *[
                    [layer for c in cells for layer in c.AllLayers()]
                    for cells in self._replica_cells
                ]
            )
            for group in groups:
                if isinstance(group[0], BatchNormLayer):
                    for name in ('acc_count', 'acc_sum', 'acc_sum_sq'):
                        total = tf.add_n([layer.vars[name].read_value() for layer in group])
                        for layer in group:
                            layer.vars[name].assign(total)
        super().PostTrainingStepUpdate()

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        cells, _, _ = cls._CellParams(p)
        return chain_meta(cells, input_shapes)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _pack_float_grads(inputs, float_grads):
    """The structure of `inputs` with gradients at float leaves and None elsewhere."""
    it = iter(float_grads)
    leaves = [
        next(it) if isinstance(x, tf.Tensor | tf.Variable) and x.dtype.is_floating else None
        for x in tf.nest.flatten(inputs)
    ]
    return tf.nest.pack_sequence_as(inputs, leaves)


def _ordered(structure, previous):
    """`structure` passed through identities that wait for the device's previous action.

    TF attaches no control inputs to function-call ops created under tf.control_dependencies,
    so the order is imposed on the call's inputs instead: the call cannot start before its
    inputs exist, and they exist only after the previous action on this device finished.
    """
    if previous is None or tf.executing_eagerly():
        return structure
    deps = [t for t in tf.nest.flatten(previous) if isinstance(t, tf.Tensor)]
    with tf.control_dependencies(deps):
        return tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), structure)
