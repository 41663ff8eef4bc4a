"""AmoebaNet-D cells (Real et al. 2019), the image model of the GPipe paper.

A cell takes the two previous hidden states (prev, cur) and returns (cur, new), so a stack of
cells is an ordinary layer sequence that a pipeline can cut anywhere. Inside, both inputs are
brought to `filters` channels, five pairs of operations each add two results into a new state,
and the cell's output concatenates some of the states. Reduction cells halve the spatial size
(their operations on the two inputs use stride 2) and the network doubles `filters` after each.
The genotype is AmoebaNet-D's as in TensorFlow's reference implementation (which reproduces
the GPipe paper's parameter counts).
"""

import tensorflow as tf

from tf_gpipe import base_layer
from tf_gpipe.layers import conv, normalization, pooling

# (input state index, operation), two per new state; then the states concatenated.
NORMAL_OPS = [
    (1, 'conv_1x1'), (1, 'max_pool_3x3'),
    (1, 'none'), (0, 'conv_1x7_7x1'),
    (0, 'conv_1x1'), (0, 'conv_1x7_7x1'),
    (2, 'max_pool_3x3'), (2, 'none'),
    (1, 'avg_pool_3x3'), (5, 'conv_1x1'),
]  # fmt: skip
NORMAL_CONCAT = [0, 3, 4, 6]
REDUCTION_OPS = [
    (0, 'max_pool_2x2'), (0, 'max_pool_3x3'),
    (2, 'none'), (1, 'conv_3x3'),
    (2, 'conv_1x7_7x1'), (2, 'max_pool_3x3'),
    (3, 'none'), (1, 'max_pool_2x2'),
    (2, 'avg_pool_3x3'), (3, 'conv_1x1'),
]  # fmt: skip
REDUCTION_CONCAT = [4, 5, 6]

_BN = normalization.BatchNormLayer.Params()
_CONV = conv.Conv2DLayer.Params().Set(bias=False, activation='NONE')


def _out_size(size, stride):
    return None if size is None else -(-size // stride)


class ReluConvBn(base_layer.BaseLayer):
    """relu -> one or more convolutions -> batch norm (filter_shapes and strides per conv)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('filter_shapes', [], 'List of (h, w, in, out).')
        p.Define('strides', [], 'List of (sh, sw), one per filter.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        self.CreateChildren(
            'convs',
            [
                _CONV.Copy().Set(name=f'conv{i}', filter_shape=tuple(f), filter_stride=tuple(s))
                for i, (f, s) in enumerate(zip(p.filter_shapes, p.strides))
            ],
        )
        self.CreateChild('bn', _BN.Copy().Set(name='bn', dim=p.filter_shapes[-1][3]))

    def FProp(self, x):
        x = tf.nn.relu(x)
        for c in self.convs:
            x = c.FProp(x)
        return self.bn.FProp(x)

    @classmethod
    def FPropMeta(cls, p, x):
        shape = base_layer.to_shape(x)
        flops = params = act = 0
        for f, s in zip(p.filter_shapes, p.strides):
            cp = _CONV.Copy().Set(filter_shape=tuple(f), filter_stride=tuple(s))
            meta = conv.Conv2DLayer.FPropMeta(cp, shape)
            flops, params, act = (
                flops + meta.flops,
                params + meta.param_count,
                act + meta.activation_bytes,
            )
            shape = meta.out_shapes[0]
        bn = normalization.BatchNormLayer.FPropMeta(_BN.Copy().Set(dim=shape[-1]), shape)
        return base_layer.Meta(
            flops + bn.flops, shape, params + bn.param_count, act + bn.activation_bytes
        )


class FactorizedReduce(base_layer.BaseLayer):
    """Halves H and W: relu, two stride-2 1x1 convs (one shifted by a pixel), concat, bn."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('in_channels', 0, 'Input channels.')
        p.Define('out_channels', 0, 'Output channels.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        half = p.out_channels // 2
        self.CreateChild(
            'conv_a',
            _CONV.Copy().Set(
                name='conv_a', filter_shape=(1, 1, p.in_channels, half), filter_stride=(2, 2)
            ),
        )
        self.CreateChild(
            'conv_b',
            _CONV.Copy().Set(
                name='conv_b',
                filter_shape=(1, 1, p.in_channels, p.out_channels - half),
                filter_stride=(2, 2),
            ),
        )
        self.CreateChild('bn', _BN.Copy().Set(name='bn', dim=p.out_channels))

    def FProp(self, x):
        x = tf.nn.relu(x)
        shifted = tf.pad(x[:, 1:, 1:, :], [[0, 0], [0, 1], [0, 1], [0, 0]])
        return self.bn.FProp(tf.concat([self.conv_a.FProp(x), self.conv_b.FProp(shifted)], -1))

    @classmethod
    def FPropMeta(cls, p, x):
        n, h, w, _ = base_layer.to_shape(x).as_list()
        out = tf.TensorShape([n, _out_size(h, 2), _out_size(w, 2), p.out_channels])
        outputs = base_layer.num_elements(out)
        params = p.in_channels * p.out_channels + 2 * p.out_channels
        return base_layer.Meta(
            2 * outputs * p.in_channels + 8 * outputs, out, params, 2 * outputs * 4
        )


def _op_params(name, op, channels, stride):
    """Params of one cell operation on `channels` channels."""
    c, s = channels, stride
    if op == 'none':
        if s == 1:
            return None
        return FactorizedReduce.Params().Set(name=name, in_channels=c, out_channels=c)
    if op.endswith('pool_3x3') or op.endswith('pool_2x2'):
        window = 3 if op.endswith('3x3') else 2
        return pooling.PoolingLayer.Params().Set(
            name=name,
            pooling_type='MAX' if op.startswith('max') else 'AVG',
            window_shape=(window, window),
            window_stride=(s, s),
            padding='SAME',
        )
    shapes = {
        'conv_1x1': ([(1, 1, c, c)], [(s, s)]),
        'conv_3x3': ([(3, 3, c, c)], [(s, s)]),
        'conv_1x7_7x1': ([(1, 7, c, c), (7, 1, c, c)], [(1, s), (s, 1)]),
    }
    if op not in shapes:
        raise ValueError(f'Unknown AmoebaNet operation {op!r}.')
    filters, strides = shapes[op]
    return ReluConvBn.Params().Set(name=name, filter_shapes=filters, strides=strides)


class AmoebaCell(base_layer.BaseLayer):
    """One normal or reduction cell: (prev, cur) -> (cur, new)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('filters', 0, 'Channels of every state inside the cell.')
        p.Define('reduction', False, 'A reduction cell (stride 2 on its inputs).')
        p.Define('prev_channels', 0, 'Channels of the previous-previous state.')
        p.Define('cur_channels', 0, 'Channels of the previous state.')
        p.Define('prev_is_larger', False, 'prev has twice the spatial size of cur.')
        return p

    @classmethod
    def _Plan(cls, p):
        """(preprocess params, [(state index, op params or None, stride)], concat)."""
        c = p.filters
        if p.prev_is_larger:
            pre0 = FactorizedReduce.Params().Set(
                name='pre0', in_channels=p.prev_channels, out_channels=c
            )
        else:
            pre0 = ReluConvBn.Params().Set(
                name='pre0', filter_shapes=[(1, 1, p.prev_channels, c)], strides=[(1, 1)]
            )
        pre1 = ReluConvBn.Params().Set(
            name='pre1', filter_shapes=[(1, 1, p.cur_channels, c)], strides=[(1, 1)]
        )
        ops, concat = (
            (REDUCTION_OPS, REDUCTION_CONCAT) if p.reduction else (NORMAL_OPS, NORMAL_CONCAT)
        )
        plan = []
        for i, (index, op) in enumerate(ops):
            stride = 2 if p.reduction and index < 2 else 1
            plan.append((index, _op_params(f'op{i}', op, c, stride), stride))
        return (pre0, pre1), plan, concat

    @classmethod
    def OutChannels(cls, p):
        return p.filters * len(REDUCTION_CONCAT if p.reduction else NORMAL_CONCAT)

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        base_layer.check_positive(p, 'filters', 'prev_channels', 'cur_channels')
        (pre0, pre1), plan, self._concat = self._Plan(p)
        self.CreateChild('pre0', pre0)
        self.CreateChild('pre1', pre1)
        self._plan = [(index, op.name if op else None) for index, op, _ in plan]
        self.CreateChildren('ops', [op for _, op, _ in plan if op is not None])
        self._by_name = {layer.layer_name: layer for layer in self.ops}

    def FProp(self, prev, cur):
        states = [self.pre0.FProp(prev), self.pre1.FProp(cur)]
        for i in range(0, len(self._plan), 2):
            pair = []
            for index, name in self._plan[i : i + 2]:
                x = states[index]
                pair.append(self._by_name[name].FProp(x) if name else x)
            states.append(pair[0] + pair[1])
        return cur, tf.concat([states[j] for j in self._concat], axis=-1)

    @classmethod
    def FPropMeta(cls, p, prev_shape, cur_shape):
        (pre0, pre1), plan, concat = cls._Plan(p)
        metas = [pre0.cls.FPropMeta(pre0, prev_shape), pre1.cls.FPropMeta(pre1, cur_shape)]
        shapes = [metas[0].out_shapes[0], metas[1].out_shapes[0]]
        for i in range(0, len(plan), 2):
            outs = []
            for index, op, _ in plan[i : i + 2]:
                if op is None:
                    outs.append(shapes[index])
                else:
                    meta = op.cls.FPropMeta(op, shapes[index])
                    metas.append(meta)
                    outs.append(meta.out_shapes[0])
            shapes.append(outs[0])
        n, h, w, _ = shapes[concat[0]].as_list()
        out = tf.TensorShape([n, h, w, cls.OutChannels(p)])
        return base_layer.Meta(
            sum(m.flops for m in metas),
            (base_layer.to_shape(cur_shape), out),
            sum(m.param_count for m in metas),
            sum(m.activation_bytes for m in metas),
        )


class AmoebaStem(base_layer.BaseLayer):
    """Images -> (x, x): a 3x3 convolution (stride 1 or 2) with batch norm."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('in_channels', 3, 'Image channels.')
        p.Define('filters', 0, 'Output channels.')
        p.Define('stride', 1, 'Stride of the stem convolution.')
        return p

    @staticmethod
    def _ConvParams(p):
        return _CONV.Copy().Set(
            name='conv',
            filter_shape=(3, 3, p.in_channels, p.filters),
            filter_stride=(p.stride, p.stride),
        )

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        self.CreateChild('conv', AmoebaStem._ConvParams(p))
        self.CreateChild('bn', _BN.Copy().Set(name='bn', dim=p.filters))

    def FProp(self, images):
        x = self.bn.FProp(self.conv.FProp(images))
        return x, x

    @classmethod
    def FPropMeta(cls, p, images):
        meta = conv.Conv2DLayer.FPropMeta(cls._ConvParams(p), images)
        out = meta.out_shapes[0]
        return base_layer.Meta(
            meta.flops + 8 * base_layer.num_elements(out),
            (out, out),
            meta.param_count + 2 * p.filters,
            2 * meta.activation_bytes,
        )


class AmoebaHead(base_layer.BaseLayer):
    """(prev, cur) -> logits: relu, global average pooling, a linear classifier."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('in_channels', 0, 'Channels of cur.')
        p.Define('num_classes', 0, 'Classes.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        self.CreateVariable('w', [p.in_channels, p.num_classes])
        self.CreateVariable('b', [p.num_classes], init=base_layer.WeightInit.Constant(0.0))

    def FProp(self, prev, cur):
        del prev
        x = tf.reduce_mean(tf.nn.relu(tf.cast(cur, self.fprop_dtype)), axis=[1, 2])
        return tf.matmul(x, self.CastToFPropDtype(self.vars.w)) + self.CastToFPropDtype(self.vars.b)

    @classmethod
    def FPropMeta(cls, p, prev, cur):
        n = base_layer.to_shape(cur)[0]
        params = p.in_channels * p.num_classes + p.num_classes
        return base_layer.Meta(
            2 * n * params + base_layer.num_elements(cur),
            tf.TensorShape([n, p.num_classes]),
            params,
            n * p.num_classes * 4,
        )


def AmoebaNetLayers(num_cells, filters, num_classes, in_channels=3, stem_stride=1):
    """The layer list of AmoebaNet-D (L=num_cells normal cells, D=filters): stem, three stacks
    of L/3 normal cells with a reduction cell between stacks (filters doubling), head."""
    if num_cells % 3:
        raise ValueError(f'num_cells (L) must be a multiple of 3, got {num_cells}.')
    sub = [
        AmoebaStem.Params().Set(
            name='stem', in_channels=in_channels, filters=filters, stride=stem_stride
        )
    ]
    prev_c = cur_c = filters
    prev_larger = False
    c = filters
    index = 0
    for stack in range(3):
        if stack:
            c *= 2
            cell = AmoebaCell.Params().Set(
                name=f'reduce{stack}',
                filters=c,
                reduction=True,
                prev_channels=prev_c,
                cur_channels=cur_c,
                prev_is_larger=prev_larger,
            )
            sub.append(cell)
            prev_c, cur_c, prev_larger = cur_c, AmoebaCell.OutChannels(cell), True
        for _ in range(num_cells // 3):
            cell = AmoebaCell.Params().Set(
                name=f'cell{index:02d}',
                filters=c,
                prev_channels=prev_c,
                cur_channels=cur_c,
                prev_is_larger=prev_larger,
            )
            sub.append(cell)
            prev_c, cur_c, prev_larger = cur_c, AmoebaCell.OutChannels(cell), False
            index += 1
    sub.append(AmoebaHead.Params().Set(name='head', in_channels=cur_c, num_classes=num_classes))
    return sub
