"""'This machine' for the planner: per-layer forward and backward times, the compute rate, and
the link between two devices, each measured with TF on the device it is asked about.

A time is the slope of in-graph repetitions: one tf.function runs the work n times in a
tf.while_loop (each pass fed by the previous one, so nothing is hoisted or merged), and
(T(n2) - T(n1)) / (n2 - n1) removes the call's own cost — on a remote worker, the RPC.
"""

import os

import numpy as np
import tensorflow as tf

from tf_gpipe import fprop_context
from tf_gpipe.planning import devices

ITERATIONS = (1, 4)


def _floats(structure):
    return [t for t in tf.nest.flatten(structure) if t.dtype.is_floating]


def _nudge(args, carry):
    """args + 0 * carry in value, but dependent on the previous pass."""
    return tf.nest.map_structure(
        lambda a: a + tf.cast(carry * 0.0, a.dtype) if a.dtype.is_floating else a, args
    )


def _slope(fn, repeats, iterations):
    """Seconds per pass of fn(n) -> tensor: the median time difference over the pass count."""
    lo, hi = iterations
    for n in (lo, hi):
        fn(tf.constant(n)).numpy()  # trace and warm up
    times = {lo: [], hi: []}
    for _ in range(repeats):
        for n in (lo, hi):
            start = tf.timestamp()
            fn(tf.constant(n)).numpy()
            times[n].append(float(tf.timestamp() - start))
    return max(0.0, (np.median(times[hi]) - np.median(times[lo])) / (hi - lo))


def _repeated(device, body, args):
    """A tf.function(n) on `device` running body(args) n times, each pass after the last."""

    @tf.function(autograph=False)
    def run(n):
        with tf.device(device):

            def step(i, carry):
                return i + 1, carry + body(_nudge(args, carry))

            return tf.while_loop(lambda i, _: i < n, step, (tf.constant(0), tf.constant(0.0)))[1]

    return run


def layer_seconds(
    sub, input_shape, device=None, repeats=5, iterations=ITERATIONS, input_dtype=tf.float32
):
    """Per layer of `sub` (params), (forward, backward) seconds on `device` for inputs of
    `input_shape` (one micro-batch; zeros of `input_dtype`, e.g. int32 token ids): backward =
    forward + backward measured, less forward."""
    device = device or '/device:CPU:0'
    with tf.device(device):
        args = (tf.zeros(input_shape, input_dtype),)
    result = []
    with fprop_context.scope(step=0):
        for p in sub:
            with tf.device(device):
                layer = p.Instantiate()

            def forward(a, layer=layer):
                return tf.add_n([tf.reduce_sum(o) for o in _floats(layer.FProp(*a))])

            def forward_backward(a, layer=layer):
                inputs = _floats(a)
                with tf.GradientTape() as tape:
                    tape.watch(inputs)
                    outs = _floats(layer.FProp(*a))
                grads = tape.gradient(outs, inputs + list(layer.trainable_variables))
                return tf.add_n([tf.reduce_sum(g) for g in grads if g is not None] + [0.0])

            f = _slope(_repeated(device, forward, args), repeats, iterations)
            fb = _slope(_repeated(device, forward_backward, args), repeats, iterations)
            result.append((f, max(fb - f, 0.0)))
            with tf.device(device):
                out = layer.FProp(*args)
            args = out if isinstance(out, tuple) else (out,)
    return result


def link(source, target, sizes=(1 << 16, 1 << 22), repeats=7):
    """(bytes per second, latency seconds) of a tensor sent from `source` to `target`, from the
    time of a round trip (the tensor there, a scalar back) at two sizes."""
    hop = []
    for size in sizes:
        with tf.device(source):
            x = tf.Variable(tf.zeros([size // 4]))

        @tf.function(autograph=False)
        def send(n, x=x):
            def step(i, carry):
                with tf.device(source), tf.control_dependencies([carry]):
                    y = tf.identity(x)  # sent again each pass, after the last one came back
                with tf.device(target):
                    back = tf.reduce_sum(y[:1])  # y crosses; one float comes back
                return i + 1, carry + back * 0.0

            return tf.while_loop(lambda i, _: i < n, step, (tf.constant(0), tf.constant(0.0)))[1]

        hop.append(_slope(send, repeats, (1, 5)))
    (s0, t0), (s1, t1) = zip(sizes, hop)
    bandwidth = (s1 - s0) / max(t1 - t0, 1e-12)
    # A pass is a round trip (the tensor there, a scalar back): a hop's latency is half of
    # what is left of it once the bytes are paid for.
    return bandwidth, max(t0 - s0 / bandwidth, 0.0) / 2


def flops_per_second(device=None, n=512, repeats=5):
    """The float32 matmul rate on `device` (n x n by n x n), an effective rate for the planner."""
    device = device or '/device:CPU:0'
    with tf.device(device):
        a = tf.random.stateless_normal([n, n], [1, 2])
    seconds = _slope(_repeated(device, lambda x: tf.reduce_sum(tf.matmul(x[0], x[0])), (a,)),
                     repeats, ITERATIONS)  # fmt: skip
    return 2 * n**3 / max(seconds, 1e-12)


def this_machine(memory_bytes=None, device=None, link_bytes_per_second=None, link_latency=None):
    """A Device profile for this machine: the matmul rate measured on `device`, the memory of
    the machine (or `memory_bytes`), and a link (measured with `link`; default: none measured,
    an instant link)."""
    if memory_bytes is None:
        memory_bytes = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    return devices.Device(
        devices.THIS_MACHINE,
        int(memory_bytes),
        flops_per_second(device),
        link_bytes_per_second or float('inf'),
        link_latency or 0.0,
    )
