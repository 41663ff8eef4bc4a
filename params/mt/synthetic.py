"""Transformer translation on the built-in synthetic two-language task (copy / reverse)."""

from tf_gpipe import base_model_params, inputs, model_registry, tasks


@model_registry.RegisterSingleTaskModel
class TransformerNmtTiny(base_model_params.SingleTaskModelParams):
    """2 + 2 layers x 64, K=4 cells (the encoder output rides along), M=4; minutes on 2 cores."""

    def Train(self):
        return inputs.SyntheticMt.Params().Set(batch_size=64, seq_len=12, vocab_size=32)

    def Test(self):
        return self.Train().Set(seed=4321)

    def Dev(self):
        return self.Train().Set(seed=5678)

    def Task(self):
        p = tasks.TranslationModel.Params().Set(
            name='mt',
            vocab_size=32,
            model_dim=64,
            num_encoder_layers=2,
            num_decoder_layers=2,
            max_seq_len=12,
            random_seed=1,
        )
        p.layer_tpl.Set(num_heads=4, hidden_dim=128)
        p.pipeline.Set(
            num_partitions=4, num_micro_batches=4, recompute='except_last', schedule='1f1b'
        )
        p.train.learner.Set(
            optimizer='adam',
            learning_rate=3e-3,
            schedule='warmup_rsqrt',
            warmup_steps=50,
            clip_gradient_norm=1.0,
        )
        p.train.Set(max_steps=400, log_interval_steps=20, save_interval_steps=200)
        p.eval.Set(interval_steps=200)
        return p
