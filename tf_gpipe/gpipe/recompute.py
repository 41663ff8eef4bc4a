"""One cell on one device: its forward, and its backward by re-running the forward.

For a recomputed micro-batch both are separate, non-inlined TF function calls placed on the
cell's device:

- the forward call returns only the cell's outputs, so the activations inside the cell die
  with the call;
- the backward call takes the saved boundary input *and the incoming gradient*, re-runs the
  forward under a tape and returns (d_input, d_variables). Because the incoming gradient is one
  of its inputs, the executor cannot start a recompute before the backward reaches the cell,
  and no graph rewrite can merge it with the forward call (different op, different inputs) or
  keep its activations alive past it. This is what bounds the peak memory, with Grappler left
  on for the rest of the user's program.

A micro-batch whose activations are kept is the same forward call under a tape of its own:
TF rewrites that call to also return what its backward needs, and the backward is one call of
a function TF derives once per cell. Zero-bubble's split of a kept forward is three calls cut
from one trace (split_functions.py). Either way a micro-batch adds calls to the step's program,
never the cell's ops: the program does not grow with M beyond a constant per action.

The variables a cell differentiates are the ones its forward *reads* (the tape's watched
variables), not the ones it owns: a tied softmax in the last cell reads the embedding of the
first, and both contributions reach the variable (see ownership.py).

The last cell of a `ComputeGradients` pipeline also runs the caller's loss on its outputs: its
function returns (outputs, weighted loss, weight) and its backward starts from d loss = 1.
"""

import contextlib

import tensorflow as tf

from tf_gpipe import fprop_context
from tf_gpipe.gpipe import (
    call_op,
    graph_cut,
    grappler,
    split_functions,
    trace,
    twins,
    weight_gradients,
)
from tf_gpipe.gpipe.opaque import opaque
from tf_gpipe.runtime import distribute

# Keeps Grappler's function optimizer from inlining the calls (inlining would let common
# subexpression elimination fold a recompute into its forward, and the executor run it early).
_NOINLINE = {'_noinline': True}


def _is_float(x):
    return isinstance(x, tf.Tensor | tf.Variable) and x.dtype.is_floating


def as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


class LossHead:
    """The caller's per-micro-batch loss on the last cell: (weighted loss, weight).

    `loss_fn(outputs, targets)` returns the micro-batch's mean loss, or (mean, weight) when the
    mean is over something other than examples (tokens); the weight defaults to the number of
    examples. The step's loss is sum(weight * mean) / sum(weight).
    """

    def __init__(self, loss_fn, batch_dim):
        self.loss_fn = loss_fn
        self.batch_dim = batch_dim

    def __call__(self, outputs, targets):
        out = outputs[0] if len(outputs) == 1 else outputs
        result = self.loss_fn(out, targets)
        if isinstance(result, tuple | list):
            if len(result) != 2:
                raise ValueError(
                    'loss_fn must return a scalar mean loss or (mean loss, weight); got '
                    f'{len(result)} values.'
                )
            mean, weight = result
        else:
            mean, weight = result, None
        mean = tf.convert_to_tensor(mean)
        if mean.shape.rank:
            raise ValueError(
                f'loss_fn must return a scalar (the micro-batch mean loss), got shape '
                f'{mean.shape}. Reduce it, e.g. tf.reduce_mean(...).'
            )
        mean = tf.cast(mean, tf.float32)
        if weight is None:
            first = tf.nest.flatten(out)[0]
            weight = tf.shape(first)[self.batch_dim]
        weight = tf.cast(weight, tf.float32)
        # An empty micro-batch (a batch smaller than M, known only at run time) has a NaN mean
        # and weight 0: it adds nothing, and no NaN reaches the sum or the gradients.
        return tf.where(weight > 0, mean * weight, 0.0), weight


class CellRunner:
    """Runs cell `index` of a pipeline on its device, as forward / recompute-backward calls."""

    def __init__(self, cell, device, index, jit_compile=False, head=None, grappler=True):
        self.cell = cell
        self.device = device
        self.index = index
        self.head = head  # LossHead on the last cell of a ComputeGradients pipeline
        self._read = []  # variables the forward reads, append-only (see _NoteRead)
        self._split = {}  # input signature -> split_functions.SplitFunctions or None
        self._jit = bool(jit_compile)
        # Whether Grappler optimises the cell's functions when a call instantiates them
        # (grappler.py): off for a shorter first call, at a higher peak memory.
        self.grappler = bool(grappler)
        jit = True if jit_compile else None
        options = dict(jit_compile=jit, experimental_attributes=_NOINLINE, autograph=False)
        self._forward = self._Function(self._Forward, **options)
        self._backward = self._Function(self._Backward, **options)
        self._forward_backward = self._Function(self._ForwardBackward, **options)
        # Twin cells (twins.py): the cells of a group trace their forwards, and the first the
        # shared backward, without device annotations (each call is placed on its caller's
        # device); a proven twin calls the first's.
        self._twin_of = None  # the group's first runner, on a twin
        self._variable_of = None  # id(handle) -> variable, of every cell of the pipeline
        self._twin_maps = {}  # forward signature -> capture map, or None where not a twin
        self._unshared = set()  # backward signatures whose shared backward does not map here
        self._shared_backward = None  # on the group's first runner
        self._forward_keys = set()  # signatures its forward was called or traced with
        # Last cell: signature -> whether its fused trace stands for its backward (_FusedFor).
        self._replays = {}
        self._trampolines = {}  # its backward calls' trampolines (call_op.py)
        self._parts = {}  # (traced 'all' backward, want) -> the part cut from it (_Part)
        self._sources = {}  # traced 'all' backward's name -> graph_cut.Source (_Part)
        self._concretes = {}  # (function, call signature) -> its trace (_Concrete)

    def ShareBackward(self, first, variable_of):
        """Makes this runner a twin candidate of `first` (an earlier cell of the same layer
        classes and variable shapes): its backward is first's trace wherever their forwards
        prove the same (twins.py). `variable_of` maps id(handle) to every pipeline variable."""
        if self._jit or first._jit or self.head is not None or first.head is not None:
            return
        self._twin_of, self._variable_of = first, variable_of
        if first._shared_backward is None:
            options = dict(experimental_attributes=_NOINLINE, autograph=False)
            first._shared_backward = first._Function(first._BackwardUnplaced, **options)

    def _Function(self, python_function, **options):
        return grappler.Function(tf.function(python_function, **options), self.grappler)

    def _CallOptions(self):
        """The `config_proto` of a call op this runner makes itself (grappler.py)."""
        return grappler.config_proto(self.grappler)

    def WithHead(self, head):
        """A runner of the same cell whose function ends with the loss `head`."""
        return CellRunner(self.cell, self.device, self.index, self._jit, head, self.grappler)

    @property
    def read_variables(self):
        """Trainable variables the cell's forward was seen to read (its own and others')."""
        return list(self._read)

    def _NoteRead(self, watched):
        known = {v.ref() for v in self._read}
        for v in watched:
            if v.ref() not in known:
                self._read.append(v)
                known.add(v.ref())
        return list(self._read)

    def _Run(self, inputs, targets):
        try:
            outputs = as_tuple(self.cell.FProp(*inputs))
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            structure = tf.nest.map_structure(lambda t: getattr(t, 'shape', t), inputs)
            raise type(e)(
                f'Cell {self.index} ({self.cell.layer_name}) cannot take its input {structure}: {e}'
            ) from e
        if self.head is None:
            return outputs
        return (outputs,) + self.head(outputs, targets)

    def _RunTaped(self, inputs, targets):
        """(tape, float inputs, outputs): the cell run under a tape watching its float inputs."""
        with tf.GradientTape() as tape:
            sources = [x for x in tf.nest.flatten(inputs) if _is_float(x)]
            tape.watch(sources)
            outputs = self._Run(inputs, targets)
        return tape, sources, outputs

    def _Scope(self, step, micro_batch, training=True, recompute=False):
        return fprop_context.scope(
            training=training, step=step, seed_offset=micro_batch, recompute=recompute
        )

    def _Forward(self, inputs, targets, step, micro_batch, training):
        place = tf.device(None) if self._Unplaced() else distribute.on(self.device)
        with place, self._Scope(step, micro_batch, training):
            return self._Run(inputs, targets)

    def _Unplaced(self):
        """Whether the forward is traced without device annotations and placed where it is
        called: a cell of a twin group (twins.py) where calls place by device name, so that its
        twins can call the group's first forward on their own devices."""
        grouped = self._twin_of is not None or self._shared_backward is not None
        return grouped and distribute.places_by_device_name()

    def _Backward(self, inputs, targets, output_grads, step, micro_batch, want, placed=True):
        """want: 'all' (d_inputs and d_variables), 'inputs' (B) or 'variables' (W). With a
        loss head, `output_grads` may be the weighted loss's gradient alone."""
        place = distribute.on(self.device) if placed else contextlib.nullcontext()
        with place, self._Scope(step, micro_batch, recompute=True):
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            tape, sources, outputs = self._RunTaped(inputs, targets)
            self._CheckNoStateChange(graph.get_operations()[first:])
            output_grads = self._FromLoss(outputs, output_grads)
            variables = self._NoteRead(tape.watched_variables())
            return self._Gradients(tape, sources, outputs, output_grads, variables, want)

    def _BackwardUnplaced(self, inputs, targets, output_grads, step, micro_batch, want):
        """_Backward with no device annotation inside: the twins' shared trace."""
        with tf.device(None):
            return self._Backward(inputs, targets, output_grads, step, micro_batch, want, False)

    def _ForwardBackward(self, inputs, targets, output_grads, step, micro_batch, want):
        """A kept micro-batch whose backward comes right after its forward, as one call:
        (outputs, d_inputs, d_variables); the forward is the real one (state updates run).
        With a loss head, `output_grads` may be the weighted loss's gradient alone."""
        graph = tf.compat.v1.get_default_graph()
        first, reads = len(graph.get_operations()), fprop_context.recompute_reads()
        with distribute.on(self.device), self._Scope(step, micro_batch):
            tape, sources, outputs = self._RunTaped(inputs, targets)
            output_grads_in, output_grads = output_grads, self._FromLoss(outputs, output_grads)
            variables = self._NoteRead(tape.watched_variables())
            grads = self._Gradients(tape, sources, outputs, output_grads, variables, want)
        if self.head is not None and not tf.executing_eagerly():
            # No write and no read of the recompute flag: the recompute computes the same.
            pure = fprop_context.recompute_reads() == reads and not any(
                op.type in split_functions.WRITE_OPS for op in graph.get_operations()[first:]
            )
            args = (inputs, targets, output_grads_in, step, micro_batch)
            self._replays[_signature(args, want)] = pure
        return (outputs,) + grads

    def _FromLoss(self, outputs, output_grads):
        """With a loss head, `output_grads` may be the weighted loss's gradient alone (the
        caller then needs no spec of the cell's outputs): as (None per output, d loss, None)."""
        if self.head is None or isinstance(output_grads, tuple):
            return output_grads
        return (tf.nest.map_structure(lambda _: None, outputs[0]), output_grads, None)

    def _CheckNoStateChange(self, ops):
        """Refuses a layer whose forward assigns a variable, in the recompute's trace: the
        recompute would assign it a second time and could compute with the changed value.

        State the pipeline replays is allowed: batch norm accumulates only outside recomputes,
        dropout draws from (step, micro-batch), Keras seed generators are set before each call.
        A layer class may declare RECOMPUTE_REPEATS_STATE = True when repeating is harmless.
        """
        assigns = [op for op in ops if op.type in split_functions.WRITE_OPS]
        if not assigns:
            return

        def handle(v):  # the variable's handle as captured inside this trace
            return weight_gradients.captured_handle(v).ref()

        owners, replayed = {}, set()  # handle -> (layer, var); handles of replayed state
        for layer in self.cell.AllLayers():
            for v in layer.ReplayedState():
                replayed.add(handle(v))
            for v in layer.vars.values():
                if isinstance(v, tf.Variable):
                    owners[handle(v)] = (layer, v)
        for op in assigns:
            if op.inputs[0].ref() in replayed:
                continue
            layer, v = owners.get(op.inputs[0].ref(), (None, None))
            if v is not None and getattr(layer, 'RECOMPUTE_REPEATS_STATE', False):
                continue
            what = (
                f"Layer '{layer.seed_name}' ({type(layer).__name__}) assigns its variable "
                f"'{v.name}'"
                if v is not None
                else f'Cell {self.index} ({self.cell.layer_name}) assigns a variable (op '
                f"'{op.name}')"
            )
            raise ValueError(
                f'{what} in its forward pass. A recomputed micro-batch runs the forward a second '
                'time, so the update would happen twice and the recompute could compute with '
                "the changed value. Use recompute='never' for this pipeline, or move the update "
                'out of the forward (as BatchNormLayer: accumulate, then apply once per step in '
                'PostTrainingStepUpdate); if repeating it is harmless, set '
                'RECOMPUTE_REPEATS_STATE = True on the layer class.'
            )

    @staticmethod
    def _Targets(outputs, output_grads):
        ys, dys = [], []
        for y, dy in zip(tf.nest.flatten(outputs), tf.nest.flatten(output_grads)):
            if _is_float(y) and dy is not None:
                ys.append(y)
                dys.append(tf.cast(dy, y.dtype))
        return ys, dys

    @classmethod
    def _Gradients(cls, tape, sources, outputs, output_grads, variables, want):
        ys, dys = cls._Targets(outputs, output_grads)
        sources = sources if want in ('all', 'inputs') else []
        variables = variables if want in ('all', 'variables') else []
        if not (sources or variables):
            return [], []
        grads = tape.gradient(
            ys,
            sources + variables,
            output_gradients=dys,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        d_sources = [tf.convert_to_tensor(g) for g in grads[: len(sources)]]
        return d_sources, list(grads[len(sources) :])

    # ---- what the executor calls -------------------------------------------------------------

    def Forward(self, inputs, targets, step, micro_batch, training=True, taped=True):
        """The cell's outputs for one micro-batch; no activations are kept. `taped=False`: no
        tape may record the call (the caller stops recording), so it is made through call_op
        (no shape inference over the cell's body, a trampoline per device)."""
        args = (inputs, targets, step, micro_batch)
        key = _signature(args, training)
        self._forward_keys.add(key)
        if not (taped or self._jit or tf.executing_eagerly()):
            # A proven twin calls its group's first forward with its own captures (twins.py).
            concrete, captures = self._SharedForward(args, key) or (
                self._Concrete(self._forward, ('forward', key), args + (training,)),
                None,
            )
            out = self._CallUntaped(concrete, args, captures)
            if out is not None:
                return out
        place = distribute.on(self.device) if self._Unplaced() else contextlib.nullcontext()
        with place:
            return self._forward(inputs, targets, step, micro_batch, training)

    def _SharedForward(self, args, key):
        """(the group's first forward for these arguments, this cell's captures for it) when
        this cell is a proven twin for them; else None, and it calls its own. `key`: the
        call's signature, `_signature(args, training)`; only a training forward is proven."""
        first = self._twin_of
        if first is None or not key[-1] or not distribute.places_by_device_name():
            return None
        mapping = self._Mapping(first, args, key)
        if mapping is None:
            return None
        concrete = first._Concrete(first._forward, ('forward', key), args + (True,))
        captures = _mapped(concrete, mapping)
        return None if captures is None else (concrete, captures)

    def _CallUntaped(self, concrete, args, captures=None):
        """One call of `concrete` on this device through call_op (its outputs structured),
        with `captures` in place of its own; None when the arguments do not match its inputs."""
        captures = concrete.captured_inputs if captures is None else captures
        with distribute.on(self.device):
            return call_op.call_structured(
                concrete, args, captures, self._CallOptions(), self._trampolines
            )

    def _Concrete(self, function, key, args):
        """`function`'s trace for `args`, looked up once per call signature `key`: asking the
        tf.function at every call (K·M calls in an unrolled step) costs a few ms each."""
        if key not in self._concretes:
            self._concretes[key] = function.get_concrete_function(*args)
        return self._concretes[key]

    def ForwardKeep(self, inputs, targets, step, micro_batch):
        """Forward whose activations are kept, for `BackwardKept` / `SplitBackward`.

        The same non-inlined call as `Forward`, recorded by a tape of its own: TF rewrites the
        call to also return what its backward needs, and the backward is one more call of a
        function TF derives once per cell (not the cell's ops inlined per micro-batch). The
        tape is read once: a persistent one would make TF return every intermediate from the
        call, each given a zero gradient in the step's program."""
        tape = tf.GradientTape()
        with tape:
            sources = [x for x in tf.nest.flatten(inputs) if _is_float(x)]
            tape.watch(sources)
            outputs = self.Forward(inputs, targets, step, micro_batch, True)
        return outputs, (tape, sources, outputs)

    def BackwardKept(self, kept, output_grads, want='all'):
        """(d_float_inputs, [(variable, d_variable)]) from a ForwardKeep's tape."""
        tape, sources, outputs = kept
        variables = self._NoteRead(tape.watched_variables())
        with distribute.on(self.device):
            # TF would hand the call's derived backward a constant zero for each float output
            # without a gradient, one more specialised copy per micro-batch (opaque.py).
            outputs, output_grads = tf.nest.flatten(outputs), tf.nest.flatten(output_grads)
            output_grads = [
                opaque(tf.zeros_like(y)) if dy is None and _is_float(y) else dy
                for y, dy in zip(outputs, output_grads)
            ]
            # The tape's gradient calls the backward TF derives from the forward call's.
            with grappler.calls(self.grappler):
                d_x, d_v = self._Gradients(tape, sources, outputs, output_grads, variables, want)
        return d_x, list(zip(variables, d_v)) if d_v else []

    def ForwardSplit(self, inputs, targets, step, micro_batch):
        """Zero-bubble's forward of a kept micro-batch: (outputs, state for SplitBackward).

        Three calls cut from one trace (split_functions.py) where the graph allows (under a
        tf.distribute strategy too); eager, XLA or ordered state in the forward fall back to a
        tape, whose B then computes the weight gradients too (exact; the W that follows has
        nothing to do)."""
        fns = None
        if not (self._jit or tf.executing_eagerly()):
            fns = self.Split(inputs, targets, step, micro_batch)
        if fns is None:
            return self.ForwardKeep(inputs, targets, step, micro_batch)
        flat = [t for t in tf.nest.flatten((inputs, targets)) if t is not None]
        outputs, residuals = fns.Forward(flat + [step, micro_batch])
        return outputs, (fns, residuals)

    def Split(self, inputs, targets, step, micro_batch, split=True):
        """split_functions.build for these input shapes (tensors or TensorSpecs), built once
        per signature and shared by the unrolled executor and the tick loop; None when the
        forward's stateful ops need an order."""
        key = tuple(
            (tuple(t.shape), t.dtype) if t is not None else None
            for t in tf.nest.flatten((inputs, targets))
        ) + (str(tf.nest.map_structure(lambda _: 0, (inputs, targets))), split)
        if key not in self._split:
            self._split[key] = split_functions.build(
                self, inputs, targets, step, micro_batch, split=split
            )
        return self._split[key]

    def SplitBackward(self, kept, output_grads, want_inputs, after=None):
        """Zero-bubble's B on a kept forward: (d_float_inputs, [(variable, d_variable)] of the
        variables B computes, state for `SplitWeights` or None). `after`: a recorded step's
        start token (trace.py), which the residuals wait for (a loss head's B takes no output
        gradient)."""
        if not isinstance(kept[0], split_functions.SplitFunctions):  # a tape: B does it all
            d_x, d_vars = self.BackwardKept(
                kept, output_grads, 'all' if want_inputs else 'variables'
            )
            return d_x, d_vars, None
        fns, residuals = kept
        residuals = trace.after_start(after, residuals)
        flat_dys = []
        if self.head is None:
            for y, dy in zip(fns.flat_outputs, tf.nest.flatten(output_grads)):
                if y.dtype.is_floating:
                    flat_dys.append(
                        opaque(tf.zeros(tf.shape(y), y.dtype))
                        if dy is None
                        else tf.cast(dy, y.dtype)
                    )
        with distribute.on(self.device):
            d_x, d_unsplit, w_feeds = fns.Backward(residuals, flat_dys, want_inputs)
        return d_x, list(zip(fns.unsplit_variables, d_unsplit)), (fns, w_feeds)

    def SplitWeights(self, state, token):
        """Zero-bubble's W after `SplitBackward`, once `token` exists: [(variable, d_variable)]
        of the split variables."""
        fns, w_feeds = state
        with distribute.on(self.device):
            return list(zip(fns.split_variables, fns.Weights(token, w_feeds)))

    def ForwardBackward(self, inputs, targets, output_grads, step, micro_batch, want='all'):
        """(outputs, d_float_inputs, [(variable, d_variable)]): forward and backward of a
        micro-batch in one call, nothing recomputed (`output_grads` known up front: the loss's).
        Its outputs are a loss and gradients, which no tape differentiates: a call_op call."""
        args = (inputs, targets, output_grads, step, micro_batch)
        out = None
        if not (self._jit or tf.executing_eagerly()):
            key = ('fused', _signature(args, want))
            out = self._CallUntaped(
                self._Concrete(self._forward_backward, key, args + (want,)), args
            )
        if out is None:
            out = self._forward_backward(*args, want)
        out, d_x, d_v = out
        return out, d_x, list(zip(self._read, d_v))

    def Backward(self, inputs, targets, output_grads, step, micro_batch, want='all'):
        """(d_float_inputs, [(variable, d_variable)]) by recomputing the forward."""
        args = (inputs, targets, output_grads, step, micro_batch)
        shared = self._Shared(args, want)
        if shared is not None:
            concrete, captures, variables = shared
            out = self._CallUntaped(concrete, args, captures)
            if out is not None:
                d_x, d_v = out
                return d_x, list(zip(variables, d_v))
        fused = self._FusedFor(args, want)
        if fused is not None:
            out = call_op.call_structured(
                fused, args, fused.captured_inputs, self._CallOptions(), self._trampolines
            )
            if out is not None:
                _, d_x, d_v = out
                return d_x, list(zip(self._read, d_v))
        out = None
        if not (self._jit or tf.executing_eagerly()):
            # Through a trampoline, without shape inference (call_op.py): its outputs are
            # gradients, which no tape differentiates.
            concrete = self._OwnBackward(args, want)
            out = call_op.call_structured(
                concrete, args, concrete.captured_inputs, self._CallOptions(), self._trampolines
            )
        if out is None:
            out = self._backward(inputs, targets, output_grads, step, micro_batch, want)
        d_x, d_v = out
        # A retrace may have found more variables; an older trace returns a prefix of the list.
        return d_x, list(zip(self._read, d_v))

    def BackwardFunction(self, inputs, targets, output_grads, step, micro_batch, want='all'):
        """(structured outputs, variables) of the backward `Backward` calls for these
        arguments (TensorSpecs allowed): its (d_inputs, d_variables) and the variables the
        latter belong to, in order. Traces it if needed."""
        args = (inputs, targets, output_grads, step, micro_batch)
        shared = self._Shared(args, want)
        if shared is not None:
            concrete, _, variables = shared
            return concrete.structured_outputs, variables
        fused = self._FusedFor(args, want)
        if fused is not None:
            return fused.structured_outputs[1:], self.read_variables
        concrete = self._OwnBackward(args, want)
        return concrete.structured_outputs, self.read_variables

    def FusedFunction(self, inputs, targets, output_grads, step, micro_batch, want='all'):
        """(structured outputs, variables) of `ForwardBackward`'s traced call for these
        arguments: (outputs, d_inputs, d_variables) and the variables of the last."""
        concrete = self._forward_backward.get_concrete_function(
            inputs, targets, output_grads, step, micro_batch, want
        )
        return concrete.structured_outputs, self.read_variables

    def ForwardFunction(self, inputs, targets, step, micro_batch, training=True):
        """The traced forward `Forward` calls for these arguments (TensorSpecs allowed)."""
        self._forward_keys.add(_signature((inputs, targets, step, micro_batch), training))
        return self._forward.get_concrete_function(inputs, targets, step, micro_batch, training)

    def _FusedFor(self, args, want):
        """The last cell's fused forward-and-backward already traced for these arguments, when
        it may stand for the recompute-backward (its gradients are what it returns after the
        outputs); else None. A schedule that keeps one micro-batch and recomputes the others on
        the last cell (GPipe's fill-drain under 'except_last') then traces the cell's forward
        and gradient once, not twice. Only a trace that writes no variable and never reads the
        recompute flag qualifies (batch norm, dropout and Keras' seeded layers write), since
        the fused call runs as the forward (recompute=False) and the backward as a replay."""
        if self.head is None or self._jit or tf.executing_eagerly():
            return None
        if not self._replays.get(_signature(args, want)):
            return None
        return self._forward_backward.get_concrete_function(*args, want)

    def _OwnBackward(self, args, want):
        """This cell's own traced backward for these arguments (not a twin's). B of a split
        backward ('inputs') is cut from the cell's 'all' trace, which W then cuts its part from
        too (`_Part`): one recompute-backward trace for both. A cell wanting its variables'
        gradients alone before any 'all' trace (the first, whose inputs are the data) traces
        that alone."""
        key = ('backward', _signature(args, 'all'))
        if want == 'inputs' or (want == 'variables' and key in self._concretes):
            return self._Part(self._Concrete(self._backward, key, args + ('all',)), want)
        return self._Concrete(self._backward, ('backward', _signature(args, want)), args + (want,))

    def _Part(self, concrete, want):
        """The part of a traced 'all' backward that `want` asks for, as a function of its own
        cut from the trace (graph_cut.py): d_inputs alone ('inputs') or d_variables alone
        ('variables'), holding only the ops they need; the trace itself for 'all'."""
        if want == 'all':
            return concrete
        key = (concrete.name, want)
        if key not in self._parts:
            d_x, d_v = concrete.structured_outputs
            structure = (d_x, []) if want == 'inputs' else ([], d_v)
            fetches = tf.nest.flatten(structure, expand_composites=True)
            feeds = concrete.inputs[: len(concrete.inputs) - len(concrete.captured_inputs)]
            if concrete.name not in self._sources:  # read once for both parts
                self._sources[concrete.name] = graph_cut.Source(concrete.graph)
            function = graph_cut.cut(
                self._sources[concrete.name],
                feeds,
                fetches,
                name=f'Backward_{want}',
                attributes=_NOINLINE,
                structure=structure,
            )
            specs = [tf.TensorSpec(t.shape, t.dtype) for t in feeds]
            with grappler.calls(self.grappler):
                self._parts[key] = function.get_concrete_function(*specs)
        return self._parts[key]

    def _Shared(self, args, want):
        """(the shared backward for args and want, this cell's captures for it, the variables
        of its d_variables) when this cell is a proven twin for this call (or the first of its
        group); else None, and the cell calls a backward traced for itself. The group traces
        'all' once; a call that wants part of it ('inputs': B of a split backward;
        'variables': the first cell, whose inputs are the data) calls that part cut from the
        trace (`_Part`), so nothing is computed for nothing and nothing is traced twice."""
        first = self if self._shared_backward is not None else self._twin_of
        if first is None or tf.executing_eagerly() or not distribute.places_by_device_name():
            return None
        key = _signature(args, 'all')
        forward_args = args[:2] + args[3:]
        mapping = (
            None
            if key in self._unshared
            else self._Mapping(first, forward_args, _signature(forward_args, True))
        )
        if mapping is None:
            return None
        shared = first._Concrete(first._shared_backward, ('shared', key), args + ('all',))
        concrete = first._Part(shared, want)
        captures = _mapped(concrete, mapping)
        # Its d_variables belong to first's read variables as they were at its trace (a
        # prefix of the list now); each must be one this cell's forward has a counterpart of.
        read = first.read_variables
        if captures is None or any(id(v.handle) not in mapping for v in read):
            self._unshared.add(key)
            return None
        if first is self:
            return concrete, captures, list(read)
        variables = [self._variable_of[id(mapping[id(v.handle)])] for v in read]
        self._NoteRead(variables)
        return concrete, captures, variables

    def _Mapping(self, first, args, key):
        """The capture map from `first`'s forward for args (inputs, targets, step,
        micro_batch) to this cell's, found once per signature `key` (`_signature(args, True)`,
        see `_TwinMap`)."""
        if key not in self._twin_maps:
            self._twin_maps[key] = self._TwinMap(first, args)
        return self._twin_maps[key]

    def _TwinMap(self, first, args):
        """The capture map from `first`'s forward to this cell's (identity on `first`), or None
        when the two forwards for these arguments are not the same computation."""
        mine = self._forward.get_concrete_function(*args, True)
        if first is self:
            return {id(v): v for v, _ in mine.graph.captures}
        # Only a signature first's own forward ran with: a cell of other inputs (a functional
        # model's cells take different tensors) is never traced with this cell's.
        if self._variable_of is None or _signature(args, True) not in first._forward_keys:
            return None
        theirs = first._forward.get_concrete_function(*args, True)
        return twins.capture_map(theirs, mine, self._variable_of)


def _mapped(concrete, mapping):
    """`concrete`'s captured values as `mapping` (a twin map) maps them, or None when one has
    no counterpart."""
    values = [external for external, _ in concrete.graph.captures]
    if any(id(v) not in mapping for v in values):
        return None
    return [mapping[id(v)] for v in values]


def _signature(args, want):
    """A call's signature for the twin maps: its structure, each tensor's shape and dtype,
    other values as they are."""

    def leaf(x):
        if isinstance(x, tf.Tensor | tf.TensorSpec):
            return (tuple(x.shape.as_list()) if x.shape.rank is not None else None, x.dtype)
        return x

    return (
        str(tf.nest.map_structure(lambda _: 0, args)),
        tuple(map(leaf, tf.nest.flatten(args))),
        want,
    )
