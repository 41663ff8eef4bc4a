"""What a model params file declares: input params for training and eval, and the task."""


class SingleTaskModelParams:
    """Subclass, register with @model_registry.RegisterSingleTaskModel, and define:

    Train(): input generator params for training; Test(): for evaluation (defaults to Train());
    Dev(): for a development set's evaler (None: no dev set); Task(): the task params
    (network, loss, metrics, learner, pipeline settings).
    """

    def Train(self):
        raise NotImplementedError(f'{type(self).__name__} must define Train().')

    def Test(self):
        return self.Train()

    def Dev(self):
        return None

    def Task(self):
        raise NotImplementedError(f'{type(self).__name__} must define Task().')
