"""The tf.distribute backend: R=2 replicas x K=2 stages on 4 logical CPUs under mesh.strategy()
(a MirroredStrategy). Replica r's cell k lives and runs on mesh[r][k]; the strategy's collectives
sum the gradients; the result is one pipeline with R*M micro-batches on one row of devices."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_ownership import _tied_lm
from tf_gpipe import fprop_context, gpipe, layers
from tf_gpipe.gpipe import split_functions
from tf_gpipe.keras import GPipe
from tf_gpipe.runtime import cluster, distribute


@pytest.fixture(scope='module')
def mesh():
    return cluster.DeviceMesh.from_local(num_replicas=2, num_stages=2)


def _dev(name):
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


def _replica_of(rows, device):
    rows = [r for r, row in enumerate(rows) if _dev(device) in map(_dev, row)]
    assert len(rows) == 1, device
    return rows[0]


def _bn_dropout_model():
    fc = layers.FCLayer.Params().Set(input_dim=8, output_dim=8, activation='RELU')
    sub = []
    for i in range(3):
        sub += [
            fc.Copy().Set(name=f'fc{i}'),
            layers.BatchNormLayer.Params().Set(name=f'bn{i}', dim=8),
            layers.DropoutLayer.Params().Set(name=f'drop{i}', keep_prob=0.7),
        ]
    return sub


def _pipe(sub, m, schedule, devices=None, tick_loop=False, recompute='except_last'):
    v = 2 if schedule == 'interleaved_1f1b' else 1
    return (
        gpipe.PipelinedLayer.Params()
        .Set(name='pipe', sub=sub, num_partitions=2, partition_by='uniform', devices=devices)
        .Set(num_micro_batches=m, schedule=schedule, recompute=recompute, random_seed=3)
        .Set(virtual_stages=v, tick_loop=tick_loop, eval_loop=tick_loop)
        .Instantiate()
    )


def _loops(graph):
    """The tf.while_loops of a traced step (the tick loop's, FProp's two, eval's)."""
    return [op for op in graph.get_operations() if op.type in ('While', 'StatelessWhile')]


def _mse(y, t):
    return tf.reduce_mean(tf.square(y - t))


def test_mesh_strategy_is_a_mirrored_strategy_with_stage_k_on_column_k(mesh):
    strategy = mesh.strategy()
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy is mesh.strategy() and strategy.num_replicas_in_sync == 2
    with strategy.scope():
        pipe = _pipe(_bn_dropout_model(), 2, 'gpipe')
    rows = pipe.replica_devices
    assert rows == [cluster.check_device_names(row) for row in mesh.devices]
    for k, cell in enumerate(pipe.cells):
        for v in cell.variables:  # trainable, moving averages and per-replica sums alike
            copies = strategy.experimental_local_results(v)
            assert [_dev(c.device) for c in copies] == [_dev(row[k]) for row in rows], v.name


def _distributed_step(strategy, pipe, x, t, loss_fn, tape_fprop=False):
    batch = next(
        iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, t))))
    )

    def replica_step(xb, tb):
        with fprop_context.scope(step=tf.constant(5, tf.int64), training=True):
            if tape_fprop:  # fill-drain as a differentiable op; the loss is the replica's share
                with tf.GradientTape() as tape:
                    share = loss_fn(pipe.FProp(xb), tb) * tf.cast(
                        tf.shape(xb)[0] / tf.shape(x)[0], tf.float32
                    )
                grads = tape.gradient(share, pipe.trainable_variables)
            else:
                share, grads = pipe.ComputeGradients(xb, tb, loss_fn)
        pipe.PostTrainingStepUpdate()
        return share, distribute.all_reduce_sum(grads)

    @tf.function
    def step(batch):
        share, grads = strategy.run(replica_step, batch)
        return strategy.experimental_local_results(share), [
            strategy.experimental_local_results(g) for g in grads
        ]

    shares, per_replica = step(batch)  # the loss shares are summed here, out of the graph
    return sum(float(s) for s in shares), per_replica, step.get_concrete_function(batch).graph


def _reference_step(pipe, x, t, loss_fn):
    with fprop_context.scope(step=tf.constant(5, tf.int64), training=True):
        loss, grads = tf.function(lambda: pipe.ComputeGradients(x, t, loss_fn))()
    pipe.PostTrainingStepUpdate()
    return loss, grads


@pytest.mark.parametrize('tick_loop', [False, True])
@pytest.mark.parametrize('schedule, tape_fprop', [('gpipe', True), ('1f1b', False)])
def test_two_replicas_of_two_stages_train_as_one_pipeline_with_r_times_m(
    mesh, schedule, tape_fprop, tick_loop
):
    """Batch norm (micro-batch statistics, moving averages from the global batch) and dropout
    (replica r's micro-batch m is global micro-batch r*M + m): loss, every gradient and the
    moving averages on both replicas equal one pipeline's with M=4 on one row (1e-5), unrolled
    and on the loops (tick_loop=True: the tick loop, or FProp's forward and backward loops,
    once per replica)."""
    x = tf.random.stateless_normal([16, 8], [1, 2])
    t = tf.random.stateless_normal([16, 8], [3, 4])
    strategy = mesh.strategy()
    with strategy.scope():
        pipe = _pipe(_bn_dropout_model(), 2, schedule, tick_loop=tick_loop)
    ref = _pipe(_bn_dropout_model(), 4, schedule, devices=pipe.replica_devices[0])
    loss, per_replica, graph = _distributed_step(strategy, pipe, x, t, _mse, tape_fprop)
    per_step = (2 if tape_fprop else 1) if tick_loop else 0
    assert len(_loops(graph)) == 2 * per_step, [op.name for op in _loops(graph)]
    want_loss, want = _reference_step(ref, x, t, _mse)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    scale = max(float(np.abs(g).max()) for g in want)
    for copies, w, v in zip(per_replica, want, ref.trainable_variables):
        for g in copies:  # every replica applies the same all-reduced gradient
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=v.name)
    assert float(np.abs(want[0]).max()) > 0
    for mine, theirs in zip(pipe.variables, ref.variables):
        if 'moving' in mine.name:
            for copy in strategy.experimental_local_results(mine):
                np.testing.assert_allclose(copy, theirs, rtol=1e-5, atol=1e-7, err_msg=mine.name)
    moved = [v for v in ref.variables if 'moving_mean' in v.name]
    assert moved and all(float(np.abs(v).max()) > 0 for v in moved)
    # The gradients are summed by the strategy's collective, never by an op of ours that
    # reads two replicas' tensors.
    ops = {op.type for op in graph.get_operations()}
    assert 'CollectiveReduceV2' in ops, sorted(ops)
    for op in graph.get_operations():
        if op.type == 'AddN':
            replicas = {
                _replica_of(pipe.replica_devices, i.op.device) for i in op.inputs if i.op.device
            }
            assert len(replicas) <= 1, (op.name, [i.op.device for i in op.inputs])


@pytest.mark.parametrize(
    'schedule, tick_loop', [('gpipe', False), ('gpipe', True), ('zero_bubble', True)]
)
def test_tied_embedding_under_the_strategy(mesh, schedule, tick_loop):
    """The embedding in cell 0 read by the softmax in cell 1: its sparse and dense gradients
    summed per replica, then over replicas, equal the plain sequence's, unrolled and on the
    tick loop."""
    ids = tf.random.stateless_uniform([8, 6], [1, 1], 0, 16, tf.int32)
    labels = tf.random.stateless_uniform([8, 6], [2, 2], 0, 16, tf.int32)
    plain = layers.SequentialLayer.Params().Set(name='p', sub=_tied_lm(), random_seed=3)
    plain = plain.Instantiate()

    def loss_fn(logits, y):
        return plain.sub[-1].XentLoss(logits, y).avg_xent

    with tf.GradientTape() as tape:
        want_loss = loss_fn(plain.FProp(ids), labels)
    want = tape.gradient(want_loss, plain.trainable_variables)
    strategy = mesh.strategy()
    with strategy.scope():
        pipe = _pipe(_tied_lm(), 2, schedule, tick_loop=tick_loop)
    loss, per_replica, graph = _distributed_step(strategy, pipe, ids, labels, loss_fn)
    assert len(_loops(graph)) == (2 if tick_loop else 0)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    want = {v.name: tf.convert_to_tensor(g) for v, g in zip(plain.trainable_variables, want)}
    scale = max(float(np.abs(g).max()) for g in want.values())
    assert 'emb/emb:0' in want
    for v, copies in zip(pipe.trainable_variables, per_replica):
        for g in copies:
            np.testing.assert_allclose(
                tf.convert_to_tensor(g), want[v.name], rtol=1e-5, atol=1e-5 * scale, err_msg=v.name
            )


SCHEDULES = ['gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble']


@pytest.mark.parametrize(
    'schedule, recompute, tick_loop',
    [(s, r, True) for s in SCHEDULES for r in ('always', 'except_last', 'never')]
    + [('zero_bubble', 'never', False), ('interleaved_1f1b', 'never', False)],
)
def test_every_schedule_and_policy_under_the_strategy(mesh, schedule, recompute, tick_loop):
    """Under the strategy every schedule and recompute policy on the tick loop, and zero-bubble's
    split of a kept micro-batch (F, B and W cut from one trace) unrolled, equal one pipeline
    with R*M micro-batches on one row (batch norm and dropout, 1e-5)."""
    x = tf.random.stateless_normal([16, 8], [5, 6])
    t = tf.random.stateless_normal([16, 8], [7, 8])
    strategy = mesh.strategy()
    with strategy.scope():
        pipe = _pipe(_bn_dropout_model(), 2, schedule, tick_loop=tick_loop, recompute=recompute)
    ref = _pipe(_bn_dropout_model(), 4, schedule, pipe.replica_devices[0], recompute=recompute)
    loss, per_replica, graph = _distributed_step(strategy, pipe, x, t, _mse)
    want_loss, want = _reference_step(ref, x, t, _mse)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    scale = max(float(np.abs(g).max()) for g in want)
    for copies, w, v in zip(per_replica, want, ref.trainable_variables):
        for g in copies:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=v.name)
    assert len(_loops(graph)) == (2 if tick_loop else 0)
    if schedule == 'zero_bubble' and recompute == 'never':  # the cut, not a tape's fallback
        cut = [f for r in pipe._runners[0] for f in r._split.values()]
        assert any(isinstance(f, split_functions.SplitFunctions) for f in cut), cut


def test_eval_under_the_strategy_runs_the_forward_loop(mesh):
    """Eval's FProp inside strategy.run: each replica's share by the forward loop (one per
    replica in the graph), merged, equals the plain sequence's outputs."""
    x = tf.random.stateless_normal([16, 8], [9, 9])
    strategy = mesh.strategy()
    with strategy.scope():
        pipe = _pipe(_bn_dropout_model(), 2, 'gpipe', tick_loop=True)
    plain = layers.SequentialLayer.Params().Set(name='p', sub=_bn_dropout_model(), random_seed=3)
    plain = plain.Instantiate()
    with fprop_context.eval_mode():
        want = plain.FProp(x)
    batch = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(x))))

    @tf.function
    def step(xb):
        def replica(xb):
            with fprop_context.eval_mode():
                return pipe.FProp(xb)

        return strategy.experimental_local_results(strategy.run(replica, (xb,)))

    got = tf.concat(step(batch), 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(_loops(step.get_concrete_function(batch).graph)) == 2


def test_errors_name_the_fix(mesh):
    with mesh.strategy().scope():
        with pytest.raises(ValueError, match='leave num_replicas=1'):
            gpipe.PipelinedLayer.Params().Set(
                name='pipe',
                sub=_bn_dropout_model(),
                num_partitions=2,
                num_replicas=2,
                partition_by='uniform',
            ).Instantiate()
    with tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1']).scope():
        with pytest.raises(ValueError, match=r'mesh.strategy\(\).scope\(\)'):
            _pipe(_bn_dropout_model(), 2, 'gpipe')


def _keras_model(batch_norm):
    keras.utils.set_random_seed(3)
    middle = [keras.layers.BatchNormalization()] if batch_norm else []
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation='relu')]
        + middle
        + [keras.layers.Dense(16, activation='tanh'), keras.layers.Dense(3)]
    )


def _fit(model, optimizer, x, y):
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history['loss']


def DATA():
    x = np.random.RandomState(0).randn(64, 6).astype('float32')
    return x, np.arange(64) % 3


@pytest.mark.parametrize(
    'schedule, optimizer, tick_loop',
    [
        ('gpipe', lambda: keras.optimizers.SGD(0.1, momentum=0.9), False),
        ('1f1b', keras.optimizers.Adam, False),
        ('1f1b', keras.optimizers.Adam, True),
    ],
)
def test_keras_fit_under_the_strategy_equals_one_device(mesh, schedule, optimizer, tick_loop):
    """GPipe built in mesh.strategy().scope(), compile/fit as usual: the history and every
    weight of plain Keras on one device (1e-5), the slots beside their variables. 65 examples
    in batches of 16: the last batch's one example leaves replica 1 an empty share."""
    x, y = DATA()
    x, y = np.concatenate([x, x[:1] + 1.0]), np.concatenate([y, y[:1]])
    plain = _keras_model(batch_norm=False)
    want = _fit(plain, optimizer(), x, y)
    with mesh.strategy().scope():
        model = GPipe(_keras_model(batch_norm=False), num_partitions=2, num_micro_batches=2,
                      schedule=schedule, tick_loop=tick_loop)  # fmt: skip
        got = _fit(model, optimizer(), x, y)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    rows = model.pipeline.replica_devices
    for v in model.optimizer.variables:
        copies = getattr(v.value, 'values', None)
        if copies is not None and v.shape.rank:  # slots, not the step counter
            stage = 0 if _dev(copies[0].device) == _dev(rows[0][0]) else 1
            assert [_dev(c.device) for c in copies] == [_dev(row[stage]) for row in rows], v.path
    np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_keras_batch_norm_under_the_strategy_pools_the_global_batch(mesh, tmp_path):
    """Batch norm: each micro-batch's statistics in training, moving averages from the whole
    global batch (both replicas): equal to one pipeline with R*M micro-batches. Saved, the model
    loads outside the strategy (one replica) and inside it (two) with the same weights."""
    x = np.random.RandomState(1).randn(64, 6).astype('float32')
    y = np.arange(64) % 3
    ref = GPipe(_keras_model(batch_norm=True), num_partitions=2, num_micro_batches=4,
                devices=list(mesh.devices[0]))  # fmt: skip
    want = _fit(ref, keras.optimizers.SGD(0.1), x, y)
    with mesh.strategy().scope():
        model = GPipe(_keras_model(batch_norm=True), num_partitions=2, num_micro_batches=2)
        got = _fit(model, keras.optimizers.SGD(0.1), x, y)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(model.get_weights(), ref.get_weights()):  # incl. the moving averages
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    bn = [w for w in model.weights if 'moving_mean' in w.path]
    assert bn and float(np.abs(bn[0].numpy()).max()) > 0
    for w in bn:
        copies = [c.numpy() for c in w.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
    path = str(tmp_path / 'model.keras')
    model.save(path)
    one = keras.models.load_model(path)
    with mesh.strategy().scope():
        two = keras.models.load_model(path)
    assert int(two.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 8
    for loaded in (one, two):
        for a, b in zip(loaded.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(one.predict(x, verbose=0), ref.predict(x, verbose=0), rtol=1e-5,
                               atol=1e-6)  # fmt: skip


def test_too_few_devices_for_the_mesh_names_the_fix():
    with pytest.raises(ValueError, match=r'need 8 devices; this process has 4.*logical_cpus\(8\)'):
        cluster.DeviceMesh.from_local(num_replicas=4, num_stages=2)


def _workers(tmp_path, workers, overrides):
    """Starts the trainer as each worker of a multi-worker run (the same command everywhere)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for task in range(len(workers)):
        config = {'cluster': {'worker': workers}, 'task': {'type': 'worker', 'index': task}}
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', TF_CONFIG=json.dumps(config))
        command = [
            sys.executable,
            os.path.join(root, 'tools', 'trainer.py'),
            '--model=lm.synthetic.TransformerLmTiny',
            f'--logdir={tmp_path / "mw"}',
            '--multi_worker',
            '--num_logical_cpus=2',
            f'--params_override={overrides}',
        ]
        runs.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=root,
            )  # fmt: skip
        )
    return runs


def _finish(runs, timeout=240):
    try:
        return [run.communicate(timeout=timeout)[1] for run in runs]
    finally:
        for run in runs:
            run.kill()


def test_two_worker_processes_under_multi_worker_mirrored_strategy(tmp_path):
    """Two loopback worker processes x 2 logical CPUs, each running the same trainer command
    (`--multi_worker`, TF_CONFIG naming its task): one replica per worker, cell k on the
    worker's CPU k. Worker 1 is killed (-9) mid-run: worker 0 ends with a clear error within a
    bound; the same two commands resume from the chief's last checkpoint, and the run ends with
    the weights of one process training K=2 with R*M micro-batches for as many steps."""
    import glob
    import re
    import time

    from tests.test_checkpoints import _params, _weights
    from tf_gpipe.runtime import local_cluster
    from tf_gpipe.trainer import trainer

    light = (
        'task.pipeline.num_partitions=2; task.num_layers=2; task.train.save_interval_steps=2; '
        'task.train.log_interval_steps=1'
    )
    workers = [f'127.0.0.1:{p}' for p in local_cluster.free_ports(2)]
    runs = _workers(tmp_path, workers, f'{light}; task.pipeline.num_micro_batches=1; '
                    'task.train.max_steps=100000')  # fmt: skip
    chief = tmp_path / 'mw' / 'checkpoints'
    deadline = time.monotonic() + 240
    while not glob.glob(str(chief / 'ckpt-4.index')) and time.monotonic() < deadline:
        assert all(run.poll() is None for run in runs), _finish(runs)
        time.sleep(0.5)
    runs[1].kill()  # SIGKILL, in the middle of some step
    killed = time.monotonic()
    log = _finish(runs[:1], timeout=180)[0]
    waited = time.monotonic() - killed
    assert runs[0].returncode == 1, log[-3000:]
    assert 'Restart it and run the same command' in log and 'Traceback' not in log, log[-3000:]
    print(f'worker 0 ended {waited:.1f} s after worker 1 was killed')  # shown with pytest -s
    assert waited < 120, waited
    last = int(re.search(r'ckpt-(\d+)', open(chief / 'checkpoint').read()).group(1))
    assert last >= 4
    # The same commands again: both resume from the chief's step `last`, two more steps.
    total = last + 2
    runs = _workers(tmp_path, workers, f'{light}; task.pipeline.num_micro_batches=1; '
                    f'task.train.max_steps={total}')  # fmt: skip
    logs = _finish(runs)
    for task, (run, log) in enumerate(zip(runs, logs)):
        assert run.returncode == 0, log[-3000:]
        assert f'(step {last})' in log and f'Training from step {last} to {total}' in log, log
        assert 'MultiWorkerMirroredStrategy, 2 replicas; trainable variable copies' in log, log
        placed = log.split('trainable variable copies in this process: ')[1].splitlines()[0]
        assert sorted(p.split(' on ')[1] for p in placed.split(', ')) == [
            f'/job:worker/replica:0/task:{task}/device:CPU:{i}' for i in (0, 1)
        ], placed
    one = trainer.Trainer(
        _params(f'{light}; task.pipeline.num_micro_batches=2; task.train.max_steps={total}'),
        str(tmp_path / 'one'),
    )
    with cluster.use_mesh(cluster.DeviceMesh.from_local(num_stages=2)):
        one.Build()
    one.Train()
    for logdir in (tmp_path / 'mw', tmp_path / 'mw' / 'worker_1'):  # the chief's, worker 1's
        reader = tf.train.load_checkpoint(str(logdir / 'checkpoints'))
        assert int(reader.get_tensor('global_step/.ATTRIBUTES/VARIABLE_VALUE')) == total
        for name, value in _weights(one).items():
            got = reader.get_tensor(name + '/.ATTRIBUTES/VARIABLE_VALUE')
            if name.endswith('b_key'):
                # Softmax ignores a bias added to every key: its exact gradient is zero, and
                # both runs' values are Adam's response to rounding noise (summed in another
                # order across workers), which is all the check can ask of them.
                assert np.abs(got).max() < 1e-4 and np.abs(value).max() < 1e-4, name
                continue
            # atol 1e-5: the key projection's gradient is nearly that noise too, and Adam turns
            # noise into steps of the learning rate's size either way.
            np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize('reduction', ['sum', 'mean_with_sample_weight'])
def test_keras_loss_reductions_with_a_regularizer_under_the_strategy(mesh, reduction):
    """1F1B under R=2 replicas shares each reduction out per micro-batch with the regularizer
    counted once over all replicas (Keras divides it by the replicas inside compute_loss):
    the loss and weights of plain Keras on one device."""

    def model():
        keras.utils.set_random_seed(3)
        reg = keras.regularizers.L2(0.05)
        return keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(16, activation='relu', kernel_regularizer=reg),
             keras.layers.Dense(16, activation='tanh'), keras.layers.Dense(3)]
        )  # fmt: skip

    x, y = DATA()
    w = np.random.RandomState(2).uniform(0.1, 2.0, 64).astype('float32')
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)

    def fit(m):
        m.compile(keras.optimizers.SGD(0.1), loss)
        fit = dict(sample_weight=w, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return m.fit(x, y, **fit).history['loss']

    plain = model()
    want = fit(plain)
    with mesh.strategy().scope():
        pipe = GPipe(model(), num_partitions=2, num_micro_batches=2, schedule='1f1b')
        got = fit(pipe)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(pipe.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
