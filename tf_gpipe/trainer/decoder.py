"""The decoder job (Lingvo's decoder_test): the newest checkpoint decoded on the test set.

Translation: beam search (beam_size 1: greedy) on task.eval.steps test batches, corpus BLEU by
sacrebleu on the token ids (tokenize='none'), hypotheses and references written to
`<logdir>/decoder_test/hyps-<step>.txt`. Language model: sampled continuations of the test
batches' first halves to `samples-<step>.txt`, and the perplexity. Summaries (bleu or
perplexity, tokens_per_sec) go to the TensorBoard run `<logdir>/decoder_test`.
"""

import math
import os

import sacrebleu
import tensorflow as tf
from absl import logging

from tf_gpipe.tasks import decoding
from tf_gpipe.tasks.lm import LanguageModel
from tf_gpipe.tasks.mt import TranslationModel
from tf_gpipe.trainer import pipeline_summaries

JOB = 'decoder_test'


def run(trainer, beam_size=4, alpha=0.6, max_len=None, temperature=1.0, top_k=0, seed=0):
    """Decodes the test set with the newest checkpoint; returns the summary values."""
    trainer.Build()
    path = trainer.Restore()
    if path is None:
        raise RuntimeError(f'No checkpoint in {trainer.CheckpointDir()} to decode; train first.')
    out_dir = os.path.join(trainer.logdir, JOB)
    os.makedirs(out_dir, exist_ok=True)
    writer = tf.summary.create_file_writer(out_dir)
    return decode_checkpoint(
        trainer, path, writer, beam_size, alpha, max_len, temperature, top_k, seed
    )


def decode_checkpoint(
    trainer, path, writer, beam_size=4, alpha=0.6, max_len=None, temperature=1.0, top_k=0, seed=0
):
    """Restores `path` and decodes the test set into `writer` and the job's directory."""
    trainer.RestoreCheckpoint(path)
    task, step = trainer.task, int(trainer.global_step.numpy())
    out_dir = os.path.join(trainer.logdir, JOB)
    os.makedirs(out_dir, exist_ok=True)
    batches = [trainer.test_input.GetBatch(i) for i in range(trainer.params.task.eval.steps)]
    if isinstance(task, TranslationModel):
        values, lines = _translate(task, batches, beam_size, alpha, max_len)
        name = f'hyps-{step}.txt'
    elif isinstance(task, LanguageModel):
        values, lines = _sample(task, batches, max_len, temperature, top_k, seed)
        metrics = trainer.EvaluateCheckpoint(path, writer)
        values['perplexity'] = math.exp(metrics['log_pplx'])
        name = f'samples-{step}.txt'
    else:
        raise ValueError(
            f'The decoder decodes translation and language models; {type(task).__name__} has '
            'nothing to decode (use --mode=eval).'
        )
    with open(os.path.join(out_dir, name), 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines) + '\n')
    pipeline_summaries.write_scalars(writer, step, values)
    logging.info(
        'decoder at step %d: %s; %s',
        step,
        '  '.join(f'{k} {v:.4g}' for k, v in sorted(values.items())),
        os.path.join(out_dir, name),
    )
    return values


def _ids(tokens):
    return ' '.join(str(t) for t in tokens)


def _translate(task, batches, beam_size, alpha, max_len):
    hyps, refs, tokens, seconds = [], [], 0, 0.0
    for batch in batches:
        length = max_len or int(batch.tgt_ids.shape[1])
        args = (batch.src_ids, batch.src_paddings, batch.tgt_ids.numpy()[:, 0], length)
        if beam_size <= 1:
            decoded = decoding.greedy(task, *args)
        else:
            decoded = decoding.beam_search(task, *args, beam_size=beam_size, alpha=alpha)
        hyps += decoded.hyps
        tokens, seconds = tokens + decoded.tokens, seconds + decoded.seconds
        for labels, weights in zip(batch.labels.numpy(), batch.weights.numpy()):
            refs.append(decoding.cut(labels[weights > 0], 0))
    bleu = sacrebleu.corpus_bleu(
        [_ids(h) for h in hyps], [[_ids(r) for r in refs]], tokenize='none'
    )
    lines = [f'{_ids(h)}\t{_ids(r)}' for h, r in zip(hyps, refs)]
    return {'bleu': bleu.score, 'tokens_per_sec': tokens / max(seconds, 1e-9)}, lines


def _sample(task, batches, max_len, temperature, top_k, seed):
    lines, tokens, seconds = [], 0, 0.0
    for i, batch in enumerate(batches):
        ids = batch.ids.numpy()
        prefix = ids[:, : max(1, ids.shape[1] // 2)]
        decoded = decoding.sample(
            task, prefix, max_len or ids.shape[1], temperature, top_k, seed + i
        )
        tokens, seconds = tokens + decoded.tokens, seconds + decoded.seconds
        lines += [f'{_ids(p)}\t{_ids(h)}' for p, h in zip(prefix, decoded.hyps)]
    return {'tokens_per_sec': tokens / max(seconds, 1e-9)}, lines


def read_hyps(path):
    """(hypotheses, references) as token-id lists from a hyps file."""
    hyps, refs = [], []
    with open(path, encoding='utf-8') as f:
        for line in f.read().splitlines():
            h, r = line.split('\t')
            hyps.append([int(x) for x in h.split()])
            refs.append([int(x) for x in r.split()])
    return hyps, refs
