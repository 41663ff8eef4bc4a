"""SyntheticLm: deterministic per step, labels are the next tokens, the rule holds."""

import numpy as np

from tf_gpipe import inputs


def _gen(**kw):
    return (
        inputs.SyntheticLm.Params()
        .Set(batch_size=16, seq_len=10, vocab_size=50)
        .Set(**kw)
        .Instantiate()
    )


def test_batches_are_a_function_of_seed_and_step():
    a, b = _gen(), _gen()
    np.testing.assert_array_equal(a.GetBatch(7).ids, b.GetBatch(7).ids)
    assert not np.array_equal(a.GetBatch(7).ids, a.GetBatch(8).ids)
    assert not np.array_equal(a.GetBatch(7).ids, _gen(seed=9).GetBatch(7).ids)


def test_the_language_rule():
    batch = _gen().GetBatch(3)
    ids, labels = batch.ids.numpy(), batch.labels.numpy()
    assert ids.shape == labels.shape == (16, 10) and batch.weights.shape == (16, 10)
    np.testing.assert_array_equal(labels[:, :-1], ids[:, 1:])
    stride = (ids[:, 1] - ids[:, 0]) % 50
    assert set(stride) <= {1, 2, 3}
    np.testing.assert_array_equal(
        (ids[:, 2:] - ids[:, 1:-1]) % 50, np.repeat(stride[:, None], 8, axis=1)
    )
    assert abs(_gen().BestAccuracy() - (9 + 1 / 3) / 10) < 1e-9
