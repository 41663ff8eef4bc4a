"""Zero-bubble's backward split for a kept forward: B stops at the weights' uses, W finishes them.

In a cell's forward (its ops in the step's graph) each variable's value reaches the computation
through *uses*: the ops that consume a read of it (followed through Identity / Cast). B
differentiates the cell's outputs with respect to its inputs and to the uses' outputs: the
chain of input gradients, without the weight gradients (TF prunes those unused ops). W turns
each use's output gradient into its variable's gradient with `tf.gradients` from the read to
the use, gradient flow stopped at the use's other inputs: one local op per use (xᵀ·dy for a
matmul) instead of walking the chain again. The sum over uses is the variable's gradient: a use
fed by another use of the same variable (a weight applied twice in a row) still counts once,
because the flow stops at the use's other inputs.

A variable read in any other way (a gather, inside control flow or a function call) is not
split: B computes its gradient, as an unsplit backward would. Eager mode has no graph to read
the uses from; there W walks the kept tape again (exact, not cheaper).
"""

import tensorflow as tf

_PASS_THROUGH = frozenset(['Identity', 'Cast'])


def captured_handle(variable):
    """The tensor that stands for `variable`'s handle in the graph being built (a capture)."""
    return tf.identity(variable.handle).op.inputs[0]


def _float_outputs(op):
    return [t for t in op.outputs if t.dtype.is_floating]


class Uses:
    """Where each variable's value enters the forward `ops`: the split points of B and W."""

    def __init__(self, ops, variables):
        inside = set(ops)
        by_handle = {captured_handle(v).ref(): v for v in variables}
        self.reads = {}  # variable ref -> [read tensors]
        self.points = {}  # variable ref -> [(use op, [its float outputs])]
        self.stops = {}  # variable ref -> [the uses' other inputs]
        unsplit = {}
        for op in ops:
            if not op.inputs or op.inputs[0].ref() not in by_handle:
                continue
            v = by_handle[op.inputs[0].ref()]
            if op.type != 'ReadVariableOp':
                unsplit[v.ref()] = v
                continue
            self.reads.setdefault(v.ref(), []).append(op.outputs[0])
            chain, frontier = {op.outputs[0].ref()}, [op.outputs[0]]
            while frontier:  # follow the read through identities and casts
                t = frontier.pop()
                for consumer in t.consumers():
                    if consumer not in inside:
                        continue
                    if consumer.type in _PASS_THROUGH:
                        out = consumer.outputs[0]
                        if out.ref() not in chain:
                            chain.add(out.ref())
                            frontier.append(out)
                        continue
                    outs = _float_outputs(consumer)
                    if not outs:
                        continue
                    uses = self.points.setdefault(v.ref(), [])
                    if all(u is not consumer for u, _ in uses):
                        uses.append((consumer, outs))
            self.stops.setdefault(v.ref(), [])
            for use, _ in self.points.get(v.ref(), []):
                self.stops[v.ref()] += [x for x in use.inputs if x.ref() not in chain]
        for ref in unsplit:
            for table in (self.reads, self.points, self.stops):
                table.pop(ref, None)
        self.unsplit = list(unsplit.values())
        self.split = [v for v in variables if v.ref() in self.points]
        # Variables read but never used (no float use) are split with no points: zero gradient.
        self.split += [
            v for v in variables if v.ref() not in self.points and v.ref() not in unsplit
        ]

    def Tensors(self):
        """Every use's float outputs, in a fixed order: what B differentiates besides inputs."""
        return [t for v in self.split for _, outs in self.points.get(v.ref(), []) for t in outs]

    def WeightGradients(self, point_grads):
        """[(variable, gradient)] of the split variables from B's gradients of `Tensors()`."""
        grads = iter(point_grads)
        result = []
        for v in self.split:
            ys, dys = [], []
            for _, outs in self.points.get(v.ref(), []):
                for y in outs:
                    dy = next(grads)
                    if dy is not None:
                        ys.append(y)
                        dys.append(dy)
            if not ys:
                result.append((v, tf.zeros_like(v)))
                continue
            reads = self.reads[v.ref()]
            parts = tf.gradients(ys, reads, grad_ys=dys, stop_gradients=self.stops[v.ref()])
            parts = [tf.cast(p, v.dtype) for p in parts if p is not None]
            result.append((v, tf.add_n(parts) if parts else tf.zeros_like(v)))
        return result
