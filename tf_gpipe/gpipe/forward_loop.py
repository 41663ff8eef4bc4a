"""Fill-drain's forward wave as one `tf.while_loop`: at tick t, cell s runs micro-batch t - s.

The unrolled wave calls every cell once per micro-batch, and TF instantiates a called function
once per call site, so that program and its start-up grow with M. Here each cell is called at
one site in the loop body whatever M (Lingvo's GPipe runs its micro-batches as loop iterations
for the same reason). A cell's output reaches the next cell as a loop variable one tick later;
within a tick the cells are independent, so their devices work at once, and the loop lets a
device run ahead by a few ticks where the data allows (parallel_iterations). The last cell
writes micro-batch m's outputs to a TensorArray at m, concatenated along the batch dimension
after the loop. Eval runs it; training `FProp` under a tape runs it with `stash`, keeping each
cell's input per micro-batch for backward_loop.py (GPipe's recompute: only cell inputs are
kept). `unsupported` names what the loop does not run (the caller runs the unrolled wave then).
"""

import tensorflow as tf

from tf_gpipe.gpipe import packed_handles, trace, unordered
from tf_gpipe.gpipe.opaque import opaque
from tf_gpipe.gpipe.tick_loop import EAGER, beside_input, run_on, same_specs, spec_of
from tf_gpipe.runtime import distribute


def unsupported(micro_inputs):
    """Why the waves cannot run as loops (the unrolled executor runs them), or None."""
    if tf.executing_eagerly():
        return EAGER
    if trace.recording():
        return 'a timeline is being recorded'
    first = [spec_of(t) for t in tf.nest.flatten(micro_inputs[0])]
    if any(s is not None and s.shape.rank is None for s in first):
        return 'an input of unknown rank'
    if not same_specs(micro_inputs):
        return 'micro-batches of different sizes'
    return None


class UnsupportedError(Exception):
    """Found while building: the caller runs the unrolled executor instead."""


def empty(spec):
    """An idle cell's stand-in for a tensor of `spec`: no rows, unknown dimensions as 0."""
    if not spec.shape.rank:
        return tf.zeros([], spec.dtype)
    dims = [0] + [0 if n is None else n for n in spec.shape.as_list()[1:]]
    return tf.zeros(dims, spec.dtype)


def relaxed(spec):
    """The shape a carried tensor has across ticks: real rows or none."""
    if not spec.shape.rank:
        return spec.shape
    return tf.TensorShape([None] + spec.shape.as_list()[1:])


def present(specs):
    """The leaves of `specs` that are not None."""
    return [sp for sp in tf.nest.flatten(specs) if sp is not None]


def fill(specs, leaves, shaped=True):
    """The structure of `specs` with `leaves`, in order, at its non-None leaves and None
    elsewhere; `shaped`: each leaf given its spec's static shape (a micro-batch's)."""
    it = iter(leaves)
    flat = [
        None if sp is None else tf.ensure_shape(next(it), sp.shape) if shaped else next(it)
        for sp in tf.nest.flatten(specs)
    ]
    return tf.nest.pack_sequence_as(specs, flat)


def front(x, batch_dim):
    """x with its batch dimension first (TensorArray.concat joins on the first)."""
    if batch_dim == 0:
        return x
    perm = [batch_dim] + [i for i in range(x.shape.rank) if i != batch_dim]
    return tf.transpose(x, perm)


def merged(ta, spec, batch_dim, num_m):
    """The micro-batches written to `ta` (batch dimension first), as one batch of `spec`'s
    layout."""
    x = ta.concat()
    rank = spec.shape.rank
    if batch_dim:
        x = tf.transpose(x, list(range(1, batch_dim + 1)) + [0] + list(range(batch_dim + 1, rank)))
    dims = spec.shape.as_list()
    if dims[batch_dim] is not None:
        dims[batch_dim] *= num_m
    return tf.ensure_shape(x, dims)


def stacked(micro, specs, device):
    """Per leaf of the micro-batches (None for None): stacked when its shape is known (one
    op), else a TensorArray written one by one (sizes may differ at run time)."""
    num_m = len(micro)
    out = []
    with distribute.on(device):
        for i, sp in enumerate(tf.nest.flatten(specs)):
            if sp is None:
                out.append(None)
            elif sp.shape.is_fully_defined():
                out.append(tf.stack([tf.nest.flatten(x)[i] for x in micro]))
            else:
                ta = tf.TensorArray(sp.dtype, size=num_m, infer_shape=False)
                for m, x in enumerate(micro):
                    ta = ta.write(m, tf.nest.flatten(x)[i])
                out.append(ta)
    return out


def read_stacked(leaves, specs, m):
    """Micro-batch m of `stacked`'s result, as the structure of `specs`."""
    flat = []
    for sp, x in zip(tf.nest.flatten(specs), leaves):
        if sp is None:
            flat.append(None)
        elif isinstance(x, tf.TensorArray):
            flat.append(tf.ensure_shape(x.read(tf.cast(m, tf.int32)), sp.shape))
        else:
            flat.append(tf.gather(x, m))
    return tf.nest.pack_sequence_as(specs, flat)


class Wave:
    """What both waves share: cells, their devices, each device's tick counter, the step."""

    def __init__(self, runners, device_of, step, seed_base, batch_dim):
        self.runners = runners
        self.device_of = device_of  # cell index -> device index
        self.step = step
        self.seed_base = seed_base  # micro-batch m draws as global micro-batch seed_base + m
        self.batch_dim = batch_dim
        self.devices = [r.device for r in runners]
        S = len(runners)
        K = max(device_of(s) for s in range(S)) + 1
        # Per device its own tick counter: no tick sends a device the loop counter.
        self.clock_devices = [
            self.devices[next(s for s in range(S) if device_of(s) == d)] for d in range(K)
        ]

    def Locals(self):
        """The step and the seed base as each cell's own copy (read at every tick)."""
        with distribute.on(self.devices[0]):
            step = tf.cast(self.step, tf.int64)
            seed_base = opaque(tf.cast(self.seed_base, tf.int64))  # never a constant (opaque.py)
        steps = [run_on(d, lambda: tf.identity(step)) for d in self.devices]
        seeds = [run_on(d, lambda: tf.identity(seed_base)) for d in self.devices]
        return steps, seeds

    def Clocks(self):
        """Each device's tick counter."""
        return [run_on(d, lambda: tf.zeros([], tf.int32)) for d in self.clock_devices]

    def Tick(self, clocks, done):
        """Each device's next tick, once its cells' actions of this one are done (`done`: per
        cell, what its branch returned): one action at a time per device, as the memory bound
        assumes (the branches are unordered calls, unordered.py: nothing else orders them)."""
        out = []
        for d, (device, c) in enumerate(zip(self.clock_devices, clocks)):
            outputs = [
                getattr(x, 'flow', x)  # a TensorArray: its flow
                for s, result in enumerate(done)
                if self.device_of(s) == d
                for x in tf.nest.flatten(result)
            ]
            with distribute.on(device), tf.control_dependencies(outputs):
                out.append(c + 1)
        return out

    def Loop(self, body, state, invariants, ticks):
        """tf.while_loop over `ticks`; its condition reads a counter of its own (state['tick'],
        on the first device), so no device's action holds up another's next tick."""
        state = dict(state, tick=run_on(self.clock_devices[0], lambda: tf.constant(0)))
        invariants = dict(invariants, tick=tf.TensorShape([]))
        # The branches' variable handles cross the loop as one tensor per device
        # (packed_handles.py); the body's branches take them from `self.packer`.
        self.packer = packed_handles.HandlePacker()

        def counted(state):
            (new,) = body(state)
            with distribute.on(self.clock_devices[0]):
                return (dict(new, tick=state['tick'] + 1),)

        with tf.compat.v1.device(beside_input):
            (final,) = tf.while_loop(
                lambda state: run_on(self.clock_devices[0], lambda: state['tick'] < ticks),
                counted,
                (state,),
                shape_invariants=(invariants,),
                maximum_iterations=ticks,
                parallel_iterations=max(10, 2 * len(self.runners)),
            )
        self.packer.Release(tf.nest.flatten(final, expand_composites=True))
        return final


class ForwardLoop(Wave):
    """Runs the forward wave of `runners` (one per cell, in order) over M micro-batches."""

    def Trace(self, micro_inputs, training=False):
        """Traces each cell's forward for these micro-batches (the loop body's calls reuse
        it): `in_specs`, `out_specs` per cell. Raises UnsupportedError before any loop."""
        bd = self.batch_dim
        step_spec = tf.TensorSpec([], tf.int64)
        self.training = training
        self.in_specs, self.out_specs = [], []
        spec = tf.nest.map_structure(spec_of, micro_inputs[0])
        for runner in self.runners:
            self.in_specs.append(spec)
            # The same signature as the calls in the loop body: traced once, here.
            fn = runner.ForwardFunction(spec, None, step_spec, step_spec, training)
            spec = tf.nest.map_structure(spec_of, fn.structured_outputs)
            self.out_specs.append(spec)
        last_flat = present(self.out_specs[-1])
        if any(sp.shape.rank is None or sp.shape.rank <= bd for sp in last_flat):
            raise UnsupportedError('an output without a batch dimension')
        for specs in self.in_specs[1:]:
            if any(sp.shape.rank is None for sp in present(specs)):
                raise UnsupportedError('a cell output of unknown rank')

    def Run(self, micro_inputs, stash=False):
        """The last cell's outputs for the whole batch (the micro-batches merged), after
        Trace. With `stash`, `self.stash` keeps each cell's input per micro-batch for the
        backward."""
        runners, bd, training = self.runners, self.batch_dim, self.training
        num_m, S = len(micro_inputs), len(runners)
        devices = self.devices
        in_specs, out_specs = self.in_specs, self.out_specs
        last_flat = present(out_specs[-1])
        self.x0 = stacked(micro_inputs, in_specs[0], devices[0])
        steps, seeds = self.Locals()
        new_list = lambda sp: tf.TensorArray(sp.dtype, size=num_m, infer_shape=False)  # noqa: E731
        state = dict(
            clock=self.Clocks(),
            # Per cell boundary: the previous tick's output of the cell before.
            carry=[
                run_on(devices[s], lambda s=s: [empty(sp) for sp in present(out_specs[s])])
                for s in range(S - 1)
            ],
            out=run_on(devices[-1], lambda: [new_list(sp) for sp in last_flat]),
            stash=[
                run_on(devices[s], lambda s=s: [new_list(sp) for sp in present(in_specs[s])])
                if stash and s
                else []
                for s in range(S)
            ],
        )
        invariants = dict(
            clock=[tf.TensorShape([])] * len(state['clock']),
            carry=[[relaxed(sp) for sp in present(out_specs[s])] for s in range(S - 1)],
            out=[tf.TensorShape(None)] * len(last_flat),
            stash=[[tf.TensorShape(None)] * len(lists) for lists in state['stash']],
        )

        def inputs(state, s, m):
            if s == 0:
                return read_stacked(self.x0, in_specs[0], m)
            return fill(in_specs[s], state['carry'][s - 1])

        def body(state):
            new = dict(carry=[None] * (S - 1))
            new['out'], new['stash'] = state['out'], list(state['stash'])
            done = []
            for s, runner in enumerate(runners):
                with distribute.on(runner.device):
                    m = tf.cast(state['clock'][self.device_of(s)], tf.int64) - s
                    active = tf.logical_and(m >= 0, m < num_m)

                    def run(s=s, runner=runner, m=m):
                        x = inputs(state, s, m)
                        y = present(runner.Forward(x, None, steps[s], seeds[s] + m, training))
                        index = tf.cast(m, tf.int32)
                        kept = [ta.write(index, v) for ta, v in zip(state['stash'][s], present(x))]
                        if s < S - 1:
                            return y, kept
                        return [
                            ta.write(index, front(v, bd)) for ta, v in zip(state['out'], y)
                        ], kept

                    def idle(s=s):
                        if s < S - 1:
                            return [empty(sp) for sp in present(out_specs[s])], state['stash'][s]
                        return list(state['out']), state['stash'][s]

                    result, kept = tf.cond(
                        active,
                        unordered.branch(run, self.packer),
                        unordered.branch(idle, self.packer),
                    )
                    done.append((result, kept))
                    new['stash'][s] = list(kept)
                    if s < S - 1:
                        new['carry'][s] = list(result)
                    else:
                        new['out'] = list(result)
            new['clock'] = self.Tick(state['clock'], done)
            return (new,)

        final = self.Loop(body, state, invariants, num_m + S - 1)
        self.stash = final['stash']
        with distribute.on(devices[-1]):
            outputs = [merged(ta, sp, bd, num_m) for ta, sp in zip(final['out'], last_flat)]
            return fill(out_specs[-1], outputs, shaped=False)
