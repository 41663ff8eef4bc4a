"""AmoebaNet-D on CIFAR-10 (tfds), at the GPipe paper's (L, D) scales."""

from tf_gpipe import base_model_params, inputs, model_registry, tasks


@model_registry.RegisterSingleTaskModel
class AmoebaNetD(base_model_params.SingleTaskModelParams):
    """AmoebaNet-D (L=18, D=256) on 32x32 CIFAR-10, K=4, M=8."""

    DATA_DIR = None
    DATASET, NUM_CLASSES, IMAGE_SIZE = 'cifar10', 10, 32
    L, D, K, M, BATCH = 18, 256, 4, 8, 128

    def Train(self):
        return inputs.TfdsImage.Params().Set(
            dataset=self.DATASET,
            split='train',
            data_dir=self.DATA_DIR,
            batch_size=self.BATCH,
            image_size=self.IMAGE_SIZE,
            augment=True,
        )

    def Test(self):
        return self.Train().Set(split='test', augment=False, shuffle_buffer=0)

    def Task(self):
        p = tasks.ImageClassifier.Params().Set(
            name='classifier',
            num_classes=self.NUM_CLASSES,
            num_cells=self.L,
            filters=self.D,
            image_size=self.IMAGE_SIZE,
            stem='cifar',
            label_smoothing=0.1,
        )
        p.pipeline.Set(num_partitions=self.K, num_micro_batches=self.M, recompute='except_last')
        p.train.learner.Set(
            optimizer='momentum',
            learning_rate=0.1,
            schedule='cosine',
            warmup_steps=1000,
            total_steps=60000,
            l2_regularizer_weight=5e-4,
        )
        p.train.Set(max_steps=60000, save_interval_steps=2000)
        p.eval.Set(interval_steps=2000)
        return p


@model_registry.RegisterSingleTaskModel
class AmoebaNetD100(AmoebaNetD):
    """The same on CIFAR-100."""

    DATASET, NUM_CLASSES = 'cifar100', 100
