"""Zero-bubble's F, B and W of a kept micro-batch as three traced calls, cut from one trace.

One trace of the cell holds its forward, B (the output gradient back to the inputs and to the
weights' uses, see weight_gradients.py) and W (the uses' gradients to the weights, one local op
per use), made by `tf.compat.v1.wrap_function`. `graph_cut.py` cuts it into three functions:

- F: inputs -> outputs, plus the residuals: every forward tensor that B or W reads;
- B: residuals and output gradients -> input gradients, the unsplit variables' gradients and
  what W reads of B's work (the uses' output gradients);
- W: what W reads -> the split variables' gradients.

So a kept micro-batch adds three calls to the step, whatever the cell's size, and W stays
local; two on a cell whose output gradient is known at F (the last, with the loss): F and B
as one call (`ForwardBackward`), which returns W's feeds, so that nothing else is carried.
Built once per cell and input signature.

`wrap_function` adds no automatic control dependencies, so the cut is refused (`build` returns
None and the caller falls back to an unsplit B) when the forward writes a resource that it also
reads: only then does the order of its stateful ops matter. Writes nobody reads in the forward
(batch norm's accumulators) are fetched by F and run there; B and W never hold them, not even
when a residual's op waits for one (`graph_cut` does not copy what a fed tensor depends on).
"""

import tensorflow as tf

from tf_gpipe.gpipe import graph_cut, grappler, weight_gradients
from tf_gpipe.runtime import distribute

_NOINLINE = {'_noinline': True}


def _is_float(x):
    return isinstance(x, tf.Tensor | tf.Variable) and x.dtype.is_floating


def _frontier(ops):
    """Tensors the ops read that none of them produces, in first-use order."""
    inside, seen, out = set(ops), set(), []
    for op in ops:
        for t in op.inputs:
            if t.op not in inside and t.ref() not in seen:
                seen.add(t.ref())
                out.append(t)
    return out


class SplitFunctions:
    """F, B and W of one cell for one input signature (see the module docstring)."""

    def __init__(self, wrapped, parts, optimize=True):
        self._parts = parts
        self._optimize = optimize
        self.flat_outputs = tf.nest.flatten(parts['outputs'])
        self.split_variables = parts['uses'].split
        self.unsplit_variables = parts['uses'].unsplit
        args, residuals = parts['args'], parts['residuals']
        arg_index = {t.ref(): i for i, t in enumerate(args)}
        # Residuals that are arguments are fed from the arguments, not returned by F.
        self._residual_args = [arg_index.get(t.ref()) for t in residuals]
        fetched = [t for t in residuals if t.ref() not in arg_index]
        self._num_fetched = len(fetched)
        self._source = graph_cut.Source(wrapped.graph)
        self.forward = self._Cut('forward', args, self.flat_outputs + fetched + parts['stateful'])
        self._backward = {}
        self._forward_backward = {}
        w_fetch = parts['d_split']
        self.weights = (
            self._Cut('weights', parts['w_feeds'], w_fetch, after=True) if w_fetch else None
        )

    def _Cut(self, part, feeds, fetches, after=False):
        """The part of the trace between feeds and fetches as a call of its own, with Grappler
        on it if the cells run it (grappler.py)."""
        function = graph_cut.cut(self._source, feeds, fetches, f'cut_{part}', _NOINLINE, after)
        return grappler.Function(function, self._optimize)

    def Forward(self, flat_args):
        """(outputs, residuals) of one micro-batch."""
        results = _as_list(self.forward(*flat_args))
        n = len(self.flat_outputs)
        outputs = tf.nest.pack_sequence_as(self._parts['outputs'], results[:n])
        fetched = iter(results[n : n + self._num_fetched])
        residuals = [flat_args[i] if i is not None else next(fetched) for i in self._residual_args]
        return outputs, residuals

    def _Backward(self, want_inputs):
        """B as a pruned call: (d_x if wanted, d_unsplit, what W reads of B's work)."""
        if want_inputs not in self._backward:
            p = self._parts
            fetch = (p['d_x'] if want_inputs else []) + _flat_grads(p['d_unsplit']) + p['b_to_w']
            feeds = p['residuals'] + p['dy_phs']
            fn = self._Cut('backward', feeds, fetch) if fetch else None
            self._backward[want_inputs] = fn
        return self._backward[want_inputs]

    def ForwardBackward(self, flat_args, want_inputs):
        """F and B of one micro-batch in one call, for a cell whose output gradients are known
        up front (the last, with its loss): (outputs, d_x if wanted, d_unsplit, W's feeds).
        Nothing passes from F to B but inside the call; only what W reads is carried."""
        p = self._parts
        if p['dy_phs']:
            raise ValueError('split_functions: F and B in one call need the output gradients')
        if want_inputs not in self._forward_backward:
            arg_index = {t.ref(): i for i, t in enumerate(p['args'])}
            w_fetched = [t for t in p['w_feeds'] if t.ref() not in arg_index]
            d_x = p['d_x'] if want_inputs else []
            fetch = self.flat_outputs + d_x + _flat_grads(p['d_unsplit']) + w_fetched
            fn = self._Cut('forward_backward', p['args'], fetch + p['stateful'])
            w_args = [arg_index.get(t.ref()) for t in p['w_feeds']]
            self._forward_backward[want_inputs] = (fn, len(d_x), w_args)
        fn, n_x, w_args = self._forward_backward[want_inputs]
        results = _as_list(fn(*flat_args))
        n, n_u = len(self.flat_outputs), len(_flat_grads(p['d_unsplit']))
        outputs = tf.nest.pack_sequence_as(p['outputs'], results[:n])
        d_x, flat_u = results[n : n + n_x], results[n + n_x : n + n_x + n_u]
        fetched = iter(results[n + n_x + n_u :])
        w_feeds = [flat_args[i] if i is not None else next(fetched) for i in w_args]
        d_unsplit = _pack_grads(p['d_unsplit'], flat_u, self.unsplit_variables)
        return outputs, d_x, d_unsplit, w_feeds

    @property
    def weight_feeds(self):
        """The tensors of the trace W reads, in the order `Weights` takes them."""
        return self._parts['w_feeds']

    def Backward(self, residuals, flat_dys, want_inputs):
        """(d_x, d_unsplit, W's feeds) from the residuals and the output gradients."""
        p = self._parts
        fn = self._Backward(want_inputs)
        results = _as_list(fn(*(list(residuals) + list(flat_dys)))) if fn is not None else []
        n_x = len(p['d_x']) if want_inputs else 0
        n_u = len(_flat_grads(p['d_unsplit']))
        d_x, flat_u, b_to_w = results[:n_x], results[n_x : n_x + n_u], results[n_x + n_u :]
        d_unsplit = _pack_grads(p['d_unsplit'], flat_u, self.unsplit_variables)
        return d_x, d_unsplit, self.WeightFeeds(residuals, flat_dys, b_to_w)

    @property
    def structured_outputs(self):
        """The cell's outputs as F returns them (tensors of the trace, for their specs)."""
        return self._parts['outputs']

    @property
    def b_to_w(self):
        """The tensors of B's work that W reads (the uses' output gradients)."""
        return self._parts['b_to_w']

    @property
    def b_to_w_positions(self):
        """Where each of `b_to_w` sits among the feeds `Backward` returns for W."""
        where = {t.ref(): i for i, t in enumerate(self._parts['w_feeds'])}
        return [where[t.ref()] for t in self._parts['b_to_w']]

    @property
    def variable_gradients(self):
        """(variable, its gradient in the trace) for every variable B or W differentiates."""
        p = self._parts
        return list(zip(self.unsplit_variables, p['d_unsplit'])) + list(
            zip(self.split_variables, p['d_split'])
        )

    @property
    def residuals(self):
        """The forward's tensors that B or W read."""
        return self._parts['residuals']

    def WeightFeeds(self, residuals, flat_dys, b_to_w):
        """What W reads, from the residuals, the output gradients and B's `b_to_w`."""
        p = self._parts
        known = dict(zip([t.ref() for t in p['b_to_w']], b_to_w))
        known.update(zip([t.ref() for t in p['residuals']], residuals))
        known.update(zip([t.ref() for t in p['dy_phs']], flat_dys))
        return [known[t.ref()] for t in p['w_feeds']]

    def Weights(self, token, w_feeds):
        """The split variables' gradients from W's feeds, once `token` exists."""
        return _as_list(self.weights(token, *w_feeds)) if self.weights is not None else []


def _as_list(results):
    return list(results) if isinstance(results, list | tuple) else [results]


def _flat_grads(grads):
    """Tensors to fetch for `grads`: a sparse gradient (a gather's) as its values and indices,
    so that it stays sparse, as TF's tape hands it to an optimizer."""
    out = []
    for g in grads:
        out += [g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g]
    return out


def _pack_grads(like, flat, variables):
    it = iter(flat)
    out = []
    for g, v in zip(like, variables):
        if isinstance(g, tf.IndexedSlices):
            values, indices = next(it), next(it)
            shape = tf.shape(v, out_type=g.dense_shape.dtype)
            out.append(tf.IndexedSlices(values, indices, shape))
        else:
            out.append(next(it))
    return out


class _Unsplit:
    """Uses of no variable: B computes every weight gradient (a backward that is not split)."""

    def __init__(self, variables):
        self.split, self.unsplit = [], list(variables)

    def Tensors(self):
        return []

    def WeightGradients(self, point_grads):
        return []


def build(runner, inputs, targets, step, micro_batch, split=True):
    """SplitFunctions of `runner`'s cell for these arguments, or None when the forward's
    stateful ops need an order (see the module docstring). `split=False`: no W, B computes
    every weight gradient (F and B of a kept micro-batch, for a schedule that does not split)."""
    flat_args = [t for t in tf.nest.flatten((inputs, targets)) if t is not None]
    flat_args += [step, micro_batch]
    specs = [
        t if isinstance(t, tf.TensorSpec) else tf.TensorSpec.from_tensor(tf.convert_to_tensor(t))
        for t in flat_args
    ]
    parts = {}

    def body(*placeholders):
        args = list(placeholders)
        it = iter(args[:-2])
        ins, tgts = tf.nest.map_structure(
            lambda t: None if t is None else next(it), (inputs, targets)
        )
        step_ph, mb_ph = args[-2:]
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with distribute.on(runner.device), runner._Scope(step_ph, mb_ph):
            tape, sources, outputs = runner._RunTaped(ins, tgts)
            fwd_ops = graph.get_operations()[first:]
            variables = runner._NoteRead(tape.watched_variables())
            uses = weight_gradients.Uses(fwd_ops, variables) if split else _Unsplit(variables)
            points = uses.Tensors()
            b_first = len(graph.get_operations())
            if runner.head is not None:  # d (weighted loss) = 1
                ys, dys, dy_phs = [outputs[1]], [tf.ones([])], []
            else:
                ys = [y for y in tf.nest.flatten(outputs) if _is_float(y)]
                dy_phs = [tf.compat.v1.placeholder(y.dtype, y.shape) for y in ys]
                dys = dy_phs
            targets_ = sources + points + uses.unsplit
            grads = tape.gradient(ys, targets_, output_gradients=dys) if targets_ else []
            n, p = len(sources), len(points)
            d_x = [_zeros_if_none(g, x) for g, x in zip(grads[:n], sources)]
            d_unsplit = [
                g if isinstance(g, tf.IndexedSlices) else _zeros_if_none(g, v)
                for g, v in zip(grads[n + p :], uses.unsplit)
            ]
            w_first = len(graph.get_operations())
            d_split = [g for _, g in uses.WeightGradients(list(grads[n : n + p]))]
            w_last = len(graph.get_operations())
        all_ops = graph.get_operations()
        parts.update(
            args=args,
            outputs=outputs,
            fwd_ops=fwd_ops,
            b_ops=all_ops[b_first:w_first],
            w_ops=all_ops[w_first:w_last],
            dy_phs=dy_phs,
            d_x=d_x,
            d_unsplit=d_unsplit,
            d_split=d_split,
            uses=uses,
        )
        return list(tf.nest.flatten(outputs)) + d_x + _flat_grads(d_unsplit) + d_split

    wrapped = tf.compat.v1.wrap_function(body, specs)
    fwd_ops = parts['fwd_ops']
    if _writes_read_resources(fwd_ops):
        return None
    fwd_side = set(fwd_ops) | {t.op for t in parts['args']}
    b_side = set(parts['b_ops'])
    # The variables' handles: placeholders of the trace that are not its arguments.
    arg_refs = {t.ref() for t in parts['args']}
    captures = {
        t.ref()
        for op in wrapped.graph.get_operations()
        if op.type == 'Placeholder'
        for t in op.outputs
        if t.ref() not in arg_refs and t.dtype == tf.resource
    }
    # What depends on no argument (a weight as read, cast or reshaped) is the same for every
    # micro-batch: B and W read it again rather than carry a copy per micro-batch.
    invariant = _Invariant(captures)
    b_reads = [t for t in _frontier(parts['b_ops']) if not invariant(t)]
    w_feeds = [t for t in _frontier(parts['w_ops']) if not invariant(t)]
    if any(t.op not in fwd_side and t.op not in b_side for t in b_reads + w_feeds):
        return None  # a tensor from outside the trace: no clean cut
    residuals, seen = [], set()
    for t in b_reads + w_feeds:
        if t.op in fwd_side and t.ref() not in seen:
            seen.add(t.ref())
            residuals.append(t)
    dy_refs = {t.ref() for t in parts['dy_phs']}
    parts.update(
        residuals=residuals,
        w_feeds=w_feeds,
        b_to_w=[t for t in w_feeds if t.op in b_side and t.ref() not in dy_refs],
        stateful=[op for op in fwd_ops if op.type in WRITE_OPS],
    )
    return SplitFunctions(wrapped, parts, runner.grappler)


# Ops that write a resource (the recompute's check uses them too).
WRITE_OPS = frozenset(
    [
        'AssignVariableOp',
        'AssignAddVariableOp',
        'AssignSubVariableOp',
        'ResourceScatterUpdate',
        'ResourceScatterAdd',
        'ResourceScatterSub',
        'ResourceScatterMul',
        'ResourceScatterDiv',
        'ResourceScatterMin',
        'ResourceScatterMax',
        'ResourceScatterNdUpdate',
        'ResourceScatterNdAdd',
        'ResourceScatterNdSub',
        'ResourceStridedSliceAssign',
    ]
)


class _Invariant:
    """Whether a tensor of the trace depends on the captured variable handles and constants
    only: no argument (input, target, step, micro-batch) and no stateful op but a variable's
    read (`build` refuses forwards that write what they read, so a read in B sees F's value)."""

    def __init__(self, captures):
        self._known = dict.fromkeys(captures, True)

    def __call__(self, t):
        # Depth first without recursion: a deep cell's forward is a chain of thousands of ops.
        stack = [t]
        while stack:
            top = stack[-1]
            if top.ref() in self._known:
                stack.pop()
                continue
            op = top.op
            if op.type == 'Placeholder' or op.control_inputs:
                # an argument or an output gradient's placeholder; an ordered op
                self._known[top.ref()] = False
                stack.pop()
                continue
            if op.type != 'ReadVariableOp' and op.op_def.is_stateful:
                self._known[top.ref()] = False
                stack.pop()
                continue
            inputs = op.inputs[:1] if op.type == 'ReadVariableOp' else list(op.inputs)
            pending = [x for x in inputs if x.ref() not in self._known]
            if pending:
                stack.extend(pending)
                continue
            self._known[top.ref()] = all(self._known[x.ref()] for x in inputs)
            stack.pop()
        return self._known[t.ref()]


def _writes_read_resources(ops):
    """Whether some op writes a resource that another op of the forward also touches."""
    written = {op.inputs[0].ref() for op in ops if op.type in WRITE_OPS and op.inputs}
    if not written:
        return False
    touching = {}
    for op in ops:
        for t in op.inputs:
            if t.ref() in written:
                touching.setdefault(t.ref(), set()).add(op)
    return any(len(users) > 1 for users in touching.values())


def _zeros_if_none(grad, like):
    return tf.zeros_like(like) if grad is None else tf.convert_to_tensor(grad)
