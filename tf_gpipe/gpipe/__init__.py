"""GPipe: partitioner, micro-batches, schedule, recompute and the PipelinedLayer."""

from tf_gpipe.gpipe import microbatch, partition, schedule
from tf_gpipe.gpipe.pipelined_layer import RECOMPUTE_POLICIES, PipelinedLayer

__all__ = ['RECOMPUTE_POLICIES', 'PipelinedLayer', 'microbatch', 'partition', 'schedule']
