"""Which of a pipeline's calls run as loops over ticks, and the log line when one cannot.

A call runs as a loop when its params let it (`tick_loop` for training, `eval_loop` for
eval: None, the default, or True) and the loop can run it; None asks for at least
AUTO_MIN_MICRO_BATCHES micro-batches in training, two in eval. Otherwise it runs unrolled (one
call per action, its program growing with M) and the log says why, once per reason: at INFO
where the default expects it (across TF tasks, eager), else a warning.

Across processes (cells on more than one TF task) every tick of a loop crosses between them, and
its steady step is much slower than the unrolled one's (docs/results.md, measured on single-core
workers): by default (None) a call then runs unrolled; a loop asked for explicitly
(`tick_loop=True`, `eval_loop=True`) still runs and the log says what it costs.
"""

import tensorflow as tf
from absl import logging

from tf_gpipe.gpipe import backward_loop, forward_loop, tick_loop

ACROSS_TASKS = 'its cells are on more than one TF task (each tick would cross processes)'
EAGER = tick_loop.EAGER
# tick_loop=None runs a training step's loops from this many micro-batches on. Below it the
# unrolled step is small (at most this many calls per cell) and starts about as fast as the
# loop, while the loop's per-tick work slows every steady step (docs/engine.md, "Start-up:
# the tick loop"; measured at K=4, L=16, M=4: docs/results/startup_default_m4.json).
AUTO_MIN_MICRO_BATCHES = 8


def spans_tasks(devices):
    """True when `devices` (names, None for unplaced) belong to more than one TF task."""
    tasks = set()
    for name in devices:
        if not name:
            continue
        spec = tf.DeviceSpec.from_string(name)
        # A name without a job is this process's (job:localhost, task 0).
        tasks.add((spec.job or 'localhost', spec.replica or 0, spec.task or 0))
    return len(tasks) > 1


class LoopChoice:
    """Builds the loop for a call of the pipeline with `params`, or says why not."""

    def __init__(self, params):
        self.params = params
        self._reasons = set()  # (param, reason) already logged

    def Ticks(self, run, micro, targets, return_outputs):
        """Runs executor `run`'s schedule as a tick loop (ComputeGradients) when it can: its
        losses, outputs and sums set as the executor would; False when it runs unrolled."""
        p = self.params
        if p.tick_loop is False or _too_few_for_auto(p.tick_loop, micro):
            return False
        targets = None if targets is None or targets[0] is None else targets
        why = tick_loop.unsupported(run.sched, p.recompute, micro, targets)
        why = why or _across_tasks_for_auto(p.tick_loop, run.runners)
        if why is None:
            loop = tick_loop.TickLoop(
                run.runners, run.sched, p.recompute, run.step, run.seed_base, run.sums
            )
            try:
                loop.Run(micro, targets, want_outputs=return_outputs)
            except tick_loop.UnsupportedError as e:
                why = str(e)
        if why is not None:
            self._Unrolled('tick_loop', why)
            return False
        self._AcrossTasks('tick_loop', run.runners)
        run.losses, run.outputs = loop.losses, loop.outputs
        return True

    def Eval(self, runners, sched, micro, step, seed_base):
        """One replica's eval as a forward loop, merged; None when it runs unrolled."""
        p = self.params
        if p.eval_loop is False or len(micro) == 1:
            return None  # one micro-batch: one call per cell either way
        why = forward_loop.unsupported(micro) or _across_tasks_for_auto(p.eval_loop, runners)
        if why is None:
            loop = forward_loop.ForwardLoop(runners, sched.device_of, step, seed_base, p.batch_dim)
            try:
                loop.Trace(micro)
                merged = loop.Run(micro)
                self._AcrossTasks('eval_loop', runners)
                return merged
            except forward_loop.UnsupportedError as e:
                why = str(e)
        self._Unrolled('eval_loop', why)
        return None

    def FillDrain(self, runners, sched, micro, step, seed_base):
        """One replica's training FProp as a forward and a backward loop, its forward run
        (`outputs` set); None when it runs unrolled."""
        p = self.params
        if p.tick_loop is False or len(micro) == 1 or _too_few_for_auto(p.tick_loop, micro):
            return None
        why = forward_loop.unsupported(micro)
        if why is None and p.recompute == 'never':
            why = "recompute='never' (the loops keep each cell's input only, as 'always')"
        why = why or _across_tasks_for_auto(p.tick_loop, runners)
        if why is None:
            loops = backward_loop.FillDrain(runners, sched.device_of, step, seed_base, p.batch_dim)
            try:
                loops.Forward(micro)
                self._AcrossTasks('tick_loop', runners)
                return loops
            except forward_loop.UnsupportedError as e:
                why = str(e)
        self._Unrolled('tick_loop', why)
        return None

    def _AcrossTasks(self, param, runners):
        """A loop that runs across processes, asked for: slower there, said once per param."""
        key = (param, ACROSS_TASKS)
        if key not in self._reasons and spans_tasks([r.device for r in runners]):
            self._reasons.add(key)
            logging.warning(
                "%s: %s=True, and %s: its steady step is slower than the unrolled one's there "
                '(docs/results.md, "Across processes"); %s=%s unless start-up is the wall.',
                self.params.name,
                param,
                ACROSS_TASKS,
                param,
                'None' if param == 'eval_loop' else 'False',
            )

    def _Unrolled(self, param, why):
        """Logs once per reason that a call runs unrolled: a warning, but at INFO where the
        default (None) expects it (across TF tasks; eager, which builds no program)."""
        if (param, why) not in self._reasons:
            self._reasons.add((param, why))
            expected = getattr(self.params, param) is None and why in (ACROSS_TASKS, EAGER)
            (logging.info if expected else logging.warning)(
                '%s: %s=%s, but this call runs unrolled (its program grows with M): %s.',
                self.params.name,
                param,
                _value(getattr(self.params, param)),
                why,
            )


def _too_few_for_auto(value, micro):
    """Whether the default (None) leaves a training step of these micro-batches unrolled."""
    return value is None and len(micro) < AUTO_MIN_MICRO_BATCHES


def _across_tasks_for_auto(value, runners):
    """ACROSS_TASKS when the default (None) declines a loop over these cells, else None."""
    if value is None and spans_tasks([r.device for r in runners]):
        return ACROSS_TASKS
    return None


def _value(v):
    return 'None (auto)' if v is None else v
