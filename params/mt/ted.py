"""Multilingual translation on TED talks (tfds ted_multi_translate): English -> 4 languages."""

from tf_gpipe import base_model_params, inputs, model_registry, tasks


@model_registry.RegisterSingleTaskModel
class TransformerNmtBase(base_model_params.SingleTaskModelParams):
    """6 + 6 layers x 512, byte-level, target-language token; K=4, M=8."""

    DATA_DIR = None
    ENC, DEC, MODEL_DIM, HIDDEN_DIM, NUM_HEADS = 6, 6, 512, 2048, 8
    K, M, BATCH, SEQ_LEN = 4, 8, 64, 256

    def Train(self):
        return inputs.TfdsTranslation.Params().Set(
            split='train', data_dir=self.DATA_DIR, batch_size=self.BATCH, seq_len=self.SEQ_LEN
        )

    def Test(self):
        return self.Train().Set(split='validation', shuffle_buffer=0)

    def Task(self):
        p = tasks.TranslationModel.Params().Set(
            name='mt',
            vocab_size=inputs.TfdsTranslation.VocabSize(self.Train()),
            model_dim=self.MODEL_DIM,
            num_encoder_layers=self.ENC,
            num_decoder_layers=self.DEC,
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
        p.train.Set(max_steps=200000, save_interval_steps=2000)
        p.eval.Set(interval_steps=2000)
        return p


@model_registry.RegisterSingleTaskModel
class TransformerNmtPaper(TransformerNmtBase):
    """Paper scale: 24 + 24 layers x 1024 (hidden 8192, 16 heads), K=8, M=32."""

    ENC, DEC, MODEL_DIM, HIDDEN_DIM, NUM_HEADS = 24, 24, 1024, 8192, 16
    K, M, BATCH, SEQ_LEN = 8, 32, 256, 256
