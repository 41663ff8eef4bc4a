"""A trained params model as a SavedModel for serving: one device, any batch size.

The task is rebuilt with one cell and one micro-batch (K=1, M=1: the pipeline's exactness
makes it the same function), its newest checkpoint restored by name (checkpoints restore at any
K), and its forward traced with the batch (and the sequence length) left open. The SavedModel
holds graphs and variables only: serving it needs TensorFlow, not tf_gpipe.
"""

import logging as std_logging
import os

import tensorflow as tf
from absl import logging

from tf_gpipe import fprop_context
from tf_gpipe.trainer import trainer as trainer_lib


def OneDeviceParams(model_params):
    """`model_params` with the pipeline folded onto one device (K=1, M=1, one replica)."""
    p = model_params.Copy()
    p.task.pipeline.Set(
        num_partitions=1, num_micro_batches=1, num_replicas=1, virtual_stages=1, splits=None
    )
    p.task.pipeline.schedule = 'gpipe'
    return p


class _Serving(tf.Module):
    """The served function and the variables it reads (tracked, so the SavedModel has them)."""

    def __init__(self, task, specs):
        super().__init__(name='serving')
        self.model_variables = list(task.variables)  # the task itself stays untracked

        @tf.function(input_signature=[specs], autograph=False)
        def serve(inputs):
            with fprop_context.eval_mode():
                return task.Serve(inputs)

        self.serve = serve


def Export(model_params, logdir, export_dir):
    """Writes the SavedModel of `logdir`'s newest checkpoint to `export_dir` (its
    'serving_default' signature: the task's ServingSpecs in, its Serve outputs out); returns
    the checkpoint path exported."""
    if tf.io.gfile.exists(os.path.join(export_dir, 'saved_model.pb')):
        raise FileExistsError(
            f'{export_dir} already holds a SavedModel; pass a new --export_dir (nothing is '
            'overwritten).'
        )
    t = trainer_lib.Trainer(OneDeviceParams(model_params), logdir)
    path = t.Restore()
    if path is None:
        raise FileNotFoundError(
            f'No checkpoint in {logdir}/checkpoints to export; train first (or pass the '
            "training run's --logdir)."
        )
    # The signature's argument names are the specs' names: the task's keys.
    specs = {
        k: tf.TensorSpec(sp.shape, sp.dtype, name=k)
        for k, sp in t.task.ServingSpecs(model_params.input).items()
    }
    module = _Serving(t.task, specs)
    # TF's save reads absl's verbosity and sets it back explicitly, which pins a logger that
    # inherited its level (absl INFO lines vanish afterwards): restore the logger as it was.
    absl_logger = std_logging.getLogger('absl')
    level = absl_logger.level
    try:
        tf.saved_model.save(
            module,
            export_dir,
            signatures={'serving_default': module.serve.get_concrete_function()},
        )
    finally:
        absl_logger.setLevel(level)
    logging.info('Exported %s to %s (inputs: %s).', path, export_dir, ', '.join(sorted(specs)))
    return path
