"""BaseTask: a network, its loss and metrics, the learner and the loop settings."""

import tensorflow as tf

from tf_gpipe import base_layer, hyperparams
from tf_gpipe.gpipe import PipelinedLayer
from tf_gpipe.trainer.learner import Learner


def PipelineParams():
    """The pipeline settings a task exposes (copied into its PipelinedLayer)."""
    p = hyperparams.Params()
    p.Define('num_partitions', 1, 'K: cells, each on its own device.')
    p.Define('num_micro_batches', 1, 'M: micro-batches per batch.')
    p.Define('recompute', 'except_last', "'always', 'except_last' or 'never'.")
    p.Define('schedule', 'gpipe', "'gpipe', '1f1b', 'interleaved_1f1b' or 'zero_bubble'.")
    p.Define('virtual_stages', 1, "v: cells per device for 'interleaved_1f1b'.")
    p.Define('partition_by', 'flops', "'flops', 'params', 'activation_bytes', 'uniform', 'time'.")
    p.Define('splits', None, 'Explicit ending layer indices (overrides partition_by).')
    p.Define('num_replicas', 1, 'R: data-parallel replicas of the pipeline.')
    p.Define('jit_compile', False, 'XLA for each cell.')
    p.Define(
        'twin_cells',
        True,
        'Cells of the same layers trace their backward once (PipelinedLayer.twin_cells).',
    )
    p.Define(
        'cell_grappler',
        False,
        "Grappler on the cells' functions too (PipelinedLayer.cell_grappler); off (the "
        'default): a shorter first step.',
    )
    p.Define(
        'tick_loop',
        None,
        'The training step as a loop over clock ticks: start-up flat in M. None: from 8 '
        'micro-batches on in one process, not across TF tasks (slower there); True / False: '
        'always / never (PipelinedLayer.tick_loop).',
    )
    p.Define(
        'eval_loop',
        None,
        "Eval's forward as a loop over ticks: start-up flat in M. None: in one process yes, "
        'across TF tasks no (slower there); True / False: always / never '
        '(PipelinedLayer.eval_loop).',
    )
    return p


def TrainParams():
    """The training loop (Lingvo's task.train): steps, intervals, checkpoints, the learner."""
    p = hyperparams.Params()
    p.Define('learner', Learner.Params(), 'Optimizer, learning rate and its schedule, clipping.')
    p.Define('max_steps', 1000, 'Training stops at this global step.')
    p.Define('log_interval_steps', 20, 'Log and write summaries every this many steps.')
    p.Define('save_interval_steps', 200, 'Checkpoint every this many steps (and at the end).')
    p.Define('max_checkpoints_to_keep', 5, 'Older checkpoints are deleted.')
    p.Define(
        'init_from_checkpoint_rules',
        {},
        'Warm start (a run without a checkpoint of its own): {checkpoint path: ([(regex, '
        "format)], [ignore regex])}; a variable whose name (e.g. 'task/network/fc0/w') fully "
        'matches a regex is loaded from the name format % match.groups().',
    )
    p.Define(
        'trace_interval_steps',
        0,
        'Every this many steps, time each pipeline action of the step and write each '
        "device's busy time and the measured bubble to TensorBoard (pipeline/...); 0: never. "
        'The first such step traces the training step a second time.',
    )
    p.Define(
        'nonfinite_policy',
        'stop',
        "A step whose loss or gradient is NaN/Inf changes nothing, then: 'stop' (an error "
        "naming the step; the last checkpoint stays the last good state) or 'skip' (training "
        'goes on; the step is counted in nonfinite_steps).',
    )
    return p


def EvalParams():
    """Evaluation settings (Lingvo's task.eval)."""
    p = hyperparams.Params()
    p.Define('interval_steps', 200, "Evaluate every this many training steps ('train_and_eval').")
    p.Define('steps', 4, 'Batches per evaluation.')
    return p


def PipelinedParamsFor(task_params, sub, input_shape):
    """PipelinedLayer params for layer list `sub` from a task's pipeline settings."""
    pp = task_params.pipeline
    return PipelinedLayer.Params().Set(
        name='network',
        sub=sub,
        input_shape=input_shape,
        num_partitions=pp.num_partitions,
        num_micro_batches=pp.num_micro_batches,
        recompute=pp.recompute,
        schedule=pp.schedule,
        virtual_stages=pp.virtual_stages,
        partition_by=pp.partition_by,
        splits=pp.splits,
        num_replicas=pp.num_replicas,
        jit_compile=pp.jit_compile,
        twin_cells=pp.twin_cells,
        cell_grappler=pp.cell_grappler,
        tick_loop=pp.tick_loop,
        eval_loop=pp.eval_loop,
    )


def TokenXentMetrics(softmax, logits, labels, weights):
    """(xent NestedMap, accuracy) over weighted token positions."""
    xent = softmax.XentLoss(logits, labels, weights)
    predicted = tf.argmax(logits, -1, output_type=tf.int32)
    correct = tf.cast(tf.equal(predicted, labels), tf.float32) * weights
    return xent, tf.reduce_sum(correct) / tf.maximum(xent.total_weight, 1.0)


class TokenLossMixin:
    """For tasks whose targets are NestedMap(labels, weights) of token positions and whose
    `_Softmax()` is the network's softmax layer: the token-weighted loss and its metrics."""

    def MicroBatchLoss(self, logits, targets):
        xent = self._Softmax().XentLoss(logits, targets.labels, targets.weights)
        return xent.avg_xent, xent.total_weight  # a token mean: weighted by tokens

    def _TokenMetrics(self, logits, targets):
        """(xent NestedMap, accuracy) of the whole batch."""
        return TokenXentMetrics(self._Softmax(), logits, targets.labels, targets.weights)


class BaseTask(base_layer.BaseLayer):
    """Subclasses build `self.network` (a PipelinedLayer) and say how a batch feeds it:
    `NetworkInputs(batch)` -> (inputs, targets), `MicroBatchLoss(outputs, targets)` (one
    micro-batch's mean loss, or (mean, weight)) and `Metrics(outputs, targets)` (the whole
    batch's NestedMap(loss, metrics))."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('pipeline', PipelineParams(), 'Pipeline settings.')
        p.Define('train', TrainParams(), 'Training loop settings and the learner.')
        p.Define('eval', EvalParams(), 'Evaluation settings.')
        # The names before Lingvo's tree, still accepted (with a deprecation warning).
        p.DefineAlias('learner', 'train.learner')
        p.DefineAlias('train.eval_interval_steps', 'eval.interval_steps')
        p.DefineAlias('train.eval_steps', 'eval.steps')
        return p

    @classmethod
    def InputShape(cls, task_p, input_p):
        """The network's input shape for batches of `input_p` (None: unknown)."""
        return None

    def NetworkInputs(self, batch):
        """(network inputs, loss targets) of a batch."""
        raise NotImplementedError

    def MicroBatchLoss(self, outputs, targets):
        """One micro-batch's mean loss, or (mean loss, weight); runs on the last stage."""
        raise NotImplementedError

    def Metrics(self, outputs, targets):
        """NestedMap(loss=scalar, metrics=NestedMap of scalars) of the whole batch."""
        raise NotImplementedError

    def ServingSpecs(self, input_p):
        """{name: TensorSpec} of a served forward's inputs, the batch (and length) open."""
        raise NotImplementedError(
            f'{type(self).__name__} defines no serving signature: define ServingSpecs and '
            'Serve to export it.'
        )

    def Serve(self, inputs):
        """{name: tensor} of the forward on `inputs` (as ServingSpecs names them), eval mode."""
        raise NotImplementedError(f'{type(self).__name__} defines no Serve.')

    def ServeStep(self, inputs, state, t, max_len):
        """Serve for decoding position by position: ({name: tensor} at positions t.., the
        network's new state); see BaseLayer.ExtendStep."""
        raise NotImplementedError(f'{type(self).__name__} defines no ServeStep.')

    def _NumExamples(self, inputs):
        return tf.shape(tf.nest.flatten(inputs)[0])[0]

    def FPropTower(self, batch):
        """NestedMap(loss, metrics, num_examples) of a forward pass (eval)."""
        inputs, targets = self.NetworkInputs(batch)
        outputs = self.network.FProp(inputs)
        with tf.device(self.network.devices[-1]):  # loss and metrics on the last stage
            out = self.Metrics(outputs, targets)
        out.num_examples = self._NumExamples(inputs)
        return out

    def ComputeGradients(self, batch):
        """(NestedMap(loss, metrics, num_examples), grads lined up with the network's
        trainable variables): one training step of the pipeline under its schedule."""
        inputs, targets = self.NetworkInputs(batch)
        loss, grads, outputs = self.network.ComputeGradients(
            inputs, targets, self.MicroBatchLoss, return_outputs=True
        )
        with tf.device(self.network.devices[-1]):
            out = self.Metrics(tf.stop_gradient(outputs), targets)
        out.loss = loss
        out.num_examples = self._NumExamples(inputs)
        return out, grads

    def RegularizedVariables(self):
        """Trainable variables of layers that do not set skip_lp_regularization."""
        out = []
        for layer in self.AllLayers():
            if not layer.params.skip_lp_regularization:
                out.extend(layer.vars[k] for k in sorted(layer.vars) if layer.vars[k].trainable)
        return out
