"""cluster: logical CPUs, device-name checks, the device mesh."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tf_gpipe.runtime import cluster


def test_logical_cpus_is_idempotent_and_refuses_a_different_count():
    # conftest split the CPU into 4 before TF initialised; logical_cpus itself does not start
    # TF's context (a multi-worker strategy must be made first), listing devices does.
    assert cluster.logical_cpus(4) == [f'/device:CPU:{i}' for i in range(4)]
    assert [d.name for d in tf.config.list_logical_devices('CPU')] == cluster.logical_cpus(4)
    with pytest.raises(
        RuntimeError, match=r'already initialised with 4 .*cluster.logical_cpus\(8\)'
    ):
        cluster.logical_cpus(8)
    with pytest.raises(ValueError, match='positive int'):
        cluster.logical_cpus(0)


def test_check_device_names():
    assert cluster.check_device_names(['/cpu:1', '/device:CPU:3'])[0].endswith('/device:CPU:1')
    with pytest.raises(ValueError, match=r"Unknown device '/device:CPU:9'.*logical_cpus"):
        cluster.check_device_names(['/device:CPU:9'])
    with pytest.raises(ValueError, match='Unknown device'):
        cluster.check_device_names(['/device:GPU:0'])
    remote = cluster.check_device_names(['/job:worker/task:1/device:CPU:0'])
    assert remote == ['/job:worker/task:1/device:CPU:0']


def test_mesh():
    mesh = cluster.current_mesh()
    assert mesh.shape == (1, 4)
    assert mesh.stage_devices(2) == [d.name for d in tf.config.list_logical_devices('CPU')][:2]
    with pytest.raises(ValueError, match=r'5 cells but the device mesh offers only 4'):
        mesh.stage_devices(5)
    custom = cluster.DeviceMesh([['/cpu:0', '/cpu:1'], ['/cpu:2', '/cpu:3']])
    with cluster.use_mesh(custom):
        assert cluster.current_mesh() is custom
        assert custom.stage_devices(2, replica=1) == ['/cpu:2', '/cpu:3']
    assert cluster.current_mesh().shape == (1, 4)
    assert 'replicas x 2 stages' in str(custom)


def test_mesh_from_local():
    mesh = cluster.DeviceMesh.from_local(num_replicas=2, num_stages=2)
    assert mesh.shape == (2, 2) and mesh.devices[1][0].endswith('CPU:2')
    assert cluster.DeviceMesh.from_local().shape == (1, 4)
    with pytest.raises(
        ValueError, match='3 replicas x 2 stages need 6 devices; this process has 4'
    ):
        cluster.DeviceMesh.from_local(num_replicas=3, num_stages=2)
    assert cluster.current_mesh().pipeline_devices(2, 2)[1][1].endswith('CPU:3')


def test_mesh_from_cluster_spec_and_tf_config(monkeypatch):
    spec = {'worker': [f'127.0.0.1:{2000 + i}' for i in range(4)], 'chief': ['127.0.0.1:1999']}
    mesh = cluster.DeviceMesh.from_cluster(tf.train.ClusterSpec(spec), num_replicas=2)
    assert mesh.devices.tolist() == [
        ['/job:worker/replica:0/task:0/device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:0'],
        ['/job:worker/replica:0/task:2/device:CPU:0', '/job:worker/replica:0/task:3/device:CPU:0'],
    ]
    monkeypatch.setenv(
        'TF_CONFIG',
        json.dumps(
            {'cluster': {'worker': ['h1:1', 'h2:2']}, 'task': {'type': 'worker', 'index': 0}}
        ),
    )
    gpus = cluster.DeviceMesh.from_cluster(device_type='GPU', devices_per_task=2)
    assert gpus.shape == (1, 4)
    assert gpus.devices[0][3] == '/job:worker/replica:0/task:1/device:GPU:1'
    with pytest.raises(ValueError, match="no job 'ps'"):
        cluster.DeviceMesh.from_cluster(spec, job_name='ps')
    with pytest.raises(ValueError, match='need 6 devices'):
        cluster.DeviceMesh.from_cluster(spec, num_replicas=3, num_stages=2)


def _topology():
    """A 2-host, 8-core TPU topology (no TPU needed to build one)."""
    coords = np.array(
        [[[x, y, 0, c] for x in range(2) for c in range(2)] for y in range(2)], dtype=np.int32
    )
    return tf.tpu.experimental.Topology(mesh_shape=[2, 2, 1, 2], device_coordinates=coords)


@pytest.mark.parametrize('stages,replicas', [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_tpu_device_assignment_arithmetic(stages, replicas):
    da = cluster.tpu_device_assignment(stages, topology=_topology())
    assert da.num_cores_per_replica == stages and da.num_replicas == replicas
    mesh = cluster.DeviceMesh.from_tpu(da, job='worker')
    assert mesh.shape == (replicas, stages)
    names = mesh.devices.reshape(-1).tolist()
    assert len(set(names)) == 8  # every core used once
    assert all(n.startswith('/job:worker/task:') and '/device:TPU:' in n for n in names)


def test_tpu_device_assignment_errors():
    with pytest.raises(ValueError, match='8 TPU cores cannot be cut into stages of 3'):
        cluster.tpu_device_assignment(3, topology=_topology())
    with pytest.raises(ValueError, match='need 16 TPU cores'):
        cluster.tpu_device_assignment(4, num_replicas=4, topology=_topology())


def test_tpu_mesh_maps_stage_k_to_logical_core_k_of_every_replica():
    """The TPUStrategy path as far as a CPU goes: replica r's stage k is logical core k (the
    core TPUStrategy's experimental_logical_device(k) names in every replica); a K=2 replica
    takes both cores of one chip (the stage boundary on the chip's own link)."""
    from tf_gpipe.runtime import distribute

    topology = _topology()
    da = cluster.tpu_device_assignment(2, topology=topology)
    mesh = cluster.DeviceMesh.from_tpu(da, job='worker')
    for r in range(mesh.num_replicas):
        chips = {tuple(da.coordinates(r, k)[:3]) for k in range(2)}
        assert len(chips) == 1, chips  # both stages on one chip
        for k in range(2):
            assert distribute.stage_core(mesh, mesh.devices[r][k]) == k
    assert distribute.stage_core(mesh, '/job:worker/task:9/device:TPU:0') is None
    # Outside a TPU replica, a stage's ops are placed by device name as everywhere else.
    with distribute.on('/device:CPU:1'):
        assert tf.constant(1.0).device.endswith('CPU:1')
    # The strategy needs the TPU the mesh was built for.
    with pytest.raises(ValueError, match=r'cluster.tpu_mesh\(num_stages, tpu=NAME\)'):
        mesh.strategy()


def test_no_tpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r'No TPU answered for tpu=None \(Please provide a TPU'):
        cluster.tpu_mesh(2)
