"""cluster: logical CPUs, device-name checks, the device mesh."""

import pytest
import tensorflow as tf

from tf_gpipe import cluster


def test_logical_cpus_is_idempotent_and_refuses_a_different_count():
    # conftest split the CPU into 4 before TF initialised.
    assert len(cluster.logical_cpus(4)) == 4
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
