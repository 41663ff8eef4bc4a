"""Transformer language model: embedding, L Transformer layers, softmax — one pipeline."""

import tensorflow as tf

from tf_gpipe import layers
from tf_gpipe.nested_map import NestedMap
from tf_gpipe.tasks import base_task


class LanguageModel(base_task.TokenLossMixin, base_task.BaseTask):
    """Predicts token t+1 from tokens <= t. Batch: NestedMap(ids, labels, weights) [B, T]."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 0, 'Token ids.')
        p.Define('model_dim', 0, 'Model dimension.')
        p.Define('num_layers', 1, 'Transformer layers.')
        p.Define('max_seq_len', 128, 'Sequence length used to estimate layer costs.')
        p.Define(
            'layer_tpl',
            layers.TransformerLayer.Params().Set(causal=True),
            'Template of every Transformer layer (input_dim and name are set).',
        )
        p.Define('label_smoothing', 0.0, 'Label smoothing of the loss.')
        p.Define(
            'tie_embedding',
            False,
            'The softmax reuses the input embedding (as GPT-2, T5, Lingvo): fewer parameters; '
            'the embedding sits in the first cell, the softmax in the last, and the gradient is '
            'the sum of both uses.',
        )
        return p

    @classmethod
    def LayerParams(cls, p):
        """The flat layer list the pipeline cuts into cells."""
        sub = [
            layers.EmbeddingLayer.Params().Set(
                name='emb',
                vocab_size=p.vocab_size,
                embedding_dim=p.model_dim,
                scale_sqrt_depth=True,
            ),
            layers.PositionalEmbeddingLayer.Params().Set(name='pos', embedding_dim=p.model_dim),
        ]
        for i in range(p.num_layers):
            sub.append(p.layer_tpl.Copy().Set(name=f'layer{i:02d}', input_dim=p.model_dim))
        sub.append(layers.LayerNorm.Params().Set(name='final_ln', input_dim=p.model_dim))
        sub.append(
            layers.SoftmaxLayer.Params().Set(
                name='softmax',
                input_dim=p.model_dim,
                num_classes=p.vocab_size,
                label_smoothing=p.label_smoothing,
                tied_embedding='emb' if p.tie_embedding else None,
            )
        )
        return sub

    @classmethod
    def NetworkParams(cls, p):
        pp = p.pipeline
        nominal_batch = max(pp.num_micro_batches * pp.num_replicas, 1)
        return base_task.PipelinedParamsFor(p, cls.LayerParams(p), (nominal_batch, p.max_seq_len))

    @classmethod
    def InputShape(cls, task_p, input_p):
        return (input_p.batch_size, input_p.seq_len)

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        for name in ('vocab_size', 'model_dim'):
            if p.Get(name) <= 0:
                raise ValueError(f'LanguageModel: set {name} (got {p.Get(name)}).')
        self.CreateChild('network', self.NetworkParams(p))

    def NetworkInputs(self, batch):
        return batch.ids, NestedMap(labels=batch.labels, weights=batch.weights)

    def ServingSpecs(self, input_p):
        return {'ids': tf.TensorSpec([None, None], tf.int32, name='ids')}

    def Serve(self, inputs):
        """Next-token logits and log-probabilities at every position of `ids` [B, T]."""
        logits = tf.cast(self.network.FProp(inputs['ids']), tf.float32)
        return {'logits': logits, 'log_probs': tf.nn.log_softmax(logits)}

    def ServeStep(self, inputs, state, t, max_len):
        """Serve of positions t.. of `ids` (the first call: a whole prompt)."""
        logits, state = self.network.ExtendStep(inputs['ids'], state, t, max_len)
        logits = tf.cast(logits, tf.float32)
        return {'logits': logits, 'log_probs': tf.nn.log_softmax(logits)}, state

    def _Softmax(self):
        return self.network.cells[-1].sub[-1]

    def Metrics(self, logits, targets):
        xent, accuracy = self._TokenMetrics(logits, targets)
        metrics = NestedMap(loss=xent.avg_xent, accuracy=accuracy, log_pplx=xent.avg_xent)
        return NestedMap(loss=xent.avg_xent, metrics=metrics)
