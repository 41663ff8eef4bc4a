"""Layer containers: SequentialLayer (run sub-layers in order) and RepeatLayer. Part of the
framework, beside base_layer: the engine builds its cells from them."""

from tf_gpipe import base_layer


def chain(layers, args):
    """Feeds `args` through `layers`: a tuple output is splatted into the next FProp."""
    out = args
    for layer in layers:
        out = layer.FProp(*args)
        args = out if isinstance(out, tuple) else (out,)
    return out


def chain_steps(layers, inputs, states, t, max_len):
    """ExtendStep through `layers` in order: (outputs, [each layer's new state])."""
    states = [None] * len(layers) if states is None else states
    new = []
    for layer, state in zip(layers, states):
        inputs, state = layer.ExtendStep(inputs, state, t, max_len)
        new.append(state)
    return inputs, new


def chain_meta(params_list, shapes):
    """FPropMeta of running `params_list` in order on `shapes` (a tuple of input shapes)."""
    flops = params = act = 0
    for p in params_list:
        meta = p.cls.FPropMeta(p, *shapes)
        flops, params, act = (
            flops + meta.flops,
            params + meta.param_count,
            act + meta.activation_bytes,
        )
        shapes = meta.out_shapes
    return base_layer.Meta(flops, tuple(shapes), params, act)


class SequentialLayer(base_layer.BaseLayer):
    """Runs `sub` layers in order: each layer's outputs are the next layer's inputs."""

    _SEED_CONTAINER = True

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('sub', [], 'Params of the sub-layers, in order.')
        return p

    def __init__(self, params):
        super().__init__(params)
        if not self.params.sub:
            raise ValueError(f'SequentialLayer {self.params.name!r} has no sub-layers.')
        self.CreateChildren('sub', self.params.sub)
        base_layer.link_layers(self.AllLayers())

    def FProp(self, *args):
        return chain(self.sub, args)

    def ExtendStep(self, inputs, state, t, max_len):
        return chain_steps(self.sub, inputs, state, t, max_len)

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        return chain_meta(p.sub, input_shapes)


class RepeatLayer(base_layer.BaseLayer):
    """Runs `repeat` copies of `body` in order, each with its own variables (`<body>_<i>`)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define('body', None, 'Params of the repeated layer.')
        p.Define('repeat', 1, 'Number of copies.')
        return p

    def __init__(self, params):
        super().__init__(params)
        p = self.params
        if p.body is None:
            raise ValueError(f'RepeatLayer {p.name!r}: set body to a layer params.')
        base_layer.check_positive(p, 'repeat')
        self.CreateChildren('body', self._BodyParams(p))

    @staticmethod
    def _BodyParams(p):
        base = p.body.name or 'body'
        return [p.body.Copy().Set(name=f'{base}_{i}') for i in range(p.repeat)]

    def FProp(self, *args):
        return chain(self.body, args)

    def ExtendStep(self, inputs, state, t, max_len):
        return chain_steps(self.body, inputs, state, t, max_len)

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        return chain_meta(cls._BodyParams(p), input_shapes)
