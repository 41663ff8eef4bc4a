"""Devices for the pipeline: logical CPUs, local GPUs, and the mesh a PipelinedLayer uses."""

import contextlib
import difflib

import numpy as np
import tensorflow as tf


def logical_cpus(n):
    """Splits the CPU into n logical devices; returns their names. Call before TF initialises.

    Idempotent: calling it again with the same n is fine. A different n after TF has
    initialised raises (TF fixes its devices once), naming what to do. It does not start TF's
    context itself, so a multi-worker strategy can still be made afterwards.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f'logical_cpus needs a positive int, got {n!r}.')
    cpu = tf.config.list_physical_devices('CPU')[0]
    current = tf.config.get_logical_device_configuration(cpu)
    names = [f'/device:CPU:{i}' for i in range(n)]
    if current is not None and len(current) == n:
        return names
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices('CPU'))
        if have == n:
            return [d.name for d in tf.config.list_logical_devices('CPU')]
        raise RuntimeError(
            f'TensorFlow is already initialised with {have} logical CPU device(s), so it cannot '
            f'be split into {n}. Call cluster.logical_cpus({n}) before anything else touches '
            'TensorFlow (first thing in main, or in a pytest conftest).'
        ) from e
    # Not listed (listing starts TF's context; a MultiWorkerMirroredStrategy must come first).
    return names


def local_devices():
    """Local accelerators if there are any (GPUs, then TPUs), else the logical CPUs."""
    for kind in ('GPU', 'TPU'):
        found = tf.config.list_logical_devices(kind)
        if found:
            return [d.name for d in found]
    return [d.name for d in tf.config.list_logical_devices('CPU')]


class DeviceMesh:
    """Device names arranged as [replicas, stages]."""

    def __init__(self, devices):
        self.devices = np.array(devices, dtype=object)
        if self.devices.ndim != 2 or self.devices.size == 0:
            raise ValueError('DeviceMesh needs a non-empty [replicas, stages] array of names.')
        # The replicas (rows) this process runs: all of them, except under a multi-worker
        # strategy (its own task's row); set by strategy().
        self.local_replicas = list(range(self.devices.shape[0]))
        self._strategy = None
        self.tpu = None  # (resolver, DeviceAssignment) of a mesh of TPU cores (from_tpu)

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def from_local(cls, num_replicas=1, num_stages=None, device_type=None):
        """[R, K] of this process's devices (GPUs if any, else logical CPUs), row-major."""
        if device_type is None:
            names = local_devices()
        else:
            names = [d.name for d in tf.config.list_logical_devices(device_type.upper())]
        num_stages = num_stages or len(names) // num_replicas
        return cls(_reshape(names, num_replicas, num_stages, 'this process'))

    @classmethod
    def from_cluster(
        cls,
        cluster=None,
        num_replicas=1,
        num_stages=None,
        job_name='worker',
        device_type='CPU',
        devices_per_task=1,
    ):
        """[R, K] over the tasks of a TF cluster: stage k of replica r on task r*K + k.

        `cluster`: a tf.train.ClusterSpec, a dict, a cluster resolver, or None to read the
        TF_CONFIG environment variable. With devices_per_task > 1 (e.g. a host's GPUs), a
        task's devices are consecutive stages.
        """
        if cluster is None:
            cluster = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        if isinstance(cluster, tf.distribute.cluster_resolver.ClusterResolver):
            cluster = cluster.cluster_spec()
        spec = tf.train.ClusterSpec(cluster)
        if job_name not in spec.jobs:
            raise ValueError(
                f"The cluster has no job '{job_name}' (jobs: {', '.join(spec.jobs) or 'none'}); "
                'set job_name, or check TF_CONFIG.'
            )
        names = [
            f'/job:{job_name}/replica:0/task:{t}/device:{device_type.upper()}:{i}'
            for t in spec.task_indices(job_name)
            for i in range(devices_per_task)
        ]
        num_stages = num_stages or len(names) // num_replicas
        return cls(_reshape(names, num_replicas, num_stages, f"the cluster's job '{job_name}'"))

    @classmethod
    def from_tpu(cls, device_assignment, job=None, resolver=None):
        """[R, K] from a tf.tpu.experimental.DeviceAssignment: replica r's logical core k (its
        stage k) at [r][k]. `resolver`, the TPU's cluster resolver, lets strategy() make the
        TPUStrategy; `tpu_mesh` passes both."""
        da = device_assignment
        mesh = cls(
            [
                [
                    da.tpu_device(replica=r, logical_core=k, job=job)
                    for k in range(da.num_cores_per_replica)
                ]
                for r in range(da.num_replicas)
            ]
        )
        mesh.tpu = (resolver, da)
        return mesh

    def strategy(self):
        """The mesh's tf.distribute strategy (made once): replicas are its rows; pipelines built
        inside its scope put cell k of replica r on [r][k] (see distribute.py)."""
        from tf_gpipe.runtime import distribute

        return distribute.strategy_for(self)

    @property
    def shape(self):
        return self.devices.shape

    @property
    def num_replicas(self):
        return self.devices.shape[0]

    @property
    def num_stages(self):
        return self.devices.shape[1]

    def stage_devices(self, num_stages, replica=0):
        """The first `num_stages` devices of a replica's row; a clear error if too few."""
        row = list(self.devices[replica])
        if num_stages > len(row):
            raise ValueError(
                f'The pipeline has {num_stages} cells but the device mesh offers only '
                f'{len(row)} device(s) per replica ({", ".join(row)}). Pass devices=[...] with '
                f'{num_stages} names, or create more devices: cluster.logical_cpus({num_stages}) '
                'before TF initialises (CPU), or virtual GPUs.'
            )
        return row[:num_stages]

    def pipeline_devices(self, num_replicas, num_stages):
        """[num_replicas][num_stages] device names: the mesh's rows, or its one row reshaped."""
        if num_replicas == 1:
            return [self.stage_devices(num_stages)]
        if self.num_replicas >= num_replicas:
            return [self.stage_devices(num_stages, r) for r in range(num_replicas)]
        flat = list(self.devices.reshape(-1))
        need = num_replicas * num_stages
        if len(flat) < need:
            raise ValueError(
                f'{num_replicas} replicas x {num_stages} stages need {need} devices; the device '
                f'mesh has {len(flat)} ({", ".join(flat)}). Create more (e.g. '
                f'cluster.logical_cpus({need}) before TF initialises) or pass devices=[...].'
            )
        return [flat[r * num_stages : (r + 1) * num_stages] for r in range(num_replicas)]

    def __str__(self):
        rows = [f'  replica {r}: ' + ', '.join(self.devices[r]) for r in range(self.num_replicas)]
        return (
            f'DeviceMesh [{self.num_replicas} replicas x {self.num_stages} stages]\n'
            + '\n'.join(rows)
        )


def _reshape(names, num_replicas, num_stages, where):
    need = num_replicas * max(num_stages, 1)
    if num_stages < 1 or len(names) < need:
        more = (
            f' Create more: cluster.logical_cpus({need}) before TF initialises (CPU), or '
            'virtual GPUs.'
            if where == 'this process'
            else ''
        )
        raise ValueError(
            f'{num_replicas} replicas x {max(num_stages, 1)} stages need {need} devices; '
            f'{where} has {len(names)}.{more}'
        )
    return [names[r * num_stages : (r + 1) * num_stages] for r in range(num_replicas)]


def tpu_mesh(num_stages, tpu=None, num_replicas=None):
    """The mesh of a TPU: R replicas x K = num_stages cores each (R = all cores // K by
    default). Connects to the TPU named `tpu` ('local' on a TPU VM, a name or grpc:// address
    otherwise) and initialises it; `mesh.strategy()` is then a TPUStrategy whose replica r runs
    stage k on its logical core k. A clear RuntimeError when no TPU answers."""
    resolver, topology = _tpu_system(tpu)
    da = tpu_device_assignment(num_stages, num_replicas, topology)
    return DeviceMesh.from_tpu(da, job=resolver.get_job_name(), resolver=resolver)


def _tpu_system(tpu):
    """(resolver, topology) of the TPU `tpu`, connected and initialised."""
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f'No TPU answered for tpu={tpu!r} ({first}). Run on a TPU VM with --tpu=local, or '
            "pass the TPU's name or grpc:// address from a machine that can reach it."
        ) from e
    return resolver, topology


def tpu_device_assignment(num_stages, num_replicas=None, topology=None, tpu=None):
    """A DeviceAssignment with K = num_stages cores per replica (R = all cores // K by default).

    `topology` defaults to initialising the TPU system named `tpu`
    (tf.tpu.experimental.initialize_tpu_system); pass one to plan without a TPU.
    """
    if topology is None:
        _, topology = _tpu_system(tpu)
    cores = topology.num_tasks * topology.num_tpus_per_task
    if num_stages < 1 or cores % num_stages:
        raise ValueError(f'{cores} TPU cores cannot be cut into stages of {num_stages} cores.')
    num_replicas = num_replicas or cores // num_stages
    if num_replicas * num_stages > cores:
        raise ValueError(
            f'{num_replicas} replicas x {num_stages} stages need '
            f'{num_replicas * num_stages} TPU cores; the topology has {cores}.'
        )
    shape = [1] * (len(topology.mesh_shape) - 1) + [num_stages]
    if num_stages > topology.mesh_shape[-1]:
        shape = _core_shape(topology.mesh_shape, num_stages)
    return tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=shape, num_replicas=num_replicas
    )


def _core_shape(mesh_shape, num_cores):
    """The smallest sub-mesh shape (last axis first) that holds num_cores cores."""
    shape, left = [1] * len(mesh_shape), num_cores
    for axis in reversed(range(len(mesh_shape))):
        take = min(mesh_shape[axis], left)
        while left % take:
            take -= 1
        shape[axis], left = take, left // take
    if left != 1:
        raise ValueError(f'{num_cores} cores do not tile the TPU mesh {list(mesh_shape)}.')
    return shape


_mesh_stack = []


def current_mesh():
    """The innermost mesh of `use_mesh`, else one replica over all local devices."""
    if _mesh_stack:
        return _mesh_stack[-1]
    return DeviceMesh([local_devices()])


@contextlib.contextmanager
def use_mesh(mesh):
    """Makes `mesh` the one PipelinedLayers built inside use (when their devices is None)."""
    _mesh_stack.append(mesh)
    try:
        yield mesh
    finally:
        _mesh_stack.pop()


def check_device_names(names):
    """Canonical names for `names`; an unknown local device raises naming the known ones."""
    known = {d.name for d in tf.config.list_logical_devices()}
    out = []
    for name in names:
        spec = tf.DeviceSpec.from_string(name)
        if spec.job not in (None, 'localhost'):
            out.append(spec.to_string())  # A remote device: checked by TF when it is used.
            continue
        if spec.device_type is None:
            raise ValueError(f"Device name {name!r} has no device type (e.g. '/device:CPU:0').")
        local = f'/device:{spec.device_type.upper()}:{spec.device_index or 0}'
        match = [k for k in known if k.endswith(local)]
        if not match:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ''
            raise ValueError(
                f'Unknown device {name!r}{hint}. This process has: {", ".join(sorted(known))}. '
                'For more CPU devices call cluster.logical_cpus(n) before TF initialises.'
            )
        out.append(match[0])
    return out
