"""Grappler on the cells' functions (grappler.py): off by default, on when asked for.

Pinned here: a call created inside `calls(False)` carries Grappler off in its options and one
created outside keeps TF's; the option is set back afterwards (after an error too) and scopes
nest; a program that turned Grappler off or asked it for mixed precision is left alone; the
raw call's options match; and in a pipeline step every call of a cell's function (forward,
backward, shared twin backward, zero-bubble's F/B/W) is made so, or with Grappler when
`cell_grappler=True`, whose gradients are checked in test_pipelined_layer.py; our own
helpers' calls (the gradient sums, the carried residuals' packing) run without it whatever
the option.
"""

import pytest
import tensorflow as tf

from tf_gpipe import gpipe, layers
from tf_gpipe.gpipe import grappler


def _off(config_bytes):
    config = tf.compat.v1.ConfigProto.FromString(config_bytes)
    return config.graph_options.rewrite_options.disable_meta_optimizer


def _call_configs(graph_def, names=None):
    """{called function name: [Grappler off?]} over every call op of the graph and library."""
    out = {}
    bodies = [graph_def.node] + [f.node_def for f in graph_def.library.function]
    for nodes in bodies:
        for node in nodes:
            if node.op in ('StatefulPartitionedCall', 'PartitionedCall'):
                name = node.attr['f'].func.name
                out.setdefault(name, []).append(_off(node.attr['config_proto'].s))
    return out


def _inner():
    return tf.function(lambda x: x * 2.0, experimental_attributes={'_noinline': True})


def _options():
    return tf.config.optimizer.get_experimental_options().get('disable_meta_optimizer', False)


def test_calls_made_inside_the_scope_carry_grappler_off_and_the_option_is_set_back():
    inner = _inner()

    @tf.function
    def outer(x):
        with grappler.calls(False):
            with grappler.calls(False):  # nested: the outer scope restores
                a = inner(x)
            assert _options()
            b = inner(x + 1.0)
        return a + b + inner(x + 2.0)

    graph_def = outer.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    assert not _options()
    (offs,) = _call_configs(graph_def).values()
    assert offs == [True, True, False]  # the last call is made outside the scope
    assert float(tf.reduce_sum(outer(tf.ones([2])))) == 2.0 * (2 + 4 + 6)


def test_the_option_is_set_back_after_an_error():
    with pytest.raises(RuntimeError):
        with grappler.calls(False):
            assert _options()
            raise RuntimeError('boom')
    assert not _options()


def test_optimize_true_changes_nothing():
    inner = _inner()

    @tf.function
    def outer(x):
        with grappler.calls(True):
            assert not _options()
            return inner(x)

    graph_def = outer.get_concrete_function(tf.TensorSpec([2])).graph.as_graph_def()
    assert list(_call_configs(graph_def).values()) == [[False]]
    assert grappler.config_proto(True) == b''
    assert _off(grappler.config_proto(False))


@pytest.mark.parametrize(
    'options', [{'disable_meta_optimizer': True}, {'auto_mixed_precision': True}]
)
def test_a_program_that_chose_grappler_options_is_left_alone(monkeypatch, options):
    set_calls = []
    monkeypatch.setattr(tf.config.optimizer, 'get_experimental_options', lambda: dict(options))
    monkeypatch.setattr(tf.config.optimizer, 'set_experimental_options', set_calls.append)
    with grappler.calls(False):
        pass
    assert set_calls == []
    # Mixed precision is only Grappler's: a raw call keeps TF's options then.
    mixed = 'auto_mixed_precision' in options
    assert (grappler.config_proto(False) == b'') == mixed


def _layers(n):
    fc = layers.FCLayer.Params().Set(input_dim=4, output_dim=4, activation='TANH')
    return [fc.Copy().Set(name=f'fc{i}') for i in range(n)]


def _step_calls(schedule, policy, cell_grappler, loop=False):
    """`_call_configs` of a ComputeGradients step's graph."""
    pipe = (
        gpipe.PipelinedLayer.Params()
        .Set(
            name='pipe',
            sub=_layers(8),
            num_partitions=4,
            partition_by='uniform',
            num_micro_batches=4,
            recompute=policy,
            schedule=schedule,
            cell_grappler=cell_grappler,
            tick_loop=loop,
        )
        .Instantiate()
    )
    x = tf.random.stateless_normal([8, 4], [1, 2])
    step = tf.function(lambda: pipe.ComputeGradients(x, None, lambda y, t: tf.reduce_mean(y * y)))
    return _call_configs(step.get_concrete_function().graph.as_graph_def())


def _cell_calls(schedule, policy, cell_grappler):
    # Calls of our own helpers (sums, carried values) are not cells': keep the cells' only.
    cell_fns = ('_Forward', 'Backward', 'cut_')
    return {
        name: offs
        for name, offs in _step_calls(schedule, policy, cell_grappler).items()
        if any(part in name for part in cell_fns)
    }


@pytest.mark.parametrize(
    'schedule,policy',
    [
        ('1f1b', 'except_last'),
        ('gpipe', 'never'),
        ('zero_bubble', 'never'),
        ('zero_bubble', 'except_last'),
    ],
)
def test_every_cell_call_of_a_step_follows_cell_grappler(schedule, policy):
    calls = _cell_calls(schedule, policy, False)
    kinds = {'forward': '_Forward_', 'backward': 'Backward'}
    if (schedule, policy) == ('zero_bubble', 'never'):
        kinds = {'F': 'cut_forward', 'B': 'cut_backward', 'W': 'cut_weights'}
    elif schedule == 'zero_bubble':  # recomputed B and W: parts cut from the shared backward
        kinds = {'B': 'Backward_inputs', 'W': 'Backward_variables'}
    for kind, part in kinds.items():
        assert any(part in name for name in calls), (kind, sorted(calls))
    # No exception: the first cell's part of its twins' shared backward is cut from the trace
    # (recompute.py), not pruned by Grappler.
    assert all(all(offs) for offs in calls.values()), calls
    calls = _cell_calls(schedule, policy, True)
    assert calls and not any(any(offs) for offs in calls.values()), calls


def test_cells_run_without_grappler_by_default():
    """The default, for PipelinedLayer and a task's pipeline: the cells' functions as traced."""
    from tf_gpipe.tasks import base_task

    assert gpipe.PipelinedLayer.Params().cell_grappler is False
    assert base_task.BaseTask.Params().pipeline.cell_grappler is False


@pytest.mark.parametrize('loop', [False, True], ids=['unrolled', 'tick_loop'])
def test_the_gradient_sums_calls_run_without_grappler_whatever_the_cells_option(loop):
    """Adding a micro-batch's gradients to the sums (and reading the loop's sums out) gives
    Grappler nothing to do: its pass per device would only lengthen the first call."""
    for cell_grappler in (False, True):
        calls = _step_calls('1f1b', 'except_last', cell_grappler, loop)
        parts = ('_add_entries', '_get_all_entries') if loop else ('_accumulate',)
        for part in parts:
            sums = [offs for name, offs in calls.items() if part in name]
            assert sums and all(all(offs) for offs in sums), (part, sorted(calls))


def test_the_carried_residuals_packing_runs_without_grappler_whatever_the_cells_option():
    """A kept micro-batch's small residuals cross the tick loop packed into one vector per
    dtype (carried.py): reshapes, a concat and a split, nothing for Grappler to do."""
    for cell_grappler in (False, True):
        # Under 'never' every cell keeps its micro-batches, their residuals small.
        calls = _step_calls('1f1b', 'never', cell_grappler, loop=True)
        for way in ('carried_pack', 'carried_unpack'):
            packing = [offs for name, offs in calls.items() if way in name]
            assert packing and all(all(offs) for offs in packing), (way, sorted(calls))
