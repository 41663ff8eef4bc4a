"""The tf.distribute backend of a DeviceMesh: a standard strategy whose replicas are the mesh's
rows, and the placement of a pipeline's stage k on column k of every replica.

`mesh.strategy()` (cluster.py) calls `strategy_for(mesh)`: a MirroredStrategy over the stage-0
device of every replica, for a mesh of worker tasks a MultiWorkerMirroredStrategy (one
replica per worker; each worker runs the same program), for a TPU mesh (`cluster.tpu_mesh`) a
TPUStrategy with K cores per replica. Inside its `scope()`, a pipeline creates cell k's
variables under `stage_variables(mesh, k)`, which puts replica r's copy on mesh[r][k] (on TPU:
logical core k of every replica); inside `strategy.run`, replica r (`replica_index()`) runs its
cells on row r, each stage's ops placed by `on(device)` (on TPU: by logical core).
Gradients and batch-norm statistics are reduced by the strategy's own collectives
(CollectiveReduceV2), never by an all-reduce of ours.
"""

import contextlib
import weakref

import tensorflow as tf

# Each strategy made by strategy_for -> the mesh it serves; a device layout -> its strategy.
_MESHES = weakref.WeakKeyDictionary()
_BY_LAYOUT = {}


class _StageColumn:
    """What MirroredStrategy's variable creator reads from `colocate_with`: one device per
    replica for the copies of a variable (`_devices`). A private contract of TF's
    mirrored_strategy.py (`_create_variable`), pinned by tests/test_private_apis.py."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def strategy_for(mesh):
    """A tf.distribute strategy whose R replicas are the rows of `mesh` (made once per mesh):
    MirroredStrategy for this process's devices, MultiWorkerMirroredStrategy for a mesh whose
    row r is worker task r's devices (this process being one of those workers)."""
    if mesh._strategy is not None:
        return mesh._strategy
    # One strategy per device layout and process: two strategies over the same devices would
    # number their collectives alike, and one's all-reduce could meet the other's.
    layout = tuple(mesh.devices.reshape(-1)) + (mesh.num_replicas,)
    if layout in _BY_LAYOUT:
        mesh._strategy, mesh.local_replicas = _BY_LAYOUT[layout]
        return mesh._strategy
    specs = [tf.DeviceSpec.from_string(d) for d in mesh.devices.reshape(-1)]
    if any(s.device_type == 'TPU' for s in specs):
        strategy, local_rows = _tpu(mesh), list(range(mesh.num_replicas))
    elif all(s.job in (None, 'localhost') for s in specs):
        strategy = tf.distribute.MirroredStrategy(devices=[row[0] for row in mesh.devices])
        local_rows = list(range(mesh.num_replicas))
    else:
        strategy, local_rows = _multi_worker(mesh)
    mesh._strategy, mesh.local_replicas = strategy, local_rows
    _MESHES[strategy] = mesh
    _BY_LAYOUT[layout] = strategy, local_rows
    return strategy


def _tpu(mesh):
    """TPUStrategy over the mesh's device assignment: replica r's logical core k is [r][k]."""
    resolver, assignment = mesh.tpu or (None, None)
    if resolver is None:
        raise ValueError(
            'A TPU mesh makes its strategy from the TPU it was built for: use '
            'cluster.tpu_mesh(num_stages, tpu=NAME), or DeviceMesh.from_tpu(assignment, '
            'resolver=resolver).'
        )
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)


def _multi_worker(mesh):
    """MultiWorkerMirroredStrategy over the workers of TF_CONFIG, one replica per task."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    rows = []
    for r, row in enumerate(mesh.devices):
        tasks = {(s.job, s.task) for s in map(tf.DeviceSpec.from_string, row)}
        if len(tasks) != 1:
            raise ValueError(
                f'For a multi-worker strategy each replica is one worker task with its K '
                f'devices; replica {r} spans {sorted(tasks)}. Build the mesh with '
                'DeviceMesh.from_cluster(num_replicas=W, num_stages=K, devices_per_task=K).'
            )
        rows.append(tasks.pop())
    if not resolver.task_type or (resolver.task_type, resolver.task_id) not in rows:
        raise ValueError(
            f'mesh.strategy() for a mesh of worker tasks runs on each of those workers (every '
            f'worker runs the same program, TF_CONFIG naming its task); this process is '
            f'{resolver.task_type!r} {resolver.task_id!r}, not one of {rows}.'
        )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    return strategy, [rows.index((resolver.task_type, resolver.task_id))]


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
    """Variables created inside get one copy per (local) replica, replica r's on mesh[r][stage]."""
    if mesh.tpu is not None:  # TPUStrategy: logical core `stage` of every replica
        with mesh.strategy().extended.experimental_logical_device(stage):
            yield
        return
    column = _StageColumn(mesh.devices[mesh.local_replicas, stage])

    def creator(next_creator, **kwargs):
        if kwargs.get('colocate_with') is None:
            kwargs['colocate_with'] = column
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def stage_core(mesh, device):
    """The stage (column) of `device` in a TPU mesh: the logical core that runs it in every
    replica; None for a device outside the mesh."""
    name = tf.DeviceSpec.from_string(device).to_string()
    for row in mesh.devices:
        for k, d in enumerate(row):
            if tf.DeviceSpec.from_string(d).to_string() == name:
                return k
    return None


def _tpu_replica_mesh():
    """The TPU mesh whose strategy.run this is; None elsewhere."""
    if not in_replica_context():
        return None
    mesh = _MESHES.get(tf.distribute.get_strategy())
    return mesh if mesh is not None and mesh.tpu is not None else None


def on(device):
    """Where a stage's ops go: tf.device(device); inside a TPU replica (TPUStrategy places by
    logical core, not by device name) that stage's logical core, or XLA's choice off the mesh."""
    mesh = _tpu_replica_mesh() if device else None
    if mesh is None:
        return tf.device(device)
    core = stage_core(mesh, device)
    if core is None:
        return contextlib.nullcontext()
    return mesh.strategy().extended.experimental_logical_device(core)


def places_by_device_name():
    """Whether `on(device)` is tf.device(device) here: not inside a tf.distribute strategy's
    replica (whose variables and placement the strategy owns) nor a TPU replica."""
    return not tf.distribute.has_strategy() and _tpu_replica_mesh() is None


def tpu_replica_id():
    """Inside a TPU replica: its id (a tensor: TPU replicas run one program); else None."""
    if _tpu_replica_mesh() is None:
        return None
    return tf.distribute.get_replica_context().replica_id_in_sync_group


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
