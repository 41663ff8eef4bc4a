"""Zero-bubble's B/W split on a kept forward: exact, and W is local (one op per weight use)."""

import contextlib

import numpy as np
import tensorflow as tf

from tf_gpipe.gpipe import weight_gradients


def _variables():
    tf.random.set_seed(3)
    ws = [tf.Variable(tf.random.normal([6, 6]) * 0.5, name=f'w{i}') for i in range(4)]
    bias = tf.Variable(tf.random.normal([6]), name='bias')
    emb = tf.Variable(tf.random.normal([10, 6]), name='emb')
    return ws, bias, emb


def _forward(x, ids, ws, bias, emb):
    h = x + tf.gather(emb, ids)  # a gather: not split, B computes it
    for w in ws:
        h = tf.tanh(h @ w + bias)  # bias used four times
    h = h @ ws[0]  # ws[0] used again, fed by its first use
    h = tf.cast(h, tf.bfloat16) @ tf.cast(ws[1], tf.bfloat16)  # a use through a cast
    return tf.cast(h, tf.float32)


def test_split_backward_equals_the_tape_and_w_is_local():
    ws, bias, emb = _variables()
    variables = ws + [bias, emb]
    x = tf.random.normal([5, 6])
    ids = tf.constant([1, 2, 1, 1, 7])
    dy = tf.random.normal([5, 6])

    @tf.function
    def run():
        graph = tf.compat.v1.get_default_graph()
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            first = len(graph.get_operations())
            y = _forward(x, ids, ws, bias, emb)
            ops = graph.get_operations()[first:]
        want = tape.gradient(y, [x] + variables, output_gradients=dy)
        uses = weight_gradients.Uses(ops, variables)
        points = uses.Tensors()
        b = tape.gradient(y, [x] + points + uses.unsplit, output_gradients=dy)
        before = len(graph.get_operations())
        w = uses.WeightGradients(b[1 : 1 + len(points)])
        w_ops = graph.get_operations()[before:]
        got = dict((v.ref(), g) for v, g in w)
        got.update((v.ref(), g) for v, g in zip(uses.unsplit, b[1 + len(points) :]))
        grads = [b[0]] + [tf.convert_to_tensor(got[v.ref()]) for v in variables]
        # Ops W really runs: those its gradients depend on (TF prunes the rest).
        needed, stack = set(), [tf.convert_to_tensor(g).op for _, g in w]
        while stack:
            op = stack.pop()
            if op in needed or op not in set(w_ops):
                continue
            needed.add(op)
            stack += [t.op for t in op.inputs] + list(op.control_inputs)
        matmuls = sum(op.type in ('MatMul', 'BatchMatMulV2') for op in needed)
        return want, grads, matmuls, [v.name for v in uses.unsplit]

    want, got, matmuls, unsplit = run()
    for a, b in zip(want, got):
        np.testing.assert_allclose(tf.convert_to_tensor(b), tf.convert_to_tensor(a), rtol=2e-2)
    # ws[0] twice, ws[1] twice (once through a cast), ws[2], ws[3]: one weight matmul per use.
    assert int(matmuls) == 6
    assert unsplit == ['emb:0']


def _w_against_the_tape(forward, variables, x, dy, around_w=contextlib.nullcontext):
    """(the tape's gradients of `variables`, W's) for forward(x) and output gradient dy, W
    built inside `around_w()`."""

    @tf.function
    def run():
        graph = tf.compat.v1.get_default_graph()
        with tf.GradientTape(persistent=True) as tape:
            first = len(graph.get_operations())
            h = forward(x)
            ops = graph.get_operations()[first:]
        want = tape.gradient(h, variables, output_gradients=dy)
        uses = weight_gradients.Uses(ops, variables)
        points = tape.gradient(h, uses.Tensors(), output_gradients=dy)
        with around_w():
            got = dict((v.ref(), g) for v, g in uses.WeightGradients(points))
        return want, [got[v.ref()] for v in variables]

    return run()


def test_float32_split_is_exact_to_1e6():
    ws, bias, _ = _variables()

    def forward(h):
        for w in ws + ws[::-1]:  # every weight used twice, chained through the other uses
            h = tf.tanh(h @ w + bias)
        return h

    x, dy = tf.random.normal([5, 6]), tf.random.normal([5, 6])
    want, got = _w_against_the_tape(forward, ws + [bias], x, dy)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_w_walks_the_trace_a_few_times_not_once_per_variable(monkeypatch):
    """Each tf.gradients call walks the whole trace downstream of its sources, so W groups the
    variables: 6 layers of matmul, bias and a scale (18 variables, each bias add stopping at its
    matmul's output) take 2 calls, and W still equals the tape."""
    calls = []
    real = tf.gradients

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    @contextlib.contextmanager
    def counted():
        monkeypatch.setattr(tf, 'gradients', counting)
        yield
        monkeypatch.setattr(tf, 'gradients', real)

    tf.random.set_seed(4)
    ws = [tf.Variable(tf.random.normal([6, 6]) * 0.5, name=f'w{i}') for i in range(6)]
    bs = [tf.Variable(tf.random.normal([6]), name=f'b{i}') for i in range(6)]
    gs = [tf.Variable(1.0 + tf.random.normal([6]) * 0.1, name=f'g{i}') for i in range(6)]

    def forward(h):
        for w, b, g in zip(ws, bs, gs):
            h = tf.tanh(h @ w + b) * g
        return h

    x, dy = tf.random.normal([5, 6]), tf.random.normal([5, 6])
    want, got = _w_against_the_tape(forward, ws + bs + gs, x, dy, counted)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert len(calls) == 2, len(calls)
