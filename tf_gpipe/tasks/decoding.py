"""Decoding a trained task with its pipelined network: greedy and beam search for translation,
sampling for language models.

The search (argmax, beams, sampling) is NumPy on the host, between steps; a stepper gives it
the next position's logits as the sequence grows by one token:

- incremental (the default): the task's `ServeStep`, replica 0's cells in order, each on its
  device, in eval mode. Every causal attention layer keeps the keys and values of the positions
  decoded so far in a cache of fixed length on its cell's device (cross-attention: the source's,
  computed once), so a step computes one position: O(T) per step. Traced twice: the first call
  (the source or the prompt) and every later one.
- recompute: the task's `Serve` over a fixed-length buffer of the whole prefix at every step
  (causal attention makes the positions not decoded yet irrelevant): O(T^2) per sequence. Used
  when a layer cannot step (it defines no `ExtendStep`), said once in the log, or when asked.
"""

import dataclasses
import time
import weakref

import numpy as np
import tensorflow as tf
from absl import logging

from tf_gpipe import fprop_context


@dataclasses.dataclass
class Decoded:
    """Hypotheses (token lists, the end token cut), their scores, and the decoding's speed
    (`tokens`: the hypotheses' tokens, each one's end token included); `incremental`: whether
    the steps used attention caches (else each recomputed the prefix)."""

    hyps: list
    scores: np.ndarray
    tokens: int
    seconds: float
    incremental: bool = True

    @property
    def tokens_per_sec(self):
        return self.tokens / max(self.seconds, 1e-9)


def cut(tokens, eos_id):
    """`tokens` up to the first `eos_id`, as ints."""
    tokens = list(int(t) for t in tokens)
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


# One traced step function per task (held weakly: a decoder job restores tasks in turn).
_STEP_FUNCTIONS = weakref.WeakKeyDictionary()
_FALLBACK_SAID = weakref.WeakSet()  # tasks whose fallback was logged


def _step_function(task):
    if task not in _STEP_FUNCTIONS:
        task_ref = weakref.ref(task)

        def step(inputs, state, t, max_len):
            with fprop_context.eval_mode():
                return task_ref().ServeStep(inputs, state, t, max_len)

        _STEP_FUNCTIONS[task] = tf.function(step, autograph=False)
    return _STEP_FUNCTIONS[task]


class _Stepper:
    """Logits and log-probabilities [B, V] of the next position of B growing sequences.

    `fixed`: inputs that do not grow (a translation's source), `key`: the growing ids' input
    name, `pad_key`: its paddings' name (all zeros), or None.
    """

    def __init__(self, task, fixed, key, pad_key, max_len, incremental=True):
        self.task, self.fixed, self.key, self.pad_key = task, dict(fixed), key, pad_key
        self.max_len, self.incremental = max_len, incremental
        self.state = self.ids = None  # the ids so far [B, max_len], kept in both modes
        self.t = 0

    def _inputs(self, ids, fixed):
        inputs = dict(self.fixed) if fixed else {}
        inputs[self.key] = tf.constant(ids, tf.int32)
        if self.pad_key:
            inputs[self.pad_key] = tf.zeros(ids.shape, tf.float32)
        return inputs

    def _step(self, ids, first):
        """ServeStep of `ids` at positions t..; None where the network cannot step."""
        try:
            out, self.state = _step_function(self.task)(
                self._inputs(ids, first), None if first else self.state, tf.constant(self.t),
                self.max_len,
            )  # fmt: skip
        except NotImplementedError as e:
            self.incremental, self.state = False, None
            if self.task not in _FALLBACK_SAID:
                _FALLBACK_SAID.add(self.task)
                logging.warning(
                    '%s decodes by recomputing the prefix each step: %s',
                    type(self.task).__name__, e,
                )  # fmt: skip
            return None
        return {k: v.numpy()[:, -1] for k, v in out.items()}

    def start(self, prefix):
        """The first position after `prefix` [B, P]."""
        prefix = np.asarray(prefix, np.int32)
        self.ids = np.zeros([prefix.shape[0], self.max_len], np.int32)
        self.ids[:, : prefix.shape[1]] = prefix
        self.t = 0
        out = self._step(prefix, True) if self.incremental else None
        self.t = prefix.shape[1]
        return self._serve() if out is None else out

    def extend(self, tokens):
        """The next position after appending `tokens` [B]."""
        tokens = np.asarray(tokens, np.int32)
        self.ids[:, self.t] = tokens
        out = self._step(tokens[:, None], False) if self.incremental else None
        self.t += 1
        return self._serve() if out is None else out

    def reorder(self, rows):
        """Sequence i continues sequence rows[i] (beam search): its state follows."""
        rows = np.asarray(rows, np.int32)
        self.ids = self.ids[rows]
        if self.incremental:
            rows = tf.constant(rows)

            def gather(x):
                with tf.device(x.device):  # a cache stays on its cell's device
                    return tf.gather(x, rows)

            self.state = tf.nest.map_structure(gather, self.state)

    def _serve(self):
        """The whole prefix again, in a buffer of max_len positions (one shape: one trace)."""
        with fprop_context.eval_mode():
            out = self.task.Serve(self._inputs(self.ids, True))
        return {k: v.numpy()[:, self.t - 1] for k, v in out.items()}


def _translation_stepper(task, src_ids, src_paddings, max_len, incremental):
    fixed = {
        'src_ids': tf.constant(src_ids, tf.int32),
        'src_paddings': tf.constant(src_paddings, tf.float32),
    }
    return _Stepper(task, fixed, 'tgt_ids', 'tgt_paddings', max_len, incremental)


def greedy(task, src_ids, src_paddings, start_ids, max_len, eos_id=0, incremental=True):
    """The argmax continuation of each source: [B] token lists (up to max_len, EOS cut)."""
    start = time.time()
    src_ids, src_paddings = np.asarray(src_ids), np.asarray(src_paddings)
    b = src_ids.shape[0]
    steps = _translation_stepper(task, src_ids, src_paddings, max_len, incremental)
    logp = steps.start(np.asarray(start_ids).reshape(b, 1))['log_probs']
    out, score = np.zeros([b, max_len], np.int32), np.zeros([b])
    done = np.zeros([b], bool)
    for t in range(max_len):
        token = np.argmax(logp, axis=-1)
        score += np.where(done, 0.0, logp[np.arange(b), token])
        out[:, t] = np.where(done, eos_id, token)
        done |= token == eos_id
        if done.all() or t + 1 == max_len:
            break
        logp = steps.extend(out[:, t])['log_probs']
    hyps = [cut(row, eos_id) for row in out]
    seconds = time.time() - start
    return Decoded(hyps, score, sum(len(h) + 1 for h in hyps), seconds, steps.incremental)


def _length_penalty(length, alpha):
    """GNMT's ((5 + length) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def beam_search(
    task,
    src_ids,
    src_paddings,
    start_ids,
    max_len,
    beam_size=4,
    alpha=0.6,
    eos_id=0,
    incremental=True,
):
    """The best hypothesis of each source by beam search, scores normalised by GNMT's length
    penalty; a beam ends at EOS (or max_len)."""
    start = time.time()
    src_ids, src_paddings = np.asarray(src_ids), np.asarray(src_paddings)
    b, k = src_ids.shape[0], beam_size
    rows = np.repeat(np.arange(b), k)
    steps = _translation_stepper(task, src_ids[rows], src_paddings[rows], max_len, incremental)
    logp = steps.start(np.asarray(start_ids)[rows].reshape(b * k, 1))['log_probs']
    seqs = np.zeros([b, k, max_len], np.int32)
    alive = np.full([b, k], -np.inf)
    alive[:, 0] = 0.0  # one live beam at first: the others would repeat it
    finished = [[] for _ in range(b)]  # (normalised score, tokens)
    for t in range(max_len):
        v = logp.shape[-1]
        cand = (alive[:, :, None] + logp.reshape(b, k, v)).reshape(b, k * v)
        order = np.argsort(-cand, axis=-1)[:, : 2 * k]  # enough to refill k live beams
        new_seqs, new_alive = np.zeros_like(seqs), np.full([b, k], -np.inf)
        parents = rows * k  # a row left without a live beam continues any (its score: -inf)
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
                    parents[i * k + n] = i * k + beam
                    n += 1
        seqs, alive = new_seqs, new_alive
        # Stop once no live beam can beat the best finished one (scores only fall).
        best_alive = alive.max(axis=1) / _length_penalty(max_len, alpha)
        if t + 1 == max_len or all(
            finished[i] and max(f[0] for f in finished[i]) >= best_alive[i] for i in range(b)
        ):
            break
        steps.reorder(parents)
        logp = steps.extend(seqs[:, :, t].reshape(b * k))['log_probs']
    hyps, scores = [], np.zeros([b])
    for i in range(b):
        score, tokens = max(finished[i], key=lambda f: f[0])
        hyps.append([int(x) for x in tokens])
        scores[i] = score
    seconds = time.time() - start
    return Decoded(hyps, scores, sum(len(h) + 1 for h in hyps), seconds, steps.incremental)


def sample(task, prefix_ids, max_len, temperature=1.0, top_k=0, seed=0, incremental=True):
    """Continuations of each LM prefix [B, P] up to max_len tokens in all: tokens drawn from
    softmax(logits / temperature), among the top_k most likely (0: all); reproducible by seed."""
    start = time.time()
    prefix_ids = np.asarray(prefix_ids)
    b, p = prefix_ids.shape
    steps = _Stepper(task, {}, 'ids', None, max_len, incremental)
    rng = np.random.default_rng(seed)
    hyps = np.zeros([b, max_len - p], np.int32)
    logits = steps.start(prefix_ids)['logits']
    for t in range(max_len - p):
        logits = logits / max(temperature, 1e-6)
        if top_k:
            kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
            logits = np.where(logits < kth, -np.inf, logits)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        hyps[:, t] = [rng.choice(len(row), p=row) for row in probs]
        if t + 1 < max_len - p:
            logits = steps.extend(hyps[:, t])['logits']
    seconds = time.time() - start
    return Decoded(
        [list(int(x) for x in row) for row in hyps], np.zeros([b]), b * (max_len - p), seconds,
        steps.incremental,
    )  # fmt: skip
