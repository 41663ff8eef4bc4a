"""Transformer language models on the built-in synthetic arithmetic language (offline)."""

from tf_gpipe import base_model_params, inputs, model_registry, tasks


@model_registry.RegisterSingleTaskModel
class TransformerLmTiny(base_model_params.SingleTaskModelParams):
    """4-layer Transformer LM, K=4 cells, M=8; learns the language in minutes on 2 CPU cores."""

    def Train(self):
        return inputs.SyntheticLm.Params().Set(batch_size=64, seq_len=32, vocab_size=64)

    def Test(self):
        return self.Train().Set(seed=4321)

    def Dev(self):
        return self.Train().Set(seed=5678)

    def Task(self):
        p = tasks.LanguageModel.Params().Set(
            name='lm', vocab_size=64, model_dim=64, num_layers=4, max_seq_len=32, random_seed=1
        )
        p.layer_tpl.Set(num_heads=4, hidden_dim=256, dropout_prob=0.0)
        # 1F1B: fill-drain's bubble, at most K micro-batches' boundaries stored, and the
        # last cell's F and B one call each (no backward derived per cell at the first step).
        p.pipeline.Set(
            num_partitions=4, num_micro_batches=8, recompute='except_last', schedule='1f1b'
        )
        p.train.learner.Set(
            optimizer='adam',
            learning_rate=3e-3,
            schedule='warmup_rsqrt',
            warmup_steps=50,
            clip_gradient_norm=1.0,
        )
        p.train.Set(max_steps=300, log_interval_steps=20, save_interval_steps=100)
        p.eval.Set(interval_steps=100)
        return p
