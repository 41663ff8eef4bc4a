"""The training / evaluation loop: checkpoints, TensorBoard summaries, progress logs.

Library code: tools/trainer.py parses the flags and calls `Trainer`.
"""

import os
import time

import tensorflow as tf
from absl import logging

from tf_gpipe import fprop_context, hyperparams
from tf_gpipe.gpipe import PipelinedLayer, partition
from tf_gpipe.nested_map import NestedMap


def ModelParams(task_p, train_input_p, test_input_p):
    """One Params tree: task / train (input) / test (input); overrides address it."""
    root = hyperparams.Params()
    root.Define('task', task_p, 'The task: network, loss, learner, pipeline, loop settings.')
    root.Define('train', train_input_p, 'Training input.')
    root.Define('test', test_input_p, 'Evaluation input.')
    return root


class Trainer:
    """Builds a model from params and trains, evaluates or inspects it under `logdir`."""

    def __init__(self, model_params, logdir):
        self.params = model_params.Copy().Freeze()
        self.logdir = logdir
        self._built = False

    # ---- building ----------------------------------------------------------------------------

    def Build(self):
        """Builds task, inputs, learner and checkpointing (inside a `cluster.use_mesh` to place
        the pipeline on that mesh); idempotent."""
        if self._built:
            return
        _check_logdir(self.logdir)
        p = self.params
        self.task = p.task.Instantiate()
        self.train_input = p.train.Instantiate()
        self.test_input = p.test.Instantiate()
        self.learner = p.task.learner.Instantiate()
        self.variables = list(self.task.trainable_variables)
        self.learner.Build(self.variables)
        self.regularized = self.task.RegularizedVariables()
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
        # An input whose position is state (a tf.data iterator) is checkpointed with the model.
        items = getattr(self.train_input, 'CheckpointItems', dict)()
        self.checkpoint = tf.train.Checkpoint(
            task=self.task, optimizer=self.learner.optimizer, global_step=self.global_step, **items
        )
        self.manager = tf.train.CheckpointManager(
            self.checkpoint,
            os.path.join(self.logdir, 'checkpoints'),
            max_to_keep=p.task.train.max_checkpoints_to_keep,
        )
        self._train_step = tf.function(self._TrainStep)
        self._eval_step = tf.function(self._EvalStep)
        self._built = True

    def _TrainStep(self):
        step = self.global_step.read_value()
        batch = self.train_input.GetBatch(step)
        with fprop_context.scope(step=step, training=True), tf.GradientTape() as tape:
            out = self.task.FPropTower(batch)
        grads = tape.gradient(out.loss, self.variables)
        stats = self.learner.Apply(grads, self.variables, self.regularized)
        self.task.PostTrainingStepUpdate()
        self.global_step.assign_add(1)
        return NestedMap(metrics=out.metrics, num_examples=out.num_examples, **stats)

    def _EvalStep(self, index):
        batch = self.test_input.GetBatch(index)
        with fprop_context.eval_mode():
            return self.task.FPropTower(batch).metrics

    def Restore(self):
        """Restores the latest checkpoint in logdir, if any; returns its path or None."""
        self.Build()
        path = self.manager.latest_checkpoint
        if path:
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
            except (tf.errors.OpError, AssertionError, ValueError) as e:
                raise RuntimeError(
                    f'Cannot restore {path}: {e}. Is it a checkpoint of another model? Use '
                    'another --logdir, or move its checkpoints/ away.'
                ) from e
            logging.info('Restored %s (step %d).', path, int(self.global_step))
        return path

    # ---- modes -------------------------------------------------------------------------------

    def Train(self, eval_too=False):
        """Trains up to task.train.max_steps; returns the last metrics (floats)."""
        self.Restore()
        tp = self.params.task.train
        writer = tf.summary.create_file_writer(os.path.join(self.logdir, 'train'))
        step = int(self.global_step)
        last, start, start_step, first = {}, time.time(), step, step + 1
        logging.info('Training from step %d to %d.', step, tp.max_steps)
        while step < tp.max_steps:
            out = self._train_step()
            step = int(self.global_step)
            if step % tp.log_interval_steps == 0 or step in (first, tp.max_steps):
                elapsed = max(time.time() - start, 1e-9)
                steps_per_sec = (step - start_step) / elapsed
                examples_per_sec = steps_per_sec * int(out.num_examples)
                last = {k: float(v) for k, v in out.metrics.items()}
                last.update(
                    grad_norm=float(out.grad_norm),
                    learning_rate=float(out.learning_rate),
                    steps_per_sec=steps_per_sec,
                    examples_per_sec=examples_per_sec,
                )
                with writer.as_default(step=step):
                    for name, value in last.items():
                        tf.summary.scalar(name, value)
                logging.info(
                    'step %6d  loss %.4f  %s  %.2f steps/s  %.0f examples/s',
                    step,
                    last['loss'],
                    '  '.join(
                        f'{k} {v:.4f}' for k, v in sorted(out.metrics.items()) if k != 'loss'
                    ),
                    steps_per_sec,
                    examples_per_sec,
                )
                start, start_step = time.time(), step
            if step % tp.save_interval_steps == 0:
                self.manager.save(checkpoint_number=step)
            if eval_too and step % tp.eval_interval_steps == 0:
                self.Evaluate()
        if self.manager.latest_checkpoint is None or not self.manager.latest_checkpoint.endswith(
            f'-{step}'
        ):
            self.manager.save(checkpoint_number=step)
        writer.flush()
        return last

    def Evaluate(self):
        """Metrics averaged over task.train.eval_steps test batches; written to logdir/eval."""
        self.Build()
        if int(self.global_step) == 0 and self.Restore() is None:
            raise RuntimeError(
                f'No checkpoint in {self.logdir}/checkpoints to evaluate; train first.'
            )
        totals = {}
        n = self.params.task.train.eval_steps
        for i in range(n):
            for k, v in self._eval_step(tf.constant(i, tf.int64)).items():
                totals[k] = totals.get(k, 0.0) + float(v) / n
        writer = tf.summary.create_file_writer(os.path.join(self.logdir, 'eval'))
        with writer.as_default(step=int(self.global_step)):
            for k, v in totals.items():
                tf.summary.scalar(k, v)
        writer.flush()
        logging.info(
            'eval at step %d: %s',
            int(self.global_step),
            '  '.join(f'{k} {v:.4f}' for k, v in sorted(totals.items())),
        )
        return totals


def InspectModel(task_p, input_p=None):
    """The partition table, parameter count and a memory estimate per cell — nothing built.

    With the training input's params, activations are estimated for its real batch shape.
    """
    network_p = task_p.cls.NetworkParams(task_p).Copy()
    if input_p is not None and task_p.cls.InputShape(task_p, input_p) is not None:
        network_p.input_shape = task_p.cls.InputShape(task_p, input_p)
    cells, splits, sub = PipelinedLayer._CellParams(network_p)
    if sub is None:
        sub, splits = [c for c in cells], list(range(1, len(cells) + 1))
    metas = partition.layer_metas(sub, network_p.input_shape)
    rows = [('cell', 'layers', 'params', 'param+opt MB', 'act MB/micro-batch')]
    total = 0
    m = network_p.num_micro_batches
    for k, (a, b) in enumerate(partition.blocks(splits)):
        params = sum(meta.param_count for meta in metas[a:b])
        total += params
        # Weights, gradient accumulator and two optimizer slots (Adam), float32.
        param_mb = params * 4 * 4 / 2**20
        act_mb = sum(meta.activation_bytes for meta in metas[a:b]) / max(m, 1) / 2**20
        rows.append(
            (
                str(k),
                partition.block_label(sub, a, b),
                f'{params:,}',
                f'{param_mb:.1f}',
                f'{act_mb:.2f}',
            )
        )
    lines = [partition.format_table(rows)]
    shape = network_p.input_shape
    shape = {k: tuple(v) for k, v in shape.items()} if isinstance(shape, dict) else tuple(shape)
    lines.append(f'total parameters: {total:,}  (activation estimate for input shape {shape})')
    return '\n'.join(lines), total


def _check_logdir(logdir):
    try:
        os.makedirs(logdir, exist_ok=True)
        probe = os.path.join(logdir, '.write_test')
        with open(probe, 'w') as f:
            f.write('ok')
        os.remove(probe)
    except OSError as e:
        raise RuntimeError(
            f'Cannot write to logdir {logdir!r}: {e.strerror}. Pass a --logdir you can write to.'
        ) from e
