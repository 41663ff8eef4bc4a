"""export: a model trained at K=2 becomes a SavedModel on one device with an open batch size,
served in a process that cannot import tf_gpipe, with the pipelined model's predictions."""

import logging
import os

import numpy as np
import pytest
import tensorflow as tf

from tests.standalone import run_without_tf_gpipe
from tf_gpipe import fprop_context, hyperparams, model_registry
from tf_gpipe.trainer import export, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Serves in a fresh interpreter where `import tf_gpipe` fails: the SavedModel must stand alone.
SERVE = """
import sys
import numpy as np
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures['serving_default']
inputs = dict(np.load(sys.argv[2]))
out = serve(**{k: tf.constant(v) for k, v in inputs.items()})
np.savez(sys.argv[3], **{k: v.numpy() for k, v in out.items()})
"""


def _trained(tmp_path, key, overrides):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    model = model_registry.GetClass(key)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(
        p,
        'task.pipeline.num_partitions=2; task.pipeline.num_micro_batches=2; '
        f'task.train.max_steps=2; {overrides}',
    )
    logdir = str(tmp_path / 'run')
    t = trainer.Trainer(p, logdir)
    t.Train()
    return p, logdir, t


def _served(tmp_path, export_dir, inputs):
    np.savez(tmp_path / 'in.npz', **inputs)
    run_without_tf_gpipe(SERVE, export_dir, tmp_path / 'in.npz', tmp_path / 'out', cwd=tmp_path)
    return dict(np.load(tmp_path / 'out.npz'))


@pytest.mark.parametrize(
    'key,overrides',
    [
        ('lm.synthetic.TransformerLmTiny', ''),
        ('mt.synthetic.TransformerNmtTiny', ''),
    ],
)
def test_served_on_one_device_at_any_batch_equals_the_pipelined_model(tmp_path, key, overrides):
    p, logdir, t = _trained(tmp_path, key, overrides)
    export_dir = str(tmp_path / 'export')
    absl_level = logging.getLogger('absl').level
    path = export.Export(p, logdir, export_dir)
    assert path == t.manager.latest_checkpoint
    assert logging.getLogger('absl').level == absl_level  # TF's save pins it; Export restores
    # A batch of 3 (training used 64 / 2 micro-batches), length 7: neither was traced.
    ids = np.random.RandomState(0).randint(1, 16, size=(3, 7)).astype(np.int32)
    if key.startswith('lm.'):
        inputs = {'ids': ids}
        network_inputs = tf.constant(ids)
    else:
        paddings = np.zeros((3, 7), np.float32)
        paddings[1, 5:] = 1.0
        inputs = dict(
            src_ids=ids, src_paddings=paddings, tgt_ids=ids[:, ::-1].copy(), tgt_paddings=paddings
        )
        network_inputs = t.task.NetworkInputs(_batch(inputs))[0]
    with fprop_context.eval_mode():
        want = tf.nn.log_softmax(tf.cast(t.task.network.FProp(network_inputs), tf.float32))
    got = _served(tmp_path, export_dir, inputs)
    np.testing.assert_allclose(got['log_probs'], want.numpy(), rtol=1e-5, atol=1e-5)
    # Nothing is overwritten.
    with pytest.raises(FileExistsError, match='already holds a SavedModel'):
        export.Export(p, logdir, export_dir)


def _batch(inputs):
    from tf_gpipe.nested_map import NestedMap

    zeros = tf.zeros_like(tf.constant(inputs['tgt_ids']))
    return NestedMap(
        **{k: tf.constant(v) for k, v in inputs.items()},
        labels=zeros,
        weights=tf.cast(zeros, tf.float32),
    )


def test_no_checkpoint_is_a_clear_error(tmp_path):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    model = model_registry.GetClass('lm.synthetic.TransformerLmTiny')()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    with pytest.raises(FileNotFoundError, match='No checkpoint in .* to export; train first'):
        export.Export(p, str(tmp_path / 'empty'), str(tmp_path / 'export'))
