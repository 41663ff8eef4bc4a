"""How a pipelined Keras model trains: fit's train step and a custom loop's `compute_gradients`.

One training path: the compiled loss is computed per micro-batch on the last cell, inside the
pipeline (`ComputeGradients`), each micro-batch contributing its share of the batch's loss
(micro_loss), under every schedule. Under schedule='gpipe' a loss that cannot be shared out
exactly (an output with a Keras mask, a loss that mixes examples, mixed reductions) is computed
on the merged output instead, by a tape over the pipeline's call, and the log says why; other
schedules refuse it by name. A custom training loop gets the per-micro-batch loss through
`compute_gradients` and, under 'gpipe', may differentiate a training call. Either way batch norm
moves its averages once per step and dropout draws new masks at every training call, as in
plain Keras.
"""

import contextlib
import re

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tf_gpipe import fprop_context
from tf_gpipe.gpipe import executor
from tf_gpipe.keras import layer_sequence, loss_probe, micro_loss
from tf_gpipe.runtime import distribute, placement
from tf_gpipe.runtime.variables import backing


class TrainSteps:
    """Training methods of GPipeModel (a keras.Model with `_pipe`, `_Inputs`, `_Outputs`)."""

    _in_step = False

    @contextlib.contextmanager
    def _Stepping(self, step):
        """A training step of ours: the call inside it leaves batch norm to the step."""
        object.__setattr__(self, '_in_step', True)
        try:
            with fprop_context.scope(training=True, step=step):
                yield
        finally:
            object.__setattr__(self, '_in_step', False)

    def _TrainingCall(self, inputs):
        """call(training=True): the pipeline's differentiable forward. Outside fit (a custom
        loop) each call draws new dropout masks (the pipeline's own step counter) and moves
        batch norm's averages, as a plain Keras training call does."""
        if self._options['schedule'] != 'gpipe' and not self._in_step:
            raise ValueError(
                f"{self.name}: schedule={self._options['schedule']!r} starts each micro-batch's "
                'backward before the last forward, so a training call cannot be differentiated '
                'by a tape. In a custom training loop use loss, grads = '
                "model.compute_gradients(x, y) (every schedule), or schedule='gpipe'."
            )
        with fprop_context.scope(training=True):
            outputs = self._Outputs(self._pipe.FProp(*inputs))
        if not self._in_step:
            self._pipe.PostTrainingStepUpdate()
        return outputs

    # ---- fit ---------------------------------------------------------------------------------

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if self._options['schedule'] != 'gpipe' or self._LossPerMicroBatch(y, sample_weight):
            return self._ScheduledTrainStep(data)
        # The loss on the merged output (a loss that cannot be shared out per micro-batch).
        # Loss, metrics and the start of the backward pass on the last stage, where the output
        # is (unplaced, they would run on a TF cluster's client); updates stay with their
        # variables (Keras colocates them).
        with distribute.on(self._pipe.devices[-1]):
            with tf.GradientTape() as tape, self._Stepping(self._OptimizerStep()):
                y_pred = self(x, training=True)
                mean = self._LocalMean(x, y, y_pred, sample_weight)
                counts = self._Counts(x)
                loss = self.optimizer.scale_loss(self._Share(mean, counts))
            grads = tape.gradient(loss, self.trainable_weights)
            grads = self._WithoutGradient(grads, self.trainable_weights)
            placement.apply_gradients(self.optimizer, zip(grads, self.trainable_weights))
            self._TrackLoss(mean, counts)
            logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        # Batch norm: one moving-average update per step, from the whole batch's statistics.
        self._pipe.PostTrainingStepUpdate()
        return logs

    def _LossPerMicroBatch(self, y, sample_weight):
        """Whether fit under 'gpipe' computes the compiled loss per micro-batch inside the
        pipeline, as every other schedule does (one training path: the last cell's backward
        starts from its micro-batch's loss, the merged output needs no gradient). A loss that
        cannot be shared out exactly is computed on the merged output instead, and the log
        says why, once."""
        why = None
        try:
            kind = micro_loss.reduction(self, 'gpipe')
        except ValueError:
            why = 'the compiled losses cannot be shared out per micro-batch by one reduction'
        else:
            several = len(self._CompiledLosses(y)) > 1
            if self._OutputsCarryMasks():
                why = (
                    'an output carries a Keras mask (Keras averages its loss over the unmasked '
                    "entries of the whole batch, which a micro-batch's loss cannot know)"
                )
            elif kind != micro_loss.MEAN and several:
                why = (
                    f'several outputs have losses with reduction {kind!r} (Keras tracks each '
                    "output's loss per call as a mean over rows, which per micro-batch is not "
                    "the batch's value: history's per-output losses would differ)"
                )
            elif self._LastCellRecomputes() and several:
                why = (
                    'several outputs have losses (Keras tracks each one in the loss, a state '
                    "update that a recomputed micro-batch would repeat; recompute='never' has none)"
                )
            elif kind == micro_loss.WEIGHTED_MEAN and isinstance(sample_weight, (dict, list)):
                why = "sample weights per output with reduction 'mean_with_sample_weight'"
            else:
                if kind == micro_loss.WEIGHTED_MEAN and sample_weight is None:
                    kind = micro_loss.MEAN
                why = self._SharesMismatch(y, kind, None)
        if why is None:
            return True
        said = self.__dict__.setdefault('_merged_loss_said', set())
        if why not in said:
            said.add(why)
            logging.info(
                "%s: fit under schedule='gpipe' computes the loss on the merged output, after "
                'the last forward, not per micro-batch: %s.',
                self.name,
                why,
            )
        return False

    def _LastCellRecomputes(self):
        """Whether the schedule and policy recompute a micro-batch of the last cell (its loss
        then runs twice)."""
        sched = self._pipe.Schedule()
        kept = executor.kept_micro_batches(sched, self._options['recompute'])
        last = sched.num_stages - 1
        return any((last, m) not in kept for m in range(sched.num_micro_batches))

    def _OutputsCarryMasks(self):
        """Whether an output of the pipeline carries a Keras mask (from the layers' metadata;
        cached)."""
        if '_carries_masks' not in self.__dict__:
            p = self._pipe.params
            shapes = p.input_shape if self._input_names is not None else (p.input_shape,)
            meta = type(self._pipe).FPropMeta(p, *shapes)
            self.__dict__['_carries_masks'] = layer_sequence.carries_mask(list(meta.out_shapes))
        return self.__dict__['_carries_masks']

    def _ScheduledTrainStep(self, data):
        """A training step under a schedule that needs the loss inside the pipeline: each
        micro-batch's share of the compiled loss on the last stage, metrics on the merged
        output, the update as in Keras' own train_step."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        # The scale this step's loss is multiplied by (apply_gradients may change it).
        loss_scale = tf.convert_to_tensor(self.optimizer.dynamic_scale) if scaled else None

        loss, grads, y_pred, counts = self._MicroBatchGradients(
            x,
            y,
            sample_weight,
            self._CompiledLoss,
            micro_loss.reduction(self, self._options['schedule']),
            self._OptimizerStep(),
            self.optimizer.scale_loss,
        )
        variables = self.trainable_variables
        placement.apply_gradients(
            self.optimizer, zip(self._WithoutGradient(grads, variables), variables)
        )
        with distribute.on(self._pipe.devices[-1]):
            if scaled:
                loss = loss / tf.cast(loss_scale, loss.dtype)
            n, total = counts  # the share back to this replica's own loss
            self._TrackLoss(loss * tf.cast(total / tf.maximum(n, 1.0), loss.dtype), counts)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def test_step(self, data):
        with distribute.on(self._pipe.devices[-1]):
            return super().test_step(data)

    def _OptimizerStep(self):
        """fit's step (dropout masks depend on it): the optimizer's iterations."""
        return tf.convert_to_tensor(self.optimizer.iterations)

    # ---- custom training loops ---------------------------------------------------------------

    def compute_gradients(self, x, y, loss=None, sample_weight=None):
        """(loss, gradients) of one training step under this model's schedule, for a custom
        training loop; apply them with `optimizer.apply_gradients(zip(grads,
        model.trainable_variables))`, or `tf_gpipe.placement.apply_gradients(optimizer, ...)`
        to run each variable's update on its device.

        `loss`: a Keras loss (a name, a function of (y_true, y_pred), or a keras.losses.Loss,
        whose reduction is honoured); None: the compiled loss. As Keras's compute_loss, the
        model's regularization losses are added. The gradients line up with
        `model.trainable_variables`, None for a variable no loss reaches (as tape.gradient).
        Like a fit step, it draws new dropout masks and moves batch norm's averages once.
        """
        schedule = self._options['schedule']
        x, y, sample_weight = tf.nest.map_structure(
            lambda t: t if t is None else tf.convert_to_tensor(t), (x, y, sample_weight)
        )
        if loss is None:
            if getattr(self, 'loss', None) is None:
                raise ValueError(
                    f'{self.name}.compute_gradients: give loss=... (e.g. "mse" or a '
                    'keras.losses.Loss), or compile the model with a loss.'
                )
            kind, loss_of = micro_loss.reduction(self, schedule), self._CompiledLoss
        else:
            loss_object = _loss_object(loss)
            kind = micro_loss.reduction_of(loss_object, schedule)

            def loss_of(y_true, y_pred, weights):
                value = loss_object(y_true, y_pred, sample_weight=weights)
                return value + micro_loss.regularization(self)

        with distribute.on(self._pipe.devices[-1]):
            loss_value, grads, _, _ = self._MicroBatchGradients(
                x, y, sample_weight, loss_of, kind, None, None, loss
            )
        if loss is None:
            grads = self._WithoutGradient(grads, self.trainable_variables)
        return loss_value, grads

    # ---- the pipeline's gradients ------------------------------------------------------------

    def _CompiledLoss(self, y_true, y_pred, weights):
        """A micro-batch's compiled loss (regularizers included), as Keras's compute_loss."""
        return self.compute_loss(y=y_true, y_pred=y_pred, sample_weight=weights)

    def _MicroBatchGradients(
        self, x, y, sample_weight, loss_of, kind, step, scale_loss, custom_loss=None
    ):
        """(loss, grads lined up with trainable_variables, outputs, _Counts) of one step, the
        loss computed per micro-batch on the last stage: `loss_of(y, y_pred, sample_weight)`
        is a micro-batch's loss under reduction `kind` (regularizers included), shared out by
        micro_loss. `custom_loss`: compute_gradients' loss argument inside `loss_of` (None:
        the compiled ones), checked for mixing examples. `step` None: the pipeline's own counter. Moves batch
        norm's averages."""
        targets = (y,) if sample_weight is None else (y, sample_weight)
        counts = self._Counts(x)
        total_weight = None
        if kind == micro_loss.WEIGHTED_MEAN:
            if sample_weight is None:
                kind = micro_loss.MEAN  # Keras divides by the count then
            else:
                total_weight = self._SumWeights(sample_weight)
        found = self._SharesMismatch(y, kind, custom_loss)
        if found:
            raise ValueError(f'{self.name}: {loss_probe.refusal(found, self._options["schedule"])}')
        if custom_loss is None and self._LastCellRecomputes() and len(self._CompiledLosses(y)) > 1:
            o = self._options
            raise ValueError(
                f'{self.name}: compiled losses on several outputs, and recompute='
                f'{o["recompute"]!r} under schedule={o["schedule"]!r} recomputes micro-batches '
                "of the last cell, where the loss is computed: Keras's per-output loss "
                'trackers are updated inside the loss computation, which a recompute would '
                "repeat. Use recompute='never' (or 'except_last' under a 1f1b-like schedule, "
                "where the last cell keeps its micro-batches), schedule='gpipe' (the loss on "
                'the merged output), or one loss.'
            )
        # Under a tf.distribute strategy Keras divides a mean loss by the number of replicas;
        # ComputeGradients already returns each replica's share of the global batch's loss.
        undo = 1 if kind == micro_loss.SUM else tf.distribute.get_strategy().num_replicas_in_sync

        def loss_fn(y_pred, t):
            y_pred = self._Unmasked(y_pred)
            weights = t[1] if len(t) > 1 else None
            loss = loss_of(t[0], y_pred, weights) * undo
            rows = tf.cast(tf.shape(tf.nest.flatten(y_pred)[0])[0], tf.float32)
            part = micro_loss.share(
                kind,
                loss,
                None if kind == micro_loss.MEAN else micro_loss.regularization(self),
                rows,
                counts[1],
                None if total_weight is None else tf.reduce_sum(tf.cast(weights, tf.float32)),
                total_weight,
                undo,
            )
            # (mean, weight) with mean * weight = the share: the backward starts from the
            # share (times the loss scale), as plain Keras's does.
            weight = rows / tf.maximum(counts[1], 1.0)
            mean = tf.math.divide_no_nan(part, weight)
            return (mean if scale_loss is None else scale_loss(mean)), weight

        with self._Stepping(step):
            loss, grads, y_pred = self._pipe.ComputeGradients(
                self._Inputs(x), targets, loss_fn, True
            )
        self._pipe.PostTrainingStepUpdate()
        by_ref = {v.ref(): g for v, g in zip(self._pipe.trainable_variables, grads)}
        grads = [by_ref.get(backing(v).ref()) for v in self.trainable_variables]
        return loss, grads, self._Outputs(y_pred), counts

    def _SharesMismatch(self, y, kind, custom_loss):
        """The first loss that does not add up per micro-batch (loss_probe.mismatch), or None;
        `custom_loss` None: each compiled loss on its output. A verdict is kept per loss
        argument (held, so its id stays its own), reduction and shapes: traces do not probe
        again."""
        if custom_loss is not None:
            obj = _loss_object(custom_loss)
            flat_pred = tf.nest.flatten(self._out_spec)
            what = f'the loss {_loss_name(obj)!r}'
            checks = [(custom_loss, obj, y, self._Pack(flat_pred), what)]
        else:
            checks = self._CompiledLosses(y)
        weighted = kind == micro_loss.WEIGHTED_MEAN
        verdicts = self.__dict__.setdefault('_share_verdicts', {})
        for source, obj, y_true, y_pred, what in checks:
            key = (id(source), what, kind, repr(tf.nest.map_structure(_spec, (y_true, y_pred))))
            if key not in verdicts:
                found = loss_probe.mismatch(
                    lambda t, p, w, obj=obj: obj(t, p, sample_weight=w if weighted else None),
                    kind,
                    y_true,
                    y_pred,
                    what,
                )
                verdicts[key] = (source, found)
            if verdicts[key][1]:
                return verdicts[key][1]
        return None

    def _CompiledLosses(self, y):
        """(compile's loss argument, its loss object, y_true, y_pred spec, description) per
        output with a compiled loss; none when y cannot be matched to the outputs (then Keras
        itself refuses it)."""
        flat_pred = tf.nest.flatten(self._out_spec)
        names = list(getattr(self, 'output_names', None) or [])
        if isinstance(y, dict):
            flat_true = [y.get(name) for name in names]
        elif len(flat_pred) == 1:
            flat_true = [y]
        elif isinstance(y, (list, tuple)) and len(y) == len(flat_pred):
            flat_true = list(y)
        else:
            return []
        if isinstance(self.loss, (dict, list, tuple)):
            pairs = micro_loss.compiled_losses(self.loss, names)
            by_output = {names.index(n) if n in names else int(n): v for n, v in pairs}
        else:
            by_output = {i: self.loss for i in range(len(flat_pred))}
        checks = []
        for i, loss in sorted(by_output.items()):
            if loss is None or i >= len(flat_pred) or flat_true[i] is None:
                continue
            obj = _loss_object(loss)
            name = f' of output {names[i]!r}' if len(flat_pred) > 1 and i < len(names) else ''
            what = f'the compiled loss {_loss_name(obj)!r}{name}'
            checks.append((loss, obj, flat_true[i], flat_pred[i], what))
        return checks

    def _WithoutGradient(self, grads, variables):
        """`grads` with None for the variables no compiled loss reaches (plain Keras's None:
        the optimizer leaves them alone, no weight decay or momentum); the pipeline's cells
        return zeros for them."""
        used = micro_loss.outputs_with_loss(self.loss, list(getattr(self, 'output_names', [])))
        if self._reach is None or used is None:
            return grads
        steps = set().union(*(self._reach[i] for i in used))
        reached = {
            backing(v).ref() for i in steps for v in self.partition_layers[i].trainable_weights
        }
        unreached = [v for v in variables if backing(v).ref() not in reached]
        if unreached:  # a regularizer still gives them a gradient
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch([backing(v) for v in unreached])
                penalties = list(self.losses)
            from_penalties = (
                tape.gradient(penalties, [backing(v) for v in unreached])
                if penalties
                else [None] * len(unreached)
            )
            unreached = {backing(v).ref() for v, g in zip(unreached, from_penalties) if g is None}
        return [None if backing(v).ref() in unreached else g for v, g in zip(variables, grads)]

    # ---- losses across replicas --------------------------------------------------------------

    def _LocalMean(self, x, y, y_pred, sample_weight):
        """This replica's mean loss over its rows (Keras' compute_loss divides it by the number
        of replicas under a strategy; undone here)."""
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        return loss * tf.cast(tf.distribute.get_strategy().num_replicas_in_sync, loss.dtype)

    def _Counts(self, x):
        """(rows of this replica, rows of the global batch), as floats (one all-reduce)."""
        n = tf.cast(tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0], tf.float32)
        return n, distribute.all_reduce_sum(n) if distribute.in_replica_context() else n

    def _Share(self, mean, counts):
        """This replica's share of the global batch's mean: mean * n / N. The optimizer's
        all-reduce sums the shares' gradients into the global mean's even when the replicas'
        rows differ (Keras' own mean / R does not: a last partial batch can leave a replica
        a single row, or none). `counts`: _Counts."""
        n, total = counts
        return tf.where(n > 0, mean * tf.cast(n / tf.maximum(total, 1.0), mean.dtype), 0.0)

    def _TrackLoss(self, mean, counts):
        """Keras' loss tracker (by its public name): each replica's mean, weighted by its rows."""
        n, _ = counts
        for metric in self.metrics:
            if metric.name == 'loss':
                metric.update_state(tf.where(n > 0, mean, 0.0), sample_weight=n)

    def _SumWeights(self, sample_weight):
        """The sum of the global batch's sample weights (one tensor; a dict per output is
        refused: its per-output sums would share each output's loss differently)."""
        if not tf.is_tensor(sample_weight) and not isinstance(sample_weight, np.ndarray):
            raise ValueError(
                "reduction='mean_with_sample_weight' with sample weights per output: schedule="
                f'{self._options["schedule"]!r} shares the loss out per micro-batch by one '
                "tensor of sample weights. Give one, or use schedule='gpipe'."
            )
        total = tf.reduce_sum(tf.cast(sample_weight, tf.float32))
        return distribute.all_reduce_sum(total) if distribute.in_replica_context() else total


def _loss_object(loss):
    """A keras.losses.Loss for a compile() or compute_gradients loss argument (a name, a
    function of (y_true, y_pred) or a Loss)."""
    obj = keras.losses.get(loss)
    return obj if isinstance(obj, keras.losses.Loss) else _FunctionLoss(obj)


class _FunctionLoss(keras.losses.Loss):
    """A loss function as Keras's compile wraps one: per-example values, reduced by Keras's
    default reduction ('sum_over_batch_size'). (Keras's own wrapper is not public.)"""

    def __init__(self, fn):
        # The name is a TF name scope: no leading underscore, no '<lambda>'.
        name = re.sub(r'[^A-Za-z0-9_.]', '', getattr(fn, '__name__', '')).lstrip('_')
        super().__init__(name=name or 'loss')
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def _loss_name(obj):
    fn = getattr(obj, 'fn', None)
    return getattr(fn, '__name__', None) or getattr(obj, 'name', None) or type(obj).__name__


def _spec(t):
    """A tensor's shape and dtype, as a cache key."""
    return None if t is None else (str(tf.TensorShape(t.shape)), str(t.dtype))
