"""Eval's forward wave as one `tf.while_loop`: at tick t, cell s runs micro-batch t - s.

The unrolled wave calls every cell once per micro-batch, and TF instantiates a called function
once per call site, so that program and its start-up grow with M. Here each cell is called at
one site in the loop body whatever M (Lingvo's GPipe runs its micro-batches as loop iterations
for the same reason). A cell's output reaches the next cell as a loop variable one tick later;
within a tick the cells are independent, so their devices work at once, and the loop lets a
device run ahead by a few ticks where the data allows (parallel_iterations). The last cell
writes micro-batch m's outputs to a TensorArray at m, concatenated along the batch dimension
after the loop. `unsupported` names what the loop does not run (the caller runs the unrolled
wave then).
"""

import tensorflow as tf

from tf_gpipe.gpipe import trace
from tf_gpipe.gpipe.tick_loop import beside_input, run_on, spec_of
from tf_gpipe.runtime import distribute


def unsupported(micro_inputs):
    """Why eval cannot run as a loop (the unrolled wave runs it), or None."""
    if tf.executing_eagerly():
        return 'eager execution'
    if tf.distribute.has_strategy():
        return 'a tf.distribute strategy'  # as the training loop (tick_loop.unsupported)
    if trace.recording():
        return 'a timeline is being recorded'
    first = [spec_of(t) for t in tf.nest.flatten(micro_inputs[0])]
    if any(s is not None and s.shape.rank is None for s in first):
        return 'an input of unknown rank'
    for other in micro_inputs[1:]:
        if [spec_of(t) for t in tf.nest.flatten(other)] != first:
            return 'micro-batches of different sizes'
    return None


class UnsupportedError(Exception):
    """Found while building: the caller runs the unrolled wave instead."""


def _empty(spec):
    """An idle cell's stand-in output: no rows, unknown dimensions as 0."""
    if not spec.shape.rank:
        return tf.zeros([], spec.dtype)
    dims = [0] + [0 if n is None else n for n in spec.shape.as_list()[1:]]
    return tf.zeros(dims, spec.dtype)


def _relaxed(spec):
    """The shape a carried output has across ticks: real rows or none."""
    if not spec.shape.rank:
        return spec.shape
    return tf.TensorShape([None] + spec.shape.as_list()[1:])


def _front(x, batch_dim):
    """x with its batch dimension first (TensorArray.concat joins on the first)."""
    if batch_dim == 0:
        return x
    perm = [batch_dim] + [i for i in range(x.shape.rank) if i != batch_dim]
    return tf.transpose(x, perm)


def _back(x, batch_dim, rank):
    """Inverse of _front for a tensor of `rank`."""
    if batch_dim == 0:
        return x
    perm = list(range(1, batch_dim + 1)) + [0] + list(range(batch_dim + 1, rank))
    return tf.transpose(x, perm)


def _merged_shape(spec, batch_dim, num_m):
    dims = spec.shape.as_list()
    if dims[batch_dim] is not None:
        dims[batch_dim] *= num_m
    return tf.TensorShape(dims)


class EvalLoop:
    """Runs the forward wave of `runners` (one per cell, in order) over M micro-batches."""

    def __init__(self, runners, device_of, step, seed_base, batch_dim):
        self.runners = runners
        self.device_of = device_of  # cell index -> device index
        self.step = step
        self.seed_base = seed_base  # micro-batch m draws as global micro-batch seed_base + m
        self.batch_dim = batch_dim

    def Run(self, micro_inputs):
        """The last cell's outputs for the whole batch (the micro-batches merged)."""
        runners, bd = self.runners, self.batch_dim
        num_m, S = len(micro_inputs), len(runners)
        devices = [r.device for r in runners]
        step_spec = tf.TensorSpec([], tf.int64)
        in_specs, out_specs = [], []
        spec = tf.nest.map_structure(spec_of, micro_inputs[0])
        for runner in runners:
            in_specs.append(spec)
            # The same signature as the calls in the loop body: traced once, here.
            forward = runner._forward.get_concrete_function(spec, None, step_spec, step_spec, False)
            spec = tf.nest.map_structure(spec_of, forward.structured_outputs)
            out_specs.append(spec)
        last_flat = [sp for sp in tf.nest.flatten(out_specs[-1]) if sp is not None]
        if any(sp.shape.rank is None or sp.shape.rank <= bd for sp in last_flat):
            raise UnsupportedError('an output without a batch dimension')
        for specs in out_specs[:-1]:
            if any(sp is not None and sp.shape.rank is None for sp in tf.nest.flatten(specs)):
                raise UnsupportedError('a cell output of unknown rank')

        # The micro-batches, on the first cell's device: stacked when their shapes are known
        # (one op), else written one by one (their sizes may differ at run time).
        first_flat = tf.nest.flatten(in_specs[0])
        with distribute.on(devices[0]):
            x0 = []
            for i, sp in enumerate(first_flat):
                if sp is None:
                    x0.append(None)
                elif sp.shape.is_fully_defined():
                    x0.append(tf.stack([tf.nest.flatten(x)[i] for x in micro_inputs]))
                else:
                    ta = tf.TensorArray(sp.dtype, size=num_m, infer_shape=False)
                    for m, x in enumerate(micro_inputs):
                        ta = ta.write(m, tf.nest.flatten(x)[i])
                    x0.append(ta)
            step = tf.cast(self.step, tf.int64)
            seed_base = step - step + tf.cast(self.seed_base, tf.int64)

        def present(specs):
            return [sp for sp in tf.nest.flatten(specs) if sp is not None]

        # Loop state: per device its own tick counter (no tick sends a device the counter),
        # per cell boundary the previous tick's output of the cell before, the outputs.
        K = max(self.device_of(s) for s in range(S)) + 1
        cell_device = [
            devices[next(s for s in range(S) if self.device_of(s) == d)] for d in range(K)
        ]
        state = dict(
            clock=[run_on(cell_device[d], lambda: tf.zeros([], tf.int32)) for d in range(K)],
            carry=[
                run_on(devices[s], lambda s=s: [_empty(sp) for sp in present(out_specs[s])])
                for s in range(S - 1)
            ],
            out=run_on(
                devices[-1],
                lambda: [
                    tf.TensorArray(sp.dtype, size=num_m, infer_shape=False) for sp in last_flat
                ],
            ),
        )
        invariants = dict(
            clock=[tf.TensorShape([])] * K,
            carry=[[_relaxed(sp) for sp in present(out_specs[s])] for s in range(S - 1)],
            out=[tf.TensorShape(None)] * len(last_flat),
        )

        def read_input(state, s, m):
            if s > 0:
                it = iter(state['carry'][s - 1])
                flat = [
                    None if sp is None else tf.ensure_shape(next(it), sp.shape)
                    for sp in tf.nest.flatten(in_specs[s])
                ]
            else:
                flat = []
                for sp, x in zip(first_flat, x0):
                    if sp is None:
                        flat.append(None)
                    elif isinstance(x, tf.TensorArray):
                        flat.append(tf.ensure_shape(x.read(tf.cast(m, tf.int32)), sp.shape))
                    else:
                        flat.append(tf.gather(x, m))
            return tf.nest.pack_sequence_as(in_specs[s], flat)

        def body(state):
            new = dict(clock=[], carry=[None] * (S - 1), out=state['out'])
            for d in range(K):
                with distribute.on(cell_device[d]):
                    new['clock'].append(state['clock'][d] + 1)
            for s, runner in enumerate(runners):
                with distribute.on(runner.device):
                    t = tf.cast(state['clock'][self.device_of(s)], tf.int64)
                    m = t - s
                    active = tf.logical_and(m >= 0, m < num_m)

                    def run(s=s, runner=runner, m=m):
                        y = runner.Forward(
                            read_input(state, s, m), None, step_local[s], seed_local[s] + m, False
                        )
                        flat = present(y)
                        if s < S - 1:
                            return flat
                        index = tf.cast(m, tf.int32)
                        return [
                            ta.write(index, _front(y_, bd)) for ta, y_ in zip(state['out'], flat)
                        ]

                    def idle(s=s):
                        if s < S - 1:
                            return [_empty(sp) for sp in present(out_specs[s])]
                        return list(state['out'])

                    result = tf.cond(active, run, idle)
                    if s < S - 1:
                        new['carry'][s] = list(result)
                    else:
                        new['out'] = list(result)
            return (new,)

        step_local = [run_on(devices[s], lambda: tf.identity(step)) for s in range(S)]
        seed_local = [run_on(devices[s], lambda: tf.identity(seed_base)) for s in range(S)]
        ticks = num_m + S - 1
        with tf.compat.v1.device(beside_input):
            (final,) = tf.while_loop(
                lambda state: state['clock'][0] < ticks,
                body,
                (state,),
                shape_invariants=(invariants,),
                maximum_iterations=ticks,
                parallel_iterations=max(10, 2 * S),
            )
        with distribute.on(devices[-1]):
            flat = [
                tf.ensure_shape(_back(ta.concat(), bd, sp.shape.rank), _merged_shape(sp, bd, num_m))
                for ta, sp in zip(final['out'], last_flat)
            ]
            it = iter(flat)
            return tf.nest.pack_sequence_as(
                out_specs[-1],
                [None if sp is None else next(it) for sp in tf.nest.flatten(out_specs[-1])],
            )
