"""One replica's training schedule as a `tf.while_loop` over clock ticks.

TF instantiates a called function once per call *site*: a step that calls each cell once per
micro-batch starts up in time that grows with M even when the calls are small. Here the
schedule becomes a table: each tick of a simulation of the schedule (F = W = 1, B = 2) gives
each device at most one action to start, and the loop body holds, per device, one
`tf.switch_case` over the actions that device can run (idle, F / B / W of each of its stages).
Every call site exists once, whatever M: the step's program and its start-up do not grow with
the micro-batches (Lingvo's GPipe runs its micro-batches as loop iterations for the same reason).

What crosses ticks is loop state:
- boundary tensors (a stage's input, the gradient of its output) in TensorArrays indexed by
  micro-batch, written on the consumer's device; an action writes index m, every other device
  writes an empty tensor to the spare slot M. After a stage-micro-batch's last backward action
  its slots are overwritten with empty tensors, so boundaries live as long as in the schedule.
  A device reads another device's boundary as it was DELAY ticks ago (the loop keeps that many
  versions; the table leaves that slack), so it never waits for a neighbour's current action;
- each device's running sums of the dense gradients of the variables its stages read, as one
  flat vector per dtype (added in the device's own order, micro-batch after micro-batch), and
  sparse contributions (gathers) per micro-batch, concatenated after the loop as TF's tape
  aggregates them, so an optimizer still gets them sparse;
- the loss sums, and the last stage's outputs when asked for.

A kept micro-batch whose backward is the very next action on the last stage is one call for
forward and backward (its activations live only inside it). Under 'except_last' without a
split backward the other kept ones (fill-drain's last, whose B waits for its output gradient)
are recomputed; any other kept micro-batch carries its residuals in TensorArrays from F to B
(and W), F, B and W being cut from one trace of the cell (split_functions.py). Each device runs
one action at a time: its next tick waits for its current action. `unsupported` names what the loop does not run (the caller runs the
unrolled executor then).
"""

import tensorflow as tf

from tf_gpipe.gpipe import (
    call_op,
    carried,
    dense_sums,
    executor,
    packed_handles,
    schedules,
    trace,
    unordered,
)
from tf_gpipe.gpipe.schedules import BACKWARD, FORWARD, WEIGHT
from tf_gpipe.runtime import distribute

_IDLE = 'idle'
# Ticks between an action on one device and the first tick another device may use its result:
# the longest action of the table (B = 2 ticks), so that a neighbour's B does not hold a device
# up (measured at K=4, L=16, M=32: a 3-tick delay was slower, more ticks for the same work).
DELAY = 2
_FB = 'FB'  # forward and backward of a kept last-stage micro-batch in one call
# A kept micro-batch elsewhere: F returns its residuals (carried in loop state), B and W read them.
_KEPT = {FORWARD: 'FK', BACKWARD: 'BK', WEIGHT: 'WK'}
# Zero-bubble's last stage, B right after F: both in one call, only W's feeds carried to WK.
_FBK = 'FBK'
_KEPT_KINDS = frozenset(_KEPT.values()) | {_FBK}
_STEP_SPEC = tf.TensorSpec([], tf.int64)  # the step's and the micro-batch number's spec
EAGER = 'eager execution'


def unsupported(sched, policy, micro_inputs, micro_targets):
    """Why this step cannot run as a tick loop (the unrolled executor runs it), or None."""
    if tf.executing_eagerly():
        return EAGER
    if trace.recording():
        return 'a timeline is being recorded'
    for micro in (micro_inputs, micro_targets):
        if micro is None or micro[0] is None:
            continue
        first = [spec_of(t) for t in tf.nest.flatten(micro[0])]
        if any(s is not None and not s.shape.is_fully_defined() for s in first):
            return 'a micro-batch shape known only at run time'
        if not same_specs(micro):
            return 'micro-batches of different sizes'
    return None


def same_specs(micro):
    """Whether every micro-batch has the first one's shapes and dtypes, as traced."""
    first = [spec_of(t) for t in tf.nest.flatten(micro[0])]
    return all([spec_of(t) for t in tf.nest.flatten(other)] == first for other in micro[1:])


def spec_of(t):
    """t's TensorSpec (None for None)."""
    return None if t is None else tf.TensorSpec(t.shape, t.dtype)


def _present(flat):
    """The specs of a flat structure that are not None."""
    return [sp for sp in flat if sp is not None]


def _is_float_spec(spec):
    return spec is not None and spec.dtype.is_floating


class _Stage:
    """What the loop knows of stage s before it runs: its calls traced, its message shapes."""

    def __init__(self, index, runner, in_struct, tgt_struct, sched, fused_only, kept_only):
        self.index = index
        self.runner = runner
        self.device = runner.device
        self.last = index == sched.num_stages - 1
        self.in_struct = in_struct  # structure of TensorSpecs (None leaves allowed)
        self.tgt_struct = tgt_struct if self.last else None
        self.fns = None  # split_functions.SplitFunctions when a micro-batch is kept across ticks
        self.one_call_fb = False  # its kept micro-batches' F and B are one call (_FBK)
        split = None
        if kept_only and not runner._jit:
            # Only kept calls run this cell (zero-bubble's last; every micro-batch under
            # 'never'): their F, B and W are cut from one trace, whose outputs give the specs;
            # a forward traced for them alone would be a cell's trace that nothing calls.
            split = runner.Split(
                in_struct, self.tgt_struct, _STEP_SPEC, _STEP_SPEC, split=sched.split_backward
            )
        # The loop runs ComputeGradients: its last cell ends with the loss head.
        if self.last and fused_only:
            # Only fused calls run this cell (1F1B's last, every micro-batch kept): its
            # outputs' specs come from that trace, not from a forward's that nothing calls.
            outputs, _ = runner.FusedFunction(
                in_struct, self.tgt_struct, _SCALAR, _STEP_SPEC, _STEP_SPEC, fused_only
            )
            out = tf.nest.map_structure(spec_of, outputs[0])
        elif split is not None:
            out = tf.nest.map_structure(spec_of, split.structured_outputs)
        else:
            forward = runner.ForwardFunction(in_struct, self.tgt_struct, _STEP_SPEC, _STEP_SPEC)
            out = tf.nest.map_structure(spec_of, forward.structured_outputs)
        self.out_struct = out[0] if self.last else out  # last: (outputs, loss, weight)
        self.in_flat = tf.nest.flatten(in_struct)
        self.out_flat = tf.nest.flatten(self.out_struct)
        self.float_in = [i for i, s in enumerate(self.in_flat) if _is_float_spec(s)]
        self.res_slots = self.bw_slots = carried.Slots([])

    def OutputGradSpecs(self):
        """The output-gradient argument of the backward call, as specs (with a loss: d loss
        alone, see CellRunner._FromLoss)."""
        if self.last:
            return _SCALAR
        return tf.nest.map_structure(lambda s: s if _is_float_spec(s) else None, self.out_struct)


_SCALAR = tf.TensorSpec([], tf.float32)


class TickLoop:
    """Runs `sched` for one replica as a loop over ticks; results like executor.Executor's.

    After `Run`: `losses` ({0: (sum of weighted losses, sum of weights)}), `outputs`
    ({m: last stage outputs} when asked for), and every gradient in `sums`."""

    def __init__(self, runners, sched, policy, step, seed_base, sums):
        self.runners = runners
        self.sched = sched
        self.step = tf.cast(step, tf.int64)
        self.seed_base = seed_base
        self.sums = sums
        kept = executor.kept_micro_batches(sched, policy)
        self.fused = executor.fusable(sched, kept)
        if policy == 'except_last' and not sched.split_backward:
            # A kept micro-batch whose B waits ticks for its output gradient (fill-drain's last
            # one on every cell but the last) would carry its residuals, which needs the cell
            # cut into F and B (a second trace of every cell, start-up doubled); recomputing
            # it costs one micro-batch's forward per such cell and step instead.
            kept = self.fused
        self.carried = kept - self.fused
        # Under a split backward, the last stage's kept micro-batches whose B follows F at
        # once (zero-bubble's, every one): F and B in one call, as 1F1B's last stage does F
        # and B, with W apart. All or none of a stage's, so that its carried slots hold one
        # kind of thing (W's feeds, not F's residuals).
        last = {x for x in self.carried if x[0] == sched.num_stages - 1}
        fusable = executor.fusable(sched, kept, split=True) if sched.split_backward else set()
        self.fused_kept = last if last and last <= fusable else set()
        self.losses = {}
        self.outputs = {}

    # ---- the table --------------------------------------------------------------------------

    def _Table(self):
        """Per tick and device: (branch key, micro-batch); keys are (kind, stage).

        Ticks are a simulation of the schedule with F = W = 1 and B = 2 (B = 1 when split) and a
        message from another device usable DELAY ticks after its sender started: the loop state
        a device reads from another is DELAY ticks old (see Run), so no device waits for a
        neighbour's action that the table does not say it needs."""
        backward = 1.0 if self.sched.split_backward else 2.0
        cost = {FORWARD: 1.0, BACKWARD: backward, WEIGHT: 1.0}
        sim = schedules.simulate(
            self.sched, 1.0, backward, 1.0, transfer=lambda dep, _: DELAY - cost[dep.phase]
        )
        ticks = int(round(sim.makespan))
        table = [[(_IDLE, -1, -1)] * self.sched.num_devices for _ in range(ticks)]
        for a, (start, _) in sim.times.items():
            s, m = a.stage, a.micro_batch
            kind = a.phase
            if (s, m) in self.fused:
                if a.phase == FORWARD:
                    kind = _FB
                else:
                    continue  # done by the fused call at F's tick
            elif (s, m) in self.fused_kept and a.phase != WEIGHT:
                if a.phase == BACKWARD:
                    continue  # done by F's call
                kind = _FBK
            elif (s, m) in self.carried:
                kind = _KEPT[a.phase]
            elif a.phase == BACKWARD and self.sched.split_backward and not self._WantX(s):
                continue  # B of stage 0 with nothing to compute: W does the weights
            table[int(round(start))][self.sched.device_of(s)] = (kind, s, m)
        return table

    def _WantX(self, s):
        return s > 0

    def _Kinds(self, what):
        """The action kinds that, for a stage, write `what` (see the write tables in Run)."""
        split = self.sched.split_backward
        return {
            'x': (FORWARD, 'FK'),
            'd': (BACKWARD, 'BK', _FB, _FBK),
            'free': (WEIGHT, 'WK') if split else (BACKWARD, 'BK', _FB),
            # a sparse gradient: B's unsplit ones of a kept micro-batch, W of a recomputed one
            'sparse': (WEIGHT, 'BK', _FBK) if split else (BACKWARD, 'BK', _FB),
            'out': (FORWARD, 'FK', _FB, _FBK),
        }[what]

    # ---- running ----------------------------------------------------------------------------

    def Run(self, micro_inputs, micro_targets, want_outputs=False):
        """Builds the loop for these micro-batches and runs it: the stages' specs, the
        per-device tables, a trace of every call the branches make, the initial state, then
        `tf.while_loop` over the ticks; results in `losses`, `outputs` and `sums`. Its call
        sites are made once whatever M: no trampolines (call_op.direct_calls)."""
        with call_op.direct_calls():
            self._Run(micro_inputs, micro_targets, want_outputs)

    def _Run(self, micro_inputs, micro_targets, want_outputs):
        num_m = len(micro_inputs)
        table = self._Table()
        keys = self._BranchKeys(table)
        stages = self._Stages(micro_inputs, micro_targets, keys)
        self._TraceGradients(stages, keys)
        state, ctx = self._InitialState(stages, micro_inputs, micro_targets, want_outputs)
        ctx.keys = keys
        ctx.tables, ctx.columns, ctx.where = self._DeviceTables(table, keys, num_m)
        ticks = len(ctx.tables[0])
        devices = ctx.devices
        # The branches' variable handles cross the loop as one tensor per device
        # (packed_handles.py): not a loop variable and a case input per variable.
        ctx.packer = packed_handles.HandlePacker()
        # tf.while_loop returns the body's results through identities it makes itself, with
        # no device: placed by default on the first device, each would cost a send there and
        # back at every tick. The device function puts such an identity beside its input.
        # The While op itself stays unplaced: TF then places each loop variable's Enter, Merge,
        # Switch and NextIteration beside its initial value (a device given here would gather
        # them all on that device).
        with tf.compat.v1.device(beside_input):
            _, final = tf.while_loop(
                lambda t, _: run_on(devices[0], lambda: t < ticks),
                lambda t, state: self._Tick(t, state, ctx),
                (run_on(devices[0], lambda: tf.constant(0)), state),
                maximum_iterations=ticks,
                # Devices drift apart by up to DELAY ticks per hop: that many ticks in flight.
                parallel_iterations=max(10, 2 * DELAY * self.sched.num_devices),
            )
        ctx.packer.Release(tf.nest.flatten(final, expand_composites=True))
        self._Collect(final, num_m, want_outputs)

    def _Stages(self, micro_inputs, micro_targets, keys):
        """A _Stage per stage, each taking the previous one's output structure."""
        tgt_struct = (
            None
            if micro_targets is None or micro_targets[0] is None
            else tf.nest.map_structure(spec_of, micro_targets[0])
        )
        stages = []
        in_struct = tf.nest.map_structure(spec_of, micro_inputs[0])
        for s in range(self.sched.num_stages):
            used = _used_kinds(keys, s)
            fused_only = self._Want(_FB, s) if used == {_FB} else None
            kept_only = bool(used) and used <= _KEPT_KINDS
            st = _Stage(
                s, self.runners[s], in_struct, tgt_struct, self.sched, fused_only, kept_only
            )
            st.one_call_fb = _FBK in used
            stages.append(st)
            in_struct = st.out_struct
        return stages

    def _BranchKeys(self, table):
        """Per device, its switch_case's branch keys in a fixed order, idle first."""
        keys = [[_IDLE] for _ in range(self.sched.num_devices)]
        for row in table:
            for d, (kind, s, _) in enumerate(row):
                if kind != _IDLE and (kind, s) not in keys[d]:
                    keys[d].append((kind, s))
        return keys

    def _TraceGradients(self, stages, keys):
        """Traces every call the branches make (so the variables each stage reads are known)
        and sets `_grad_kinds`: stage -> [(variable, its gradient in a trace)], from which the
        dense gradients (summed in the loop) and sparse ones (kept per m) are told apart.
        Cuts a kept micro-batch's cell into F, B and W (`fns`)."""
        sched = self.sched
        self._grad_kinds = {}
        for s, st in enumerate(stages):
            used = _used_kinds(keys, s)
            kinds = {}
            if used & _KEPT_KINDS:
                if st.runner._jit:
                    raise UnsupportedError('a kept micro-batch of an XLA-compiled cell')
                st.fns = st.runner.Split(
                    st.in_struct, st.tgt_struct, _STEP_SPEC, _STEP_SPEC, split=sched.split_backward
                )
                if st.fns is None:
                    raise UnsupportedError('a kept forward whose stateful ops need an order')
                for v, g in st.fns.variable_gradients:
                    kinds[v.ref()] = (v, g)
            # The fused call first: the last cell's backward may be its trace (_FusedFor).
            for kind in sorted(used & {BACKWARD, WEIGHT, _FB}, key=lambda k: k != _FB):
                want = self._Want(kind, s)
                if want is None:
                    continue
                args = (st.in_struct, st.tgt_struct, st.OutputGradSpecs(), _STEP_SPEC, _STEP_SPEC)
                if kind == _FB:
                    outputs, variables = st.runner.FusedFunction(*args, want)
                else:
                    outputs, variables = st.runner.BackwardFunction(*args, want)
                for v, g in zip(variables, outputs[-1]):
                    kinds[v.ref()] = (v, g)
            self._grad_kinds[s] = list(kinds.values())

    def _DeviceTables(self, table, keys, num_m):
        """(tables, columns, where): per device, the per-tick table (built inside the loop
        body on that device, so no tick sends a device its own schedule): its branch, its
        micro-batch, and the indices of the list writes it does, in `columns[d][(what,
        stage)]`; `where[(what, stage)]` is the device whose table has that column. A write
        index is m where stage s's action of one of the kinds writing `what` runs at that
        tick, else the spare slot num_m."""
        sched = self.sched
        S, K = sched.num_stages, sched.num_devices
        branch_of = [{k: i for i, k in enumerate(ks)} for ks in keys]

        def write_index(s, what, row):
            kinds = self._Kinds(what)
            found = [m for kind, st_, m in row if st_ == s and kind in kinds]
            return found[0] if found else num_m

        columns = {d: {} for d in range(K)}  # device -> {(what, stage): column}
        for s in range(S):
            d = sched.device_of(s)
            for what, at in (('x', s - 1), ('d', s + 1), ('free', s)):
                if 0 <= at < S:
                    columns[d][(what, at)] = None
            for what in ('sparse', 'out'):
                columns[d][(what, s)] = None
        where = {key: d for d in range(K) for key in columns[d]}
        tables = {}
        for d in range(K):
            keys_d = list(columns[d])
            columns[d] = {key: 2 + j for j, key in enumerate(keys_d)}
            tables[d] = [
                [
                    branch_of[d][row[d][:2] if row[d][0] != _IDLE else _IDLE],
                    max(row[d][2], 0),
                ]
                + [write_index(st_, what, row) for what, st_ in keys_d]
                for row in table
            ]
        return tables, columns, where

    def _InitialState(self, stages, micro_inputs, micro_targets, want_outputs):
        """(loop state, _Context). No None leaves: loop state and branch outputs are tensors."""
        sched = self.sched
        num_m = len(micro_inputs)
        S, K = sched.num_stages, sched.num_devices

        def new_list(spec, device):
            with distribute.on(device):
                ta = tf.TensorArray(
                    spec.dtype, size=num_m + 1, infer_shape=False, clear_after_read=False
                )
                return ta.write(num_m, carried.empty(spec))

        with distribute.on(stages[0].device):
            x0 = [
                tf.stack([tf.nest.flatten(x)[i] for x in micro_inputs])
                for i, sp in enumerate(stages[0].in_flat)
                if sp is not None
            ]
        tgt_flat = []
        if stages[-1].tgt_struct is not None:
            with distribute.on(stages[-1].device):
                tgt_flat = [
                    tf.stack([tf.nest.flatten(t)[i] for t in micro_targets])
                    for i, sp in enumerate(tf.nest.flatten(stages[-1].tgt_struct))
                    if sp is not None
                ]
        devices = [stages[d].device for d in range(K)]

        def delay(sender, receiver):
            """How many versions of a boundary the loop keeps: a receiver on another device
            reads the state DELAY - 1 ticks old, which its sender's recent actions have not
            touched (the table leaves that slack); on the same device, the newest."""
            return DELAY if sched.device_of(sender) != sched.device_of(receiver) else 1

        state = dict(
            # Per boundary, its last `versions` states, newest first (see `delay`).
            x={
                s: [[new_list(sp, stages[s].device) for sp in _present(stages[s].in_flat)]]
                * delay(s - 1, s)
                for s in range(1, S)
            },
            d={
                s: [
                    [
                        new_list(sp, stages[s].device)
                        for sp in stages[s].out_flat
                        if _is_float_spec(sp)
                    ]
                ]
                * delay(s + 1, s)
                for s in range(S - 1)
            },
            dense={},
            sparse={},
            loss=run_on(stages[-1].device, lambda: [tf.zeros([]), tf.zeros([])]),
            # Each device counts the ticks itself: no tick sends it the loop counter.
            clock={d: run_on(devices[d], lambda: tf.zeros([], tf.int32)) for d in range(K)},
            out=[new_list(sp, stages[-1].device) for sp in _present(stages[-1].out_flat)]
            if want_outputs
            else [],
        )
        # A kept micro-batch's residuals, and under a split backward what W reads of B's work.
        state['res'], state['bw'] = {}, {}
        for s, st in enumerate(stages):
            if st.fns is None:
                continue
            if st.one_call_fb:  # F and B in one call: W's feeds alone
                res_specs, bw_specs = [spec_of(t) for t in st.fns.weight_feeds], []
            else:
                res_specs = [spec_of(t) for t in st.fns.residuals]
                bw_specs = [spec_of(t) for t in st.fns.b_to_w] if sched.split_backward else []
            if not all(
                sp.shape.is_fully_defined() and sp.dtype not in (tf.resource, tf.variant)
                for sp in res_specs + bw_specs
            ):
                raise UnsupportedError('a kept forward whose residuals have unknown shapes')
            # One list per dtype, a slot per tensor and micro-batch (carried.Slots).
            st.res_slots, st.bw_slots = carried.Slots(res_specs), carried.Slots(bw_specs)
            state['res'][s] = st.res_slots.New(num_m, st.device)
            state['bw'][s] = st.bw_slots.New(num_m, st.device)
        dense_vars = {d: {} for d in range(K)}  # device -> {variable ref: (variable, spec)}
        sparse_specs = {}  # (stage, variable ref) -> (values spec, indices spec)
        for s, st in enumerate(stages):
            d = sched.device_of(s)
            for v, g in self._grad_kinds[s]:
                if isinstance(g, tf.IndexedSlices):
                    specs = (spec_of(g.values), spec_of(g.indices))
                    if not all(sp.shape.is_fully_defined() for sp in specs):
                        raise UnsupportedError('a sparse gradient of unknown size')
                    sparse_specs[(s, v.ref())] = specs
                    state['sparse'][_key(s, v.ref(), sparse_specs)] = [
                        new_list(sp, st.device) for sp in specs
                    ]
                else:
                    dense_vars[d].setdefault(v.ref(), (v, spec_of(g)))
        # A device's dense sums: one TensorList per dtype (dense_sums.py), not a loop variable
        # per variable (each loop variable and switch_case output costs ops at every tick).
        sums = {}
        for d in range(K):
            sums[d] = dense_sums.DenseSums(list(dense_vars[d].values()))
            with distribute.on(devices[d]):
                state['dense'][d] = sums[d].New()
        self._stages, self._dense_sums, self._sparse_specs = stages, sums, sparse_specs
        ctx = _Context(stages, x0, tgt_flat, sums, sparse_specs, want_outputs)
        ctx.devices = devices
        # The step and the seed base as every device's own copy (read at every tick).
        ctx.step = {d: run_on(devices[d], lambda: tf.identity(self.step)) for d in range(K)}
        ctx.seed_base = {
            d: run_on(devices[d], lambda: tf.cast(self.seed_base, tf.int64)) for d in range(K)
        }
        return state, ctx

    def _Tick(self, t, state, ctx):
        """The loop body: each device's action of this tick (its switch_case), then the
        writes that carry the messages to the next ticks."""
        sched, stages, devices = self.sched, ctx.stages, ctx.devices
        S, K = sched.num_stages, sched.num_devices
        messages, rows = {}, {}
        for d in range(K):
            with distribute.on(devices[d]):
                rows[d] = tf.gather(tf.constant(ctx.tables[d], tf.int32), state['clock'][d])
                m = tf.cast(rows[d][1], tf.int64)
                # Unordered: no tick waits for every device's action (unordered.py).
                fns = [
                    unordered.branch(self._Branch(key, d, m, state, ctx), ctx.packer)
                    for key in ctx.keys[d]
                ]
                if len(fns) > 1:
                    messages[d] = tf.switch_case(rows[d][0], fns)
                else:
                    messages[d] = fns[0]()

        def at(what, s):
            d = ctx.where[(what, s)]
            return rows[d][ctx.columns[d][(what, s)]]

        new = dict(x={}, d={}, dense={}, sparse={}, res={}, bw={}, clock={})
        # Boundary writes, on the consumer's device: the message at m (or the spare slot),
        # then an empty tensor over what its last backward action used.
        for s in range(1, S):
            sent = messages[sched.device_of(s - 1)]['fwd'][s - 1]
            specs = _present(stages[s].in_flat)
            with distribute.on(stages[s].device):
                i, j = at('x', s - 1), at('free', s)
                newest = [
                    ta.write(i, y).write(j, carried.empty(sp))
                    for ta, y, sp in zip(state['x'][s][0], sent, specs)
                ]
                # Older versions pass through, placed here too (an unplaced identity would
                # land on another device and cost a send per tick).
                new['x'][s] = [newest] + _on_device(state['x'][s][:-1])
        for s in range(S - 1):
            sent = messages[sched.device_of(s + 1)]['bwd'][s + 1]
            specs = [sp for sp in stages[s].out_flat if _is_float_spec(sp)]
            with distribute.on(stages[s].device):
                i, j = at('d', s + 1), at('free', s)
                newest = [
                    ta.write(i, g).write(j, carried.empty(sp))
                    for ta, g, sp in zip(state['d'][s][0], sent, specs)
                ]
                new['d'][s] = [newest] + _on_device(state['d'][s][:-1])
        for s, ref in ctx.sparse_specs:
            name = _key(s, ref, ctx.sparse_specs)
            sent = messages[sched.device_of(s)]['sparse'][name]
            with distribute.on(stages[s].device):
                i = at('sparse', s)
                new['sparse'][name] = [ta.write(i, g) for ta, g in zip(state['sparse'][name], sent)]
        # A kept micro-batch's residuals (and B's work for W): written, read and emptied
        # inside the branches, so they only pass through here.
        for what in ('res', 'bw'):
            for s in state[what]:
                new[what][s] = messages[sched.device_of(s)][what][s]
        for d in range(K):
            new['dense'][d] = messages[d]['dense']
            # A device starts its next tick's action once this one's is done: one action
            # at a time per device, as the schedule (and its memory bound) assumes.
            with (
                distribute.on(devices[d]),
                tf.control_dependencies(tf.nest.flatten(messages[d])),
            ):
                new['clock'][d] = state['clock'][d] + 1
        last = messages[sched.device_of(S - 1)]
        with distribute.on(stages[-1].device):
            new['loss'] = [
                state['loss'][0] + last['loss'][0],
                state['loss'][1] + last['loss'][1],
            ]
            i = at('out', S - 1)
            new['out'] = [ta.write(i, o) for ta, o in zip(state['out'], last.get('out', []))]
        with distribute.on(devices[0]):
            return t + 1, new

    def _Want(self, kind, s):
        want_x = self._WantX(s)
        if kind == FORWARD:
            return None
        if kind == WEIGHT:
            return 'variables'
        if kind == BACKWARD and self.sched.split_backward:
            return 'inputs' if want_x else None
        return 'all' if want_x else 'variables'

    def _Branch(self, key, d, m, state, ctx):
        """The function switch_case runs on device d for branch `key`; every branch returns
        the same structure (what it does not produce: empty tensors; the sums: unchanged)."""
        sched, stages = self.sched, ctx.stages
        S = sched.num_stages
        local = [s for s in range(S) if sched.device_of(s) == d]

        def default():
            msg = dict(
                fwd={
                    s: [carried.empty(sp) for sp in stages[s].out_flat if sp is not None]
                    for s in local
                    if s < S - 1
                },
                bwd={
                    s: [carried.empty(stages[s].in_flat[i]) for i in stages[s].float_in]
                    for s in local
                    if s > 0
                },
                sparse={
                    _key(s, ref, ctx.sparse_specs): [carried.empty(sp) for sp in specs]
                    for (s, ref), specs in ctx.sparse_specs.items()
                    if s in local
                },
                dense=list(state['dense'][d]),
                res={s: list(state['res'][s]) for s in local if s in state['res']},
                bw={s: list(state['bw'][s]) for s in local if s in state['bw']},
            )
            if S - 1 in local:
                msg['loss'] = [tf.zeros([]), tf.zeros([])]
                if ctx.want_outputs:
                    msg['out'] = [carried.empty(sp) for sp in stages[-1].out_flat if sp is not None]
            return msg

        if key == _IDLE:
            return default

        kind, s = key
        st = stages[s]
        index = tf.cast(m, tf.int32)

        def read(lists, flat):
            it = iter(lists)
            return [
                None if sp is None else tf.ensure_shape(next(it).read(index), sp.shape)
                for sp in flat
            ]

        def read_inputs():
            if s == 0:
                it = iter(ctx.x0)
                flat = [None if sp is None else tf.gather(next(it), m) for sp in st.in_flat]
            else:
                flat = read(state['x'][s][-1], st.in_flat)
            return tf.nest.pack_sequence_as(st.in_struct, flat)

        def read_targets():
            if not st.last or st.tgt_struct is None:
                return None
            it = iter(ctx.tgt_flat)
            flat = [
                None if sp is None else tf.gather(next(it), m)
                for sp in tf.nest.flatten(st.tgt_struct)
            ]
            return tf.nest.pack_sequence_as(st.tgt_struct, flat)

        def output_grads():
            if st.last:
                return tf.ones([])  # d (weighted loss) = 1
            floats = [sp if _is_float_spec(sp) else None for sp in st.out_flat]
            return tf.nest.pack_sequence_as(st.out_struct, read(state['d'][s][-1], floats))

        def add_weight_grads(msg, d_vars):
            dense = []
            for v, g in d_vars:
                if (s, v.ref()) in ctx.sparse_specs:
                    msg['sparse'][_key(s, v.ref(), ctx.sparse_specs)] = [g.values, g.indices]
                else:
                    dense.append((v, g))
            msg['dense'] = ctx.dense_sums[d].Add(msg['dense'], dense)

        def flat_dys():
            if st.last:
                return []  # d (weighted loss) = 1 is inside B
            floats = [sp if _is_float_spec(sp) else None for sp in st.out_flat]
            return [g for g in read(state['d'][s][-1], floats) if g is not None]

        def run_kept(msg, seed):
            fns = st.fns
            if kind in ('FK', _FBK):
                flat = [
                    t for t in tf.nest.flatten((read_inputs(), read_targets())) if t is not None
                ]
                flat += [ctx.step[d], seed]
            if kind == _FBK:
                y, d_x, d_unsplit, w_feeds = fns.ForwardBackward(flat, s > 0)
                msg['res'][s] = st.res_slots.Write(msg['res'][s], index, w_feeds)
                forward_message(msg, y)
                if s > 0:
                    msg['bwd'][s] = list(d_x)
                add_weight_grads(msg, list(zip(fns.unsplit_variables, d_unsplit)))
                return msg
            if kind == 'FK':
                y, residuals = fns.Forward(flat)
                msg['res'][s] = st.res_slots.Write(msg['res'][s], index, residuals)
                forward_message(msg, y)
                return msg
            residuals = st.res_slots.Read(msg['res'][s], index)
            if kind == 'BK':
                d_x, d_unsplit, w_feeds = fns.Backward(residuals, flat_dys(), s > 0)
                if s > 0:
                    msg['bwd'][s] = list(d_x)
                d_vars = list(zip(fns.unsplit_variables, d_unsplit))
                if self.sched.split_backward:
                    b_to_w = [w_feeds[i] for i in fns.b_to_w_positions]
                    msg['bw'][s] = st.bw_slots.Write(msg['bw'][s], index, b_to_w)
                else:  # B and W of one backward, back to back: the last use
                    d_split = fns.Weights(tf.zeros([], tf.int32), w_feeds)
                    d_vars += list(zip(fns.split_variables, d_split))
                    msg['res'][s] = st.res_slots.Free(msg['res'][s], index)
            elif st.one_call_fb:  # WK after FBK: its slots hold W's feeds
                d_vars = list(
                    zip(fns.split_variables, fns.Weights(tf.zeros([], tf.int32), residuals))
                )
                msg['res'][s] = st.res_slots.Free(msg['res'][s], index)
            else:  # WK, the last use
                b_to_w = st.bw_slots.Read(msg['bw'][s], index)
                w_feeds = fns.WeightFeeds(residuals, flat_dys(), b_to_w)
                d_vars = list(
                    zip(fns.split_variables, fns.Weights(tf.zeros([], tf.int32), w_feeds))
                )
                msg['res'][s] = st.res_slots.Free(msg['res'][s], index)
                msg['bw'][s] = st.bw_slots.Free(msg['bw'][s], index)
            add_weight_grads(msg, d_vars)
            return msg

        def forward_message(msg, y):
            if st.last and st.runner.head is not None:
                outputs, weighted, weight = y
                msg['loss'] = [weighted, weight]
                if ctx.want_outputs:
                    msg['out'] = [o for o in tf.nest.flatten(outputs) if o is not None]
            else:
                msg['fwd'][s] = [o for o in tf.nest.flatten(y) if o is not None]

        def run():
            msg = default()
            runner = st.runner
            # Micro-batch m draws its randomness as global micro-batch seed_base + m.
            seed = m + ctx.seed_base[d]
            if kind in _KEPT_KINDS:
                return run_kept(msg, seed)
            if kind == FORWARD:
                # A training loop: nothing differentiates its calls (it computes gradients).
                y = runner.Forward(read_inputs(), read_targets(), ctx.step[d], seed, taped=False)
                forward_message(msg, y)
                return msg
            want = self._Want(kind, s)
            if kind == _FB:
                y, d_x, d_vars = runner.ForwardBackward(
                    read_inputs(), read_targets(), output_grads(), ctx.step[d], seed, want
                )
                outputs, weighted, weight = y
                msg['loss'] = [weighted, weight]
                if ctx.want_outputs:
                    msg['out'] = [o for o in tf.nest.flatten(outputs) if o is not None]
            else:
                d_x, d_vars = runner.Backward(
                    read_inputs(), read_targets(), output_grads(), ctx.step[d], seed, want
                )
            if want in ('all', 'inputs') and s > 0:
                msg['bwd'][s] = list(d_x)
            if want in ('all', 'variables'):
                add_weight_grads(msg, d_vars)
            return msg

        return run

    def _Collect(self, final, num_m, want_outputs):
        stages = self._stages
        self.losses = {0: tuple(final['loss'])}
        for d, sums in self._dense_sums.items():
            with distribute.on(stages[d].device):
                for v, total in sums.Read(final['dense'][d]):
                    self.sums.Add(v, total)
        for s, ref in self._sparse_specs:
            vals, inds = final['sparse'][_key(s, ref, self._sparse_specs)]
            v = ref.deref()
            with distribute.on(stages[s].device):
                values, indices = vals.concat(), inds.concat()
                self.sums.Add(
                    v, tf.IndexedSlices(values, indices, tf.shape(v, out_type=indices.dtype))
                )
        if want_outputs:
            last = stages[-1]
            with distribute.on(last.device):
                flat = [
                    None
                    if ta is None
                    else [tf.ensure_shape(ta.read(m), sp.shape) for m in range(num_m)]
                    for ta, sp in zip(final['out'], last.out_flat)
                ]
            for m in range(num_m):
                self.outputs[m] = tf.nest.pack_sequence_as(
                    last.out_struct, [None if f is None else f[m] for f in flat]
                )


def beside_input(op):
    """A device function: an identity without a device goes where its input is."""
    if op.type == 'Identity' and not op.device and op.inputs and op.inputs[0].device:
        return op.inputs[0].device
    return op.device


def run_on(device, fn):
    """fn() under `device`."""
    with distribute.on(device):
        return fn()


def _on_device(tree):
    """Identities of `tree`'s TensorArrays under the current device scope."""
    return tf.nest.map_structure(lambda ta: ta.identity(), tree)


class UnsupportedError(Exception):
    """Found while building: the caller runs the unrolled executor instead."""


class _Context:
    """What every branch reads besides the loop state."""

    def __init__(self, stages, x0, tgt_flat, dense_sums, sparse_specs, want_outputs):
        self.stages = stages
        self.x0 = x0
        self.tgt_flat = tgt_flat
        self.dense_sums = dense_sums  # device -> dense_sums.DenseSums
        self.sparse_specs = sparse_specs
        self.want_outputs = want_outputs


def _used_kinds(keys, stage):
    """The action kinds the branches run for `stage` (`keys`: per device, idle first)."""
    return {key[0] for d_keys in keys for key in d_keys[1:] if key[1] == stage}


def _key(stage, ref, sparse_specs):
    """A string key per (stage, sparse variable): loop-state dicts need sortable keys."""
    return f'{stage}_{list(sparse_specs).index((stage, ref))}'
