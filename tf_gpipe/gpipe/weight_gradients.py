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
        self._chains = set()  # every read and its identities and casts, of every variable
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
            self._chains |= chain
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
        """[(variable, gradient)] of the split variables from B's gradients of `Tensors()`.

        Each `tf.gradients` call walks every op downstream of its sources (the whole rest of
        the trace), so a call per variable cost time quadratic in the cell's size. The
        variables are grouped instead, a call per group: two variables share one unless a
        use of one stops at a use of the other (a matmul's output feeding a bias add), since
        a stop there would cut the other's flow. Within a group flow stops at every use's
        other inputs but a variable's read, identity or cast (a product of two weights), so
        each use's gradient reaches its own variables' reads once: the per-variable result,
        a handful of walks per cell (tests/test_weight_gradients.py)."""
        grads = iter(point_grads)
        targets = {}  # variable ref -> [(use output, B's gradient of it)]
        owners = {}  # use output ref -> refs of the variables it is a use of
        for v in self.split:
            for _, outs in self.points.get(v.ref(), []):
                for y in outs:
                    dy = next(grads)
                    if dy is not None:
                        targets.setdefault(v.ref(), []).append((y, dy))
                        owners.setdefault(y.ref(), set()).add(v.ref())
        groups = self._Groups([v for v in self.split if v.ref() in targets], owners)
        summed = {}
        for group in groups:
            ys, dys, seen, stops, stopped = [], [], set(), [], set()
            for v in group:
                for y, dy in targets[v.ref()]:
                    if y.ref() not in seen:  # a use of two variables: one target
                        seen.add(y.ref())
                        ys.append(y)
                        dys.append(dy)
                for t in self.stops[v.ref()]:
                    if t.ref() not in self._chains and t.ref() not in stopped:
                        stopped.add(t.ref())
                        stops.append(t)
            reads = [(v, r) for v in group for r in self.reads[v.ref()]]
            parts = tf.gradients(ys, [r for _, r in reads], grad_ys=dys, stop_gradients=stops)
            for (v, _), g in zip(reads, parts):
                if g is not None:
                    summed.setdefault(v.ref(), []).append(tf.cast(g, v.dtype))
        return [
            (v, tf.add_n(summed[v.ref()]) if v.ref() in summed else tf.zeros_like(v))
            for v in self.split
        ]

    def _Groups(self, variables, owners):
        """`variables` in groups (greedy colouring) with no variable whose use stops at a use
        of another variable of its group."""
        clash = {v.ref(): set() for v in variables}
        for v in variables:
            for t in self.stops[v.ref()]:
                for other in owners.get(t.ref(), ()):
                    if other != v.ref() and other in clash:
                        clash[v.ref()].add(other)
                        clash[other].add(v.ref())
        groups, group_of = [], {}
        for v in variables:
            taken = {group_of[o] for o in clash[v.ref()] if o in group_of}
            g = next((i for i in range(len(groups)) if i not in taken), len(groups))
            if g == len(groups):
                groups.append([])
            groups[g].append(v)
            group_of[v.ref()] = g
        return groups
