"""Which of a pipeline's calls run as loops over ticks, and the log line when one cannot.

A call runs as a loop when its params ask for it (`tick_loop` for training, `eval_loop` for
eval) and the loop can run it; otherwise it runs unrolled (one call per action, its program
growing with M) and the log says why, once per reason.
"""

from absl import logging

from tf_gpipe.gpipe import backward_loop, forward_loop, tick_loop


class LoopChoice:
    """Builds the loop for a call of the pipeline with `params`, or says why not."""

    def __init__(self, params):
        self.params = params
        self._reasons = set()  # (param, reason) already logged

    def Ticks(self, run, micro, targets, return_outputs):
        """Runs executor `run`'s schedule as a tick loop (ComputeGradients) when it can: its
        losses, outputs and sums set as the executor would; False when it runs unrolled."""
        p = self.params
        if not p.tick_loop:
            return False
        targets = None if targets is None or targets[0] is None else targets
        why = tick_loop.unsupported(run.sched, p.recompute, micro, targets)
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
        run.losses, run.outputs = loop.losses, loop.outputs
        return True

    def Eval(self, runners, sched, micro, step, seed_base):
        """One replica's eval as a forward loop, merged; None when it runs unrolled."""
        p = self.params
        if not p.eval_loop or len(micro) == 1:
            return None  # one micro-batch: one call per cell either way
        why = forward_loop.unsupported(micro)
        if why is None:
            loop = forward_loop.ForwardLoop(runners, sched.device_of, step, seed_base, p.batch_dim)
            try:
                loop.Trace(micro)
                return loop.Run(micro)
            except forward_loop.UnsupportedError as e:
                why = str(e)
        self._Unrolled('eval_loop', why)
        return None

    def FillDrain(self, runners, sched, micro, step, seed_base):
        """One replica's training FProp as a forward and a backward loop, its forward run
        (`outputs` set); None when it runs unrolled."""
        p = self.params
        if not p.tick_loop or len(micro) == 1:
            return None
        why = forward_loop.unsupported(micro)
        if why is None and p.recompute == 'never':
            why = "recompute='never' (the loops keep each cell's input only, as 'always')"
        if why is None:
            loops = backward_loop.FillDrain(runners, sched.device_of, step, seed_base, p.batch_dim)
            try:
                loops.Forward(micro)
                return loops
            except forward_loop.UnsupportedError as e:
                why = str(e)
        self._Unrolled('tick_loop', why)
        return None

    def _Unrolled(self, param, why):
        if (param, why) not in self._reasons:
            self._reasons.add((param, why))
            logging.warning(
                '%s: %s=True, but this call runs unrolled (its program grows with M): %s.',
                self.params.name,
                param,
                why,
            )
