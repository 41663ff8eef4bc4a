"""A loop body's per-device branches (unordered.py): without it TF makes every tick wait for
every device's branch (pinned: a TF that stops doing so fails here loudly); with it a device's
next tick waits only for what it reads, and what the branches do still happens."""

import tensorflow as tf

from tests.placement_testing import ancestors
from tf_gpipe.gpipe import unordered


def _node(name):
    """A FunctionDef input ('^n', 'n:output:0') as the node name it comes from."""
    return name.lstrip('^').split(':')[0]


def _two_device_loop(wrap, counter=None):
    """A loop over 3 ticks: each of two devices multiplies its value by its own variable in
    a cond; `wrap` wraps the branches. Returns (the step, its While body's FunctionDef)."""
    with tf.device('CPU:0'):
        w0 = tf.Variable(2.0)
    with tf.device('CPU:1'):
        w1 = tf.Variable(3.0)
    scale0 = tf.function(lambda x: x * w0)
    scale1 = tf.function(lambda x: x * w1)

    def counted(x):
        if counter is not None:
            counter.assign_add(1.0)
        return x + 1.0

    counted = tf.function(counted)

    @tf.function(autograph=False)
    def step():
        def body(t, a, b):
            with tf.device('CPU:0'):
                a = tf.cond(t < 2, wrap(lambda: scale0(a)), wrap(lambda: counted(a)))
            with tf.device('CPU:1'):
                b = tf.cond(t < 3, wrap(lambda: scale1(b)), wrap(lambda: b))
            return t + 1, a, b

        return tf.while_loop(lambda t, *_: t < 3, body, (tf.constant(0), 1.0, 1.0))

    graph = step.get_concrete_function().graph.as_graph_def()
    lib = {f.signature.name: f for f in graph.library.function}
    (loop,) = [n for n in graph.node if n.op in ('While', 'StatelessWhile')]
    return step, lib[loop.attr['body'].func.name]


def _conds(fdef):
    return [n for n in fdef.node_def if n.op in ('If', 'StatelessIf')]


def _device_of_output(fdef, index):
    """The node that returns the body's output `index` (0: t, 1: a, 2: b)."""
    return _node(fdef.ret[fdef.signature.output_arg[index].name])


def test_tf_makes_every_tick_wait_for_every_stateful_branch():
    """The behaviour unordered.py is for. If this fails, TF no longer puts a barrier at the
    end of a loop body: unordered.branch may no longer be needed (docs/private-apis.md)."""
    _, body = _two_device_loop(lambda f: f)
    conds = _conds(body)
    assert len(conds) == 2 and all(c.op == 'If' for c in conds)
    cond_b = [c.name for c in conds if c.device.endswith('CPU:1')][0]
    # Device 0's next value waits for device 1's branch, though it reads nothing from it.
    assert cond_b in ancestors(body, _device_of_output(body, 1))


def test_unordered_branches_leave_each_device_to_its_own_data():
    _, body = _two_device_loop(unordered.branch)
    conds = _conds(body)
    assert len(conds) == 2 and all(c.op == 'StatelessIf' for c in conds)
    by_device = {c.device[-5:]: c.name for c in conds}
    assert by_device['CPU:1'] not in ancestors(body, _device_of_output(body, 1))
    assert by_device['CPU:0'] not in ancestors(body, _device_of_output(body, 2))


def test_what_the_branches_do_still_happens_and_results_are_the_same():
    plain, _ = _two_device_loop(lambda f: f)
    counter = tf.Variable(0.0)
    step, _ = _two_device_loop(unordered.branch, counter)
    _, a, b = step()
    _, a_plain, b_plain = plain()
    # Ticks 0, 1 scale by 2, tick 2 adds 1 (and counts); device 1 scales by 3 three times.
    assert float(a) == float(a_plain) == 5.0 and float(b) == float(b_plain) == 27.0
    assert float(counter) == 1.0  # the stateful op inside the called function ran once
    step()
    assert float(counter) == 2.0


def test_tensor_arrays_come_back_as_lists_on_the_new_flow():
    @tf.function(autograph=False)
    def run():
        ta = tf.TensorArray(tf.float32, size=3, infer_shape=False)

        def write(ta=ta):
            return {'list': ta.write(1, tf.ones([2])), 'n': tf.constant(7)}

        out = unordered.branch(write)()
        assert isinstance(out['list'], tf.TensorArray)
        assert out['n'].shape == []  # static shapes survive the call
        written = out['list'].write(2, tf.zeros([3]))  # a list that still takes writes
        return written.read(1), written.read(2), out['n']

    one, two, n = run()
    assert one.numpy().tolist() == [1.0, 1.0] and two.numpy().tolist() == [0.0, 0.0, 0.0]
    assert int(n) == 7
