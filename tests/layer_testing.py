"""Helpers shared by the layer tests."""

import numpy as np
import tensorflow as tf

from tf_gpipe import base_layer


def check_meta(p, *inputs):
    """FPropMeta's shapes and parameter count equal those of a real layer on real inputs."""
    layer = p.Instantiate()
    out = layer.FProp(*inputs)
    shapes = [tf.TensorShape(x.shape) if hasattr(x, 'shape') else x for x in inputs]
    shapes = [
        tf.nest.map_structure(lambda t: t.shape, x) if isinstance(x, dict) else s
        for x, s in zip(inputs, shapes)
    ]
    meta = p.cls.FPropMeta(p, *shapes)
    outs = out if isinstance(out, tuple) else (out,)
    expected = [tf.nest.map_structure(lambda t: t.shape, o) for o in outs]
    got = list(meta.out_shapes)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert base_layer.flatten_shapes(base_layer.to_shape(g)) == base_layer.flatten_shapes(
            base_layer.to_shape(e)
        ), (g, e)
    n_params = sum(int(np.prod(v.shape)) for v in layer.trainable_variables)
    assert meta.param_count == n_params
    assert meta.flops > 0 or n_params == 0
    assert meta.activation_bytes >= 0
    return meta


def grads(fn, x, variables):
    """(value, d/dx, [d/dvars]) of sum(fn(x) * fixed random weights)."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
        w = tf.random.stateless_normal(tf.shape(y), [1, 2])
        loss = tf.reduce_sum(y * w)
    gx, gv = tape.gradient(loss, [x, list(variables)])
    gv = [tf.convert_to_tensor(g) for g in gv]
    return y, gx, gv


def assert_same_grads(layer_fn, ref_fn, x, variables, rtol=1e-5, atol=1e-6):
    """The layer's output and gradients equal a hand-written TF computation's."""
    y1, gx1, gv1 = grads(layer_fn, x, variables)
    y2, gx2, gv2 = grads(ref_fn, x, variables)
    np.testing.assert_allclose(y1, y2, rtol=rtol, atol=atol)
    if gx1 is not None or gx2 is not None:
        np.testing.assert_allclose(gx1, gx2, rtol=rtol, atol=atol)
    assert len(gv1) == len(gv2) and all(g is not None for g in gv1)
    for a, b in zip(gv1, gv2):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def derived_backward_ops(fn, x, dy):
    """Op types of the backward TF derives for a call of tf.function `fn` on `x` under a tape
    (a kept micro-batch's backward: a function apart from its forward's)."""

    @tf.function
    def backward(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return tape.gradient(y, x, output_gradients=dy)

    graph = backward.get_concrete_function(x, dy).graph.as_graph_def()
    derived = [f for f in graph.library.function if '__backward_' in f.signature.name]
    assert len(derived) == 1, [f.signature.name for f in graph.library.function]
    return [n.op for n in derived[0].node_def]
