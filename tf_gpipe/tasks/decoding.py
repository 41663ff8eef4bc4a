"""Decoding a trained task with its pipelined network: greedy and beam search for translation,
sampling for language models.

Each step runs the task's `Serve` (the pipelined forward, eval mode, every cell on its device)
on a fixed-length target buffer: causal attention makes position t depend only on positions
<= t, so the positions not yet decoded change nothing, and one shape means one trace. The
search itself (argmax, beams, sampling) is NumPy on the host, between steps. No incremental
attention state: each step recomputes the prefix (simple and exact; O(T^2) per sequence).
"""

import dataclasses
import time

import numpy as np
import tensorflow as tf

from tf_gpipe import fprop_context


@dataclasses.dataclass
class Decoded:
    """Hypotheses (token lists, the end token cut), their scores, and the decoding's speed
    (`tokens`: the hypotheses' tokens, each one's end token included)."""

    hyps: list
    scores: np.ndarray
    tokens: int
    seconds: float

    @property
    def tokens_per_sec(self):
        return self.tokens / max(self.seconds, 1e-9)


def _log_probs(task, inputs):
    with fprop_context.eval_mode():
        return task.Serve(inputs)['log_probs'].numpy()


def _mt_inputs(src_ids, src_paddings, tgt):
    return {
        'src_ids': tf.constant(src_ids, tf.int32),
        'src_paddings': tf.constant(src_paddings, tf.float32),
        'tgt_ids': tf.constant(tgt, tf.int32),
        'tgt_paddings': tf.zeros(tgt.shape, tf.float32),
    }


def cut(tokens, eos_id):
    """`tokens` up to the first `eos_id`, as ints."""
    tokens = list(int(t) for t in tokens)
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def greedy(task, src_ids, src_paddings, start_ids, max_len, eos_id=0):
    """The argmax continuation of each source: [B] token lists (up to max_len, EOS cut)."""
    start = time.time()
    src_ids, src_paddings = np.asarray(src_ids), np.asarray(src_paddings)
    b = src_ids.shape[0]
    tgt = np.zeros([b, max_len], np.int32)
    tgt[:, 0] = start_ids
    out, score = np.zeros([b, max_len], np.int32), np.zeros([b])
    done = np.zeros([b], bool)
    for t in range(max_len):
        logp = _log_probs(task, _mt_inputs(src_ids, src_paddings, tgt))[:, t]
        token = np.argmax(logp, axis=-1)
        score += np.where(done, 0.0, logp[np.arange(b), token])
        out[:, t] = np.where(done, eos_id, token)
        done |= token == eos_id
        if t + 1 < max_len:
            tgt[:, t + 1] = out[:, t]
        if done.all():
            break
    hyps = [cut(row, eos_id) for row in out]
    return Decoded(hyps, score, sum(len(h) + 1 for h in hyps), time.time() - start)


def _length_penalty(length, alpha):
    """GNMT's ((5 + length) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_search(task, src_ids, src_paddings, start_ids, max_len, beam_size=4, alpha=0.6, eos_id=0):
    """The best hypothesis of each source by beam search, scores normalised by GNMT's length
    penalty; a beam ends at EOS (or max_len)."""
    start = time.time()
    src_ids, src_paddings = np.asarray(src_ids), np.asarray(src_paddings)
    b, k = src_ids.shape[0], beam_size
    rows = np.repeat(np.arange(b), k)
    tgt = np.zeros([b * k, max_len], np.int32)
    tgt[:, 0] = np.asarray(start_ids)[rows]
    seqs = np.zeros([b, k, max_len], np.int32)
    alive = np.full([b, k], -np.inf)
    alive[:, 0] = 0.0  # one live beam at first: the others would repeat it
    finished = [[] for _ in range(b)]  # (normalised score, tokens)
    for t in range(max_len):
        logp = _log_probs(task, _mt_inputs(src_ids[rows], src_paddings[rows], tgt))[:, t]
        v = logp.shape[-1]
        cand = (alive[:, :, None] + logp.reshape(b, k, v)).reshape(b, k * v)
        order = np.argsort(-cand, axis=-1)[:, : 2 * k]  # enough to refill k live beams
        new_seqs, new_alive = np.zeros_like(seqs), np.full([b, k], -np.inf)
        for i in range(b):
            n = 0
            for flat in order[i]:
                score = cand[i, flat]
                if not np.isfinite(score):
                    break
                beam, token = divmod(int(flat), v)
                if token == eos_id or t == max_len - 1:
                    tokens = list(seqs[i, beam, :t]) + ([] if token == eos_id else [token])
                    finished[i].append((score / _length_penalty(t + 1, alpha), tokens))
                    continue
                if n < k:
                    new_seqs[i, n] = seqs[i, beam]
                    new_seqs[i, n, t] = token
                    new_alive[i, n] = score
                    n += 1
        seqs, alive = new_seqs, new_alive
        if t + 1 < max_len:
            tgt[:, 1 : t + 2] = seqs.reshape(b * k, max_len)[:, : t + 1]
        # Stop once no live beam can beat the best finished one (scores only fall).
        best_alive = alive.max(axis=1) / _length_penalty(max_len, alpha)
        if all(finished[i] and max(f[0] for f in finished[i]) >= best_alive[i] for i in range(b)):
            break
    hyps, scores = [], np.zeros([b])
    for i in range(b):
        score, tokens = max(finished[i], key=lambda f: f[0])
        hyps.append([int(x) for x in tokens])
        scores[i] = score
    return Decoded(hyps, scores, sum(len(h) + 1 for h in hyps), time.time() - start)


def sample(task, prefix_ids, max_len, temperature=1.0, top_k=0, seed=0):
    """Continuations of each LM prefix [B, P] up to max_len tokens in all: tokens drawn from
    softmax(logits / temperature), among the top_k most likely (0: all); reproducible by seed."""
    start = time.time()
    prefix_ids = np.asarray(prefix_ids)
    b, p = prefix_ids.shape
    ids = np.zeros([b, max_len], np.int32)
    ids[:, :p] = prefix_ids
    rng = np.random.default_rng(seed)
    for t in range(p - 1, max_len - 1):
        with fprop_context.eval_mode():
            logits = task.Serve({'ids': tf.constant(ids)})['logits'].numpy()[:, t]
        logits = logits / max(temperature, 1e-6)
        if top_k:
            kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
            logits = np.where(logits < kth, -np.inf, logits)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        ids[:, t + 1] = [rng.choice(len(row), p=row) for row in probs]
    hyps = [list(int(x) for x in row[p:]) for row in ids]
    return Decoded(hyps, np.zeros([b]), b * (max_len - p), time.time() - start)
