"""TensorBoard summaries that show the pipeline: each device's busy time and the measured
bubble of a step (from the pipeline's own action timestamps, gpipe/trace.py), and each device's
peak memory where TF reports it (GPUs; CPUs with TF_CPU_ALLOCATOR_USE_BFC=true)."""

import numpy as np
import tensorflow as tf

from tf_gpipe.gpipe import trace


def write_scalars(writer, step, values, prefix=''):
    """One scalar summary per (name, value) at `step`, then flushed."""
    with writer.as_default(step=step):
        for name, value in values.items():
            tf.summary.scalar(prefix + name, value)
    writer.flush()


def traced(step_fn):
    """`step_fn` run with every pipeline action timestamped: (its output, [[start, end]] per
    action, [(phase, stage, micro-batch)] per action — the latter known once traced)."""
    meta = []

    def run():
        with trace.record() as events:
            out = step_fn()
        meta[:] = [(e.phase, e.stage, e.micro_batch) for e in events]
        return out, [tf.stack([e.start, e.end]) for e in events]

    return run, meta


def step_profile(meta, stamps, num_devices):
    """{'step_ms', 'bubble', 'device_<k>_busy_ms'...} of one timestamped step: the span from the
    first action's start to the last one's end, and each device's share of it spent in
    actions (stage s runs on device s mod K); the bubble is the mean idle share."""
    stamps = np.asarray(stamps, np.float64).reshape(-1, 2)
    if not len(stamps):
        return {}
    span = float(stamps[:, 1].max() - stamps[:, 0].min())
    busy = np.zeros([num_devices])
    for (_, stage, _), (start, end) in zip(meta, stamps):
        busy[stage % num_devices] += end - start
    out = {'step_ms': 1e3 * span, 'bubble': float(np.mean(1.0 - busy / max(span, 1e-12)))}
    out.update({f'device_{k}_busy_ms': 1e3 * float(b) for k, b in enumerate(busy)})
    return out


def peak_memory(devices):
    """{'<device>_peak_mb': ...} for the devices whose allocator reports its peak."""
    out = {}
    for device in devices:
        try:
            info = tf.config.experimental.get_memory_info(device)
        except (ValueError, tf.errors.OpError):
            continue  # this allocator keeps no statistics
        name = device.split('device:')[-1].replace(':', '_')
        out[f'{name}_peak_mb'] = info['peak'] / 2**20
    return out
