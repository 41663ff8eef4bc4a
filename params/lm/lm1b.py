"""Transformer language models on lm1b (tfds), byte-level (vocabulary 257, no vocab file)."""

from tf_gpipe import base_model_params, inputs, model_registry, tasks


@model_registry.RegisterSingleTaskModel
class TransformerLmBase(base_model_params.SingleTaskModelParams):
    """12 layers x 512, K=4, M=8: a real run on a few accelerators."""

    DATA_DIR = None  # tfds data_dir; None: tfds' default (~/tensorflow_datasets)
    NUM_LAYERS, MODEL_DIM, HIDDEN_DIM, NUM_HEADS = 12, 512, 2048, 8
    K, M, BATCH, SEQ_LEN = 4, 8, 64, 256

    def Train(self):
        return inputs.TfdsLm.Params().Set(
            dataset='lm1b',
            split='train',
            data_dir=self.DATA_DIR,
            batch_size=self.BATCH,
            seq_len=self.SEQ_LEN,
        )

    def Test(self):
        return self.Train().Set(split='test', shuffle_buffer=0)

    def Task(self):
        p = tasks.LanguageModel.Params().Set(
            name='lm',
            vocab_size=inputs.TfdsLm.VocabSize(),
            model_dim=self.MODEL_DIM,
            num_layers=self.NUM_LAYERS,
            max_seq_len=self.SEQ_LEN,
        )
        p.layer_tpl.Set(num_heads=self.NUM_HEADS, hidden_dim=self.HIDDEN_DIM, dropout_prob=0.1)
        p.pipeline.Set(num_partitions=self.K, num_micro_batches=self.M, recompute='except_last')
        p.train.learner.Set(
            optimizer='adam',
            learning_rate=1e-3,
            schedule='warmup_rsqrt',
            warmup_steps=4000,
            clip_gradient_norm=1.0,
        )
        p.train.Set(max_steps=100000, save_interval_steps=2000)
        p.eval.Set(interval_steps=2000)
        return p


@model_registry.RegisterSingleTaskModel
class TransformerLmPaper(TransformerLmBase):
    """Paper scale: 64 layers x 1024 (hidden 8192, 16 heads), ~1.3B parameters, K=8, M=32."""

    NUM_LAYERS, MODEL_DIM, HIDDEN_DIM, NUM_HEADS = 64, 1024, 8192, 16
    K, M, BATCH, SEQ_LEN = 8, 32, 256, 512
