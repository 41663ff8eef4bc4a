"""The tf.distribute backend of a DeviceMesh: a standard strategy whose replicas are the mesh's
rows, and the placement of a pipeline's stage k on column k of every replica.

`mesh.strategy()` (cluster.py) calls `strategy_for(mesh)`: a MirroredStrategy over the stage-0
device of every replica. Inside its `scope()`, a pipeline creates cell k's variables under
`stage_variables(k)`, which puts replica r's copy on mesh[r][k]; inside `strategy.run`, replica r
runs its cells on row r (`replica_row`). Gradients and batch-norm statistics are then reduced by
the strategy's own collectives (CollectiveReduceV2), never by an all-reduce of ours.
"""

import contextlib
import weakref

import tensorflow as tf

# Each strategy made by strategy_for, and the mesh it serves.
_MESHES = weakref.WeakKeyDictionary()


class _StageColumn:
    """What MirroredStrategy's variable creator reads from `colocate_with`: one device per
    replica for the copies of a variable (`_devices`). A private contract of TF's
    mirrored_strategy.py (`_create_variable`), pinned by tests/test_private_apis.py."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def strategy_for(mesh):
    """A tf.distribute strategy whose R replicas are the rows of `mesh` (made once per mesh)."""
    found = getattr(mesh, '_strategy', None)
    if found is not None:
        return found
    remote = [d for d in mesh.devices.reshape(-1) if tf.DeviceSpec.from_string(d).job not in
              (None, 'localhost')]  # fmt: skip
    if remote:
        raise NotImplementedError(
            f'mesh.strategy() for devices of a TF cluster ({remote[0]}, ...) is not built yet: '
            'train a cluster mesh with num_replicas on the pipeline (one client), or one '
            'local mesh per process.'
        )
    kinds = {tf.DeviceSpec.from_string(d).device_type for d in mesh.devices.reshape(-1)}
    if 'TPU' in kinds:
        raise NotImplementedError('mesh.strategy() for TPU meshes is not built yet.')
    strategy = tf.distribute.MirroredStrategy(devices=[row[0] for row in mesh.devices])
    mesh._strategy = strategy
    _MESHES[strategy] = mesh
    return strategy


def current_mesh():
    """The mesh of the strategy whose scope is current; None outside any strategy's scope.

    A strategy not made by `mesh.strategy()` raises: its replicas have one device each, so
    it cannot say where a pipeline's other stages go.
    """
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    mesh = _MESHES.get(strategy)
    if mesh is None:
        raise ValueError(
            f'A pipeline was built inside the scope of a {type(strategy).__name__} that does '
            'not come from a DeviceMesh, so its replicas have no devices for the stages after '
            'the first. Use mesh = cluster.DeviceMesh.from_local(num_replicas=R, num_stages=K) '
            'and build inside mesh.strategy().scope().'
        )
    return mesh


@contextlib.contextmanager
def stage_variables(mesh, stage):
    """Variables created inside get one copy per replica, replica r's on mesh[r][stage]."""
    column = _StageColumn(mesh.devices[:, stage])

    def creator(next_creator, **kwargs):
        if kwargs.get('colocate_with') is None:
            kwargs['colocate_with'] = column
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def replica_index():
    """This replica's index inside `strategy.run` (a Python int); 0 in cross-replica context."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or not tf.distribute.has_strategy():
        return 0
    index = tf.get_static_value(ctx.replica_id_in_sync_group)
    if index is None:
        raise NotImplementedError('A replica id known only at run time (TPU) is not supported yet.')
    return int(index)


def in_replica_context():
    """True inside `strategy.run` of a strategy (not the default one)."""
    return tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context() is False


def all_reduce_sum(values):
    """The sum over replicas of `values` (a structure), by the strategy's collectives."""
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, values)
