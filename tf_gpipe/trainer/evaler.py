"""A continuous evaler, as Lingvo's evaler_test job: every new checkpoint evaluated once.

It runs beside the trainer (another process, other devices), polls the logdir's checkpoints,
evaluates each one it has not evaluated yet — oldest first; one the trainer deleted meanwhile
(max_to_keep) is skipped — and stops after the trainer's final step. Its summaries go to their
own TensorBoard run (`<logdir>/eval_test`, one event file per run of the job); the last step it
evaluated is kept there too (`evaler_state.json`), so a restarted evaler goes on where it
stopped. Waiting is bounded: no new checkpoint within `timeout_seconds` ends it with a message.
"""

import json
import os
import time

import tensorflow as tf
from absl import logging

STATE_FILE = 'evaler_state.json'


def job_dir(logdir, job='eval_test'):
    return os.path.join(logdir, job)


def evaluated_step(logdir, job='eval_test'):
    """The last step this job evaluated (0 if none)."""
    path = os.path.join(job_dir(logdir, job), STATE_FILE)
    if not os.path.exists(path):
        return 0
    with open(path, encoding='utf-8') as f:
        return int(json.load(f)['step'])


def _remember(logdir, job, step):
    path = os.path.join(job_dir(logdir, job), STATE_FILE)
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
        json.dump({'step': step}, f)
    os.replace(path + '.tmp', path)


def _checkpoints(directory):
    """(step, path) of the checkpoints the manager's index lists, oldest first."""
    state = tf.train.get_checkpoint_state(directory)
    if state is None:
        return []
    out = []
    for path in state.all_model_checkpoint_paths:
        if not os.path.isabs(path):
            path = os.path.join(directory, path)
        try:
            out.append((int(path.rsplit('-', 1)[1]), path))
        except (IndexError, ValueError):
            continue
    return sorted(out)


def run(
    trainer, poll_seconds=5.0, timeout_seconds=3600.0, job='eval_test', evaluate=None,
    sleep=time.sleep,
):  # fmt: skip
    """Evaluates every new checkpoint of `trainer.logdir` once, until the final step's.

    `evaluate(path, writer)` (default: the trainer's metrics on the test set) returns a
    checkpoint's values; `job` names the TensorBoard run and state directory (the decoder job
    passes its decoding and 'decoder_test'). Returns {step: values}. Raises TimeoutError when
    no new checkpoint comes within `timeout_seconds` (the trainer stopped, or is elsewhere).
    """
    trainer.Build()
    evaluate = evaluate or trainer.EvaluateCheckpoint
    final = trainer.params.task.train.max_steps
    directory = trainer.CheckpointDir()
    os.makedirs(job_dir(trainer.logdir, job), exist_ok=True)
    writer = tf.summary.create_file_writer(job_dir(trainer.logdir, job))
    done = evaluated_step(trainer.logdir, job)
    results, waited_since = {}, time.time()
    logging.info('%s: checkpoints in %s after step %d, until step %d.', job, directory, done, final)
    while done < final:
        fresh = [(s, p) for s, p in _checkpoints(directory) if s > done]
        if not fresh:
            if time.time() - waited_since > timeout_seconds:
                raise TimeoutError(
                    f'{job}: no checkpoint after step {done} in {directory} for '
                    f'{timeout_seconds:.0f} s (the trainer runs to step {final}). Is the trainer '
                    f'running on this logdir? Rerun this job to go on from step {done}.'
                )
            sleep(poll_seconds)
            continue
        for step, path in fresh:
            try:
                values = evaluate(path, writer)
            except (tf.errors.NotFoundError, tf.errors.DataLossError, OSError) as e:
                # Deleted (max_to_keep) or still being written: the next poll sees newer ones.
                logging.warning('Skipped %s: %s', path, str(e).splitlines()[0][:200])
                continue
            results[step] = values
            done = step
            _remember(trainer.logdir, job, step)
        waited_since = time.time()
    writer.flush()
    logging.info('%s: evaluated up to the final step %d.', job, final)
    return results
