"""tf_gpipe: GPipe pipeline parallelism for TensorFlow 2, in the style of Lingvo.

Packages, in layers: the framework (`hyperparams`, `nested_map`, `base_layer`,
`fprop_context`, `model_registry`), `layers`, the engine (`gpipe`), the runtime (`runtime`:
devices, TF clusters, tf.distribute), and on top `tasks`, `inputs`, `trainer`, `keras`,
`planning`.
"""

import importlib

__version__ = '0.1.0'

# The runtime's modules, importable from the package root as before they had a package of
# their own (`from tf_gpipe import cluster` is the public spelling); imported when first named.
_RUNTIME = (
    'cluster',
    'cluster_spec',
    'distribute',
    'exposure',
    'local_cluster',
    'memory',
    'placement',
    'worker',
)


def __getattr__(name):
    if name in _RUNTIME:
        return importlib.import_module(f'tf_gpipe.runtime.{name}')
    raise AttributeError(f"module 'tf_gpipe' has no attribute {name!r}")
