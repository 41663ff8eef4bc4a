"""Softmax classifier head and its cross-entropy loss."""

import tensorflow as tf

from tf_gpipe import base_layer
from tf_gpipe.nested_map import NestedMap


class SoftmaxLayer(base_layer.BaseLayer):
    """FProp gives logits [..., num_classes]; XentLoss turns logits and labels into a loss."""

    _POSITION_WISE = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Size of the last input dimension.')
        p.Define('num_classes', 0, 'Number of classes.')
        p.Define('label_smoothing', 0.0, 'Mass moved uniformly from the label to all classes.')
        p.Define('bias', True, 'Whether the logits have a bias.')
        p.Define(
            'tied_embedding',
            None,
            'Name path (seed name, e.g. "emb") of an EmbeddingLayer in the same sequence or '
            'pipeline whose [num_classes, input_dim] matrix this softmax reuses (transposed) '
            'instead of a weight of its own, as Lingvo shares embedding and softmax.',
        )
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        base_layer.check_positive(p, 'input_dim', 'num_classes')
        if not 0.0 <= p.label_smoothing < 1.0:
            raise ValueError(f'SoftmaxLayer {p.name!r}: label_smoothing must be in [0, 1).')
        self._tied = None  # a function returning the embedding matrix (not tracked: not ours)
        if p.tied_embedding is None:
            self.CreateVariable('w', [p.input_dim, p.num_classes])
        if p.bias:
            self.CreateVariable('b', [p.num_classes], init=base_layer.WeightInit.Constant(0.0))

    def LinkTo(self, layers_by_name):
        """Ties to the embedding `tied_embedding` names, among the container's layers."""
        from tf_gpipe.layers.embedding import EmbeddingLayer

        embedding = layers_by_name.get(self.params.tied_embedding)
        if isinstance(embedding, EmbeddingLayer):
            self.TieTo(embedding)

    def TieTo(self, embedding):
        """Reads `embedding`'s matrix as this softmax's weight (transposed)."""
        p, e = self.params, embedding.params
        if (e.vocab_size, e.embedding_dim) != (p.num_classes, p.input_dim):
            raise ValueError(
                f'SoftmaxLayer {p.name!r} (input_dim={p.input_dim}, num_classes={p.num_classes}) '
                f'cannot tie to {embedding.seed_name!r} (vocab_size={e.vocab_size}, '
                f'embedding_dim={e.embedding_dim}): the shapes must match.'
            )
        self._tied = lambda: embedding.vars.emb

    def _Weight(self):
        if self.params.tied_embedding is None:
            return self.vars.w
        if self._tied is None:
            raise ValueError(
                f'SoftmaxLayer {self.params.name!r} ties to the embedding '
                f'{self.params.tied_embedding!r}, which is not in the same SequentialLayer or '
                'PipelinedLayer (or has another name path: layer names joined by "/", '
                'containers add nothing).'
            )
        return tf.transpose(self._tied())

    def FProp(self, inputs):
        x = tf.cast(inputs, self.fprop_dtype)
        logits = tf.tensordot(x, self.CastToFPropDtype(self._Weight()), axes=1)
        if self.params.bias:
            logits += self.CastToFPropDtype(self.vars.b)
        return logits

    def XentLoss(self, logits, class_ids, class_weights=None):
        """Cross-entropy (in float32) with label smoothing.

        Returns NestedMap(log_probs, per_example_xent, total_xent, total_weight, avg_xent):
        avg_xent = sum(weight * xent) / sum(weight).
        """
        p = self.params
        log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
        targets = tf.one_hot(class_ids, p.num_classes, dtype=tf.float32)
        if p.label_smoothing:
            targets = targets * (1.0 - p.label_smoothing) + p.label_smoothing / p.num_classes
        per_example = -tf.reduce_sum(targets * log_probs, axis=-1)
        if class_weights is None:
            class_weights = tf.ones_like(per_example)
        class_weights = tf.cast(class_weights, tf.float32)
        total = tf.reduce_sum(per_example * class_weights)
        weight = tf.reduce_sum(class_weights)
        return NestedMap(
            log_probs=log_probs,
            per_example_xent=per_example,
            total_xent=total,
            total_weight=weight,
            avg_xent=total / tf.maximum(weight, 1e-9),
        )

    @classmethod
    def FPropMeta(cls, p, inputs):
        inputs = base_layer.to_shape(inputs)
        rows = base_layer.num_elements(inputs[:-1])
        out = inputs[:-1].concatenate([p.num_classes])
        own = 0 if p.tied_embedding is not None else p.input_dim * p.num_classes
        params = own + (p.num_classes if p.bias else 0)
        act_bytes = rows * p.num_classes * base_layer.dtype_bytes(p.fprop_dtype or p.dtype)
        return base_layer.Meta(2 * rows * p.input_dim * p.num_classes, out, params, act_bytes)
