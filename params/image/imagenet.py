"""AmoebaNet-D on ImageNet (tfds imagenet2012: prepare it under DATA_DIR first)."""

from tf_gpipe import base_model_params, inputs, model_registry, tasks


@model_registry.RegisterSingleTaskModel
class AmoebaNetD(base_model_params.SingleTaskModelParams):
    """AmoebaNet-D (L=18, D=208), 224x224, K=4, M=8: the paper's naive model (82M parameters)."""

    DATA_DIR = None
    L, D, K, M, BATCH = 18, 208, 4, 8, 256

    def Train(self):
        return inputs.TfdsImage.Params().Set(
            dataset='imagenet2012',
            split='train',
            data_dir=self.DATA_DIR,
            batch_size=self.BATCH,
            image_size=224,
            augment=True,
        )

    def Test(self):
        return self.Train().Set(split='validation', augment=False, shuffle_buffer=0)

    def Task(self):
        p = tasks.ImageClassifier.Params().Set(
            name='classifier',
            num_classes=1000,
            num_cells=self.L,
            filters=self.D,
            image_size=224,
            stem='imagenet',
            label_smoothing=0.1,
        )
        p.pipeline.Set(num_partitions=self.K, num_micro_batches=self.M, recompute='except_last')
        p.train.learner.Set(
            optimizer='rmsprop',
            learning_rate=0.256,
            schedule='cosine',
            warmup_steps=5000,
            total_steps=400000,
            l2_regularizer_weight=1e-5,
            clip_gradient_norm=10.0,
        )
        p.train.Set(max_steps=400000, save_interval_steps=5000)
        p.eval.Set(interval_steps=5000)
        return p


@model_registry.RegisterSingleTaskModel
class AmoebaNetDLarge(AmoebaNetD):
    """AmoebaNet-D (L=18, D=416): the paper's Pipeline-1 model (318M parameters), K=8, M=32."""

    L, D, K, M = 18, 416, 8, 32
