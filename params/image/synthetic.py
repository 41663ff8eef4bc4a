"""AmoebaNet-D on built-in procedurally drawn shapes (offline)."""

from tf_gpipe import base_model_params, inputs, model_registry, tasks


@model_registry.RegisterSingleTaskModel
class AmoebaNetTiny(base_model_params.SingleTaskModelParams):
    """AmoebaNet-D (L=3, D=8) on 16x16 shapes, K=4, M=4; learns in minutes on 2 cores."""

    def Train(self):
        return inputs.SyntheticShapes.Params().Set(batch_size=32, image_size=16)

    def Test(self):
        return self.Train().Set(seed=4321)

    def Task(self):
        p = tasks.ImageClassifier.Params().Set(
            name='classifier',
            num_classes=inputs.SyntheticShapes.NUM_CLASSES,
            num_cells=3,
            filters=8,
            stem_filters=8,
            image_size=16,
            random_seed=1,
        )
        p.pipeline.Set(num_partitions=4, num_micro_batches=4, recompute='except_last')
        p.train.learner.Set(optimizer='adam', learning_rate=3e-3, clip_gradient_norm=5.0)
        p.train.Set(max_steps=200, log_interval_steps=20, save_interval_steps=100)
        p.eval.Set(interval_steps=100)
        return p
