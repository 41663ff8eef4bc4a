"""AmoebaNet-D (Real et al. 2019), the image model of the GPipe paper, as a layer sequence.

Follows TensorFlow's reference implementation (tensorflow/tpu models/official/amoeba_net, which
the paper's Table 1 counts come from): a cell reads the two previous hidden states, brings them
to `filters` channels, builds five new states, each the sum of two operations, and concatenates
some of them. State 0 is the cell's latest input, state 1 the one before. 3x3 and 1x7-7x1
convolutions are bottlenecks (1x1 down to filters/4, the convolution, 1x1 back up); every
convolution is relu -> conv -> batch norm. Reduction cells use stride 2 on operations that read
the two inputs, and the network doubles `filters` at each reduction. The ImageNet stem is a
stride-2 convolution and two reduction cells (filters D/4 and D/2), so the first normal stack
runs at 1/8 of the image size. A cell maps (prev, cur) -> (cur, new), so a stack of cells is an
ordinary layer sequence that a pipeline can cut anywhere. Not built: the optional auxiliary
head and drop-path.
"""

import tensorflow as tf

from tf_gpipe import base_layer
from tf_gpipe.layers import conv, normalization, pooling

# (state index, operation), two per new state; then the states concatenated. State 0 is the
# cell's latest input, 1 the input before it (the reference's hiddenstate_indices).
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
STEMS = ('imagenet', 'cifar')

_BN = normalization.BatchNormLayer.Params()
_CONV = conv.Conv2DLayer.Params().Set(bias=False, activation='NONE')


def _out_size(size, stride):
    return None if size is None else -(-size // stride)


def _sum_metas(metas, out_shapes):
    return base_layer.Meta(
        sum(m.flops for m in metas),
        out_shapes,
        sum(m.param_count for m in metas),
        sum(m.activation_bytes for m in metas),
    )


class ReluConvBn(base_layer.BaseLayer):
    """A chain of relu -> convolution -> batch norm, one link per filter shape."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('filter_shapes', [], 'List of (h, w, in, out).')
        p.Define('strides', [], 'List of (sh, sw), one per filter.')
        return p

    @staticmethod
    def _Links(p):
        for i, (f, s) in enumerate(zip(p.filter_shapes, p.strides)):
            yield (
                _CONV.Copy().Set(name=f'conv{i}', filter_shape=tuple(f), filter_stride=tuple(s)),
                _BN.Copy().Set(name=f'bn{i}', dim=f[3]),
            )

    def __init__(self, params):
        super().__init__(params)
        links = list(self._Links(self.params))
        self.CreateChildren('convs', [c for c, _ in links])
        self.CreateChildren('bns', [b for _, b in links])

    def FProp(self, x):
        for c, b in zip(self.convs, self.bns):
            x = b.FProp(c.FProp(tf.nn.relu(x)))
        return x

    @classmethod
    def FPropMeta(cls, p, x):
        shape, metas = base_layer.to_shape(x), []
        for cp, bp in cls._Links(p):
            metas.append(conv.Conv2DLayer.FPropMeta(cp, shape))
            shape = metas[-1].out_shapes[0]
            metas.append(normalization.BatchNormLayer.FPropMeta(bp, shape))
        return _sum_metas(metas, shape)


class FactorizedReduce(base_layer.BaseLayer):
    """Halves H and W: relu, two stride-2 1x1 convs (one shifted by a pixel), concat, bn."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('in_channels', 0, 'Input channels.')
        p.Define('out_channels', 0, 'Output channels.')
        return p

    @staticmethod
    def _ConvParams(p):
        half = p.out_channels // 2
        return [
            _CONV.Copy().Set(name=name, filter_shape=(1, 1, p.in_channels, c), filter_stride=(2, 2))
            for name, c in (('conv_a', half), ('conv_b', p.out_channels - half))
        ]

    def __init__(self, params):
        super().__init__(params)
        conv_a, conv_b = self._ConvParams(self.params)
        self.CreateChild('conv_a', conv_a)
        self.CreateChild('conv_b', conv_b)
        self.CreateChild('bn', _BN.Copy().Set(name='bn', dim=self.params.out_channels))

    def FProp(self, x):
        x = tf.nn.relu(x)
        shifted = tf.pad(x[:, 1:, 1:, :], [[0, 0], [0, 1], [0, 1], [0, 0]])
        return self.bn.FProp(tf.concat([self.conv_a.FProp(x), self.conv_b.FProp(shifted)], -1))

    @classmethod
    def FPropMeta(cls, p, x):
        metas = [conv.Conv2DLayer.FPropMeta(cp, x) for cp in cls._ConvParams(p)]
        n, h, w, _ = metas[0].out_shapes[0].as_list()
        out = tf.TensorShape([n, h, w, p.out_channels])
        metas.append(
            normalization.BatchNormLayer.FPropMeta(_BN.Copy().Set(dim=p.out_channels), out)
        )
        return _sum_metas(metas, out)


def _op_params(name, op, channels, stride):
    """Params of one cell operation on `channels` channels, or None for the identity."""
    c, s, q = channels, stride, channels // 4  # q: the bottleneck's width
    if op == 'none':
        return None if s == 1 else _op_params(name, 'conv_1x1', c, s)
    if op in ('max_pool_2x2', 'max_pool_3x3', 'avg_pool_3x3'):
        window = int(op[-1])
        return pooling.PoolingLayer.Params().Set(
            name=name,
            pooling_type='MAX' if op.startswith('max') else 'AVG',
            window_shape=(window, window),
            window_stride=(s, s),
            padding='SAME',
        )
    if op == 'conv_1x1':
        filters, strides = [(1, 1, c, c)], [(s, s)]
    elif op in ('conv_3x3', 'conv_1x7_7x1') and q < 1:  # too narrow for a bottleneck
        filters, strides = {
            'conv_3x3': ([(3, 3, c, c)], [(s, s)]),
            'conv_1x7_7x1': ([(1, 7, c, c), (7, 1, c, c)], [(1, s), (s, 1)]),
        }[op]
    elif op == 'conv_3x3':
        filters = [(1, 1, c, q), (3, 3, q, q), (1, 1, q, c)]
        strides = [(1, 1), (s, s), (1, 1)]
    elif op == 'conv_1x7_7x1':
        filters = [(1, 1, c, q), (1, 7, q, q), (7, 1, q, q), (1, 1, q, c)]
        strides = [(1, 1), (1, s), (s, 1), (1, 1)]
    else:
        raise ValueError(f'Unknown AmoebaNet operation {op!r}.')
    return ReluConvBn.Params().Set(name=name, filter_shapes=filters, strides=strides)


class AmoebaCell(base_layer.BaseLayer):
    """One normal or reduction cell: (prev, cur) -> (cur, new)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('filters', 0, 'Channels of every state inside the cell.')
        p.Define('reduction', False, 'A reduction cell (stride 2 on its inputs).')
        p.Define('prev_channels', 0, 'Channels of the input before the latest (prev).')
        p.Define('cur_channels', 0, 'Channels of the latest input (cur).')
        p.Define('prev_is_larger', False, 'prev has twice the spatial size of cur.')
        return p

    @classmethod
    def _Plan(cls, p):
        """(pre_cur, pre_prev or None, [(state index, op params or None)], concat)."""
        c = p.filters
        pre_cur = ReluConvBn.Params().Set(
            name='pre_cur', filter_shapes=[(1, 1, p.cur_channels, c)], strides=[(1, 1)]
        )
        pre_prev = None
        if p.prev_is_larger:
            pre_prev = FactorizedReduce.Params().Set(
                name='pre_prev', in_channels=p.prev_channels, out_channels=c
            )
        elif p.prev_channels != c:
            pre_prev = ReluConvBn.Params().Set(
                name='pre_prev', filter_shapes=[(1, 1, p.prev_channels, c)], strides=[(1, 1)]
            )
        ops, concat = (
            (REDUCTION_OPS, REDUCTION_CONCAT) if p.reduction else (NORMAL_OPS, NORMAL_CONCAT)
        )
        plan = []
        for i, (index, op) in enumerate(ops):
            stride = 2 if p.reduction and index < 2 else 1
            plan.append((index, _op_params(f'op{i}', op, c, stride)))
        return pre_cur, pre_prev, plan, concat

    @classmethod
    def OutChannels(cls, p):
        return p.filters * len(REDUCTION_CONCAT if p.reduction else NORMAL_CONCAT)

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        base_layer.check_positive(p, 'filters', 'prev_channels', 'cur_channels')
        pre_cur, pre_prev, plan, self._concat = self._Plan(p)
        self.CreateChild('pre_cur', pre_cur)
        self._has_pre_prev = pre_prev is not None
        if pre_prev is not None:
            self.CreateChild('pre_prev', pre_prev)
        self._plan = [(index, op.name if op else None) for index, op in plan]
        self.CreateChildren('ops', [op for _, op in plan if op is not None])
        self._by_name = {layer.layer_name: layer for layer in self.ops}

    def FProp(self, prev, cur):
        states = [
            self.pre_cur.FProp(cur),
            self.pre_prev.FProp(prev) if self._has_pre_prev else prev,
        ]
        for i in range(0, len(self._plan), 2):
            pair = []
            for index, name in self._plan[i : i + 2]:
                x = states[index]
                pair.append(self._by_name[name].FProp(x) if name else x)
            states.append(pair[0] + pair[1])
        return cur, tf.concat([states[j] for j in self._concat], axis=-1)

    @classmethod
    def FPropMeta(cls, p, prev_shape, cur_shape):
        pre_cur, pre_prev, plan, concat = cls._Plan(p)
        metas = [pre_cur.cls.FPropMeta(pre_cur, cur_shape)]
        shapes = [metas[0].out_shapes[0], base_layer.to_shape(prev_shape)]
        if pre_prev is not None:
            metas.append(pre_prev.cls.FPropMeta(pre_prev, prev_shape))
            shapes[1] = metas[-1].out_shapes[0]
        for i in range(0, len(plan), 2):
            outs = []
            for index, op in plan[i : i + 2]:
                if op is None:
                    outs.append(shapes[index])
                else:
                    metas.append(op.cls.FPropMeta(op, shapes[index]))
                    outs.append(metas[-1].out_shapes[0])
            shapes.append(outs[0])
        n, h, w, _ = shapes[concat[0]].as_list()
        out = tf.TensorShape([n, h, w, cls.OutChannels(p)])
        return _sum_metas(metas, (base_layer.to_shape(cur_shape), out))


class AmoebaStem(base_layer.BaseLayer):
    """Images -> (x, x): a 3x3 convolution (stride 2 for ImageNet, 1 for CIFAR) and batch norm."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('in_channels', 3, 'Image channels.')
        p.Define('filters', 32, 'Output channels (the reference: 32).')
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
        bn = normalization.BatchNormLayer.FPropMeta(_BN.Copy().Set(dim=p.filters), out)
        return _sum_metas([meta, bn], (out, out))


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


def AmoebaNetLayers(num_cells, filters, num_classes, in_channels=3, stem='cifar', stem_filters=32):
    """The layer list of AmoebaNet-D (L=num_cells normal cells, D=filters of the first normal
    stack): stem, three stacks of L/3 normal cells with a reduction cell between stacks (filters
    doubling), head. stem='imagenet': a stride-2 convolution and two reduction cells (D/4, D/2);
    'cifar': a stride-1 convolution only (the reference's two stems)."""
    if num_cells <= 0 or num_cells % 3:
        raise ValueError(f'num_cells (L) must be a positive multiple of 3, got {num_cells}.')
    if stem not in STEMS:
        raise ValueError(f'stem must be one of {STEMS}, got {stem!r}.')
    if stem == 'imagenet' and filters % 8:
        raise ValueError(
            f'filters (D) must be a multiple of 8 with the ImageNet stem (its cells have D/4 '
            f'filters, halved again by their factorized reductions), got {filters}.'
        )
    sub = [
        AmoebaStem.Params().Set(
            name='stem',
            in_channels=in_channels,
            filters=stem_filters,
            stride=2 if stem == 'imagenet' else 1,
        )
    ]
    state = dict(prev_channels=stem_filters, cur_channels=stem_filters, prev_is_larger=False)

    def add(name, c, reduction):
        cell = AmoebaCell.Params().Set(name=name, filters=c, reduction=reduction, **state)
        sub.append(cell)
        state.update(
            prev_channels=state['cur_channels'],
            cur_channels=AmoebaCell.OutChannels(cell),
            prev_is_larger=reduction,
        )

    if stem == 'imagenet':
        add('stem_reduce0', filters // 4, True)
        add('stem_reduce1', filters // 2, True)
    index = 0
    for stack in range(3):
        if stack:
            add(f'reduce{stack}', filters * 2**stack, True)
        for _ in range(num_cells // 3):
            add(f'cell{index:02d}', filters * 2**stack, False)
            index += 1
    sub.append(
        AmoebaHead.Params().Set(
            name='head', in_channels=state['cur_channels'], num_classes=num_classes
        )
    )
    return sub
