"""GPipe: partitioner, micro-batches, schedules, executor, recompute, gradient ownership,
replication and the PipelinedLayer façade."""

from tf_gpipe.gpipe import microbatch, partition, schedules
from tf_gpipe.gpipe.pipelined_layer import RECOMPUTE_POLICIES, PipelinedLayer
from tf_gpipe.gpipe.schedules import SCHEDULES

__all__ = [
    'RECOMPUTE_POLICIES',
    'SCHEDULES',
    'PipelinedLayer',
    'microbatch',
    'partition',
    'schedules',
]
