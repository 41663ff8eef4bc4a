"""Runs one replica's schedule: any list of F / B / W actions, in the schedule's order.

The executor builds each action's ops in `schedules.execution_order` (so eager mode runs them
in a valid order too) and chains each device's actions: an action's inputs pass through
identities that wait for the device's previous action, so neither TF's executor nor a graph
rewrite can reorder a device's work — memory and overlap are what the schedule says.

What an action keeps, and when it is freed:
- F(s, m) stores the stage's boundary input (recomputed micro-batch) or its forward tape
  (kept micro-batch); the stored item is dropped as soon as the last backward action of (s, m)
  has used it, so eager mode frees it then, too.
- B(s, m) turns the output gradient into the input gradient for stage s-1 and, unless the
  schedule splits the backward, the variables' gradients, which go straight into the
  per-variable sums (ownership.py). W(s, m) adds the variables' gradients alone: for a kept
  micro-batch from the gradients B left at each weight's uses (split_functions.py), for a
  recomputed one by recomputing the cell (exact, not cheaper).

Every action is a few calls and ordering identities in the step's program, whatever the
cell's size: the program grows by a constant per micro-batch (tests/test_step_size.py).

Which micro-batches are recomputed: 'always' all, 'never' none, 'except_last' every one whose
backward is not the very next action after its forward on that device — under fill-drain the
last micro-batch, under 1F1B also every micro-batch of the last stage. Kept activations then
never cover more than one micro-batch at a time beyond the boundaries.
"""

import tensorflow as tf

from tf_gpipe.gpipe import schedules, trace
from tf_gpipe.gpipe.opaque import opaque
from tf_gpipe.gpipe.schedules import BACKWARD, FORWARD, WEIGHT
from tf_gpipe.runtime import distribute

try:  # Pauses every active tape (public equivalent: none for all tapes at once).
    from tensorflow.python.eager.record import stop_recording as _stop_recording
except ImportError:  # Older TF.
    from tensorflow.python.eager.tape import stop_recording as _stop_recording


def stop_recording():
    """No tape records what runs under it (a recomputed forward, the loops' forward)."""
    return _stop_recording()


def kept_micro_batches(sched, policy):
    """{(stage, micro_batch)} whose activations are kept (not recomputed) under `policy`."""
    if policy == 'never':
        return {(s, m) for s in range(sched.num_stages) for m in range(sched.num_micro_batches)}
    if policy == 'always':
        return set()
    kept = set()
    for acts in sched.actions:
        for a, b in zip(acts, acts[1:]):
            if a.phase == FORWARD and b.phase == BACKWARD and a[1:] == b[1:]:
                kept.add((a.stage, a.micro_batch))
    return kept


def fusable(sched, kept, split=False):
    """{(stage, m)} of kept micro-batches whose B directly follows their F on the last stage:
    one call does both (its activations live only inside it, freed as its backward goes).
    A split backward's W stays apart from B: none, unless `split` (the caller's fused call
    does F and B only, and W later)."""
    last = sched.num_stages - 1
    out = set()
    if sched.split_backward and not split:
        return out
    for acts in sched.actions:
        for a, b in zip(acts, acts[1:]):
            if (
                a.phase == FORWARD
                and b.phase == BACKWARD
                and a[1:] == b[1:]
                and a.stage == last
                and (a.stage, a.micro_batch) in kept
            ):
                out.add((a.stage, a.micro_batch))
    return out


class Executor:
    """One replica's pipeline run of `sched` over its cells.

    Args:
      runners: one CellRunner per stage (the last one with a LossHead in loss mode).
      sched: a schedules.Schedule.
      policy: the recompute policy.
      step: the step (scalar int64 tensor); micro-batch m draws randomness as global micro-batch
        `seed_base + m`.
      sums: ownership.GradientSums that receives every variable gradient.
      input_grads: whether stage 0 computes the gradient of its float inputs.
    """

    def __init__(self, runners, sched, policy, step, seed_base, sums, input_grads):
        self.runners = runners
        self.sched = sched
        self.step = step
        self.seed_base = seed_base
        self.sums = sums
        self.input_grads = input_grads
        self.kept_set = kept_micro_batches(sched, policy)
        # Loss mode only: the last stage's output gradient (d loss = 1) is known at its F.
        self.fused = fusable(sched, self.kept_set) if runners[-1].head is not None else set()
        self._fused = {}  # (stage, m) -> (d_x, [(variable, d_variable)]) from F's fused call
        self._inputs = {}  # (stage, m) -> boundary input (stored for recompute)
        self._targets = {}  # m -> targets of micro-batch m (last stage)
        self._kept = {}  # (stage, m) -> forward tape of a kept micro-batch
        self._d_out = {}  # (stage, m) -> gradient of the stage's outputs
        self._w_state = {}  # (stage, m) -> what W needs after a split B
        self._last = {}  # device index -> outputs of its previous action (for ordering)
        self.outputs = {}  # m -> last stage outputs (tuple)
        self.losses = {}  # m -> (weighted loss, weight) in loss mode
        self.d_inputs = {}  # m -> gradient of micro-batch m's inputs (input_grads)

    # ---- feeding -----------------------------------------------------------------------------

    def Feed(self, micro_inputs, micro_targets=None):
        # opaque: a micro-batch that Grappler could fold (a batch of ones cut in M) would give
        # every micro-batch's call a function of its own at the first run (opaque.py).
        with distribute.on(self.runners[0].device):
            for m, x in enumerate(micro_inputs):
                self._inputs[(0, m)] = opaque(x)
        with distribute.on(self.runners[-1].device):
            for m, t in enumerate(micro_targets or []):
                self._targets[m] = opaque(t)

    def FeedOutputGrads(self, micro_d_outputs):
        """fprop mode: the caller's gradients of the last stage's outputs, per micro-batch."""
        last = self.sched.num_stages - 1
        with distribute.on(self.runners[-1].device):
            for m, dy in enumerate(micro_d_outputs):
                self._d_out[(last, m)] = opaque(dy)

    def Run(self, actions):
        for a in actions:
            {FORWARD: self._F, BACKWARD: self._B, WEIGHT: self._W}[a.phase](a)

    def Evaluate(self, actions):
        """Forward actions in inference mode: no tapes, nothing stored."""
        for a in actions:
            s, m = a.stage, a.micro_batch
            runner = self.runners[s]
            with distribute.on(runner.device):
                x = self._Ordered(s, self._inputs.pop((s, m)))
                y = runner.Forward(x, None, self.step, self._Mb(m), training=False)
            self._Done(s, y)
            if s == self.sched.num_stages - 1:
                self.outputs[m] = y
            else:
                self._inputs[(s + 1, m)] = y

    # ---- actions -----------------------------------------------------------------------------

    def _Mb(self, m):
        # Not a graph constant, or each micro-batch's call would be a function of its own.
        return opaque(tf.cast(self.seed_base + m, tf.int64))

    def _Device(self, stage):
        return self.sched.device_of(stage)

    def _Ordered(self, stage, structure):
        return ordered(structure, self._last.get(self._Device(stage)))

    def _Done(self, stage, outputs):
        self._last[self._Device(stage)] = outputs

    def _F(self, a):
        s, m = a.stage, a.micro_batch
        runner = self.runners[s]
        last = s == self.sched.num_stages - 1
        targets = self._targets.get(m) if last else None
        with distribute.on(runner.device):
            x = self._Ordered(s, self._inputs[(s, m)])
            t0, x = trace.start(x, runner.device)
            if (s, m) in self.fused:
                # B's work too: a kept micro-batch's backward as a call of its own would hold
                # every activation until its last weight gradient (a call frees its inputs
                # only when it returns): one more set of weight gradients at the peak.
                want = 'all' if s > 0 or self.input_grads else 'variables'
                y, *self._fused[(s, m)] = runner.ForwardBackward(
                    x, targets, self._LossGrad(), self.step, self._Mb(m), want
                )
            elif (s, m) in self.kept_set and self.sched.split_backward:
                y, self._kept[(s, m)] = runner.ForwardSplit(x, targets, self.step, self._Mb(m))
            elif (s, m) in self.kept_set:
                y, self._kept[(s, m)] = runner.ForwardKeep(x, targets, self.step, self._Mb(m))
            else:
                with stop_recording():
                    y = runner.Forward(x, targets, self.step, self._Mb(m), taped=False)
            y = trace.end(t0, FORWARD, s, m, y)
        self._inputs[(s, m)] = x
        self._Done(s, y)
        if last:
            if runner.head is not None:
                outputs, weighted, weight = y
                self.losses[m] = (weighted, weight)
                self.outputs[m] = outputs
            else:
                self.outputs[m] = y
        else:
            self._inputs[(s + 1, m)] = y

    def _LossGrad(self):
        # d (weighted loss) = 1: one tensor per micro-batch, never a constant (opaque.py).
        return opaque(tf.ones([]))

    def _OutputGrads(self, s, m):
        runner = self.runners[s]
        if runner.head is not None:  # d (weighted loss) = 1; nothing flows into the outputs
            return (tf.nest.map_structure(lambda _: None, self.outputs[m]), self._LossGrad(), None)
        dy = self._d_out.pop((s, m))
        return dy if isinstance(dy, tuple) else (dy,)

    def _Stored(self, s, m, final):
        """(boundary input, forward tape or None) of (s, m); forgotten when `final` (its last
        backward action), so nothing outlives its use."""
        if final:
            return self._inputs.pop((s, m)), self._kept.pop((s, m), None)
        return self._inputs[(s, m)], self._kept.get((s, m))

    def _B(self, a):
        s, m = a.stage, a.micro_batch
        split = self.sched.split_backward
        want_x = s > 0 or self.input_grads
        runner = self.runners[s]
        with distribute.on(runner.device):
            dy = self._Ordered(s, self._OutputGrads(s, m))
            x, kept = self._Stored(s, m, final=not split)
            t0, dy = trace.start(dy, runner.device)
            point_grads, w_how, w_fns = [], None, None  # what W will need, once B has ended
            if (s, m) in self._fused:  # done by F's call
                d_x, d_vars = self._fused.pop((s, m))
            elif split and kept is not None:
                # Kept forward: B stops at the weights' uses, W finishes them locally.
                d_x, d_vars, w_state = runner.SplitBackward(kept, dy, want_x, after=t0)
                w_how = 'split' if w_state else 'done'
                w_fns, point_grads = w_state if w_state else (None, [])
            else:
                if split:
                    want = 'inputs' if want_x else None
                    w_how = 'recompute'
                else:
                    want = 'all' if want_x else 'variables'
                d_x, d_vars = self._Backward(runner, x, kept, m, dy, want)
            done = trace.end(t0, BACKWARD, s, m, (d_x, [g for _, g in d_vars], point_grads, dy))
            # What later actions take from B, as it passes B's end stamp (the same when not
            # recording): so a stamp downstream waits for B's end, not only for its start.
            d_x, grads, point_grads, dy = done
            d_vars = [(v, g) for (v, _), g in zip(d_vars, grads)]
            if w_how is not None:
                state = {'split': (w_fns, point_grads), 'recompute': dy, 'done': None}[w_how]
                self._w_state[(s, m)] = (w_how, state)
            done += (self.sums.AddAll(d_vars),)
        self._Done(s, done)
        if want_x:
            d_in = pack_float_grads(x, d_x)
            if s > 0:
                self._d_out[(s - 1, m)] = d_in
            else:
                self.d_inputs[m] = d_in

    def _W(self, a):
        s, m = a.stage, a.micro_batch
        runner = self.runners[s]
        how, state = self._w_state.pop((s, m))
        with distribute.on(runner.device):
            x, kept = self._Stored(s, m, final=True)
            if how == 'done':  # B computed every weight gradient already: nothing to order
                t0, previous = trace.start(self._last.get(self._Device(s)), runner.device)
                self._last[self._Device(s)] = trace.end(t0, WEIGHT, s, m, previous)
                return
            if how == 'split':
                # One scalar waits for the device's previous action, not each of W's inputs.
                token = self._Ordered(s, opaque(tf.zeros([], tf.int32)))
                t0, (token, _) = trace.start([token, state[1]], runner.device)
                d_vars = runner.SplitWeights(state, token)
            else:  # a recomputed micro-batch: re-derives the chain by recomputing the cell
                dy = self._Ordered(s, state)
                t0, dy = trace.start(dy, runner.device)
                _, d_vars = self._Backward(runner, x, kept, m, dy, 'variables')
                token = dy
            grads = trace.end(t0, WEIGHT, s, m, [g for _, g in d_vars])
            d_vars = [(v, g) for (v, _), g in zip(d_vars, grads)]
            totals = self.sums.AddAll(d_vars)
        self._Done(s, ([g for _, g in d_vars], token, totals))

    def _Backward(self, runner, x, kept, m, dy, want):
        if want is None:
            return [], []
        if kept is not None:
            return runner.BackwardKept(kept, dy, want)
        targets = None
        if runner.head is not None:
            # d (weighted loss) alone, as the fused call takes it: one signature for both, so
            # that the fused trace can stand for this backward (recompute.py, _FusedFor).
            targets, dy = self._targets.get(m), dy[1]
        return runner.Backward(x, targets, dy, self.step, self._Mb(m), want)


def eval_order(num_stages, num_micro_batches):
    """Forward-only actions as a diagonal wave: F(s, m) at clock s + m."""
    return sorted(
        (
            schedules.Action(FORWARD, s, m)
            for s in range(num_stages)
            for m in range(num_micro_batches)
        ),
        key=lambda a: (a.stage + a.micro_batch, a.stage),
    )


def pack_float_grads(inputs, float_grads):
    """The structure of `inputs` with gradients at float leaves and None elsewhere."""
    it = iter(float_grads)
    leaves = [
        next(it) if isinstance(x, tf.Tensor | tf.Variable) and x.dtype.is_floating else None
        for x in tf.nest.flatten(inputs)
    ]
    return tf.nest.pack_sequence_as(inputs, leaves)


def ordered(structure, previous):
    """`structure` passed through identities that wait for the device's previous action.

    TF attaches no control inputs to function-call ops created under tf.control_dependencies,
    so the order is imposed on the call's inputs instead: the call cannot start before its
    inputs exist, and they exist only after the previous action on this device finished.
    """
    if previous is None or tf.executing_eagerly():
        return structure
    deps = [
        t for t in tf.nest.flatten(previous, expand_composites=True) if isinstance(t, tf.Tensor)
    ]
    with tf.control_dependencies(deps):
        return tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), structure)
