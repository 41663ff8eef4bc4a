"""Transformer encoder-decoder for (multilingual) translation — one pipeline.

The layer list is: source embedding, encoder layers, a bridge that moves the encoder output
into `aux_vecs` and embeds the target, decoder layers (cross-attending to `aux_vecs`), output.
Between cells the state is one NestedMap, so the encoder output (and the target ids, while the
encoder runs) travel through the pipeline with the activations.
"""

import tensorflow as tf

from tf_gpipe import base_layer, layers
from tf_gpipe.nested_map import NestedMap
from tf_gpipe.tasks import base_task


def _emb_and_pos(layer, dim, vocab):
    layer.CreateChild(
        'emb',
        layers.EmbeddingLayer.Params().Set(
            name='emb', vocab_size=vocab, embedding_dim=dim, scale_sqrt_depth=True
        ),
    )
    layer.CreateChild(
        'pos', layers.PositionalEmbeddingLayer.Params().Set(name='pos', embedding_dim=dim)
    )


class _MtLayer(base_layer.BaseLayer):
    """Base of the translation-specific layers: vocabulary and model dimension."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 0, 'Ids.')
        p.Define('model_dim', 0, 'Model dimension.')
        return p


class MtSourceLayer(_MtLayer):
    """Batch NestedMap(src_ids, src_paddings, tgt_ids, tgt_paddings) -> encoder state."""

    def __init__(self, params):
        super().__init__(params)
        _emb_and_pos(self, self.params.model_dim, self.params.vocab_size)

    def FProp(self, batch):
        return NestedMap(
            vecs=self.pos.FProp(self.emb.FProp(batch.src_ids)),
            paddings=batch.src_paddings,
            tgt_ids=batch.tgt_ids,
            tgt_paddings=batch.tgt_paddings,
        )

    def ExtendStep(self, batch, state, t, max_len):
        """Decoding: the source on the first call; later calls carry only the target step."""
        if state is None:
            return self.FProp(batch), ()
        return NestedMap(tgt_ids=batch.tgt_ids, tgt_paddings=batch.tgt_paddings), ()

    @classmethod
    def FPropMeta(cls, p, batch):
        batch = base_layer.to_shape(batch)
        b, t = batch['src_ids'].as_list()
        vecs = tf.TensorShape([b, t, p.model_dim])
        out = NestedMap(
            vecs=vecs,
            paddings=batch['src_paddings'],
            tgt_ids=batch['tgt_ids'],
            tgt_paddings=batch['tgt_paddings'],
        )
        n = b * t * p.model_dim
        return base_layer.Meta(2 * n, out, p.vocab_size * p.model_dim, 4 * n)


class MtBridgeLayer(_MtLayer):
    """Encoder state -> decoder state: aux_vecs = LN(encoder output), vecs = target embedding."""

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        self.CreateChild('ln', layers.LayerNorm.Params().Set(name='ln', input_dim=p.model_dim))
        _emb_and_pos(self, p.model_dim, p.vocab_size)

    def FProp(self, state):
        return NestedMap(
            vecs=self.pos.FProp(self.emb.FProp(state.tgt_ids)),
            paddings=state.tgt_paddings,
            aux_vecs=self.ln.FProp(state.vecs),
            aux_paddings=state.paddings,
        )

    def ExtendStep(self, state, cache, t, max_len):
        """Decoding: the target step's embedding at its positions; the encoder output (for the
        decoder layers' cross-attention to cache) on the first call only."""
        vecs, _ = self.pos.ExtendStep(self.emb.FProp(state.tgt_ids), None, t, max_len)
        out = NestedMap(vecs=vecs, paddings=state.tgt_paddings)
        if cache is None:
            out.aux_vecs, out.aux_paddings = self.ln.FProp(state.vecs), state.paddings
        return out, ()

    @classmethod
    def FPropMeta(cls, p, state):
        state = base_layer.to_shape(state)
        b, t = state['tgt_ids'].as_list()
        out = NestedMap(
            vecs=tf.TensorShape([b, t, p.model_dim]),
            paddings=state['tgt_paddings'],
            aux_vecs=state['vecs'],
            aux_paddings=state['paddings'],
        )
        n = b * t * p.model_dim + base_layer.num_elements(state['vecs'])
        return base_layer.Meta(10 * n, out, p.vocab_size * p.model_dim + 2 * p.model_dim, 4 * n)


class MtOutputLayer(_MtLayer):
    """Decoder state -> logits [B, T, vocab] (final layer norm, then softmax weights)."""

    _POSITION_WISE = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('tied_embedding', None, "Softmax tied to this embedding (e.g. 'bridge/emb').")
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        self.CreateChild('ln', layers.LayerNorm.Params().Set(name='ln', input_dim=p.model_dim))
        self.CreateChild(
            'softmax',
            layers.SoftmaxLayer.Params().Set(
                name='softmax',
                input_dim=p.model_dim,
                num_classes=p.vocab_size,
                tied_embedding=p.tied_embedding,
            ),
        )

    def FProp(self, state):
        return self.softmax.FProp(self.ln.FProp(state.vecs))

    @classmethod
    def FPropMeta(cls, p, state):
        vecs = base_layer.to_shape(state)['vecs']
        sm = layers.SoftmaxLayer.Params().Set(
            input_dim=p.model_dim, num_classes=p.vocab_size, tied_embedding=p.tied_embedding
        )
        meta = layers.SoftmaxLayer.FPropMeta(sm, vecs)
        return base_layer.Meta(
            meta.flops + 8 * base_layer.num_elements(vecs),
            meta.out_shapes,
            meta.param_count + 2 * p.model_dim,
            meta.activation_bytes,
        )


class TranslationModel(base_task.TokenLossMixin, base_task.BaseTask):
    """Encoder-decoder Transformer; batch NestedMap(src_ids, src_paddings, tgt_ids,
    tgt_paddings, labels, weights)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('vocab_size', 0, 'Shared source / target ids.')
        p.Define('model_dim', 0, 'Model dimension.')
        p.Define('num_encoder_layers', 1, 'Encoder layers.')
        p.Define('num_decoder_layers', 1, 'Decoder layers.')
        p.Define('max_seq_len', 64, 'Sequence length used to estimate layer costs.')
        p.Define('layer_tpl', layers.TransformerLayer.Params(), 'Template of every layer.')
        p.Define(
            'tie_embedding',
            False,
            'The output softmax reuses the target embedding (in the bridge, often in another '
            'cell): fewer parameters, and its gradient is the sum of both uses.',
        )
        return p

    @classmethod
    def LayerParams(cls, p):
        common = dict(vocab_size=p.vocab_size, model_dim=p.model_dim)
        sub = [MtSourceLayer.Params().Set(name='source', **common)]
        for i in range(p.num_encoder_layers):
            sub.append(
                p.layer_tpl.Copy().Set(
                    name=f'enc{i:02d}', input_dim=p.model_dim, causal=False, has_aux_atten=False
                )
            )
        sub.append(MtBridgeLayer.Params().Set(name='bridge', **common))
        for i in range(p.num_decoder_layers):
            sub.append(
                p.layer_tpl.Copy().Set(
                    name=f'dec{i:02d}', input_dim=p.model_dim, causal=True, has_aux_atten=True
                )
            )
        tied = 'bridge/emb' if p.tie_embedding else None
        sub.append(MtOutputLayer.Params().Set(name='output', tied_embedding=tied, **common))
        return sub

    @classmethod
    def InputShape(cls, task_p, input_p):
        return cls._BatchShapes(input_p.batch_size, input_p.seq_len)

    @staticmethod
    def _BatchShapes(b, t):
        return NestedMap(src_ids=(b, t), src_paddings=(b, t), tgt_ids=(b, t), tgt_paddings=(b, t))

    @classmethod
    def NetworkParams(cls, p):
        pp = p.pipeline
        shapes = cls._BatchShapes(max(pp.num_micro_batches * pp.num_replicas, 1), p.max_seq_len)
        return base_task.PipelinedParamsFor(p, cls.LayerParams(p), shapes)

    def __init__(self, params):
        super().__init__(params)
        for name in ('vocab_size', 'model_dim'):
            if self.params.Get(name) <= 0:
                raise ValueError(f'TranslationModel: set {name} (got {self.params.Get(name)}).')
        self.CreateChild('network', self.NetworkParams(self.params))

    def NetworkInputs(self, batch):
        inputs = NestedMap(
            src_ids=batch.src_ids,
            src_paddings=batch.src_paddings,
            tgt_ids=batch.tgt_ids,
            tgt_paddings=batch.tgt_paddings,
        )
        return inputs, NestedMap(labels=batch.labels, weights=batch.weights)

    def ServingSpecs(self, input_p):
        ids, paddings = tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None])
        return {'src_ids': ids, 'src_paddings': paddings, 'tgt_ids': ids, 'tgt_paddings': paddings}

    def Serve(self, inputs):
        """Teacher-forced logits and log-probabilities of the target tokens given the source
        (one decoding step of a search reads the last position)."""
        logits = tf.cast(self.network.FProp(NestedMap(**inputs)), tf.float32)
        return {'logits': logits, 'log_probs': tf.nn.log_softmax(logits)}

    def ServeStep(self, inputs, state, t, max_len):
        """Serve of target positions t..: the first call takes the source too (the decoder
        layers cache its keys and values); later ones only tgt_ids and tgt_paddings."""
        logits, state = self.network.ExtendStep(NestedMap(**inputs), state, t, max_len)
        logits = tf.cast(logits, tf.float32)
        return {'logits': logits, 'log_probs': tf.nn.log_softmax(logits)}, state

    def _Softmax(self):
        return self.network.cells[-1].sub[-1].softmax

    def Metrics(self, logits, targets):
        xent, accuracy = self._TokenMetrics(logits, targets)
        return NestedMap(
            loss=xent.avg_xent, metrics=NestedMap(loss=xent.avg_xent, accuracy=accuracy)
        )
