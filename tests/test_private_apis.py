"""The private TF / Keras APIs docs/private-apis.md lists: each import and its behaviour, so an upgrade
that moves or changes one fails here, by name, rather than somewhere deep in a pipeline."""

import numpy as np
import pytest
import tensorflow as tf


def test_stop_recording_pauses_every_active_tape():
    from tensorflow.python.eager.record import stop_recording  # noqa: F401 - the pinned path

    from tf_gpipe.gpipe import executor

    x = tf.constant(2.0)
    with tf.GradientTape(persistent=True) as outer, tf.GradientTape() as inner:
        outer.watch(x)
        inner.watch(x)
        with executor.stop_recording():  # what the executor and the loops call
            y = x * x
        z = x * 3.0
    assert outer.gradient(y, x) is None and inner.gradient(y, x) is None
    assert float(outer.gradient(z, x)) == 3.0


def test_keras_symbolic_scope_flag():
    from keras.src.backend.common.symbolic_scope import SymbolicScope, in_symbolic_scope

    assert not in_symbolic_scope()
    with SymbolicScope():
        assert in_symbolic_scope()


def test_keras_layer_internals_used_by_keras_state():
    """keras_state walks nested layers (`_flatten_layers`), replays `_seed_generators` (each a
    SeedGenerator whose `state` is [seed, counter]), and takes over BatchNormalization's
    training call using `_moments` and `_reduction_axes`, by setting `call` on the instance, as
    it does for MaxPooling2D's (keras_state.recomputing_max_pools)."""
    import keras
    import numpy as np

    inner = keras.layers.Dropout(0.5, seed=1)
    block = keras.Sequential([keras.layers.Dense(4), inner])
    assert inner in block._flatten_layers(include_self=True, recursive=True)
    (gen,) = inner._seed_generators
    assert isinstance(gen, keras.random.SeedGenerator) and tuple(gen.state.shape) == (2,)
    bn = keras.layers.BatchNormalization()
    x = tf.random.normal([6, 3, 5])
    bn.build(x.shape)
    assert list(bn._reduction_axes) == [0, 1]
    mean, variance = bn._moments(x, None)
    want_mean, want_variance = tf.nn.moments(x, [0, 1])
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(variance, want_variance, rtol=1e-5, atol=1e-6)
    bn.call = lambda inputs, training=None, mask=None: inputs * 0 + 7
    assert float(bn(x, training=True)[0, 0, 0]) == 7.0  # __call__ runs the instance's call
    # MaxPooling2D: the same replacement, and the attributes its replacement reads.
    pool = keras.layers.MaxPooling2D(3, strides=2, padding='same')
    assert (pool.pool_size, pool.strides, pool.padding, pool.data_format) == (
        (3, 3),
        (2, 2),
        'same',
        'channels_last',
    )
    pool.call = lambda inputs: inputs[:, :1, :1] * 0 + 5
    assert float(pool(tf.ones([1, 4, 4, 1]))[0, 0, 0, 0]) == 5.0


@pytest.mark.parametrize('kind', ['SGD', 'Adam'])
def test_keras_optimizer_hooks_placement_replaces(kind):
    """placement.colocated wraps `update_step`, `_apply_weight_decay`,
    `_clip_gradients` and `_all_reduce_sum_gradients` on the optimizer instance; apply_gradients
    must still call each of them."""
    import keras

    optimizer = getattr(keras.optimizers, kind)(0.1, weight_decay=0.01, global_clipnorm=1.0)
    names = ('update_step', '_apply_weight_decay', '_clip_gradients', '_all_reduce_sum_gradients')
    called = set()

    def recording(name, original):
        def hook(*args):
            called.add(name)
            return original(*args)

        return hook

    for name in names:
        setattr(optimizer, name, recording(name, getattr(optimizer, name)))
    optimizer.apply_gradients([(tf.constant([0.5, 0.5]), tf.Variable([1.0, 2.0]))])
    assert called == set(names)


def test_mirrored_strategy_takes_copy_devices_from_colocate_with():
    """distribute.stage_variables passes MirroredStrategy's variable creator an object whose
    `_devices` name the copies' devices (mirrored_strategy.py, MirroredExtended._create_variable):
    the only way to put cell k's copies on column k of the mesh."""
    import inspect

    from tensorflow.python.distribute import mirrored_strategy

    from tf_gpipe.runtime import cluster, distribute

    source = inspect.getsource(mirrored_strategy.MirroredExtended._create_variable)
    assert 'colocate_with._devices' in source
    mesh = cluster.DeviceMesh.from_local(num_replicas=2, num_stages=2)
    strategy = mesh.strategy()
    with strategy.scope(), distribute.stage_variables(mesh, 1):
        v = tf.Variable(1.0)
    got = [tf.DeviceSpec.from_string(c.device).device_index for c in v.values]
    assert got == [1, 3]


def test_noinline_function_attribute_is_kept():
    """Cells' forward/backward (recompute.py, split_functions.py) and the loop's helpers
    (ownership.py, tick_loop.py) are tf.functions with the function attribute `_noinline`, so
    TF calls one instantiated function wherever they appear instead of inlining a copy of
    their body at every call site (a step's program would grow with L and M)."""

    @tf.function(autograph=False, experimental_attributes={'_noinline': True})
    def cell(x):
        return x * 2.0

    fdef = cell.get_concrete_function(tf.TensorSpec([2])).function_def
    assert fdef.attr['_noinline'].b is True

    @tf.function(autograph=False)
    def step(x):
        return cell(x) + cell(x + 1.0)

    graph = step.get_concrete_function(tf.TensorSpec([2])).graph
    calls = [op for op in graph.get_operations() if op.type.endswith('PartitionedCall')]
    assert len(calls) == 2 and float(tf.reduce_sum(step(tf.ones([2])))) == 12.0


def test_call_shape_inference_node_attribute_is_honoured():
    """Backward calls and gradient sums (call_op.py) carry the node attribute
    `_disable_call_shape_inference`, so that adding each call to a step's graph does not run
    shape inference over the called cell's whole body. TF honours it: the call's outputs have
    the traced function's shapes, not the ones inference through the body would find."""

    @tf.function(autograph=False)
    def f(x):
        return x * 2.0

    concrete = f.get_concrete_function(tf.TensorSpec([None, 3]))
    shapes = {}

    @tf.function(autograph=False)
    def step(x):
        graph = tf.compat.v1.get_default_graph()
        concrete.add_to_graph(graph)
        for skip in (False, True):
            attrs = {
                'f': tf.compat.v1.AttrValue(func=tf.compat.v1.NameAttrList(name=concrete.name)),
                'Tin': tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(type=[1])),
                'Tout': tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(type=[1])),
            }
            if skip:
                attrs['_disable_call_shape_inference'] = tf.compat.v1.AttrValue(b=True)
            op = graph.create_op('StatefulPartitionedCall', [x], [tf.float32], attrs=attrs)
            shapes[skip] = op.outputs[0].shape
        return op.outputs[0]

    np.testing.assert_array_equal(step(tf.ones([2, 3])), 2 * np.ones([2, 3]))
    assert shapes[False].as_list() == [2, 3], 'TF no longer infers shapes through a call'
    assert shapes[True].rank is None, (
        'TF no longer honours _disable_call_shape_inference: backward calls would be '
        'shape-inferred through the cell again (slower traces; call_op.py)'
    )


def test_op_type_names_and_the_captured_variable_handle():
    """B/W splitting (weight_gradients.py, split_functions.py) finds a variable's reads in a
    traced graph: the variable's handle is captured as a resource Placeholder (found by
    `tf.identity(v.handle).op.inputs[0]`), read by ops of type 'ReadVariableOp' (followed
    through 'Identity' and 'Cast'), written by the assign ops split_functions.WRITE_OPS names."""
    from tf_gpipe.gpipe import split_functions, weight_gradients

    v = tf.Variable(tf.ones([2, 2]))
    seen = {}

    @tf.function(autograph=False)
    def fn(x):
        handle = weight_gradients.captured_handle(v)
        seen['handle'] = (handle.op.type, handle.dtype)
        y = tf.matmul(tf.cast(x, tf.float16), tf.cast(tf.identity(v), tf.float16))
        v.assign_add(tf.ones([2, 2]))
        graph = tf.compat.v1.get_default_graph()
        seen['reads'] = [
            op for op in graph.get_operations()
            if op.type == 'ReadVariableOp' and op.inputs[0] is handle
        ]  # fmt: skip
        seen['types'] = {op.type for op in graph.get_operations()}
        return y

    fn(tf.ones([1, 2]))
    assert seen['handle'] == ('Placeholder', tf.resource)
    assert seen['reads'], 'no ReadVariableOp reads the captured handle'
    assert {'Identity', 'Cast'} <= seen['types']
    assert 'AssignAddVariableOp' in seen['types'] & split_functions.WRITE_OPS


def test_keras_variable_value_is_the_backing_tf_variable():
    """keras/layer.py, keras/state.py and runtime/variables.backing read `KerasVariable.value`:
    under the TF backend it is the tf.Variable itself (its handle, device and .ref() are what
    the pipeline's tapes and placement see)."""
    import keras

    from tf_gpipe.runtime.variables import backing

    v = keras.Variable(tf.ones([3]))
    assert isinstance(v.value, tf.Variable)
    assert v.value is v.value  # one variable, not a fresh read
    assert backing(v) is v.value and backing(v.value) is v.value
    v.assign(tf.zeros([3]))
    assert float(tf.reduce_sum(v.value)) == 0.0


def test_read_only_resource_inputs_attribute_is_honoured():
    """Cell calls made by call_op.py carry `_read_only_resource_inputs` (as TF's own
    tf.function calls do), so that TF's automatic control dependencies do not chain two calls
    that only read one variable (a tied embedding read on two devices would run them in
    lockstep). TF honours it: with it, two reading calls get no control edge; without it,
    the second waits for the first."""
    v = tf.Variable(tf.ones([3]))

    @tf.function(autograph=False)
    def read(h):
        return tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32) * 2.0

    concrete = read.get_concrete_function(tf.TensorSpec([], tf.resource))
    edges = {}

    @tf.function(autograph=False)
    def step():
        graph = tf.compat.v1.get_default_graph()
        concrete.add_to_graph(graph)
        out = []
        for marked in (False, True):
            ops = []
            for _ in range(2):
                attrs = {
                    'f': tf.compat.v1.AttrValue(func=tf.compat.v1.NameAttrList(name=concrete.name)),
                    'Tin': tf.compat.v1.AttrValue(
                        list=tf.compat.v1.AttrValue.ListValue(type=[tf.resource.as_datatype_enum])
                    ),
                    'Tout': tf.compat.v1.AttrValue(list=tf.compat.v1.AttrValue.ListValue(type=[1])),
                }
                if marked:
                    attrs['_read_only_resource_inputs'] = tf.compat.v1.AttrValue(
                        list=tf.compat.v1.AttrValue.ListValue(i=[0])
                    )
                op = graph.create_op(
                    'StatefulPartitionedCall', [v.handle], [tf.float32], attrs=attrs
                )
                ops.append(op)
                out.append(op.outputs[0])
            edges[marked] = ops
        return out

    assert all(np.allclose(t, 2.0) for t in step())
    unmarked, marked = edges[False], edges[True]
    assert unmarked[0] in unmarked[1].control_inputs, 'TF no longer orders unmarked calls'
    assert not (set(marked[1].control_inputs) & set(marked)), (
        'TF no longer honours _read_only_resource_inputs: cell calls that read one variable '
        'would run one after another across devices (call_op.py)'
    )
