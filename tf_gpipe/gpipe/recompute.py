"""One cell on one device: its forward, and its backward by re-running the forward.

For a recomputed micro-batch both are separate, non-inlined TF function calls placed on the
cell's device:

- the forward call returns only the cell's outputs, so the activations inside the cell die
  with the call;
- the backward call takes the saved boundary input *and the incoming gradient*, re-runs the
  forward under a tape and returns (d_input, d_variables). Because the incoming gradient is one
  of its inputs, the executor cannot start a recompute before the backward wave reaches the
  cell, and no graph rewrite can merge it with the forward call (different op, different
  inputs) or keep its activations alive past it. This is what bounds the peak memory, with
  Grappler left on for the rest of the user's program.

A micro-batch whose activations are kept (recompute='never', and except_last's last one) needs
no boundary: its forward ops go straight into the step's graph, under the step's tape, where
TF optimises them with their gradient as in a plain sequence (a call boundary cost AmoebaNet
13% at K=1, M=1). Only under XLA (jit_compile) or gpipe.trace is it a call too.
"""

import tensorflow as tf

from tf_gpipe import fprop_context
from tf_gpipe.gpipe import trace

# Keeps Grappler's function optimizer from inlining the calls (inlining would let common
# subexpression elimination fold a recompute into its forward, and the executor run it early).
_NOINLINE = {'_noinline': True}


def _is_float(x):
    return isinstance(x, tf.Tensor | tf.Variable) and x.dtype.is_floating


def _timed():
    return trace.recording() and not tf.executing_eagerly()


def _stamp_after(structure):
    with tf.control_dependencies([t for t in tf.nest.flatten(structure) if t is not None]):
        return tf.timestamp()


def as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


class CellRunner:
    """Runs cell `k` of a pipeline on its device, as forward / recompute-backward calls."""

    def __init__(self, cell, device, index, jit_compile=False):
        self.cell = cell
        self.device = device
        self.index = index
        self._variables = None
        self._jit = bool(jit_compile)
        jit = True if jit_compile else None
        options = dict(jit_compile=jit, experimental_attributes=_NOINLINE, autograph=False)
        self._forward = tf.function(self._Forward, **options)
        self._backward = tf.function(self._Backward, **options)

    @property
    def variables(self):
        """The cell's trainable variables, in a fixed order."""
        if self._variables is None:
            self._variables = list(self.cell.trainable_variables)
        return self._variables

    def _Run(self, inputs):
        try:
            return as_tuple(self.cell.FProp(*inputs))
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            structure = tf.nest.map_structure(lambda t: getattr(t, 'shape', t), inputs)
            raise type(e)(
                f'Cell {self.index} ({self.cell.layer_name}) cannot take its input {structure}: {e}'
            ) from e

    def _Forward(self, inputs, step, micro_batch, training, recompute, timed=False):
        with (
            tf.device(self.device),
            fprop_context.scope(
                training=training, step=step, seed_offset=micro_batch, recompute=recompute
            ),
        ):
            # Timed (gpipe.trace): the call's first op stamps when the call really began.
            start = tf.timestamp() if timed else None
            outputs = self._Run(inputs)
            return (outputs, start, _stamp_after(outputs)) if timed else outputs

    def _Backward(self, inputs, output_grads, step, micro_batch, timed=False):
        with (
            tf.device(self.device),
            fprop_context.scope(training=True, step=step, seed_offset=micro_batch, recompute=True),
        ):
            start = tf.timestamp() if timed else None
            with tf.GradientTape() as tape:
                sources = [x for x in tf.nest.flatten(inputs) if _is_float(x)]
                tape.watch(sources)
                outputs = self._Run(inputs)
            grads = self._Gradients(tape, sources, outputs, output_grads)
            return (grads, start, _stamp_after(grads)) if timed else grads

    def _Gradients(self, tape, sources, outputs, output_grads):
        targets, grads = [], []
        for y, dy in zip(tf.nest.flatten(outputs), tf.nest.flatten(output_grads)):
            if _is_float(y) and dy is not None:
                targets.append(y)
                grads.append(tf.cast(dy, y.dtype))
        all_grads = tape.gradient(
            targets,
            sources + self.variables,
            output_gradients=grads,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        all_grads = [tf.convert_to_tensor(g) for g in all_grads]  # IndexedSlices -> dense
        return all_grads[: len(sources)], all_grads[len(sources) :]

    def Forward(self, inputs, step, micro_batch, training=True, recompute=False):
        """The cell's outputs (a tuple) for one micro-batch; no activations are kept."""
        return self._Timed(self._forward(inputs, step, micro_batch, training, recompute, _timed()))

    def ForwardKeep(self, inputs, step, micro_batch):
        """Forward whose activations are kept on a tape for `BackwardKept` (no recompute)."""
        tape = tf.GradientTape()
        with tape:
            sources = [x for x in tf.nest.flatten(inputs) if _is_float(x)]
            tape.watch(sources)
            if self._jit or tf.executing_eagerly() or _timed():  # timed: a call stamps itself
                outputs = self._Timed(
                    self._forward(inputs, step, micro_batch, True, False, _timed())
                )
            else:
                # Kept activations need no call boundary: the cell's ops go straight into the
                # step's graph, where TF optimises forward and backward together (as for the
                # plain sequence). The inputs already wait for the device's previous action.
                outputs = self._Forward(inputs, step, micro_batch, True, False)
        return outputs, (tape, sources, outputs)

    def _Timed(self, result):
        """Unpacks (result, start, end) of a timed call, handing the stamps to gpipe.trace."""
        if not _timed():
            return result
        result, start, end = result
        trace.note_stamps(start, end)
        return result

    def BackwardKept(self, kept, output_grads):
        """(d_float_inputs, d_variables) from a ForwardKeep's tape."""
        tape, sources, outputs = kept
        with tf.device(self.device):
            return self._Gradients(tape, sources, outputs, output_grads)

    def Backward(self, inputs, output_grads, step, micro_batch):
        """(d_float_inputs, d_variables) by recomputing the forward from the boundary input."""
        return self._Timed(self._backward(inputs, output_grads, step, micro_batch, _timed()))
