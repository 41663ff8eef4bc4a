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


def test_synthetic_translation():
    batch = inputs.SyntheticMt.Params().Set(batch_size=32, seq_len=8).Instantiate().GetBatch(2)
    src, tgt_in, labels = batch.src_ids.numpy(), batch.tgt_ids.numpy(), batch.labels.numpy()
    weights = batch.weights.numpy()
    for i in range(32):
        n = int((1.0 - batch.src_paddings.numpy()[i]).sum())
        assert (src[i, n:] == 0).all() and (src[i, :n] >= 3).all()
        lang = tgt_in[i, 0]
        want = src[i, :n] if lang == 1 else src[i, :n][::-1]
        np.testing.assert_array_equal(labels[i, :n], want)
        np.testing.assert_array_equal(tgt_in[i, 1:n], labels[i, : n - 1])
        # Then the end token 0, weighted, where it fits.
        assert weights[i].sum() == min(n + 1, 8) and (labels[i, n:] == 0).all()
        if n < 8:
            assert tgt_in[i, n] == labels[i, n - 1]
    assert set(tgt_in[:, 0]) == {1, 2}  # both target languages occur
    np.testing.assert_array_equal(batch.tgt_paddings.numpy(), 1.0 - weights)


def test_synthetic_shapes():
    gen = inputs.SyntheticShapes.Params().Set(batch_size=64, image_size=16, noise=0.0)
    batch = gen.Instantiate().GetBatch(0)
    images, labels = batch.images.numpy(), batch.labels.numpy()
    assert images.shape == (64, 16, 16, 3) and set(labels) == {0, 1, 2, 3}
    for image, label in zip(images[..., 0], labels):
        ys, xs = np.nonzero(image)
        if label == 0:
            assert len(set(ys)) == 1 and len(set(xs)) > 1
        elif label == 1:
            assert len(set(xs)) == 1 and len(set(ys)) > 1
        elif label == 2:
            assert len(ys) == (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)  # filled box
        else:
            assert len(set(ys - xs)) == 1 and len(ys) > 1
