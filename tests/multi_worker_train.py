"""One worker of a MultiWorkerMirroredStrategy run (tests/test_distribute.py starts two): the
trainer on the tiny LM at K=2 on this worker's 2 logical CPUs, one replica per worker.

    python tests/multi_worker_train.py TASK PORT0,PORT1 LOGDIR OVERRIDES
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(task, ports, logdir, overrides):
    workers = [f'127.0.0.1:{p}' for p in ports.split(',')]
    os.environ['TF_CONFIG'] = json.dumps(
        {'cluster': {'worker': workers}, 'task': {'type': 'worker', 'index': int(task)}}
    )
    from tf_gpipe import cluster

    cluster.logical_cpus(2)  # before the strategy, which must come before TF's context
    mesh = cluster.DeviceMesh.from_cluster(
        num_replicas=len(workers), num_stages=2, devices_per_task=2
    )
    strategy = mesh.strategy()
    import numpy as np

    from tests.test_checkpoints import _params, _weights
    from tf_gpipe.trainer import trainer

    t = trainer.Trainer(_params(overrides), logdir)
    with strategy.scope():
        t.Build()
    t.Train()
    devices = {v.name: [c.device for c in v.values] for v in t.variables}
    np.savez(os.path.join(logdir, 'weights.npz'), **_weights(t))
    with open(os.path.join(logdir, 'devices.json'), 'w') as f:
        json.dump(devices, f)


if __name__ == '__main__':
    main(*sys.argv[1:])
