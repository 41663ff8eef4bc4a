"""Peak memory of a function on a device (needs TF's BFC allocator on CPU).

On CPU, `tf.config.experimental.get_memory_info('CPU:0')` works only when the process starts
with TF_CPU_ALLOCATOR_USE_BFC=true; TF_CPU_BFC_MEM_LIMIT_IN_MB=N then caps the allocator, like
an accelerator with N MB.
"""

import os

import tensorflow as tf


def cpu_bfc_enabled():
    return os.environ.get('TF_CPU_ALLOCATOR_USE_BFC', '').lower() in ('1', 'true')


def peak_bytes(fn, device='CPU:0'):
    """(result of fn(), peak bytes allocated on `device` while fn ran, above the bytes before)."""
    if device.upper().startswith('CPU') and not cpu_bfc_enabled():
        raise RuntimeError(
            'Memory statistics on CPU need TF_CPU_ALLOCATOR_USE_BFC=true in the environment '
            'before TensorFlow starts.'
        )
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)['current']
    result = fn()
    return result, tf.config.experimental.get_memory_info(device)['peak'] - before
