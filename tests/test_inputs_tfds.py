"""The real tfds input path, offline: tfds.load under tfds.testing.mock_data."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import gcs_utils

from tf_gpipe import inputs


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setattr(gcs_utils, '_is_gcs_disabled', True)  # no network here
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
        yield


def test_lm1b_bytes():
    gen = inputs.TfdsLm.Params().Set(dataset='lm1b', batch_size=4, seq_len=16).Instantiate()
    batch = gen.GetBatch(0)
    ids, labels, weights = batch.ids.numpy(), batch.labels.numpy(), batch.weights.numpy()
    assert ids.shape == labels.shape == weights.shape == (4, 16)
    np.testing.assert_array_equal(labels[:, :-1], ids[:, 1:])
    assert ids.min() >= 0 and ids.max() < inputs.TfdsLm.VocabSize()
    np.testing.assert_array_equal(weights, (labels > 0).astype(np.float32))
    assert 'input_iterator' in gen.CheckpointItems()
    second = gen.GetBatch(1)
    assert second.ids.shape == (4, 16)


@pytest.mark.parametrize(
    'dataset,classes', [('cifar10', 10), ('cifar100', 100), ('imagenet2012', 1000)]
)
def test_image_datasets(dataset, classes):
    gen = (
        inputs.TfdsImage.Params()
        .Set(dataset=dataset, batch_size=4, image_size=24, augment=True)
        .Instantiate()
    )
    batch = gen.GetBatch(0)
    assert batch.images.shape == (4, 24, 24, 3) and batch.images.dtype.name == 'float32'
    labels = batch.labels.numpy()
    assert labels.dtype == np.int32 and labels.min() >= 0 and labels.max() < classes


def _ted_examples(*args, **kwargs):
    """Talks as tfds' ted_multi_translate gives them (mock_data's random strings are no
    language codes, so the test hands tfds.load these)."""
    del args, kwargs
    langs = tf.ragged.constant([['en', 'de', 'ja'], ['de', 'fr'], ['fr', 'en']])
    texts = tf.ragged.constant([['hi', 'hallo', 'konnichiwa'], ['hallo', 'salut'], ['salut', 'hi']])
    return tf.data.Dataset.from_tensor_slices(
        {'translations': {'language': langs, 'translation': texts}}
    ).map(lambda ex: {'translations': {k: v for k, v in ex['translations'].items()}})


def test_ted_multi_translate_pairs():
    with tfds.testing.mock_data(as_dataset_fn=_ted_examples):
        p = inputs.TfdsTranslation.Params().Set(
            batch_size=2, seq_len=6, shuffle_buffer=0, target_languages=['de', 'fr']
        )
        batch = p.Instantiate().GetBatch(0)
    offset = 3  # pad, <2de>, <2fr>
    src, tgt_in, labels = batch.src_ids.numpy(), batch.tgt_ids.numpy(), batch.labels.numpy()

    def encode(text):
        ids = [b + offset for b in text.encode()]
        return ids + [0] * (6 - len(ids))

    # talk 0: en->de ('ja' is not wanted); talk 1 has no English; talk 2: en->fr.
    np.testing.assert_array_equal(src, [encode('hi'), encode('hi')])
    np.testing.assert_array_equal(labels, [encode('hallo'), encode('salut')])
    assert list(tgt_in[:, 0]) == [1, 2]  # the target-language tokens
    np.testing.assert_array_equal(tgt_in[:, 1:5], labels[:, :4])
    np.testing.assert_array_equal(batch.weights.numpy(), (labels > 0).astype(np.float32))
    assert inputs.TfdsTranslation.VocabSize(p) == 259
