"""PipelinedLayer: exactness against the plain sequence for every K, M and recompute policy,
dropout and batch-norm semantics, recompute counts, eval, dtypes, XLA and errors."""

import numpy as np
import pytest
import tensorflow as tf

from tests.placement_testing import bulk_unplaced
from tf_gpipe import base_layer, fprop_context, gpipe, layers
from tf_gpipe.gpipe import trace
from tf_gpipe.nested_map import NestedMap

K_VALUES = (1, 2, 4)
M_VALUES = (1, 2, 4, 8)
POLICIES = gpipe.RECOMPUTE_POLICIES


def _fc_model(num_fc=5):
    fc = layers.FCLayer.Params().Set(input_dim=8, output_dim=8, activation='TANH')
    sub = [fc.Copy().Set(name=f'fc{i}') for i in range(num_fc)]
    sub.append(layers.SoftmaxLayer.Params().Set(name='logits', input_dim=8, num_classes=3))
    return sub, (tf.random.stateless_normal([8, 8], [1, 1]),)


def _conv_model():
    conv = layers.Conv2DLayer.Params().Set(activation='RELU')
    sub = [
        conv.Copy().Set(name='conv0', filter_shape=(3, 3, 1, 4)),
        conv.Copy().Set(name='conv1', filter_shape=(3, 3, 4, 4), filter_stride=(2, 2)),
        layers.PoolingLayer.Params().Set(name='pool', pooling_type='AVG'),
        conv.Copy().Set(name='conv2', filter_shape=(1, 1, 4, 6), activation='TANH'),
        layers.GlobalPoolingLayer.Params().Set(name='gap'),
        layers.FCLayer.Params().Set(name='fc', input_dim=6, output_dim=3, activation='NONE'),
    ]
    return sub, (tf.random.stateless_normal([8, 8, 8, 1], [2, 2]),)


def _transformer_model():
    tr = layers.TransformerLayer.Params().Set(input_dim=8, num_heads=2, hidden_dim=16, causal=True)
    sub = [tr.Copy().Set(name=f'tr{i}') for i in range(4)]
    paddings = tf.constant([[0, 0, 0, 0, 1]] * 4 + [[0, 0, 0, 0, 0]] * 4, tf.float32)
    state = NestedMap(vecs=tf.random.stateless_normal([8, 5, 8], [3, 3]), paddings=paddings)
    return sub, (state,)


MODELS = {'fc': _fc_model, 'conv': _conv_model, 'transformer': _transformer_model}


def _plain(sub, seed=1):
    return (
        layers.SequentialLayer.Params().Set(name='plain', sub=sub, random_seed=seed).Instantiate()
    )


def _pipe(sub, k, m, policy, seed=1, **kw):
    return (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=sub,
            num_partitions=k,
            partition_by='uniform',
            num_micro_batches=m,
            recompute=policy,
            random_seed=seed,
        )
        .Set(**kw)
        .Instantiate()
    )


def _outputs_tensor(out):
    return out.vecs if isinstance(out, dict) else out


def _loss_and_grads(layer, inputs, step=0):
    """Loss, d loss / d float inputs, and {variable name: gradient}."""
    floats = [x for x in tf.nest.flatten(inputs) if x.dtype.is_floating]
    with fprop_context.scope(step=step), tf.GradientTape() as tape:
        tape.watch(floats)
        y = tf.cast(_outputs_tensor(layer.FProp(*inputs)), tf.float32)
        loss = tf.reduce_sum(y * tf.random.stateless_normal(tf.shape(y), [9, 9]))
    variables = layer.trainable_variables
    grads = tape.gradient(loss, floats + list(variables))
    d_inputs = [tf.zeros_like(x) if g is None else g for x, g in zip(floats, grads)]
    by_name = {v.name: tf.convert_to_tensor(g) for v, g in zip(variables, grads[len(floats) :])}
    assert len(by_name) == len(variables)
    return loss, d_inputs, by_name


def _assert_close(got, want, rtol=1e-5):
    """Relative 1e-5: elementwise, with an absolute floor of 1e-5 x the largest gradient (so a
    gradient that is zero in exact arithmetic, e.g. attention's key bias, compares as noise)."""
    loss1, dx1, dv1 = got
    loss2, dx2, dv2 = want
    np.testing.assert_allclose(loss1, loss2, rtol=rtol)
    for a, b in zip(dx1, dx2):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.abs(b).max() + 1e-30))
    assert sorted(dv1) == sorted(dv2)
    scale = max(float(np.abs(g).max()) for g in dv2.values())
    for name in dv2:
        np.testing.assert_allclose(dv1[name], dv2[name], rtol=rtol, atol=rtol * scale, err_msg=name)


@pytest.fixture(scope='module')
def references():
    """Plain-sequence loss and gradients per model (computed once)."""
    out = {}
    for name, build in MODELS.items():
        sub, inputs = build()
        out[name] = _loss_and_grads(_plain(sub), inputs)
    return out


# Every model x K x M, except M=2 on the Transformer (the slowest stack; M=1, 4, 8 cover it).
EAGER_CASES = [
    (model, k, m)
    for model in sorted(MODELS)
    for k in K_VALUES
    for m in M_VALUES
    if not (model == 'transformer' and m == 2)
]


@pytest.mark.parametrize('model,k,m', EAGER_CASES)
def test_exact_gradients_every_k_m_policy(model, k, m, references):
    """Loss, input gradient and every variable gradient equal the plain sequence's (eager)."""
    sub, inputs = MODELS[model]()
    for policy in POLICIES:
        pipe = _pipe(sub, k, m, policy)
        assert pipe.num_cells == k
        _assert_close(_loss_and_grads(pipe, inputs), references[model])


@pytest.mark.parametrize('policy', POLICIES)
def test_fprop_under_a_tape_after_compute_gradients_is_exact(policy, references):
    """Eager FProp under a tape once ComputeGradients has traced the cells: every variable
    gets its gradient (tf.custom_gradient sees only variable reads a tape records, and the
    cells' forwards run untaped; 'always' gave the first cell's variables none)."""
    sub, inputs = MODELS['fc']()
    pipe = _pipe(sub, 2, 4, policy)
    pipe.ComputeGradients(inputs[0], None, lambda y, t: tf.reduce_sum(y))
    _assert_close(_loss_and_grads(pipe, inputs), references['fc'])


@pytest.mark.parametrize(
    'model,k,m', [('fc', 2, 4), ('conv', 2, 4), ('transformer', 2, 4), ('fc', 4, 8)]
)
def test_exact_gradients_in_tf_function(model, k, m, references):
    """The same inside tf.function: control dependencies, Grappler and all."""
    sub, inputs = MODELS[model]()
    for policy in POLICIES:
        pipe = _pipe(sub, k, m, policy)
        step = tf.function(lambda *x, pipe=pipe: _loss_and_grads(pipe, x))
        _assert_close(step(*inputs), references[model])


def _dropout_model():
    fc = layers.FCLayer.Params().Set(input_dim=8, output_dim=8, activation='RELU')
    drop = layers.DropoutLayer.Params().Set(keep_prob=0.7)
    sub = []
    for i in range(4):
        sub += [fc.Copy().Set(name=f'fc{i}'), drop.Copy().Set(name=f'drop{i}')]
    return sub, (tf.random.stateless_normal([8, 8], [4, 4]),)


@pytest.mark.parametrize('m', [1, 4])
def test_dropout_identical_across_k_and_policies(m):
    sub, inputs = _dropout_model()
    want = _loss_and_grads(_pipe(sub, 1, m, 'never'), inputs, step=3)
    for k in (2, 4):
        for policy in POLICIES:
            pipe = _pipe(sub, k, m, policy)
            got = tf.function(lambda pipe=pipe: _loss_and_grads(pipe, inputs, step=3))()
            _assert_close(got, want)
    # Dropout is really on: another step draws other masks, and eval differs.
    other = _loss_and_grads(_pipe(sub, 2, m, 'always'), inputs, step=4)
    assert not np.allclose(other[0], want[0])


def test_dropout_with_one_micro_batch_equals_plain():
    sub, inputs = _dropout_model()
    _assert_close(
        _loss_and_grads(_pipe(sub, 4, 1, 'always'), inputs, step=5),
        _loss_and_grads(_plain(sub), inputs, step=5),
    )


def _bn_model():
    fc = layers.FCLayer.Params().Set(input_dim=6, output_dim=6, activation='NONE')
    bn = layers.BatchNormLayer.Params().Set(dim=6, decay=0.5)
    sub = [
        fc.Copy().Set(name='fc0'),
        bn.Copy().Set(name='bn0'),
        fc.Copy().Set(name='fc1'),
        bn.Copy().Set(name='bn1'),
        fc.Copy().Set(name='fc2'),
    ]
    x = tf.random.stateless_normal([8, 6], [5, 5]) * 3.0 + 2.0
    return sub, (x,)


def _bn_stats(layer):
    return {v.name: v.numpy() for v in layer.variables if 'moving' in v.name}


def test_batch_norm_micro_batch_statistics_and_moving_averages():
    sub, (x,) = _bn_model()
    m = 4
    # Reference: the plain sequence run micro-batch by micro-batch, losses summed.
    plain = _plain(sub)

    class _PerMicroBatch:
        trainable_variables = plain.trainable_variables

        @staticmethod
        def FProp(x):
            return tf.concat([plain.FProp(xm) for xm in tf.split(x, m)], 0)

    want = _loss_and_grads(_PerMicroBatch, (x,))
    plain.PostTrainingStepUpdate()
    want_stats = _bn_stats(plain)
    # The first BN's moving mean moved toward the full-batch statistics of its input.
    fc0 = plain.sub[0].FProp(x)
    mean, var = tf.nn.moments(fc0, [0])
    np.testing.assert_allclose(want_stats['bn0/moving_mean:0'], 0.5 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want_stats['bn0/moving_variance:0'], 0.5 + 0.5 * var, rtol=1e-5)
    for k in (1, 2, 4):
        for policy in POLICIES:
            pipe = _pipe(sub, k, m, policy)
            got = tf.function(lambda pipe=pipe: _loss_and_grads(pipe, (x,)))()
            _assert_close(got, want)
            pipe.PostTrainingStepUpdate()
            stats = _bn_stats(pipe)
            assert sorted(stats) == sorted(want_stats)
            for name, value in want_stats.items():
                np.testing.assert_allclose(stats[name], value, rtol=1e-5, atol=1e-6)


class CountingLayer(base_layer.BaseLayer):
    """y = scale * x; counts how often its forward runs (in a variable, so graphs count too)."""

    RECOMPUTE_REPEATS_STATE = True  # counting the recomputes is the point

    def __init__(self, params):
        super().__init__(params)
        self.CreateVariable('scale', [], init=base_layer.WeightInit.Constant(1.5))
        self.CreateVariable(
            'count', [], init=base_layer.WeightInit.Constant(0), dtype=tf.int64, trainable=False
        )

    def FProp(self, x):
        with tf.control_dependencies([self.vars.count.assign_add(1)]):
            return x * self.vars.scale

    @classmethod
    def FPropMeta(cls, p, x):
        return base_layer.Meta(1, base_layer.to_shape(x), 1, 0)


@pytest.mark.parametrize('policy,recomputes', [('always', 4), ('except_last', 3), ('never', 0)])
def test_forward_counts(policy, recomputes):
    """Each cell's forward runs M times plus exactly the recomputes its policy implies."""
    sub = [CountingLayer.Params().Set(name=f'c{i}') for i in range(3)]
    # The unrolled executor's counts (FProp's loops run 'except_last' as 'always').
    pipe = _pipe(sub, 3, 4, policy, tick_loop=False)
    x = tf.ones([8, 2])

    @tf.function
    def step():
        return _loss_and_grads(pipe, (x,))

    step()
    counts = [int(cell.sub[0].vars.count) for cell in pipe.cells]
    assert counts == [4 + recomputes] * 3
    with fprop_context.eval_mode():
        tf.function(lambda: pipe.FProp(x))()
    assert [int(cell.sub[0].vars.count) for cell in pipe.cells] == [4 + recomputes + 4] * 3


def test_eval_is_forward_only_and_equals_plain():
    sub = _dropout_model()[0] + _bn_model()[0][1:2]  # dropout and batch norm behave in eval
    sub[-1] = sub[-1].Copy().Set(dim=8)
    x = tf.random.stateless_normal([8, 8], [6, 6])
    plain, pipe = _plain(sub), _pipe(sub, 4, 4, 'always')
    with fprop_context.eval_mode():
        want = plain.FProp(x)
        np.testing.assert_allclose(pipe.FProp(x), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(tf.function(lambda: pipe.FProp(x))(), want, rtol=1e-5, atol=1e-6)


def test_cells_and_variables_live_on_their_devices():
    sub, _ = _fc_model()
    pipe = _pipe(sub, 4, 2, 'always')
    for cell, device in zip(pipe.cells, pipe.devices):
        for v in cell.trainable_variables:
            assert v.device.endswith(device.split('device:')[-1]), (v.device, device)
    assert pipe.devices[3].endswith('CPU:3')


@pytest.mark.parametrize('replicas', [1, 2])
def test_every_op_of_a_step_is_placed(replicas):
    # On a TF cluster an op without a device runs on the client: the batch (or the output, or
    # a gradient) would travel there and back, and the client would compute in the pipeline.
    sub, (x,) = _fc_model()
    pipe = _pipe(sub, 2, 4, 'except_last', num_replicas=replicas)
    variables = pipe.trainable_variables

    def train():
        with tf.GradientTape() as tape:
            out = pipe.FProp(x)
            with tf.device(pipe.devices[-1]):
                loss = tf.reduce_sum(out * out)
        with tf.device(pipe.devices[-1]):
            return tape.gradient(loss, variables)

    def evaluate():
        with fprop_context.eval_mode():
            return pipe.FProp(x)

    for fn in (train, evaluate):
        assert bulk_unplaced(tf.function(fn).get_concrete_function().graph) == []


def test_cell_tpl_and_splits():
    sub, inputs = _fc_model()
    seq = layers.SequentialLayer.Params()
    cells = [seq.Copy().Set(name='a', sub=sub[:2]), seq.Copy().Set(name='b', sub=sub[2:])]
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(name='pipe', cell_tpl=cells, num_micro_batches=2, random_seed=1)
        .Instantiate()
    )
    assert pipe.num_cells == 2
    _assert_close(_loss_and_grads(pipe, inputs), _loss_and_grads(_plain(sub), inputs))
    split = _pipe(sub, 1, 2, 'always', splits=[1, 5, 6])
    assert split.num_cells == 3 and [len(c.sub) for c in split.cells] == [1, 4, 1]
    # splits and a num_partitions that disagree: refused, not 3 cells silently.
    with pytest.raises(ValueError, match=r'makes 3 cells, but num_partitions=2 .* set num_'):
        _pipe(sub, 2, 2, 'always', splits=[1, 5, 6])


def test_partition_by_flops_and_table():
    fc = layers.FCLayer.Params().Set(activation='RELU')
    sub = [
        fc.Copy().Set(name='small', input_dim=4, output_dim=4),
        fc.Copy().Set(name='big', input_dim=4, output_dim=256),
        fc.Copy().Set(name='down', input_dim=256, output_dim=4),
        fc.Copy().Set(name='tiny', input_dim=4, output_dim=4),
    ]
    pipe = _pipe(sub, 2, 1, 'never', partition_by='flops', input_shape=(8, 4))
    assert pipe.splits == [2, 4]
    table = pipe.PartitionTable()
    assert 'small .. big (2)' in table and 'down .. tiny (2)' in table and 'CPU:1' in table


def test_bfloat16_fprop():
    sub, (x,) = _fc_model()
    sub = [p.Copy().Set(fprop_dtype=tf.bfloat16) for p in sub]
    pipe = _pipe(sub, 2, 2, 'always')
    y = pipe.FProp(x)
    assert y.dtype == tf.bfloat16
    loss, _, grads = tf.function(lambda: _loss_and_grads(pipe, (x,)))()
    ref_loss, _, ref_grads = _loss_and_grads(_plain(_fc_model()[0]), (x,))
    np.testing.assert_allclose(loss, ref_loss, rtol=0.05, atol=0.05)
    for name, g in ref_grads.items():
        assert grads[name].dtype == tf.float32
        np.testing.assert_allclose(grads[name], g, atol=0.05 * float(np.abs(g).max()) + 1e-3)


@pytest.mark.parametrize('model', ['fc', 'conv'])
def test_exact_gradients_with_grappler_on_the_cells(model, references):
    """cell_grappler=True (Grappler rewrites the cells' functions; the other tests run them
    as traced, the default) computes the same."""
    sub, inputs = MODELS[model]()
    for policy in POLICIES:
        pipe = _pipe(sub, 2, 4, policy, cell_grappler=True)
        step = tf.function(lambda *x, pipe=pipe: _loss_and_grads(pipe, x))
        _assert_close(step(*inputs), references[model])


def test_jit_compile(references):
    sub, inputs = _fc_model()
    pipe = _pipe(sub, 2, 4, 'except_last', jit_compile=True)
    got = tf.function(lambda: _loss_and_grads(pipe, inputs))()
    _assert_close(got, references['fc'], rtol=1e-5)


def test_integer_inputs_get_no_gradient():
    emb = layers.EmbeddingLayer.Params().Set(name='emb', vocab_size=10, embedding_dim=8)
    fc = layers.FCLayer.Params().Set(name='fc', input_dim=8, output_dim=8)
    ids = tf.constant([[1, 2], [3, 4], [5, 6], [7, 9]])
    pipe, plain = _pipe([emb, fc], 2, 2, 'always'), _plain([emb, fc])
    _assert_close(_loss_and_grads(pipe, (ids,)), _loss_and_grads(plain, (ids,)))


def test_errors_are_clear():
    sub, _ = _fc_model()
    with pytest.raises(ValueError, match='recompute must be one of'):
        _pipe(sub, 2, 2, 'sometimes')
    with pytest.raises(ValueError, match=r'num_partitions=7 is larger than the number of layers'):
        _pipe(sub, 7, 2, 'always')
    with pytest.raises(ValueError, match='5 cells but the device mesh offers only 4'):
        _pipe(sub, 5, 2, 'always')
    with pytest.raises(ValueError, match='2 cells need 2 devices, got 1'):
        _pipe(sub, 2, 2, 'always', devices=['/cpu:0'])
    with pytest.raises(ValueError, match='Unknown device'):
        _pipe(sub, 2, 2, 'always', devices=['/cpu:0', '/gpu:0'])
    with pytest.raises(ValueError, match='set exactly one of cell_tpl'):
        gpipe.PipelinedLayer.Params().Set(name='p').Instantiate()
    bad = [
        layers.FCLayer.Params().Set(name='a', input_dim=8, output_dim=4),
        layers.FCLayer.Params().Set(name='b', input_dim=8, output_dim=4),
    ]
    with pytest.raises(ValueError, match=r'Cell 1 \(cell1\) cannot take its input'):
        _pipe(bad, 2, 2, 'always').FProp(tf.ones([4, 8]))


@pytest.mark.parametrize('policy', ['always', 'except_last', 'never'])
def test_each_device_runs_its_actions_in_schedule_order(policy):
    """In the traced step, each action on a device (a cell call, or a kept forward's ops)
    depends on the device's previous action, so the executor cannot reorder a device's work
    (memory and overlap are pinned)."""
    sub, inputs = _fc_model()
    pipe = _pipe(sub, 2, 4, policy)
    with trace.record() as events:
        tf.function(lambda *x: _loss_and_grads(pipe, x)).get_concrete_function(*inputs)
    assert [(e.phase, e.stage, e.micro_batch) for e in events] == [
        (a.phase, a.stage, a.micro_batch)
        for a in gpipe.schedules.execution_order(gpipe.schedules.build('gpipe', 2, 4))
    ]
    for stage in range(2):
        on_device = [e for e in events if e.stage == stage]
        for previous, action in zip(on_device, on_device[1:]):
            # The previous action (its call, or the ops its end stamp waits for) is among the
            # ancestors of the op that marks this action's start.
            done = _action_ops(previous)
            assert done and done <= _ancestors(action.start.op), (previous, action)
    _assert_stamps_follow_the_data(events)


def _is_stamp(op):
    return op.type.endswith('PartitionedCall') and '_stamp' in op.get_attr('f').name


def _action_ops(event):
    """The ops whose outputs the action's end stamp waits for (the action's results)."""
    assert _is_stamp(event.end.op)
    token = event.end.op.inputs[1].op
    assert token.type == 'PlaceholderWithDefault'  # opaque: no copy of _stamp per action
    token = token.inputs[0].op
    return {op for op in token.control_inputs if not _is_stamp(op)}


def _ancestors(op):
    """Every op `op` depends on through data or control edges."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _assert_stamps_follow_the_data(events, device_of=lambda stage: stage):
    """Each action runs between its stamps, and stamps are chained by the data alone.

    No stamp has a control input (tf.function's automatic control dependencies would chain
    them in program order, across devices). A start stamp waits for the end stamps of the
    actions whose results the action takes (the device's previous action; F's the previous
    stage's F, B's the next stage's B), and for no stamp those do not wait for. An end stamp
    waits for its start and nothing more; every op it waits for runs after that start, or
    before it (an input, a fused call's work), or is a constant."""
    stamps = {op for e in events for op in (e.start.op, e.end.op)}
    by_key = {(e.phase, e.stage, e.micro_batch): e for e in events}
    allowed = {}  # id(event) -> the stamps its start stamp may wait for
    for i, e in enumerate(events):
        for op in (e.start.op, e.end.op):
            assert not op.control_inputs, op
        here = [p for p in events[:i] if device_of(p.stage) == device_of(e.stage)]
        taken = {'F': ('F', e.stage - 1), 'B': ('B', e.stage + 1)}.get(e.phase, ())
        taken = by_key.get(taken + (e.micro_batch,))
        producers = here[-1:] + ([taken] if taken is not None else [])
        before = _ancestors(e.start.op)
        waits = before & stamps
        for p in producers:
            assert p.end.op in waits, (e, 'does not wait for the end of', p)
        allowed[id(e)] = set()
        for p in here + producers:
            allowed[id(e)] |= allowed[id(p)] | {p.start.op, p.end.op}
        assert waits <= allowed[id(e)], (e, waits - allowed[id(e)])
        assert _ancestors(e.end.op) & stamps == waits | {e.start.op}, e
        for op in _action_ops(e):
            source = not op.inputs and not op.control_inputs  # a constant gradient
            assert source or op in before or e.start.op in _ancestors(op), (e, op)


def _replicated(sub, r, k, m, policy='always', **kw):
    return _pipe(sub, k, m, policy, num_replicas=r, **kw)


def test_data_x_pipeline_r2_k2_equals_single_device_training():
    """R=2 replicas of a K=2 pipeline on 4 devices: full-batch gradients, and after optimizer
    steps the same weights as one device training on the whole batch."""
    sub, (x,) = _fc_model()
    pipe = _replicated(sub, 2, 2, 2, random_seed=None)  # copies start equal even unseeded
    assert pipe.replica_devices == [
        [d.name for d in tf.config.list_logical_devices('CPU')][i : i + 2] for i in (0, 2)
    ]
    plain = _plain(sub)
    for v in plain.trainable_variables:  # same start as the pipeline's replica 0
        v.assign(
            next(
                w
                for w in pipe.cells[0].trainable_variables + pipe.cells[1].trainable_variables
                if w.name == v.name
            )
        )
    labels = tf.constant([0, 1, 2, 0, 1, 2, 0, 1])

    def trainer(model):
        # Adam divides by sqrt(v) + epsilon: with the default epsilon a near-zero gradient's
        # last-bit summation-order noise becomes a full-size step. A larger epsilon keeps the
        # update Lipschitz in the gradient, so equal gradients give equal weights.
        optimizer = tf.keras.optimizers.Adam(0.05, epsilon=1e-2)
        softmax = model.AllLayers()[-1]

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = softmax.XentLoss(model.FProp(x), labels).avg_xent
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss, grads

        return step

    pipe_step, plain_step = trainer(pipe), trainer(plain)
    for _ in range(3):
        (loss_p, grads_p), (loss_q, grads_q) = pipe_step(), plain_step()
        np.testing.assert_allclose(loss_p, loss_q, rtol=1e-5)
        # Every copy (both replicas) gets the full-batch gradient of its variable.
        full = {v.name: g for v, g in zip(plain.trainable_variables, grads_q)}
        assert len(grads_p) == 2 * len(full)
        for v, g in zip(pipe.trainable_variables, grads_p):
            np.testing.assert_allclose(g, full[v.name], rtol=1e-5, atol=1e-6, err_msg=v.name)
    want = {v.name: v.numpy() for v in plain.trainable_variables}
    for r in range(2):
        cells = pipe._replica_cells[r]
        got = {v.name: v.numpy() for c in cells for v in c.trainable_variables}
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    for c0, c1 in zip(pipe._replica_cells[0], pipe._replica_cells[1]):
        for a, b in zip(c0.trainable_variables, c1.trainable_variables):
            assert a.device != b.device
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_data_x_pipeline_batch_norm_pools_statistics():
    sub, (x,) = _bn_model()
    two = _replicated(sub, 2, 2, 2)
    one = _replicated(sub, 1, 2, 4)  # the same 4 micro-batches on one replica
    got = tf.function(lambda: _loss_and_grads_named(two, x))()
    want = _loss_and_grads_named(one, x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    two.PostTrainingStepUpdate()
    one.PostTrainingStepUpdate()
    stats = {v.name: v.numpy() for v in one.variables if 'moving' in v.name}
    for cells in two._replica_cells:
        for v in [v for c in cells for v in c.variables if 'moving' in v.name]:
            np.testing.assert_allclose(v.numpy(), stats[v.name], rtol=1e-5, atol=1e-6)


def _loss_and_grads_named(layer, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer.FProp(x) * tf.random.stateless_normal([8, 6], [9, 9]))
    return loss, tape.gradient(loss, layer.trainable_variables)


def test_data_x_pipeline_errors():
    sub, _ = _fc_model()
    with pytest.raises(ValueError, match='3 replicas x 2 stages need 6 devices'):
        _replicated(sub, 3, 2, 1)
