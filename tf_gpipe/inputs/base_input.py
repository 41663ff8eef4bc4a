"""Input generators: params-configured sources of batches (NestedMaps of tensors)."""

from tf_gpipe import hyperparams


class BaseInputGenerator:
    """`GetBatch(step)` returns the batch of a training step.

    A generator whose batches are a pure function of (seed, step) makes resuming exact: the
    trainer asks for the batch of the step it is at, whatever happened before.
    """

    @classmethod
    def Params(cls):
        p = hyperparams.InstantiableParams(cls)
        p.Define('name', 'input', 'Name.')
        p.Define('batch_size', 32, 'Examples per batch.')
        p.Define('seed', 1234, 'Seed of the data stream.')
        return p

    def __init__(self, params):
        self.params = params.Copy().Freeze()
        if not isinstance(params.batch_size, int) or params.batch_size < 1:
            raise ValueError(f'batch_size must be a positive int, got {params.batch_size!r}.')

    def GetBatch(self, step):
        raise NotImplementedError(f'{type(self).__name__} must define GetBatch(step).')
