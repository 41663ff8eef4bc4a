"""The executor under every schedule: `ComputeGradients` equals the plain sequence (loss and
every variable gradient) for every K, M and recompute policy, eager and in tf.function; each
device runs its actions in the schedule's order; micro-batches are recomputed as the policy
says; stored boundaries are freed as soon as their backward used them."""

import numpy as np
import pytest
import tensorflow as tf

from tests import test_pipelined_layer as tpl
from tests.test_pipelined_layer import MODELS, CountingLayer, _assert_close, _plain
from tf_gpipe import fprop_context, gpipe
from tf_gpipe.gpipe import executor, schedules

POLICIES = gpipe.RECOMPUTE_POLICIES
# The stacks under test; 'fc8' has the K*v = 8 cells interleaved K=4, v=2 needs.
STACKS = dict(MODELS, fc8=lambda: tpl._fc_model(num_fc=7))


def _pipe(sub, k, m, policy, schedule, v=1, seed=1, **kw):
    return tpl._pipe(sub, k, m, policy, seed, schedule=schedule, virtual_stages=v, **kw)


def _loss_fn(out, targets):
    y = out.vecs if isinstance(out, dict) else out
    y = tf.cast(y, tf.float32)
    axes = list(range(1, y.shape.rank))
    return tf.reduce_mean(tf.reduce_sum(y * targets, axes))


def _targets(model):
    sub, inputs = STACKS[model]()
    with fprop_context.eval_mode():
        out = _plain(sub).FProp(*inputs)
    y = out.vecs if isinstance(out, dict) else out
    return tf.random.stateless_normal(tf.shape(y), [7, 7])


def _reference(model, step=0):
    sub, inputs = STACKS[model]()
    plain, targets = _plain(sub), _targets(model)
    with fprop_context.scope(step=step), tf.GradientTape() as tape:
        loss = _loss_fn(plain.FProp(*inputs), targets)
    grads = tape.gradient(loss, plain.trainable_variables)
    return (
        loss,
        [],
        {v.name: tf.convert_to_tensor(g) for v, g in zip(plain.trainable_variables, grads)},
    )


def _computed(pipe, model, step=0, function=False):
    _, inputs = STACKS[model]()
    targets = _targets(model)

    def run():
        with fprop_context.scope(step=step):
            return pipe.ComputeGradients(inputs, targets, _loss_fn)

    loss, grads = tf.function(run)() if function else run()
    assert len(grads) == len(pipe.trainable_variables)
    by_name = {v.name: tf.convert_to_tensor(g) for v, g in zip(pipe.trainable_variables, grads)}
    return loss, [], by_name


@pytest.fixture(scope='module')
def references():
    return {model: _reference(model) for model in STACKS}


SCHEDULE_CASES = [('gpipe', 1), ('1f1b', 1), ('zero_bubble', 1), ('interleaved_1f1b', 2)]


@pytest.mark.parametrize('schedule,v', SCHEDULE_CASES)
@pytest.mark.parametrize('k', [1, 2, 4])
@pytest.mark.parametrize('m', [1, 4, 8])
def test_every_schedule_k_m_policy_equals_plain_eager(schedule, v, k, m, references):
    model = 'fc8' if k * v > 6 else 'fc'
    for policy in POLICIES:
        if v > 1 and m % k:  # interleaved runs micro-batches in groups of K: refused, named
            with pytest.raises(ValueError, match=f'num_micro_batches={m} must be a multiple'):
                _computed(_pipe(STACKS[model]()[0], k, m, policy, schedule, v), model)
            continue
        pipe = _pipe(STACKS[model]()[0], k, m, policy, schedule, v)
        _assert_close(_computed(pipe, model), references[model])


@pytest.mark.parametrize('schedule,v', SCHEDULE_CASES)
@pytest.mark.parametrize('model', sorted(MODELS))
def test_every_schedule_and_model_in_tf_function(schedule, v, model, references):
    policies = POLICIES if model != 'transformer' else ('always', 'never')  # time: the slowest
    cases = [(2, 4, policy) for policy in policies]
    if model == 'fc' and v == 1:
        cases.append((4, 8, 'except_last'))
    for k, m, policy in cases:
        pipe = _pipe(MODELS[model]()[0], k, m, policy, schedule, v)
        _assert_close(_computed(pipe, model, function=True), references[model])


@pytest.mark.parametrize('schedule,v', SCHEDULE_CASES)
@pytest.mark.parametrize('model', ['fc', 'transformer'])
def test_a_recorded_step_computes_what_the_plain_sequence_does(schedule, v, model, references):
    """With a timeline recorded, each action runs between two stamps (gpipe/trace.py): the
    values that pass them are copies, which must not cut a kept forward off its tape nor
    change a gradient, under every policy (kept, fused, split B/W and recomputed ones)."""
    from tf_gpipe.gpipe import trace

    for policy in POLICIES:
        pipe = _pipe(STACKS[model]()[0], 2, 4, policy, schedule, v)
        with trace.record() as events:
            got = _computed(pipe, model, function=True)
        assert len(events) == len(schedules.execution_order(pipe.Schedule())), policy
        _assert_close(got, references[model])


def test_a_recorded_fprop_under_a_tape_computes_what_the_plain_sequence_does():
    from tf_gpipe.gpipe import trace

    sub, inputs = STACKS['fc']()
    plain = _plain(sub)
    want = tf.function(lambda *x: tpl._loss_and_grads(plain, x))(*inputs)
    for policy in POLICIES:
        pipe = _pipe(STACKS['fc']()[0], 2, 4, policy, 'gpipe')
        with trace.record() as events:
            got = tf.function(lambda *x, p=pipe: tpl._loss_and_grads(p, x))(*inputs)
        assert len(events) == 16, policy
        _assert_close(got, want)


@pytest.mark.parametrize('schedule,v', SCHEDULE_CASES)
@pytest.mark.parametrize('policy', ['always', 'never'])
def test_each_device_runs_its_actions_in_schedule_order(schedule, v, policy):
    from tests.test_pipelined_layer import (
        _action_ops,
        _ancestors,
        _assert_stamps_follow_the_data,
    )
    from tf_gpipe.gpipe import trace

    pipe = _pipe(MODELS['fc']()[0], 2, 4, policy, schedule, v)
    _, inputs = MODELS['fc']()
    targets = _targets('fc')
    with trace.record() as events:
        tf.function(
            lambda: pipe.ComputeGradients(inputs, targets, _loss_fn)
        ).get_concrete_function()
    sched = pipe.Schedule()
    assert [(e.phase, e.stage, e.micro_batch) for e in events] == [
        tuple(a) for a in schedules.execution_order(sched)
    ]
    for device in range(2):
        on_device = [e for e in events if sched.device_of(e.stage) == device]
        assert [(e.phase, e.stage, e.micro_batch) for e in on_device] == [
            tuple(a) for a in sched.actions[device]
        ]
        for previous, action in zip(on_device, on_device[1:]):
            done = _action_ops(previous)
            assert done and done <= _ancestors(action.start.op), (previous, action)
    _assert_stamps_follow_the_data(events, sched.device_of)


@pytest.mark.parametrize(
    'schedule,policy,counts',
    [
        ('gpipe', 'except_last', [7, 7, 7]),  # M forwards + all but the last recomputed
        ('1f1b', 'except_last', [8, 8, 4]),  # the last stage's backward follows its forward
        ('1f1b', 'always', [8, 8, 8]),
        ('1f1b', 'never', [4, 4, 4]),
        # B and W each recompute; stage 0 computes no input gradient, so its B does nothing.
        ('zero_bubble', 'always', [8, 12, 12]),
    ],
)
def test_forward_counts(schedule, policy, counts):
    """Each cell's forward runs M times plus exactly the recomputes its policy implies."""
    sub = [CountingLayer.Params().Set(name=f'c{i}') for i in range(3)]
    pipe = _pipe(sub, 3, 4, policy, schedule, tick_loop=False)  # the unrolled executor's counts
    x = tf.ones([8, 2])
    tf.function(lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y)))()
    assert [int(cell.sub[0].vars.count) for cell in pipe.cells] == counts


def test_except_last_keeps_what_is_backed_up_next():
    one = schedules.build('1f1b', 3, 4)
    assert executor.kept_micro_batches(one, 'except_last') == {(2, 0), (2, 1), (2, 2), (2, 3)}
    fill = schedules.build('gpipe', 3, 4)
    assert executor.kept_micro_batches(fill, 'except_last') == {(0, 3), (1, 3), (2, 3)}


def test_a_kept_last_cell_backed_up_next_is_one_call_for_f_and_b():
    """Such a micro-batch's F and B are one call: a backward call of its own would hold every
    activation of the cell until its last weight gradient (peak memory, docs/engine.md)."""
    one = schedules.build('1f1b', 3, 4)
    kept = executor.kept_micro_batches(one, 'never')
    assert executor.fusable(one, kept) == {(2, 0), (2, 1), (2, 2), (2, 3)}
    fill = schedules.build('gpipe', 3, 4)
    assert executor.fusable(fill, kept) == {(2, 3)}
    assert executor.fusable(schedules.build('zero_bubble', 3, 4), kept) == set()

    sub = [CountingLayer.Params().Set(name=f'c{i}') for i in range(3)]
    pipe = _pipe(sub, 3, 4, 'never', '1f1b', tick_loop=False)  # the unrolled executor's calls
    x = tf.ones([8, 2])
    graph = (
        tf.function(lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y)))
        .get_concrete_function()
        .graph
    )
    # The fused call's outputs are a loss and gradients, which no tape differentiates: it
    # goes through a trampoline (call_op.py), a function whose body is the one call.
    inner = {
        f.signature.name: [n.attr['f'].func.name for n in f.node_def if 'f' in n.attr]
        for f in graph.as_graph_def().library.function
    }
    called = [
        name
        for op in graph.get_operations()
        if op.type in ('StatefulPartitionedCall', 'PartitionedCall')
        for name in [op.get_attr('f').name] + inner.get(op.get_attr('f').name, [])
    ]
    assert sum('ForwardBackward' in f for f in called) == 4, called
    # The other two cells' kept micro-batches: a forward and TF's derived backward each.
    assert sum('__backward_' in f for f in called) == 8, called


def test_fprop_under_a_tape_needs_compute_gradients_for_other_schedules():
    pipe = _pipe(MODELS['fc']()[0], 2, 4, 'always', '1f1b')
    with pytest.raises(ValueError, match='use loss, grads = pipe.ComputeGradients'):
        pipe.FProp(tf.ones([8, 8]))
    with fprop_context.eval_mode():  # eval works for every schedule
        want = _plain(MODELS['fc']()[0]).FProp(tf.ones([8, 8]))
        np.testing.assert_allclose(pipe.FProp(tf.ones([8, 8])), want, rtol=1e-5, atol=1e-6)


def test_loss_fn_errors_are_clear():
    pipe = _pipe(MODELS['fc']()[0], 2, 2, 'always', '1f1b')
    with pytest.raises(ValueError, match='must return a scalar'):
        pipe.ComputeGradients(tf.ones([4, 8]), None, lambda y, t: y)


class _Stateful(CountingLayer):
    """Changes a variable in its forward, and does not say that repeating it is harmless."""

    RECOMPUTE_REPEATS_STATE = False


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_layer_that_assigns_in_its_forward_is_refused_under_recompute(schedule):
    sub = [CountingLayer.Params().Set(name='c0'), _Stateful.Params().Set(name='s1')]
    x = tf.ones([4, 2])

    def step(pipe):
        return tf.function(lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y)))()

    with pytest.raises(
        ValueError, match=r"Layer 's1' \(_Stateful\) assigns its variable 's1/count"
    ):
        step(_pipe(sub, 2, 2, 'always', schedule))
    loss, _ = step(_pipe(sub, 2, 2, 'never', schedule))  # nothing recomputed: fine
    np.testing.assert_allclose(loss, 1.5 * 1.5)


def test_keras_spectral_normalization_is_refused_under_recompute():
    import keras

    from tf_gpipe import layers

    sn = layers.KerasLayer.Params().Set(
        name='sn',
        keras_layer='SpectralNormalization',
        config=keras.layers.SpectralNormalization(keras.layers.Dense(4)).get_config(),
        input_shape=(None, 4),
    )
    fc = layers.FCLayer.Params().Set(name='fc', input_dim=4, output_dim=4)
    pipe = _pipe([fc, sn], 2, 2, 'except_last', 'gpipe')
    with pytest.raises(ValueError, match="Layer 'sn' \\(KerasLayer\\) assigns its variable"):
        pipe.ComputeGradients(tf.ones([4, 4]), None, lambda y, t: tf.reduce_mean(y))
