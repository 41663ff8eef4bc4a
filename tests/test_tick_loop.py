"""The tick loop (tick_loop.py) computes what the unrolled executor computes, and its program
does not grow with M.

Exactness is checked against the unrolled executor (itself checked against the plain layer
sequence in test_pipelined_layer.py) on the same weights: every schedule and recompute policy,
with dropout (each micro-batch's mask), a sparse embedding gradient, the outputs, and no
targets. The program: nodes of the traced step, outer graph and function library, equal at
M=4 and M=8.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests import placement_testing
from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import schedules, tick_loop

K = 2
SCHEDULES = ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble']


def _sub(embedding=False):
    fc = layers.FCLayer.Params().Set(input_dim=6, output_dim=6, activation='TANH')
    drop = layers.DropoutLayer.Params().Set(keep_prob=0.7)
    sub = [fc.Copy().Set(name='fc0'), drop.Copy().Set(name='drop0')]
    sub += [fc.Copy().Set(name=f'fc{i}') for i in range(1, 4)]
    if embedding:
        emb = layers.EmbeddingLayer.Params().Set(vocab_size=5, embedding_dim=6)
        sub = [emb.Set(name='emb')] + sub
    return sub


def _pipe(schedule, policy, m, loop, embedding=False, sub=None):
    v = 2 if schedule == 'interleaved_1f1b' else 1
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            random_seed=1234,  # same weights and dropout masks in both pipelines
            sub=sub or _sub(embedding),
            num_partitions=K,
            partition_by='uniform',
            num_micro_batches=m,
            recompute=policy,
            schedule=schedule,
            virtual_stages=v,
            tick_loop=loop,
        )
        .Instantiate()
    )


def _loss(y, t):
    return tf.reduce_mean(tf.reduce_sum((y - t) ** 2, -1))


def _step(pipe, x, t, outputs=True):
    fn = tf.function(lambda x, t: pipe.ComputeGradients(x, t, _loss, return_outputs=outputs))
    loss, grads, *out = fn(x, t)
    dense = [np.asarray(tf.convert_to_tensor(g)) for g in grads]  # sparse ones too
    return fn, (np.asarray(loss), dense, *tf.nest.map_structure(np.asarray, out))


def _pair(schedule, policy, m=4, embedding=False):
    return _pipe(schedule, policy, m, False, embedding), _pipe(schedule, policy, m, True, embedding)


def _close(got, want):
    loss_a, grads_a, out_a = got
    loss_b, grads_b, out_b = want
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    np.testing.assert_allclose(out_a, out_b, rtol=1e-6, atol=1e-7)
    scale = max(np.max(np.abs(g)) for g in grads_b)
    for ga, gb in zip(grads_a, grads_b):
        np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('policy', ['never', 'except_last', 'always'])
def test_every_schedule_and_policy_equals_the_unrolled_executor(schedule, policy):
    unrolled, loop = _pair(schedule, policy)
    x = tf.random.stateless_normal([8, 6], [1, 2])
    t = tf.random.stateless_normal([8, 6], [3, 4])
    fn, got = _step(loop, x, t)
    _, want = _step(unrolled, x, t)
    _close(got, want)
    # It ran as a loop: one While in the step, not a call per micro-batch.
    ops = [n.op for n in fn.get_concrete_function(x, t).graph.as_graph_def().node]
    assert ops.count('While') + ops.count('StatelessWhile') == 1, sorted(set(ops))


@pytest.mark.parametrize('schedule', ['gpipe', 'zero_bubble'])
def test_a_sparse_gradient_stays_sparse_and_exact(schedule):
    unrolled, loop = _pair(schedule, 'except_last', embedding=True)
    ids = tf.constant([[0], [1], [1], [4], [2], [2], [0], [3]])
    t = tf.random.stateless_normal([8, 1, 6], [3, 4])
    _, got = _step(loop, ids, t)
    _, want = _step(unrolled, ids, t)
    _close(got, want)
    # The embedding's gradient reaches the optimizer sparse, as from TF's tape.
    traced = tf.function(lambda x, t: loop.ComputeGradients(x, t, _loss)[1])
    grads = traced.get_concrete_function(ids, t).structured_outputs
    emb = [g for v, g in zip(loop.trainable_variables, grads) if 'emb' in v.name]
    assert emb and all(isinstance(g, tf.IndexedSlices) for g in emb), emb


def test_no_targets_and_the_program_does_not_grow_with_m():
    def nodes(m):
        pipe = _pipe('1f1b', 'except_last', m, True)
        x = tf.ones([2 * m, 6])
        fn = tf.function(lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y)))
        graph = fn.get_concrete_function().graph.as_graph_def()
        return len(graph.node), sum(len(f.node_def) for f in graph.library.function)

    assert nodes(4) == nodes(8)


def test_steps_it_cannot_run_fall_back_with_a_reason(caplog):
    sched = schedules.build('1f1b', 2, 2)
    micro = [tf.ones([2, 3]), tf.ones([2, 3])]
    assert tick_loop.unsupported(sched, 'always', micro, None) == 'eager execution'
    uneven = [tf.ones([3, 3]), tf.ones([2, 3])]
    reasons = []

    @tf.function(autograph=False)
    def probe():
        reasons.append(tick_loop.unsupported(sched, 'always', uneven, None))
        reasons.append(tick_loop.unsupported(sched, 'always', micro, None))
        return tf.constant(0)

    probe()
    assert reasons == ['micro-batches of different sizes', None]
    # An uneven batch (M does not divide it) still trains, by the unrolled executor, and the
    # log says so (once per reason).
    unrolled, loop = _pair('1f1b', 'always', m=2)
    x = tf.random.stateless_normal([5, 6], [1, 2])
    t = tf.random.stateless_normal([5, 6], [3, 4])
    _close(_step(loop, x, t)[1], _step(unrolled, x, t)[1])
    assert 'runs unrolled' in caplog.text and 'micro-batches of different sizes' in caplog.text


def test_each_tick_sends_only_the_boundary_messages():
    # Loop state lives where it is used: a loop variable, or an identity TF adds around one,
    # left without a device would be placed on the first device and cost two sends per tick.
    pipe = _pipe('1f1b', 'except_last', 4, True)
    x, t = tf.ones([8, 6]), tf.ones([8, 6])
    fn = tf.function(lambda x, t: pipe.ComputeGradients(x, t, _loss))
    graph = fn.get_concrete_function(x, t).graph.as_graph_def()
    (loop,) = [n for n in graph.node if n.op in ('While', 'StatelessWhile')]
    outer = {n.name: n for n in graph.node}
    inputs = [outer[i.split(':')[0]] for i in loop.input if not i.startswith('^')]
    unplaced = [
        n.op
        for n in inputs
        if not n.device and n.attr['dtype'].type != tf.resource.as_datatype_enum  # variables
    ]
    # while_loop's own iteration counter and its bound (the tick counter t is on the first
    # device, as is the loop's condition: no tick waits on an unplaced op, a client's there)
    assert unplaced == ['Const', 'Const'], unplaced
    body = {f.signature.name: f for f in graph.library.function}[loop.attr['body'].func.name]
    nodes = {n.name: n for n in body.node_def}
    crossing = []
    for n in body.node_def:
        if not n.device:
            assert n.op in ('AddV2', 'Identity', 'NoOp', 'Const'), (n.op, n.name)
        for i in n.input:
            src = nodes.get(i.lstrip('^').split(':')[0])
            if src is not None and src.device and n.device and src.device != n.device:
                crossing.append((n.op, i.startswith('^')))
    # The forward message (stage 0 -> 1) and the backward one (1 -> 0), one tensor each.
    assert crossing == [('TensorListSetItem', False)] * 2, crossing


def test_a_device_next_tick_waits_for_its_own_action_not_for_every_device():
    """Each device's clock (its next tick) waits for its own action of this tick only: the
    branches are unordered calls (unordered.py), so a tick ends with no barrier across the
    devices, which had run them in lockstep."""
    pipe = _pipe('1f1b', 'except_last', 4, True)
    x, t = tf.ones([8, 6]), tf.ones([8, 6])
    fn = tf.function(lambda x, t: pipe.ComputeGradients(x, t, _loss))
    graph = fn.get_concrete_function(x, t).graph.as_graph_def()
    (loop,) = [n for n in graph.node if n.op in ('While', 'StatelessWhile')]
    body = {f.signature.name: f for f in graph.library.function}[loop.attr['body'].func.name]

    def ancestors(name):
        return placement_testing.ancestors(body, name)

    cases = {n.device[-5:]: n.name for n in body.node_def if n.op.endswith('Case')}
    assert {n.op for n in body.node_def if n.op.endswith('Case')} == {'StatelessCase'}
    assert len(cases) == K
    # A device's clock: its tick count + 1, made after its action (tick_loop._Tick).
    clocks = [
        n
        for n in body.node_def
        if n.op == 'AddV2'
        and n.attr['T'].type == tf.int32.as_datatype_enum
        and any(case in ancestors(n.name) for case in cases.values())
    ]
    assert sorted(c.device[-5:] for c in clocks) == sorted(cases)
    for clock in clocks:
        waits_for = {dev for dev, case in cases.items() if case in ancestors(clock.name)}
        assert waits_for == {clock.device[-5:]}, (clock.name, waits_for)


def test_except_last_recomputes_what_would_wait_across_ticks():
    """Fill-drain's last micro-batch on every cell but the last waits ticks for its output
    gradient: under 'except_last' the loop recomputes it rather than cut every cell into F and
    B (a second trace); the last cell's is one forward-and-backward call. Zero-bubble's kept
    micro-batches stay carried (W reads B's work), and so does everything under 'never'."""

    def loop(name, policy):
        return tick_loop.TickLoop(None, schedules.build(name, 2, 4), policy, 0, 0, None)

    for name in ('gpipe', '1f1b'):
        assert not loop(name, 'except_last').carried and loop(name, 'except_last').fused
    assert loop('zero_bubble', 'except_last').carried
    assert len(loop('gpipe', 'never').carried) == 7  # all but the last cell's last one (fused)


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('num_devices,num_m', [(2, 4), (4, 8), (4, 32)])
def test_the_table_gives_every_action_its_inputs_in_time(schedule, num_devices, num_m):
    """Each device's actions in its order, one per tick; an input from another device at
    least DELAY ticks old, one from the same device older; as long as the schedule simulated
    with F = W = 1 and B = 2 ticks (B = 1 when split)."""
    v = 2 if schedule == 'interleaved_1f1b' else 1
    sched = schedules.build(schedule, num_devices, num_m, v)
    table = tick_loop.TickLoop(None, sched, 'always', 0, 0, None)._Table()
    tick = {}
    for t, row in enumerate(table):
        for d, (kind, s, m) in enumerate(row):
            if kind != 'idle':
                assert sched.device_of(s) == d
                tick[schedules.Action(kind, s, m)] = t

    def inputs(a):  # an action the table leaves out (stage 0's empty B) passes on its own
        for x in schedules.dependencies(sched, a):
            yield from ([x] if x in tick else inputs(x))

    for a, t in tick.items():
        for x in inputs(a):
            lag = 1 if sched.device_of(x.stage) == sched.device_of(a.stage) else tick_loop.DELAY
            assert tick[x] <= t - lag, (a, x)
    for d, acts in enumerate(sched.actions):
        ticks = [tick[a] for a in acts if a in tick]
        assert ticks == sorted(ticks), d
    b = 1.0 if sched.split_backward else 2.0
    cost = {schedules.FORWARD: 1.0, schedules.BACKWARD: b, schedules.WEIGHT: 1.0}
    sim = schedules.simulate(
        sched, 1.0, b, 1.0, transfer=lambda dep, _: tick_loop.DELAY - cost[dep.phase]
    )
    assert len(table) == sim.makespan


def test_zero_bubble_last_cell_runs_f_and_b_as_one_call():
    """Zero-bubble's last cell does B right after F: one call for both (the loss's gradient is
    known at F), so only W's feeds cross ticks to its W; the other cells keep F, B and W."""

    def kinds(policy):
        loop = tick_loop.TickLoop(None, schedules.build('zero_bubble', 2, 4), policy, 0, 0, None)
        assert loop.fused_kept == {(1, m) for m in range(4)}
        return {key for row in loop._Table() for key in ((k, s) for k, s, _ in row)}

    last = {key for key in kinds('except_last') if key[1] == 1}
    assert last == {('FBK', 1), ('WK', 1)}
    assert {('FK', 0), ('BK', 0), ('WK', 0)} <= kinds('never')


@pytest.mark.parametrize(
    'schedule,policy,first_traces,last_traces',
    [
        ('1f1b', 'except_last', 2, 1),
        ('1f1b', 'always', 2, 2),
        ('gpipe', 'except_last', 2, 2),
        ('zero_bubble', 'except_last', 2, 1),
        ('1f1b', 'never', 1, 1),
        ('zero_bubble', 'never', 1, 1),
    ],
)
def test_a_cell_is_traced_only_for_the_calls_its_branches_make(
    schedule, policy, first_traces, last_traces, monkeypatch
):
    """1F1B's last cell under 'except_last' runs only fused forward-and-backward calls: its
    outputs' specs come from that trace, with no forward traced for nothing (a cell's trace
    is most of the loop's). A cell that runs only kept calls (zero-bubble's last; every cell
    under 'never') is traced once, for its F, B and W cut from that trace. Where the cell also
    runs forwards, each is traced once: 'always', forward and recompute; gpipe's fill-drain,
    forward and fused, whose trace its recomputes call (test_fused_backward.py)."""
    calls = []
    fprop = layers.FCLayer.FProp
    monkeypatch.setattr(
        layers.FCLayer, 'FProp', lambda self, x: calls.append(self.params.name) or fprop(self, x)
    )
    pipe = _pipe(schedule, policy, 4, True)
    x = tf.random.stateless_normal([8, 6], [1, 2])
    tf.function(lambda x: pipe.ComputeGradients(x, x, _loss)).get_concrete_function(x)
    assert calls.count('fc3') == last_traces  # fc3 is the last cell's last layer
    assert calls.count('fc0') == first_traces  # the first cell: forward and recompute, or F/B/W


@pytest.mark.parametrize('loop', [True, False])
@pytest.mark.parametrize('schedule', SCHEDULES)
def test_every_function_runs_on_the_device_that_calls_it(schedule, loop):
    """A function traced once and called from several devices (the gradient sums' additions,
    which cells of the same shapes share; a twin's backward) holds no device of its own: from
    device d it runs on d. Traced under the first caller's device scope, every device's
    sums would be added on that device, their lists copied there and back at every backward."""
    fc = layers.FCLayer.Params().Set(input_dim=6, output_dim=6, activation='TANH')
    v = 2 if schedule == 'interleaved_1f1b' else 1
    alike = [fc.Copy().Set(name=f'fc{i}') for i in range(2 * K * v)]  # cells of one shape
    pipe = _pipe(schedule, 'except_last', 4, loop, sub=alike)
    x = tf.random.stateless_normal([8, 6], [1, 2])
    fn = tf.function(lambda x: pipe.ComputeGradients(x, x, _loss))
    graph_def = fn.get_concrete_function(x).graph.as_graph_def()
    assert placement_testing.calls_run_elsewhere(graph_def) == []
    if schedule == 'gpipe':  # FProp under a tape: its loops' calls (forward_loop.py) too

        def taped(x):
            with tf.GradientTape() as tape:
                loss = _loss(pipe.FProp(x), x)
            return tape.gradient(loss, pipe.trainable_variables)

        graph_def = tf.function(taped).get_concrete_function(x).graph.as_graph_def()
        assert placement_testing.calls_run_elsewhere(graph_def) == []
