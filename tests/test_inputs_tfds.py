"""The real tfds input path, offline: tfds.load under tfds.testing.mock_data."""

import numpy as np
import pytest
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
