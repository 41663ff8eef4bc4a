"""Fill-drain's backward wave as one `tf.while_loop`, after forward_loop.py's stashed forward.

At tick t, cell s runs the backward of micro-batch M - 1 - (t - (S - 1 - s)): the last cell
starts with the last micro-batch, as the unrolled gpipe schedule does, and each cell's input
gradient reaches the cell before as a loop variable one tick later. A backward recomputes the
cell's forward from its stashed input (the same dropout masks: the same step and micro-batch
seed), then frees the stash slot. Each cell's dense weight gradients are running sums in the
loop state, one TensorList per dtype (dense_sums.py); sparse ones (gathers) are kept per
micro-batch and concatenated after the loop, as TF's tape aggregates them, so an optimizer
still gets them sparse. The first cell's input gradients are written per micro-batch and
concatenated along the batch dimension after the loop.
"""

import tensorflow as tf

from tf_gpipe.gpipe import call_op, dense_sums, executor, forward_loop, ownership, unordered
from tf_gpipe.gpipe.forward_loop import UnsupportedError, empty, fill, front, merged, present
from tf_gpipe.gpipe.tick_loop import run_on, spec_of
from tf_gpipe.runtime import distribute


def _float_spec(sp):
    return sp if sp is not None and sp.dtype.is_floating else None


class BackwardLoop(forward_loop.Wave):
    """The backward of a `ForwardLoop` run with `stash`, into ownership.GradientSums `sums`."""

    def Prepare(self, fwd, input_grads=True):
        """Traces each cell's backward for `fwd`'s specs (the loop body's calls reuse it) and
        sorts the weight gradients; raises UnsupportedError before any loop."""
        runners, S = self.runners, len(self.runners)
        step_spec = tf.TensorSpec([], tf.int64)
        in_specs, out_specs = fwd.in_specs, fwd.out_specs
        grad_specs = [tf.nest.map_structure(_float_spec, sp) for sp in out_specs]
        float_in = [present(tf.nest.map_structure(_float_spec, sp)) for sp in in_specs]
        wants = ['all' if s or (input_grads and float_in[0]) else 'variables' for s in range(S)]

        # Trace each cell's backward once (the calls in the loop body reuse it) and sort the
        # weight gradients it returns into dense (summed in the loop) and sparse (kept per m).
        dense, sparse = [], []  # per cell: [(variable, spec)] / [(variable, values, indices)]
        for s, runner in enumerate(runners):
            outputs, variables = runner.BackwardFunction(
                in_specs[s], None, grad_specs[s], step_spec, step_spec, wants[s]
            )
            d_vars = outputs[-1]
            dense.append([])
            sparse.append([])
            for v, g in zip(variables, d_vars):
                if isinstance(g, tf.IndexedSlices):
                    specs = (spec_of(g.values), spec_of(g.indices))
                    if not all(sp.shape.is_fully_defined() for sp in specs):
                        raise UnsupportedError('a sparse gradient of unknown size')
                    sparse[s].append((v,) + specs)
                elif g is not None:
                    dense[s].append((v, spec_of(g)))
        self.grad_specs, self.float_in, self.wants = grad_specs, float_in, wants
        self.sparse = sparse
        self.dense = [dense_sums.DenseSums(pairs) for pairs in dense]  # per cell

    def Run(self, fwd, micro_d_outputs, sums):
        """Adds every weight gradient to `sums`; returns the gradient of the whole batch's
        inputs (the structure of one micro-batch's inputs, None at non-float leaves). Its call
        sites are made once whatever M: no trampolines (call_op.direct_calls)."""
        with call_op.direct_calls():
            return self._Run(fwd, micro_d_outputs, sums)

    def _Run(self, fwd, micro_d_outputs, sums):
        runners, bd = self.runners, self.batch_dim
        num_m, S = len(micro_d_outputs), len(runners)
        devices = self.devices
        in_specs = fwd.in_specs
        grad_specs, float_in, wants = self.grad_specs, self.float_in, self.wants
        sparse, dense = self.sparse, self.dense

        dy = forward_loop.stacked(micro_d_outputs, grad_specs[-1], devices[-1])
        steps, seeds = self.Locals()
        new_list = lambda sp: tf.TensorArray(sp.dtype, size=num_m, infer_shape=False)  # noqa: E731
        want_d_in = wants[0] == 'all'
        state = dict(
            clock=self.Clocks(),
            # carry[s]: the gradient of cell s's float outputs, from cell s + 1's last tick.
            carry=[
                run_on(devices[s + 1], lambda s=s: [empty(sp) for sp in present(grad_specs[s])])
                for s in range(S - 1)
            ],
            stash=list(fwd.stash),
            dense=[run_on(devices[s], dense[s].New) for s in range(S)],
            sparse=[
                run_on(
                    devices[s],
                    lambda s=s: [[new_list(vs), new_list(ix)] for _, vs, ix in sparse[s]],
                )
                for s in range(S)
            ],
            d_in=run_on(devices[0], lambda: [new_list(sp) for sp in float_in[0]])
            if want_d_in
            else [],
        )
        invariants = dict(
            clock=[tf.TensorShape([])] * len(state['clock']),
            carry=[
                [forward_loop.relaxed(sp) for sp in present(grad_specs[s])] for s in range(S - 1)
            ],
            stash=[[tf.TensorShape(None)] * len(lists) for lists in state['stash']],
            dense=[[t.shape for t in lists] for lists in state['dense']],
            sparse=[[[tf.TensorShape(None)] * 2 for _ in lists] for lists in state['sparse']],
            d_in=[tf.TensorShape(None)] * len(state['d_in']),
        )

        def inputs(state, s, m):
            if s == 0:
                return forward_loop.read_stacked(fwd.x0, in_specs[0], m)
            index = tf.cast(m, tf.int32)
            return fill(in_specs[s], [ta.read(index) for ta in state['stash'][s]])

        def output_grads(state, s, m):
            if s == S - 1:
                return forward_loop.read_stacked(dy, grad_specs[s], m)
            return fill(grad_specs[s], state['carry'][s])

        def body(state):
            new = dict(carry=[None] * (S - 1))
            done = []
            for key in ('stash', 'dense', 'sparse'):
                new[key] = list(state[key])
            new['d_in'] = state['d_in']
            for s, runner in enumerate(runners):
                with distribute.on(runner.device):
                    j = tf.cast(state['clock'][self.device_of(s)], tf.int64) - (S - 1 - s)
                    m = num_m - 1 - j
                    active = tf.logical_and(j >= 0, j < num_m)

                    def run(s=s, runner=runner, m=m):
                        index = tf.cast(m, tf.int32)
                        d_x, d_vars = runner.Backward(
                            inputs(state, s, m),
                            None,
                            output_grads(state, s, m),
                            steps[s],
                            seeds[s] + m,
                            wants[s],
                        )
                        by_var = {v.ref(): g for v, g in d_vars}  # (variable, gradient) pairs
                        sums_s = dense[s].Add(state['dense'][s], d_vars)  # its dense ones
                        kept = [
                            [
                                vs.write(index, by_var[v.ref()].values),
                                ix.write(index, by_var[v.ref()].indices),
                            ]
                            for (vs, ix), (v, _, _) in zip(state['sparse'][s], sparse[s])
                        ]
                        # The stash slot is used up: free it.
                        stash = [
                            ta.write(index, empty(sp))
                            for ta, sp in zip(state['stash'][s], present(in_specs[s]))
                        ]
                        d_in = list(state['d_in'])
                        if s == 0 and want_d_in:
                            d_in = [ta.write(index, front(g, bd)) for ta, g in zip(d_in, d_x)]
                        sent = list(d_x) if s > 0 else []
                        return sent, sums_s, kept, stash, d_in

                    def idle(s=s):
                        sent = [empty(sp) for sp in float_in[s]] if s > 0 else []
                        return (
                            sent,
                            list(state['dense'][s]),
                            [list(p) for p in state['sparse'][s]],
                            list(state['stash'][s]),
                            list(state['d_in']),
                        )

                    result = tf.cond(
                        active,
                        unordered.branch(run, self.packer),
                        unordered.branch(idle, self.packer),
                    )
                    done.append(result)
                    sent, sums_s, kept, stash, d_in = result
                    if s > 0:
                        new['carry'][s - 1] = list(sent)
                    new['dense'][s], new['sparse'][s] = list(sums_s), [list(p) for p in kept]
                    new['stash'][s] = list(stash)
                    if s == 0:
                        new['d_in'] = list(d_in)
            new['clock'] = self.Tick(state['clock'], done)
            return (new,)

        final = self.Loop(body, state, invariants, num_m + S - 1)

        for s in range(S):
            with distribute.on(devices[s]):
                for v, total in dense[s].Read(final['dense'][s]):
                    sums.Add(v, total)
                for (v, _, _), (vs, ix) in zip(sparse[s], final['sparse'][s]):
                    values, indices = vs.concat(), ix.concat()
                    sums.Add(
                        v, tf.IndexedSlices(values, indices, tf.shape(v, out_type=indices.dtype))
                    )
        if not want_d_in:
            return tf.nest.map_structure(lambda _: None, in_specs[0])
        with distribute.on(devices[0]):
            return fill(
                tf.nest.map_structure(_float_spec, in_specs[0]),
                [merged(ta, sp, bd, num_m) for ta, sp in zip(final['d_in'], float_in[0])],
                shaped=False,
            )


class FillDrain:
    """gpipe's training FProp (one op under a tape) as two loops: the forward wave stashing
    each cell's input, then, when the tape asks, the backward wave into `sums`."""

    def __init__(self, runners, device_of, step, seed_base, batch_dim):
        self.forward = forward_loop.ForwardLoop(runners, device_of, step, seed_base, batch_dim)
        self.backward = BackwardLoop(runners, device_of, step, seed_base, batch_dim)
        self.sums = ownership.GradientSums()
        self.outputs = None  # the whole batch's, after Forward

    def Forward(self, micro_inputs):
        """Runs the forward wave: `outputs`, the whole batch's. Everything that can refuse
        (UnsupportedError) is traced before the first loop is built."""
        self.forward.Trace(micro_inputs, training=True)
        # Traced with tapes recording: the backward's own tape must see the cell's ops.
        self.backward.Prepare(self.forward)
        with executor.stop_recording():  # the custom gradient is the outer tape's record
            self.outputs = self.forward.Run(micro_inputs, stash=True)

    def Backward(self, micro_d_outputs):
        """The gradient of the whole batch's inputs; the weights' in `sums`."""
        return self.backward.Run(self.forward, micro_d_outputs, self.sums)
