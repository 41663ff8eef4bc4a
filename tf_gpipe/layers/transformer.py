"""Pre-LN Transformer layer: self-attention, optional cross-attention, feed-forward."""

import tensorflow as tf

from tf_gpipe import base_layer
from tf_gpipe.layers import attention, dropout, fc, normalization
from tf_gpipe.nested_map import NestedMap


class TransformerLayer(base_layer.BaseLayer):
    """x + Drop(Atten(LN(x))) [+ Drop(CrossAtten(LN(x), aux))] + Drop(FFN(LN(x))).

    FProp takes a [B, T, D] tensor, or a NestedMap with `vecs` and optionally `paddings` [B, T]
    (1.0 = pad), `segment_ids` [B, T] (packed sequences), and for cross-attention `aux_vecs`
    [B, S, D], `aux_paddings`, `aux_segment_ids`. It returns the same kind: a NestedMap comes
    back with `vecs` replaced and every other field passed on, so a stack of these layers —
    cut into pipeline cells or not — carries masks and encoder outputs from layer to layer.
    """

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('input_dim', 0, 'Model dimension.')
        p.Define('num_heads', 1, 'Attention heads.')
        p.Define('hidden_dim', 0, 'Feed-forward hidden size; 0 means 4 * input_dim.')
        p.Define('causal', False, 'Causal self-attention (a decoder / language model).')
        p.Define('has_aux_atten', False, 'Cross-attention to aux_vecs (a decoder).')
        p.Define('dropout_prob', 0.0, 'Residual dropout.')
        p.Define('atten_dropout_prob', 0.0, 'Dropout on attention probabilities.')
        p.Define('relu_dropout_prob', 0.0, 'Dropout inside the feed-forward block.')
        p.Define('activation', 'RELU', 'Feed-forward activation.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        base_layer.check_positive(p, 'input_dim', 'num_heads')
        base_layer.check_probability(p, 'dropout_prob', 'atten_dropout_prob', 'relu_dropout_prob')
        d, hidden = p.input_dim, p.hidden_dim or 4 * p.input_dim
        ln = normalization.LayerNorm.Params().Set(input_dim=d)
        atten = attention.MultiHeadAttention.Params().Set(
            input_dim=d, num_heads=p.num_heads, atten_dropout_prob=p.atten_dropout_prob
        )
        drop = dropout.DropoutLayer.Params().Set(keep_prob=1.0 - p.dropout_prob)
        self.CreateChild('ln_atten', ln.Copy().Set(name='ln_atten'))
        self.CreateChild('atten', atten.Copy().Set(name='atten', causal=p.causal))
        self.CreateChild('drop_atten', drop.Copy().Set(name='drop_atten'))
        if p.has_aux_atten:
            self.CreateChild('ln_aux', ln.Copy().Set(name='ln_aux'))
            self.CreateChild('aux_atten', atten.Copy().Set(name='aux_atten'))
            self.CreateChild('drop_aux', drop.Copy().Set(name='drop_aux'))
        self.CreateChild('ln_ffn', ln.Copy().Set(name='ln_ffn'))
        self.CreateChild(
            'ffn_in',
            fc.FCLayer.Params().Set(
                name='ffn_in', input_dim=d, output_dim=hidden, activation=p.activation
            ),
        )
        self.CreateChild(
            'relu_drop',
            dropout.DropoutLayer.Params().Set(
                name='relu_drop', keep_prob=1.0 - p.relu_dropout_prob
            ),
        )
        self.CreateChild(
            'ffn_out',
            fc.FCLayer.Params().Set(
                name='ffn_out', input_dim=hidden, output_dim=d, activation='NONE'
            ),
        )
        self.CreateChild('drop_ffn', drop.Copy().Set(name='drop_ffn'))

    def FProp(self, inputs):
        p = self.params
        state = inputs if isinstance(inputs, dict) else NestedMap(vecs=inputs)
        if 'vecs' not in state:
            raise ValueError(f"{p.name}: a NestedMap input needs 'vecs', got keys {sorted(state)}.")
        x = tf.cast(state['vecs'], self.fprop_dtype)
        h = self.atten.FProp(
            self.ln_atten.FProp(x), None, state.get('paddings'), state.get('segment_ids')
        )
        x += self.drop_atten.FProp(h)
        if p.has_aux_atten:
            if state.get('aux_vecs') is None:
                raise ValueError(
                    f"{p.name}: has_aux_atten needs 'aux_vecs' in the input "
                    'NestedMap (the encoder output).'
                )
            h = self.aux_atten.FProp(
                self.ln_aux.FProp(x),
                state['aux_vecs'],
                state.get('aux_paddings'),
                state.get('segment_ids'),
                state.get('aux_segment_ids'),
            )
            x += self.drop_aux.FProp(h)
        return self._Output(inputs, state, self._FeedForward(x))

    def _FeedForward(self, x):
        """x + Drop(FFN(LN(x))): the block's last residual branch."""
        h = self.ffn_out.FProp(self.relu_drop.FProp(self.ffn_in.FProp(self.ln_ffn.FProp(x))))
        return x + self.drop_ffn.FProp(h)

    @staticmethod
    def _Output(inputs, state, x):
        """The same kind as `inputs`: a tensor, or the NestedMap with `vecs` replaced."""
        if not isinstance(inputs, dict):
            return x
        out = NestedMap(state)
        out['vecs'] = x
        return out

    def ExtendStep(self, inputs, state, t, max_len):
        """Decoding: a causal layer attends over its cached keys and values (and to the source
        keys and values its cross-attention cached at the first call). A non-causal layer (a
        translation encoder: its source does not change as the target grows) runs on the first
        call only; later calls bring no 'vecs' for it, and it passes them through."""
        p = self.params
        state_in = inputs if isinstance(inputs, dict) else NestedMap(vecs=inputs)
        if not p.causal:
            if state is None:
                return self.FProp(inputs), ()
            if 'vecs' in state_in:
                raise NotImplementedError(
                    f'{p.name}: a non-causal layer cannot decode step by step (it sees '
                    'positions not decoded yet); set causal=True'
                )
            return inputs, ()
        if state_in.get('segment_ids') is not None:
            raise ValueError(f'{p.name}: decoding step by step takes no packed segment_ids.')
        state = NestedMap() if state is None else state
        new = NestedMap()
        x = tf.cast(state_in['vecs'], self.fprop_dtype)
        h, new.atten = self.atten.ExtendStep(
            self.ln_atten.FProp(x), state.get('atten'), t, max_len, state_in.get('paddings')
        )
        x += self.drop_atten.FProp(h)
        if p.has_aux_atten:
            if 'aux' not in state and state_in.get('aux_vecs') is None:
                raise ValueError(f"{p.name}: the first decoding step needs 'aux_vecs'.")
            h, new.aux = self.aux_atten.CrossStep(
                self.ln_aux.FProp(x), state.get('aux'), state_in.get('aux_vecs'),
                state_in.get('aux_paddings'),
            )  # fmt: skip
            x += self.drop_aux.FProp(h)
        return self._Output(inputs, state_in, self._FeedForward(x)), new

    @classmethod
    def FPropMeta(cls, p, inputs):
        inputs = base_layer.to_shape(inputs)
        is_map = isinstance(inputs, dict)
        vecs = inputs['vecs'] if is_map else inputs
        d, hidden = p.input_dim, p.hidden_dim or 4 * p.input_dim
        atten = attention.MultiHeadAttention.Params().Set(input_dim=d, num_heads=p.num_heads)
        ln = normalization.LayerNorm.Params().Set(input_dim=d)
        ffn_in = fc.FCLayer.Params().Set(input_dim=d, output_dim=hidden, activation=p.activation)
        ffn_out = fc.FCLayer.Params().Set(input_dim=hidden, output_dim=d, activation='NONE')
        for q in (atten, ln, ffn_in, ffn_out):
            q.Set(dtype=p.dtype, fprop_dtype=p.fprop_dtype)
        metas = [
            attention.MultiHeadAttention.FPropMeta(atten, vecs),
            normalization.LayerNorm.FPropMeta(ln, vecs),
            normalization.LayerNorm.FPropMeta(ln, vecs),
            fc.FCLayer.FPropMeta(ffn_in, vecs),
        ]
        metas.append(fc.FCLayer.FPropMeta(ffn_out, metas[-1].out_shapes[0]))
        if p.has_aux_atten:
            aux = inputs['aux_vecs'] if is_map and 'aux_vecs' in inputs else vecs
            metas.append(attention.MultiHeadAttention.FPropMeta(atten, vecs, aux))
            metas.append(normalization.LayerNorm.FPropMeta(ln, vecs))
        n = base_layer.num_elements(vecs)
        return base_layer.Meta(
            sum(m.flops for m in metas) + 3 * n,
            inputs,
            sum(m.param_count for m in metas),
            sum(m.activation_bytes for m in metas),
        )
