"""Decoding with the pipelined network: greedy and beam search equal at any K (the cells on
their devices vs one device, same checkpoint), beam 1 is greedy, BLEU by sacrebleu, LM
sampling reproducible and top-1 sampling is the argmax; the decoder job end to end."""

import os
import subprocess
import sys

import numpy as np
import pytest
import sacrebleu
import tensorflow as tf

from tf_gpipe import hyperparams, model_registry
from tf_gpipe.tasks import decoding
from tf_gpipe.trainer import decoder, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MT = 'mt.synthetic.TransformerNmtTiny'
LM = 'lm.synthetic.TransformerLmTiny'


def _params(key, k, m, steps=150):
    model_registry.LoadParamsDir(os.path.join(ROOT, 'params'))
    model = model_registry.GetClass(key)()
    p = trainer.ModelParams(model.Task(), model.Train(), model.Test())
    hyperparams.apply_overrides(
        p,
        f'task.pipeline.num_partitions={k}; task.pipeline.num_micro_batches={m}; '
        f'task.train.max_steps={steps}; task.eval.steps=1; test.batch_size=8',
    )
    return p


@pytest.fixture(scope='module')
def mt_logdir(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp('mt') / 'run')
    trainer.Trainer(_params(MT, 2, 2), logdir).Train()
    return logdir


def _restored(key, logdir, k, m):
    t = trainer.Trainer(_params(key, k, m), logdir)
    t.Build()
    assert t.Restore() is not None
    return t


def _search(t, beam_size=0, alpha=0.6, incremental=True):
    b = t.test_input.GetBatch(0)
    args = (t.task, b.src_ids, b.src_paddings, b.tgt_ids.numpy()[:, 0], int(b.tgt_ids.shape[1]))
    if not beam_size:
        return decoding.greedy(*args, incremental=incremental)
    return decoding.beam_search(*args, beam_size=beam_size, alpha=alpha, incremental=incremental)


def test_greedy_and_beam_search_of_the_pipeline_equal_one_device(mt_logdir):
    piped, single = _restored(MT, mt_logdir, 2, 2), _restored(MT, mt_logdir, 1, 1)
    g2, g1 = _search(piped), _search(single)
    assert g2.hyps == g1.hyps and any(g1.hyps)
    np.testing.assert_allclose(g2.scores, g1.scores, rtol=1e-5, atol=1e-6)
    b2, b1 = _search(piped, 4), _search(single, 4)
    assert b2.hyps == b1.hyps
    np.testing.assert_allclose(b2.scores, b1.scores, rtol=1e-5, atol=1e-6)
    assert len({len(h) for h in g2.hyps}) > 1  # each ends at its own end token
    # A beam of one without a length penalty follows greedy search's path and also keeps the
    # hypotheses that ended earlier: its best scores at least as well, the same where it
    # returns greedy's hypothesis.
    one = _search(piped, 1, alpha=0.0)
    assert np.all(one.scores >= g2.scores - 1e-5)
    same = [i for i, (a, b) in enumerate(zip(one.hyps, g2.hyps)) if a == b]
    assert same
    np.testing.assert_allclose(one.scores[same], g2.scores[same], rtol=1e-5, atol=1e-6)
    assert g2.tokens_per_sec > 0


def test_incremental_decoding_equals_recomputing_the_prefix(mt_logdir):
    """The attention caches (per cell, on its device) give what recomputing the whole prefix at
    every step gives: the same hypotheses, the same scores, for greedy and beam search (whose
    beams reorder the caches)."""
    piped = _restored(MT, mt_logdir, 2, 2)
    for beam in (0, 3):
        inc, full = _search(piped, beam), _search(piped, beam, incremental=False)
        assert inc.incremental and not full.incremental
        assert inc.hyps == full.hyps
        np.testing.assert_allclose(inc.scores, full.scores, rtol=1e-5, atol=1e-5)


def test_decoder_job_writes_hypotheses_and_their_bleu(mt_logdir):
    values = decoder.run(_restored(MT, mt_logdir, 2, 2), beam_size=2)
    path = os.path.join(mt_logdir, decoder.JOB, 'hyps-150.txt')
    hyps, refs = decoder.read_hyps(path)
    assert len(hyps) == 8 and all(refs)
    again = sacrebleu.corpus_bleu(
        [' '.join(map(str, h)) for h in hyps], [[' '.join(map(str, r)) for r in refs]],
        tokenize='none',
    )  # fmt: skip
    assert values['bleu'] == pytest.approx(again.score) and values['bleu'] > 10
    assert values['tokens_per_sec'] > 0
    # Through the trainer tool, as Lingvo's continuous decoder_test job: it decodes every
    # checkpoint up to the trainer's final one (here already written), then exits.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'tools', 'trainer.py'), f'--model={MT}',
         f'--logdir={mt_logdir}', '--job=decoder_test', '--beam_size=1', '--num_logical_cpus=2',
         '--max_steps=150', '--evaler_timeout=120',
         '--params_override=task.pipeline.num_partitions=2; task.eval.steps=1; test.batch_size=8'],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'decoder at step 150: bleu ' in done.stderr and 'tokens_per_sec' in done.stderr
    assert 'decoder_test: evaluated up to the final step 150' in done.stderr


def test_language_model_sampling(tmp_path):
    logdir = str(tmp_path / 'lm')
    trainer.Trainer(_params(LM, 2, 2, steps=40), logdir).Train()
    t = _restored(LM, logdir, 2, 2)
    prefix = t.test_input.GetBatch(0).ids.numpy()[:, :4]
    first = decoding.sample(t.task, prefix, 12, temperature=1.0, seed=3)
    assert first.incremental
    assert first.hyps == decoding.sample(t.task, prefix, 12, temperature=1.0, seed=3).hyps
    again = decoding.sample(t.task, prefix, 12, temperature=1.0, seed=3, incremental=False)
    assert not again.incremental and again.hyps == first.hyps
    assert all(len(h) == 8 for h in first.hyps)
    # Sampling among the single best token is the argmax continuation.
    top1 = decoding.sample(t.task, prefix, 12, top_k=1, seed=5)
    ids = np.zeros([len(prefix), 12], np.int32)
    ids[:, :4] = prefix
    from tf_gpipe import fprop_context

    for pos in range(3, 11):
        with fprop_context.eval_mode():
            logits = t.task.Serve({'ids': tf.constant(ids)})['logits'].numpy()[:, pos]
        ids[:, pos + 1] = logits.argmax(-1)
    assert top1.hyps == [list(row[4:]) for row in ids]
    values = decoder.run(t, top_k=4)
    assert values['perplexity'] > 1.0 and values['tokens_per_sec'] > 0
    assert os.path.exists(os.path.join(logdir, decoder.JOB, 'samples-40.txt'))


def test_a_layer_that_cannot_step_decodes_by_recomputing(tmp_path, caplog):
    """A non-causal LM (its layers see the future) has no step-by-step decoding: the stepper
    says why in the log and recomputes the prefix at every step instead."""
    p = _params(LM, 1, 1)
    hyperparams.apply_overrides(p, 'task.layer_tpl.causal=False')
    t = trainer.Trainer(p, str(tmp_path / 'lm'))
    t.Build()
    prefix = t.test_input.GetBatch(0).ids.numpy()[:2, :3]
    decoded = decoding.sample(t.task, prefix, 6, top_k=1)
    assert not decoded.incremental and all(len(h) == 3 for h in decoded.hyps)
    assert 'non-causal' in caplog.text and 'causal=True' in caplog.text
