"""The training / evaluation loop: checkpoints, TensorBoard summaries, progress logs.

Library code: tools/trainer.py parses the flags and calls `Trainer`.
"""

import collections
import os
import signal
import time

import tensorflow as tf
from absl import logging

from tf_gpipe import fprop_context, hyperparams
from tf_gpipe.gpipe import replication
from tf_gpipe.nested_map import NestedMap
from tf_gpipe.runtime import distribute, placement
from tf_gpipe.trainer import checkpoints, checks, logdir_lock, pipeline_summaries, stop_signals
from tf_gpipe.trainer.inspect_model import InspectModel, OptimizerSlots  # noqa: F401 (public here too)

NONFINITE_POLICIES = ('stop', 'skip')


def ModelParams(task_p, train_input_p, test_input_p, dev_input_p=None):
    """One Params tree as in Lingvo: task (with task.train, the loop and learner, and
    task.eval) / input (the training input) / test (the evaluation input); overrides address
    it. The earlier root name `train` (the input) is accepted with a deprecation warning, and
    `train.<loop setting>` means task.train.<loop setting>."""
    root = hyperparams.Params()
    root.Define('task', task_p, 'The task: network, loss, pipeline, train (loop, learner), eval.')
    root.Define('input', train_input_p, 'Training input.')
    root.Define('test', test_input_p, 'Evaluation input.')
    root.Define('dev', dev_input_p, 'Development-set input (evaler_dev); None: none.')
    root.DefineAlias('train', 'input')
    if 'train' in task_p:
        for name, _ in task_p.train.IterParams():
            if name not in train_input_p:
                root.DefineAlias(f'train.{name}', f'task.train.{name}')
    return root


class Trainer:
    """Builds a model from params and trains, evaluates or inspects it under `logdir`."""

    def __init__(self, model_params, logdir, restore_from=None):
        """`restore_from`: another run directory to resume from (a multi-worker run's chief,
        so that every worker restores the same step); default `logdir`."""
        self.params = model_params.Copy().Freeze()
        self.logdir = logdir
        self.restore_from = restore_from or logdir
        self._built = False

    # ---- building ----------------------------------------------------------------------------

    def Build(self):
        """Builds task, inputs, learner and checkpointing (inside a `cluster.use_mesh` to place
        the pipeline on that mesh); idempotent."""
        if self._built:
            return
        checks.CheckParams(
            self.params.task,
            {'input': self.params.input, 'test': self.params.test, 'dev': self.params.dev},
        )
        _check_logdir(self.logdir)
        p = self.params
        self.task = p.task.Instantiate()
        self.train_input = p.input.Instantiate()
        self.test_input = p.test.Instantiate()
        self.dev_input = p.dev.Instantiate() if p.Get('dev') is not None else None
        self.learner = p.task.train.learner.Instantiate()
        self.variables = list(self.task.trainable_variables)
        self.learner.Build(self.variables)
        self.regularized = self.task.RegularizedVariables()
        if p.task.train.nonfinite_policy not in NONFINITE_POLICIES:
            raise ValueError(
                f'task.train.nonfinite_policy must be one of {NONFINITE_POLICIES}, got '
                f'{p.task.train.nonfinite_policy!r}.'
            )
        self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
        self.nonfinite_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name='nonfinite')
        # Everything a resumed run needs to continue exactly: weights and batch-norm averages
        # (task), optimizer slots and iterations, the step (which also keys the synthetic
        # inputs and every dropout mask), and an input whose position is state (a tf.data
        # iterator).
        # Variables are saved by layer path (checkpoints.py), so a checkpoint restores into
        # another K, M, schedule or number of replicas.
        items = getattr(self.train_input, 'CheckpointItems', dict)()
        self.named_checkpoint = checkpoints.NamedCheckpoint(
            self.task,
            self.learner.optimizer,
            p.task.train.learner.optimizer,
            self.variables,
            num_replicas=p.task.pipeline.num_replicas if 'pipeline' in p.task else 1,
            global_step=self.global_step,
            nonfinite_steps=self.nonfinite_steps,
            **items,
        )
        self.checkpoint = self.named_checkpoint.checkpoint
        self.manager = tf.train.CheckpointManager(
            self.checkpoint,
            os.path.join(self.logdir, 'checkpoints'),
            max_to_keep=p.task.train.max_checkpoints_to_keep,
        )
        self._restore_manager = self.manager
        if os.path.abspath(self.restore_from) != os.path.abspath(self.logdir):
            self._restore_manager = tf.train.CheckpointManager(
                self.checkpoint, os.path.join(self.restore_from, 'checkpoints'), max_to_keep=None
            )
        # Built inside mesh.strategy().scope(): data parallelism by that strategy.
        self.strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        if self.strategy is not None:
            counts = collections.Counter(
                c.device
                for v in self.variables
                for c in self.strategy.experimental_local_results(v)
            )
            logging.info(
                '%s, %d replicas; trainable variable copies in this process: %s',
                _strategy_name(self.strategy),
                self.strategy.num_replicas_in_sync,
                ', '.join(f'{n} on {d}' for d, n in sorted(counts.items())),
            )
        train_step = self._TrainStep if self.strategy is None else self._DistributedTrainStep
        # The step is plain TF code (tf.cond where it branches): AutoGraph would only rewrite
        # every function it reaches, half the first step's time for the tiny models (measured).
        self._train_step = tf.function(train_step, autograph=False)
        # The same step with its pipeline actions timestamped (pipeline_summaries), when asked.
        traced_step, self._trace_meta = pipeline_summaries.traced(train_step)
        self._traced_step = tf.function(traced_step, autograph=False)
        self._eval_steps = {}  # dataset -> its eval step (a tf.function each)
        self._built = True

    def _TrainStep(self):
        step = self.global_step.read_value()
        with tf.name_scope('input'):  # made on the host (the client of a TF cluster)
            batch = self.train_input.GetBatch(step)
        out, grads = self._Gradients(batch, step)
        # A diverged step (NaN/Inf loss or gradient) is not applied; Train decides what next.
        stats = self.learner.Apply(grads, self.variables, self.regularized, loss=out.loss)
        self._EndStep(stats.finite)
        return NestedMap(
            metrics=out.metrics,
            num_examples=out.num_examples,
            loss=out.loss,
            param_norm=placement.global_norm(self.variables),
            **stats,
        )

    def _Gradients(self, batch, step):
        """(task output, gradients lined up with self.variables) of the pipeline's step."""
        # Every schedule: each micro-batch's loss on the last stage, the backward pass started
        # there as the schedule says; gradients summed on each variable's device.
        with fprop_context.scope(step=step, training=True):
            out, network_grads = self.task.ComputeGradients(batch)
        by_ref = {v.ref(): g for v, g in zip(self.task.network.trainable_variables, network_grads)}
        return out, [by_ref.get(v.ref()) for v in self.variables]

    def _EndStep(self, finite):
        """Once per step, after the update: batch-norm averages (pooled over replicas in
        cross-replica context), the non-finite count, the step."""
        self.task.PostTrainingStepUpdate()
        self.nonfinite_steps.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
        self.global_step.assign_add(1)

    def _DistributedTrainStep(self):
        """_TrainStep with the strategy's R replicas: each runs its pipeline on its rows of the
        batch inside strategy.run; the strategy's collective sums their gradients (before L2
        and clipping); the update runs in a second strategy.run, skipped as a whole when the
        global loss or gradient norm is not finite (a synchronisation point may not sit inside
        a tf.cond within strategy.run)."""
        strategy, pipe = self.strategy, self.params.task.pipeline
        step = self.global_step.read_value()
        with tf.name_scope('input'):
            batch = self.train_input.GetBatch(step)
        pieces = replication.split_for_replicas(
            batch, strategy.num_replicas_in_sync, pipe.num_micro_batches
        )
        local = strategy.experimental_distribute_values_from_function(
            lambda ctx: pieces[ctx.replica_id_in_sync_group]
        )

        def replica_step(local_batch):
            out, grads = self._Gradients(local_batch, step)
            grads, stats = self.learner.Prepare(grads, self.variables, self.regularized)
            loss = distribute.all_reduce_sum(out.loss)  # the shares make the global mean
            stats.finite = tf.math.is_finite(loss) & tf.math.is_finite(stats.grad_norm)
            # Metrics: the replicas' means weighted by their examples.
            n = tf.cast(out.num_examples, tf.float32)
            total = distribute.all_reduce_sum(n)
            metrics = out.metrics.Transform(
                lambda m: distribute.all_reduce_sum(tf.cast(m, tf.float32) * n) / total
            )
            return grads, NestedMap(metrics=metrics, loss=loss, num_examples=total, **stats)

        grads, out = strategy.run(replica_step, (local,))
        out = tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], out)

        def apply():
            strategy.run(lambda g: self.learner.Update(g, self.variables), (grads,))
            return tf.constant(True)

        tf.cond(out.finite, apply, lambda: tf.constant(False))
        self._EndStep(out.finite)
        out.num_examples = tf.cast(out.num_examples, tf.int64)
        out.param_norm = placement.global_norm(self.variables)
        return out

    def _EvalStep(self, dataset='test'):
        """The eval step (a tf.function of the batch index) on `dataset`: 'test' or 'dev'."""
        if dataset not in self._eval_steps:
            source = self.test_input if dataset == 'test' else self.dev_input
            if source is None:
                raise ValueError(
                    f'{self.params.task.name}: the model has no {dataset} input (its params '
                    f'class defines no {dataset.capitalize()}()); evaluate on test instead.'
                )

            def step(index):
                batch = source.GetBatch(index)
                with fprop_context.eval_mode():
                    return self.task.FPropTower(batch).metrics

            self._eval_steps[dataset] = tf.function(step, autograph=False)
        return self._eval_steps[dataset]

    def Restore(self):
        """Restores the newest readable checkpoint in logdir, if any; returns its path or None.

        A checkpoint that cannot be read (a truncated or corrupt file) is reported and the next
        older one is tried; one of another model or optimizer is an error in one line. Without
        a checkpoint, task.train.init_from_checkpoint_rules warm-start the model.
        """
        self.Build()
        paths = list(reversed(self._restore_manager.checkpoints))
        for i, path in enumerate(paths):
            try:
                self.RestoreCheckpoint(path)
            except (tf.errors.OpError, OSError, IndexError, EOFError) as e:
                older = paths[i + 1] if i + 1 < len(paths) else None
                logging.warning(
                    'Checkpoint %s is unreadable (%s: %s); %s',
                    path,
                    type(e).__name__,
                    str(e).splitlines()[0][:200],
                    f'trying the older {older}.' if older else 'no older checkpoint is left.',
                )
                continue
            logging.info('Restored %s (step %d).', path, int(self.global_step.numpy()))
            return path
        if paths:
            raise RuntimeError(
                f'No checkpoint in {self._restore_manager.directory} can be read ({len(paths)} tried). '
                'Move the directory away to start afresh.'
            )
        rules = self.params.task.train.init_from_checkpoint_rules
        if rules and int(self.global_step.numpy()) == 0:
            loaded = checkpoints.WarmStart(self.named_checkpoint.named, rules)
            self.named_checkpoint.SyncReplicas()
            logging.info(
                'Warm start: %d of %d variables loaded from %s.',
                len(loaded),
                len(self.named_checkpoint.named),
                ', '.join(rules),
            )
        return None

    # ---- modes -------------------------------------------------------------------------------

    def Train(self, eval_too=False):
        """Trains up to task.train.max_steps; returns the last metrics (floats).

        SIGTERM or SIGINT end the run after the current step with a checkpoint (the run can be
        resumed with the same command). The logdir is locked meanwhile: a second trainer on it
        stops at once with the holder's pid and command (logdir_lock.py).
        """
        self.Build()
        with logdir_lock.LogdirLock(self.logdir):
            return self._Train(eval_too)

    def _Train(self, eval_too):
        self.Restore()
        tp = self.params.task.train
        writer = tf.summary.create_file_writer(os.path.join(self.logdir, 'train'))
        step = int(self.global_step.numpy())
        last, start, start_step, first = {}, time.time(), step, step + 1
        logging.info('Training from step %d to %d.', step, tp.max_steps)
        if step < tp.max_steps and not self._train_step.experimental_get_tracing_count():
            logging.info('Tracing the training step (all cells and micro-batches) ...')
            traced = time.time()
            graph = self._train_step.get_concrete_function().graph.as_graph_def()
            logging.info(
                'Traced the training step in %.1f s: %d ops in the step, %d in its %d functions.',
                time.time() - traced,
                len(graph.node),
                sum(len(f.node_def) for f in graph.library.function),
                len(graph.library.function),
            )
        traced_at = None  # when the first step ended: the ETA leaves the tracing out
        paused = 0.0  # seconds in checkpoints and evals since the last log: not steps' time
        with stop_signals.StopSignals() as stop:
            while step < tp.max_steps and not stop.signal:
                profile = None
                if self._TimesThisStep(step + 1):
                    out, stamps = self._traced_step()
                    profile = pipeline_summaries.step_profile(
                        self._trace_meta,
                        [s.numpy() for s in stamps],
                        len(self.task.network.devices),
                    )
                else:
                    out = self._train_step()
                step = int(self.global_step.numpy())
                if profile:
                    pipeline_summaries.write_scalars(writer, step, profile, 'pipeline/')
                if traced_at is None:
                    traced_at = time.time()
                    self.first_step_seconds = traced_at - start
                    logging.info('First step done in %.1f s (tracing included).', traced_at - start)
                if not bool(out.finite):
                    self._NonFinite(step, out)
                if step % tp.log_interval_steps == 0 or step in (first, tp.max_steps):
                    elapsed = max(time.time() - start - paused, 1e-9)
                    steps_per_sec = (step - start_step) / elapsed
                    examples_per_sec = steps_per_sec * int(out.num_examples)
                    last = {k: float(v) for k, v in out.metrics.items()}
                    last.update(
                        grad_norm=float(out.grad_norm),
                        param_norm=float(out.param_norm),
                        learning_rate=float(out.learning_rate),
                        steps_per_sec=steps_per_sec,
                        examples_per_sec=examples_per_sec,
                        nonfinite_steps=float(self.nonfinite_steps.numpy()),
                    )
                    pipeline_summaries.write_scalars(writer, step, last)
                    memory = pipeline_summaries.peak_memory(self.task.network.devices)
                    pipeline_summaries.write_scalars(writer, step, memory, 'memory/')
                    logging.info(
                        'step %6d  loss %.4f  %s  %.2f steps/s  %.0f examples/s  %s',
                        step,
                        last['loss'],
                        '  '.join(
                            f'{k} {v:.4f}' for k, v in sorted(out.metrics.items()) if k != 'loss'
                        ),
                        steps_per_sec,
                        examples_per_sec,
                        _progress(step, first, tp.max_steps, time.time() - traced_at),
                    )
                    start, start_step, paused = time.time(), step, 0.0
                pause = time.time()
                if step % tp.save_interval_steps == 0:
                    self.manager.save(checkpoint_number=step)
                if (
                    eval_too
                    and step % self.params.task.eval.interval_steps == 0
                    and not stop.signal
                ):
                    self.Evaluate()
                paused += time.time() - pause
            latest = self.manager.latest_checkpoint
            if latest is None or not latest.endswith(f'-{step}'):
                self.manager.save(checkpoint_number=step)
            if stop.signal:
                logging.info(
                    'Received %s at step %d: saved %s; exiting. Run the same command to resume.',
                    signal.Signals(stop.signal).name,
                    step,
                    self.manager.latest_checkpoint,
                )
        writer.flush()
        return last

    def _TimesThisStep(self, step):
        """Whether step `step` runs timestamped (task.train.trace_interval_steps; one replica)."""
        every = self.params.task.train.trace_interval_steps
        return bool(every) and step % every == 0 and self.strategy is None

    def _NonFinite(self, step, out):
        """A step whose loss or gradient was NaN/Inf (and so changed nothing)."""
        if self.params.task.train.nonfinite_policy == 'skip':
            logging.warning(
                'Step %d: loss %s, gradient norm %s; the step was skipped (%d so far).',
                step,
                float(out.loss),
                float(out.grad_norm),
                int(self.nonfinite_steps.numpy()),
            )
            return
        raise FloatingPointError(
            f'Training diverged at step {step}: loss {float(out.loss)}, gradient norm '
            f'{float(out.grad_norm)}. Nothing of that step was applied or saved; the last '
            f'checkpoint ({self.manager.latest_checkpoint}) is the last good state. Lower the '
            'learning rate, clip gradients (task.train.learner.clip_gradient_norm), or set '
            'task.train.nonfinite_policy=skip to skip such steps.'
        )

    def Evaluate(self):
        """Metrics averaged over task.eval.steps test batches; written to logdir/eval."""
        self.Build()
        if int(self.global_step.numpy()) == 0 and self.Restore() is None:
            raise RuntimeError(
                f'No checkpoint in {self.logdir}/checkpoints to evaluate; train first.'
            )
        if getattr(self, '_eval_writer', None) is None:  # one event file per run, not per eval
            self._eval_writer = tf.summary.create_file_writer(os.path.join(self.logdir, 'eval'))
        return self._EvaluateRestored(self._eval_writer)

    def CheckpointDir(self):
        """Where this run's checkpoints are read from."""
        return os.path.join(self.restore_from, 'checkpoints')

    def RestoreCheckpoint(self, path):
        """Restores the checkpoint at `path`; one of another model is a one-line error."""
        self.Build()
        try:
            self.named_checkpoint.Restore(path)
        except AssertionError as e:
            raise RuntimeError(
                f'Cannot restore {path}: it does not match this model '
                f'({str(e).splitlines()[0][:300]}).'
            ) from e

    def EvaluateCheckpoint(self, path, writer, dataset='test'):
        """Restores the checkpoint at `path` (read only) and evaluates it on `dataset` ('test'
        or 'dev') into `writer`."""
        self.Build()
        self._EvalStep(dataset)  # no such input: said before restoring
        self.RestoreCheckpoint(path)
        return self._EvaluateRestored(writer, dataset)

    def _EvaluateRestored(self, writer, dataset='test'):
        totals = {}
        n = self.params.task.eval.steps
        step_fn = self._EvalStep(dataset)
        for i in range(n):
            for k, v in step_fn(tf.constant(i, tf.int64)).items():
                totals[k] = totals.get(k, 0.0) + float(v) / n
        pipeline_summaries.write_scalars(writer, int(self.global_step.numpy()), totals)
        logging.info(
            'eval (%s) at step %d: %s',
            dataset,
            int(self.global_step.numpy()),
            '  '.join(f'{k} {v:.4f}' for k, v in sorted(totals.items())),
        )
        return totals


def _progress(step, first, max_steps, seconds_since_first):
    """'37%  ETA 1m12s' from the pace since the first step (which includes the tracing)."""
    done = f'{100 * step / max(max_steps, 1):.0f}%'
    if step <= first or seconds_since_first <= 0:
        return done
    left = (max_steps - step) * seconds_since_first / (step - first)
    minutes, seconds = divmod(int(round(left)), 60)
    return f'{done}  ETA {minutes}m{seconds:02d}s' if minutes else f'{done}  ETA {seconds}s'


def _strategy_name(strategy):
    """The public name of a tf.distribute strategy (MultiWorkerMirroredStrategy's class is
    called CollectiveAllReduceStrategy)."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 'MultiWorkerMirroredStrategy'
    return type(strategy).__name__


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
