"""PipelinedLayer: the façade over the engine — cells on devices, micro-batches, schedules.

A layer sequence is cut into K*v cells (v = virtual_stages; cell c on device c mod K) and every
batch into M micro-batches. Training runs a schedule (schedules.py) with one executor
(executor.py): each cell keeps only its boundary inputs and recomputes its activations in the
backward pass (recompute.py), and every variable's gradient — whichever cells read it — is
summed on the variable's own device (ownership.py); R replicas split the batch and sum their
gradients (replication.py).

Two ways to train:
- `loss, grads = pipe.ComputeGradients(inputs, targets, loss_fn)`: every schedule; the loss of
  each micro-batch is computed on the last stage as soon as its forward is done.
- `pipe.FProp(x)` under a tape, then `tape.gradient`: fill-drain ('gpipe') only, as one
  differentiable op whose gradient runs the backward actions.
Both give exactly the plain sequence's gradients (micro-batch by micro-batch for layers that
mix examples, i.e. batch norm).
"""

import contextlib
import types

import tensorflow as tf

from tf_gpipe import base_layer, fprop_context
from tf_gpipe.gpipe import (
    backward_loop,
    executor,
    loop_choice,
    microbatch,
    ownership,
    partition,
    recompute,
    replication,
    schedules,
    young_heap,
)
from tf_gpipe.gpipe import cells as cell_plan
from tf_gpipe.gpipe.recompute import CellRunner
from tf_gpipe.runtime import distribute
from tf_gpipe.sequential import chain_meta

RECOMPUTE_POLICIES = ('always', 'except_last', 'never')


class PipelinedLayer(base_layer.BaseLayer):
    """GPipe: a layer sequence cut into K cells on K devices, fed M micro-batches."""

    _SEED_CONTAINER = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('cell_tpl', None, 'List of K*v cell params (usually SequentialLayers); or sub.')
        p.Define('sub', None, 'Flat list of layer params, cut into num_partitions*v cells.')
        p.Define('num_partitions', 1, 'K, the number of devices (cells: K*virtual_stages).')
        p.Define('partition_by', 'flops', f'Cost for balancing sub: {partition.PARTITION_BY}.')
        p.Define('splits', None, 'Explicit ending layer indices of the cells (overrides K).')
        p.Define('input_shape', None, 'Batch input shape, for partition_by flops/params/...')
        p.Define('input_dtype', tf.float32, "Input dtype, for partition_by='time'.")
        p.Define(
            'num_micro_batches',
            1,
            'M: micro-batches per batch. Any batch size works: min(M, N) micro-batches whose '
            'sizes differ by at most one.',
        )
        p.Define('batch_dim', 0, 'The batch dimension of every input and output tensor.')
        p.Define('recompute', 'except_last', f'Re-materialisation policy: {RECOMPUTE_POLICIES}.')
        p.Define('schedule', 'gpipe', f'Pipeline schedule: {schedules.SCHEDULES}.')
        p.Define(
            'virtual_stages',
            1,
            "v: cells per device for schedule='interleaved_1f1b' (K*v cells, cell c on device "
            'c mod K).',
        )
        p.Define('num_replicas', 1, 'R: data-parallel replicas of the K-stage pipeline.')
        p.Define(
            'devices',
            None,
            'K device names, or R lists of K (one per replica); None: cluster.current_mesh().',
        )
        p.Define('jit_compile', False, "Compile each cell's forward and backward with XLA.")
        p.Define(
            'cell_grappler',
            False,
            "Run Grappler, TF's graph optimizer, on each cell's functions when a call first "
            'instantiates them (grappler.py). False (the default): a shorter first call (K=4, '
            'M=32, L=64: about 15 s less), the same numbers and a peak memory no higher; the '
            'step around the cells keeps Grappler. Mixed precision asked of Grappler keeps it '
            'on the cells.',
        )
        p.Define(
            'twin_cells',
            True,
            'Cells of the same layers (their forwards the same graph) trace their '
            'recompute-backward once and call it with their own variables (twins.py): a '
            'shorter start-up, the same numbers. False: every cell traces its own.',
        )
        p.Define(
            'tick_loop',
            None,
            'ComputeGradients runs the schedule as a tf.while_loop over clock ticks, and '
            "gpipe's FProp under a tape as a forward and a backward loop: a program and "
            'start-up flat in M (tick_loop.py, backward_loop.py). None (auto, the default): '
            'the loops for a step of at least loop_choice.AUTO_MIN_MICRO_BATCHES (8) '
            'micro-batches whose cells are in one process; otherwise the unrolled executor (one '
            'call per action, its program growing with M): fewer micro-batches start as fast '
            'and step faster unrolled, and across TF tasks each tick would cross processes. '
            'True: the loops wherever they can run; False: unrolled. A step no loop can run '
            "(eager, uneven micro-batches, FProp with recompute='never') runs unrolled; the "
            'log says why.',
        )
        p.Define(
            'eval_loop',
            None,
            "Eval's forward (FProp in eval mode) as a tf.while_loop over ticks: a program and "
            "start-up flat in M, a steady step about 1.1x the unrolled wave's with tiny cells "
            '(forward_loop.py). None (auto): the loop when the cells are in one process, the '
            'unrolled wave when they span TF tasks (each tick would cross processes: slower). '
            'True: the loop wherever it can run; False, or a call it cannot run (eager, uneven '
            'micro-batches; said in the log): one call per cell and '
            'micro-batch.',
        )
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        if p.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f'recompute must be one of {RECOMPUTE_POLICIES}, got {p.recompute!r}.')
        base_layer.check_positive(p, 'num_micro_batches')
        base_layer.check_positive(p, 'num_replicas')
        base_layer.check_positive(p, 'virtual_stages')
        for name in ('tick_loop', 'eval_loop'):
            if getattr(p, name) not in (None, True, False):
                raise ValueError(
                    f'{p.name}: {name} must be None (auto), True or False, got '
                    f'{getattr(p, name)!r}.'
                )
        cell_params, self._splits, self._sub = self.CellParams(p)
        if len(cell_params) % p.virtual_stages:
            raise ValueError(
                f'{p.name}: {len(cell_params)} cells cannot be dealt to devices '
                f'virtual_stages={p.virtual_stages} at a time; give K*v cells.'
            )
        k, r_count = len(cell_params) // p.virtual_stages, p.num_replicas
        # Fails early on a bad name (and checks M against the interleaved schedule).
        schedules.build(p.schedule, k, p.num_micro_batches, p.virtual_stages)
        # Plain caches, out of tf.Module's tracking (a checkpoint holds no schedules).
        self._cache = types.SimpleNamespace(schedules={}, orders={})
        self._loops = loop_choice.LoopChoice(p)
        # Under mesh.strategy().scope() the strategy's replicas are the mesh's rows: one set of
        # cells whose variables have a copy per replica (cell k's on mesh[r][k]), run by
        # replica r on row r inside strategy.run. Otherwise R in-graph copies of the cells.
        self._mesh = distribute.current_mesh()
        if self._mesh is not None:
            self._replica_devices = cell_plan.strategy_rows(p, k)
        else:
            self._replica_devices = cell_plan.device_rows(p, r_count, k)
        self._devices = self._replica_devices[0]
        # Replica 0's cells are `cell<k>`; replica r's are `replica<r>_cell<k>`, copies that start
        # equal and receive the same all-reduced gradients, so they stay equal.
        self._replica_cells, self._runners = [], []
        copies = 1 if self._mesh is not None else len(self._replica_devices)
        for r, row in enumerate(self._replica_devices[:copies]):
            # Under a multi-worker strategy a worker creates only on its own devices.
            build_row = row if self._mesh is None else self._Row()
            cells = []
            for i, cp in enumerate(cell_params):
                name = f'cell{i}' if r == 0 else f'replica{r}_cell{i}'
                with distribute.on(build_row[i % k]), self._StageVariables(i % k):
                    cells.append(self.CreateChild(name, cp))
            self._replica_cells.append(cells)
            # A softmax in the last cell may read the embedding of the first (tied weights).
            base_layer.link_layers([layer for c in cells for layer in c.AllLayers()])
        for r, row in enumerate(self._replica_devices):
            cells = self._replica_cells[min(r, copies - 1)]
            self._runners.append(
                [
                    CellRunner(c, row[i % k], i, p.jit_compile, grappler=p.cell_grappler)
                    for i, c in enumerate(cells)
                ]
            )
        if p.twin_cells and self._mesh is None:
            self._PairTwins()
        self._cells = self._replica_cells[0]
        for cells in self._replica_cells[1:]:
            for src, dst in zip(self._cells, cells):
                for a, b in zip(src.variables, dst.variables):
                    b.assign(a)
        self._replica_variables = [
            [v for c in cells for v in c.trainable_variables] for cells in self._replica_cells
        ]
        with distribute.on(self._Row()[0]), self._StageVariables(0):
            self.CreateVariable(
                'step',
                [],
                init=base_layer.WeightInit.Constant(0),
                dtype=tf.int64,
                trainable=False,
                # Under a strategy every replica counts the same step: replica 0's count is kept.
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

    def _PairTwins(self):
        """Makes each runner a twin candidate of the first earlier cell of its replica with the
        same layer classes and variables (twins.py proves it at the first backward)."""
        variable_of = {
            id(v.handle): v
            for cells in self._replica_cells
            for c in cells
            for v in c.variables
            if isinstance(getattr(v, 'handle', None), tf.Tensor)
        }

        def shape(cell):
            layers = cell.AllLayers()
            return tuple(type(layer) for layer in layers), tuple(
                (tuple(v.shape), v.dtype, v.trainable)
                for layer in layers
                for v in layer.vars.Flatten()
                if isinstance(v, tf.Variable)
            )

        for runners in self._runners:
            first = {}
            for runner in runners:
                key = shape(runner.cell)
                if key in first:
                    runner.ShareBackward(first[key], variable_of)
                else:
                    first[key] = runner

    def _StageVariables(self, stage):
        if self._mesh is None:
            return contextlib.nullcontext()
        return distribute.stage_variables(self._mesh, stage)

    def _NamedChildren(self, replica):
        # Cells cut from `sub` are the partitioner's, not the model's: their layers sit
        # directly under the pipeline, so a checkpoint's names do not depend on K. Cells the
        # user gave (cell_tpl) are part of the model and keep replica 0's names.
        if not 0 <= replica < len(self._replica_cells):
            raise ValueError(
                f'{self.params.name}: replica {replica} asked, the pipeline has '
                f'{len(self._replica_cells)}.'
            )
        for i, cell in enumerate(self._replica_cells[replica]):
            if self.params.cell_tpl is not None:
                yield f'cell{i}', cell
            else:
                yield from cell._NamedChildren(replica)

    @staticmethod
    def CellParams(p):
        """The cells `p` asks for, nothing built: (each cell's params, the end index of each
        cell in `sub` or None, the flat `sub` or None when `cell_tpl` gives the cells)."""
        return cell_plan.cell_params(p)

    # ---- introspection -----------------------------------------------------------------------

    @property
    def num_cells(self):
        return len(self._cells)

    @property
    def cells(self):
        return list(self._cells)

    @property
    def mesh(self):
        """The DeviceMesh whose strategy this pipeline was built under (None: no strategy)."""
        return self._mesh

    @property
    def devices(self):
        """Replica 0's K devices (under a strategy: the running replica's, or the first local
        replica's in cross-replica context)."""
        return list(self._devices if self._mesh is None else self._Row())

    @property
    def cell_devices(self):
        """Replica 0's device of every cell (cell c on device c mod K)."""
        return [r.device for r in self._runners[0]]

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
            return partition.partition_table(
                self._sub, self._splits, self.cell_devices, p.input_shape
            )
        sub = [c.params for c in self._cells]
        return partition.partition_table(
            sub, list(range(1, len(sub) + 1)), self.cell_devices, p.input_shape
        )

    # ---- running -----------------------------------------------------------------------------

    def _Step(self):
        ctx = fprop_context.current()
        if ctx.step is not None:
            return tf.cast(ctx.step, tf.int64)
        if not ctx.training:
            return tf.constant(0, tf.int64)
        with distribute.on(self._Row()[0]):
            return self.vars.step.assign_add(1) - 1

    def Schedule(self, num_micro_batches=None):
        """The schedule (schedules.Schedule) one replica runs for M micro-batches."""
        p = self.params
        m = num_micro_batches or p.num_micro_batches
        if m not in self._cache.schedules:
            self._cache.schedules[m] = schedules.build(
                p.schedule, len(self._devices), m, p.virtual_stages
            )
        return self._cache.schedules[m]

    def _Shards(self, structure, first):
        """Per replica, its micro-batches of `structure`, split on each replica's first (or
        last) stage."""
        p = self.params
        rows = [self._replica_devices[r] for r in self._LocalReplicas()]
        devices = [row[0] if first else row[-1] for row in rows]
        return replication.shard(structure, len(rows), p.num_micro_batches, p.batch_dim, devices)

    def _Row(self):
        """The devices of the first replica this call runs."""
        return self._replica_devices[self._LocalReplicas()[0]]

    def _LocalReplicas(self):
        """The replicas this call runs: every in-graph copy, or under a strategy the one whose
        strategy.run this is (replica 0's devices in cross-replica context)."""
        if self._mesh is None:
            return list(range(len(self._replica_devices)))
        if distribute.in_replica_context():
            if self._mesh.tpu is not None:
                return [0]  # TPU: every replica's stage k is its logical core k (row 0's names)
            return [distribute.replica_index()]
        return self._mesh.local_replicas[:1]

    def _Executor(self, r, num_micro_batches, step, sums, input_grads, head=None):
        runners = list(self._runners[r])
        if head is not None:
            runners[-1] = runners[-1].WithHead(head)
        sched = self.Schedule(num_micro_batches)
        if head is None and sched.name != 'gpipe':
            raise ValueError(sched.name)
        # Micro-batch m of replica r is global micro-batch r*M + m (its dropout masks); a TPU
        # replica knows r only at run time.
        tpu_replica = distribute.tpu_replica_id()
        replica = r if tpu_replica is None else tpu_replica
        return executor.Executor(
            runners,
            sched,
            self.params.recompute,
            step,
            replica * self.params.num_micro_batches,
            sums,
            input_grads,
        )

    def FProp(self, *inputs):
        """Eval: the pipelined forward. Training: fill-drain as one differentiable op (under a
        tape, the backward runs when the caller asks for gradients); other schedules need the
        loss inside the pipeline: use ComputeGradients."""
        with young_heap.build():
            return self._FProp(inputs)

    def _FProp(self, inputs):
        p = self.params
        ctx = fprop_context.current()
        step = self._Step()
        if not ctx.training:
            return self._Eval(inputs, step)
        if p.schedule != 'gpipe':
            raise ValueError(
                f"{p.name}: schedule={p.schedule!r} starts each micro-batch's backward before "
                'the last forward, so it needs the loss inside the pipeline: use '
                'loss, grads = pipe.ComputeGradients(inputs, targets, loss_fn). A training '
                "FProp under a tape runs schedule='gpipe' only."
            )
        flat_inputs = tf.nest.flatten(inputs)
        out_structure = []

        @tf.custom_gradient
        def pipeline(*flat):
            self._RecordReads()
            shards = self._Shards(tf.nest.pack_sequence_as(inputs, list(flat)), first=True)
            runs, outs = [], []
            for r, micro in zip(self._LocalReplicas(), shards):
                if not micro:
                    continue
                loops = self._loops.FillDrain(
                    self._runners[r],
                    self.Schedule(len(micro)),
                    micro,
                    step,
                    r * p.num_micro_batches,
                )
                if loops is not None:
                    runs.append(loops)
                    outs.append(loops.outputs)
                    continue
                run = self._Executor(
                    r, len(micro), step, ownership.GradientSums(), input_grads=True
                )
                run.Feed(micro)
                run.Run([a for a in self._Order(run.sched) if a.phase == schedules.FORWARD])
                runs.append(run)
                with distribute.on(self._replica_devices[r][-1]):
                    outs.append(
                        microbatch.merge([run.outputs[m] for m in range(len(micro))], p.batch_dim)
                    )
            with distribute.on(self._Row()[-1]):
                merged = microbatch.merge(outs, p.batch_dim)
            out_structure.append(merged)

            def grad(*dys, variables=None):
                with young_heap.build():
                    return self._FPropBackward(runs, merged, dys, flat, variables or [])

            return tf.nest.flatten(merged), grad

        # tf.custom_gradient joins inputs, outputs and variables in one IdentityN op: on the
        # last stage, where the outputs are, rather than wherever the caller's scope says
        # (on a TF cluster the client, which would pull the whole batch through it).
        with distribute.on(self._Row()[-1]):
            flat_out = pipeline(*flat_inputs)
        return _Unpack(tf.nest.pack_sequence_as(out_structure[0], list(flat_out)))

    def _RecordReads(self):
        """Reads every variable the cells read, where a tape records it.

        tf.custom_gradient hands its grad function the variables whose reads it saw, but the
        cells' forward calls run untaped (stop_recording): it saw only those of a cell traced
        during this call or a kept micro-batch. After a ComputeGradients had traced the cells,
        FProp under a tape with 'always' gave the first cell's variables no gradient at all
        (tests/test_pipelined_layer.py)."""
        seen = set()
        cells_read = [v for vs in self._replica_variables for v in vs]
        cells_read += [v for runners in self._runners for r in runners for v in r.read_variables]
        for v in cells_read:
            if v.ref() not in seen:
                seen.add(v.ref())
                with distribute.on(v.device):
                    v.value()

    def _Order(self, sched):
        if sched not in self._cache.orders:
            self._cache.orders[sched] = schedules.execution_order(sched)
        return self._cache.orders[sched]

    def _FPropBackward(self, runs, merged, dys, flat_inputs, variables):
        """fill-drain's backward actions from the caller's output gradients."""
        p = self.params
        with distribute.on(self._Row()[-1]):
            dys = [
                tf.zeros_like(y) if dy is None and y.dtype.is_floating else dy
                for y, dy in zip(tf.nest.flatten(merged), dys)
            ]
            d_merged = tf.nest.pack_sequence_as(merged, dys)
        d_shards = self._Shards(d_merged, first=False)
        d_inputs = []
        for run, d_micro in zip(runs, [d for d in d_shards if d]):
            if isinstance(run, backward_loop.FillDrain):
                d_inputs.append(run.Backward([_AsTuple(d) for d in d_micro]))
                continue
            run.FeedOutputGrads([_AsTuple(d) for d in d_micro])
            run.Run([a for a in self._Order(run.sched) if a.phase != schedules.FORWARD])
            with distribute.on(run.runners[0].device):
                d_inputs.append(
                    microbatch.merge([run.d_inputs[m] for m in range(len(d_micro))], p.batch_dim)
                )
        with distribute.on(self._Row()[0]):
            d_flat = tf.nest.flatten(microbatch.merge(d_inputs, p.batch_dim))
        d_flat = [g if x.dtype.is_floating else None for x, g in zip(flat_inputs, d_flat)]
        return d_flat, self._VariableGrads([run.sums for run in runs], variables)

    def _VariableGrads(self, sums, variables, scale=None):
        """Gradients lined up with `variables`: replica copies all-reduced, others summed."""
        replica_vars = self._replica_variables
        summed = replication.sum_over_replicas(_Pad(sums, len(replica_vars)), replica_vars, scale)
        by_ref = {}
        for vs, gs in zip(replica_vars, summed):
            by_ref.update({v.ref(): g for v, g in zip(vs, gs)})
        out = []
        for v in variables:
            if v.ref() in by_ref:
                out.append(by_ref[v.ref()])
            else:  # read by a cell, owned by no cell: summed where it lives
                out.append(ownership.add([s.Total(v, scale) for s in sums], v.device))
        return out

    # Plain TF code: a caller's tf.function need not run AutoGraph over the engine (converting
    # it took most of a step's trace: 26 of 31 s for a 2-layer pipeline, measured).
    @tf.autograph.experimental.do_not_convert
    def ComputeGradients(self, inputs, targets, loss_fn, return_outputs=False):
        """(loss, grads[, outputs]) of one training step, under this pipeline's schedule.

        `loss_fn(outputs, targets)` is called on the last stage, once per micro-batch, as soon
        as that micro-batch's forward is done; it returns the micro-batch's mean loss, or (mean,
        weight) when its mean is over something else than examples (e.g. tokens). `loss` is the
        weighted mean over micro-batches (= the full batch's mean loss) and `grads` its
        gradients, lined up with `self.trainable_variables`. `inputs` and `targets` (any nested
        structure) are split into micro-batches alike. With return_outputs, the last stage's
        outputs of the whole batch come third.
        """
        with young_heap.build():
            return self._ComputeGradients(inputs, targets, loss_fn, return_outputs)

    def _ComputeGradients(self, inputs, targets, loss_fn, return_outputs):
        step = self._Step()
        inputs = _AsTuple(inputs)
        in_shards = self._Shards(inputs, first=True)
        tgt_shards = self._Shards(targets, first=False) if targets is not None else None
        head = recompute.LossHead(loss_fn, self.params.batch_dim)
        runs = []
        if tgt_shards is None:
            tgt_shards = [[None] * len(micro) for micro in in_shards]
        for r, micro, targets in zip(self._LocalReplicas(), in_shards, tgt_shards):
            if not micro:
                continue
            sums = ownership.GradientSums()
            run = self._Executor(r, len(micro), step, sums, input_grads=False, head=head)
            if self._loops.Ticks(run, micro, targets, return_outputs):
                runs.append(run)
                continue
            run.Feed(micro, targets)
            run.Run(self._Order(run.sched))
            runs.append(run)
        with distribute.on(self._Row()[-1]):
            weighted = tf.add_n([w for run in runs for w, _ in run.losses.values()])
            total_weight = tf.add_n([n for run in runs for _, n in run.losses.values()])
            if self._mesh is not None:
                # A replica's share of the global batch's mean (tf.distribute's convention: the
                # strategy's SUM over replicas, e.g. in optimizer.apply_gradients, makes it whole).
                total_weight = distribute.all_reduce_sum(total_weight)
            loss = weighted / total_weight
            scale = 1.0 / total_weight
        variables = self.trainable_variables
        self._CheckOwned([run.sums for run in runs], variables)
        grads = self._VariableGrads([run.sums for run in runs], variables, scale)
        if not return_outputs:
            return loss, grads
        merged = []
        for run, micro in zip(runs, [m for m in in_shards if m]):
            with distribute.on(run.runners[-1].device):
                merged.append(
                    microbatch.merge(
                        [run.outputs[m] for m in range(len(micro))], self.params.batch_dim
                    )
                )
        with distribute.on(self._Row()[-1]):
            outputs = _Unpack(microbatch.merge(merged, self.params.batch_dim))
        return loss, grads, outputs

    def _CheckOwned(self, sums, variables):
        known = {v.ref() for v in variables}
        for s in sums:
            for v in s.variables:
                if v.ref() not in known:
                    raise ValueError(
                        f'{self.params.name}: a cell reads the trainable variable {v.name!r}, '
                        'which no cell of this pipeline owns, so ComputeGradients (whose grads '
                        'line up with pipe.trainable_variables) would drop its gradient. Create '
                        'it in a layer of the pipeline (a tied weight: in the layer that owns '
                        'it), or compute with FProp under a tape.'
                    )

    def _Eval(self, inputs, step):
        """Forward only, no tapes, still one device after another in wave order."""
        p = self.params
        outs = []
        for r, micro in zip(self._LocalReplicas(), self._Shards(inputs, first=True)):
            if not micro:
                continue
            sched = self.Schedule(len(micro))
            merged = self._loops.Eval(self._runners[r], sched, micro, step, r * p.num_micro_batches)
            if merged is not None:
                outs.append(merged)
                continue
            run = executor.Executor(
                self._runners[r], sched, 'always', step, r * p.num_micro_batches, None, False
            )
            run.Feed(micro)
            run.Evaluate(executor.eval_order(sched.num_stages, len(micro)))
            with distribute.on(self._replica_devices[r][-1]):
                outs.append(
                    microbatch.merge([run.outputs[m] for m in range(len(micro))], p.batch_dim)
                )
        with distribute.on(self._Row()[-1]):
            return _Unpack(microbatch.merge(outs, p.batch_dim))

    def ExtendStep(self, inputs, state, t, max_len):
        """Decoding one step: replica 0's cells in order, each on its device with its own state
        (a cell's attention caches stay on the cell's device); one sequence's steps form no
        micro-batches."""
        states = [None] * self.num_cells if state is None else state
        new = []
        for runner, cell, cell_state in zip(self._runners[0], self._cells, states):
            with distribute.on(runner.device):
                inputs, cell_state = cell.ExtendStep(inputs, cell_state, t, max_len)
            new.append(cell_state)
        return inputs, new

    def PostTrainingStepUpdate(self):
        """Replicas first pool their batch-norm sums, so every copy moves with the global batch.

        Under a strategy the sums are per-replica variables (synchronized on read) whose read in
        cross-replica context is their sum over replicas: inside strategy.run, the update runs
        once there, by merge_call."""
        if self._mesh is not None and distribute.in_replica_context():
            tf.distribute.get_replica_context().merge_call(lambda _: self.PostTrainingStepUpdate())
            return
        replication.pool_replica_sums(self._replica_cells)
        super().PostTrainingStepUpdate()

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        cells, _, _ = cls.CellParams(p)
        return chain_meta(cells, input_shapes)


def _AsTuple(x):
    return x if isinstance(x, tuple) else (x,)


def _Unpack(outputs):
    return outputs[0] if isinstance(outputs, tuple) and len(outputs) == 1 else outputs


def _Pad(sums, count):
    """GradientSums per replica (replicas without micro-batches contribute nothing)."""
    return list(sums) + [ownership.GradientSums() for _ in range(count - len(sums))]
