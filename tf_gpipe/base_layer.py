"""BaseLayer: the Lingvo layer idiom on a `tf.Module`.

A layer is configured by `Params()`, built by `Params().Instantiate()` (children and variables
are created in `__init__`), and run by `FProp(*inputs)`. `FPropMeta(p, *shapes)` estimates cost
and output shapes from params alone — the pipeline partitioner's cost model.
"""

import hashlib
import math
import random
import threading

import numpy as np
import tensorflow as tf

from tf_gpipe import hyperparams
from tf_gpipe.nested_map import NestedMap


class WeightInit:
    """Variable initialisers as Params (method, scale), as Lingvo's `py_utils.WeightInit`."""

    @staticmethod
    def _Params(method, scale):
        p = hyperparams.Params()
        p.Define('method', method, 'Initialisation method.')
        p.Define('scale', scale, 'Scale (or value, for constant).')
        return p

    @staticmethod
    def Constant(scale=0.0):
        """Every element equals `scale`."""
        return WeightInit._Params('constant', float(scale))

    @staticmethod
    def Gaussian(scale=1.0):
        """Normal with standard deviation `scale`."""
        return WeightInit._Params('gaussian', float(scale))

    @staticmethod
    def TruncatedGaussian(scale=1.0):
        """Normal with standard deviation `scale`, cut at two deviations."""
        return WeightInit._Params('truncated_gaussian', float(scale))

    @staticmethod
    def Uniform(scale=1.0):
        """Uniform on [-scale, scale]."""
        return WeightInit._Params('uniform', float(scale))

    @staticmethod
    def Xavier(scale=1.0):
        """Uniform on +-scale*sqrt(6/(fan_in+fan_out)) (Glorot)."""
        return WeightInit._Params('xavier', float(scale))

    @staticmethod
    def GaussianSqrtDim(scale=1.0):
        """Normal with standard deviation scale/sqrt(fan_in)."""
        return WeightInit._Params('gaussian_sqrt_dim', float(scale))


_INIT_METHODS = (
    'constant',
    'gaussian',
    'truncated_gaussian',
    'uniform',
    'xavier',
    'gaussian_sqrt_dim',
)


def _fans(shape):
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    return shape[-2] * receptive, shape[-1] * receptive


def variable_seed(random_seed, seed_name):
    """A stateless-RNG seed pair that depends only on (random_seed, seed_name)."""
    digest = hashlib.sha256(f'{random_seed}/{seed_name}'.encode()).digest()
    return [int.from_bytes(digest[i : i + 4], 'little') & 0x7FFFFFFF for i in (0, 4)]


def initial_value(init, shape, dtype, seed):
    """The initial value of a variable for a WeightInit `init` and a seed pair."""
    method, scale = init.method, init.scale
    if method not in _INIT_METHODS:
        raise ValueError(f"Unknown WeightInit method '{method}'; use one of {_INIT_METHODS}.")
    shape = [int(d) for d in shape]
    if method == 'constant':
        return tf.fill(shape, tf.cast(scale, dtype))
    fan_in, fan_out = _fans(shape)
    if method == 'gaussian':
        value = scale * tf.random.stateless_normal(shape, seed)
    elif method == 'gaussian_sqrt_dim':
        value = scale / math.sqrt(fan_in) * tf.random.stateless_normal(shape, seed)
    elif method == 'truncated_gaussian':
        value = scale * tf.random.stateless_truncated_normal(shape, seed)
    elif method == 'uniform':
        value = tf.random.stateless_uniform(shape, seed, -scale, scale)
    else:  # xavier
        limit = scale * math.sqrt(6.0 / (fan_in + fan_out))
        value = tf.random.stateless_uniform(shape, seed, -limit, limit)
    return tf.cast(value, dtype)


# Layers under construction, innermost last: a child's __init__ finds its parent here.
_building = threading.local()

# Fields a child inherits from its parent unless it set its own (differs from the default).
_INHERITED = ('dtype', 'fprop_dtype', 'params_init', 'random_seed')


class BaseLayer(tf.Module):
    """Base class of all layers: params, children, variables, FProp and FPropMeta."""

    # Containers (SequentialLayer, PipelinedLayer, ...) add nothing to their children's seed
    # names, so a layer gets the same initial weights in a plain sequence and in a pipeline cell.
    _SEED_CONTAINER = False

    # FProp is plain TF code (no Python control flow on tensors), so tf.function need not run
    # AutoGraph over it: converting a deep model costs seconds per trace (the trainer traces its
    # step without AutoGraph). A subclass whose FProp branches on tensor values sets this to
    # True: its FProp and PostTrainingStepUpdate are converted once, here, wherever they run.
    _AUTOGRAPH = False

    # Decoding position by position (ExtendStep): a layer each of whose output positions depends
    # only on the same input position steps by its FProp and keeps no state.
    _POSITION_WISE = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ('FProp', 'PostTrainingStepUpdate'):
            if name in cls.__dict__:
                fn = cls.__dict__[name]
                if cls._AUTOGRAPH:
                    fn = tf.autograph.to_graph(fn, recursive=True)
                else:
                    fn = tf.autograph.experimental.do_not_convert(fn)
                setattr(cls, name, fn)

    @classmethod
    def Params(cls):
        p = hyperparams.InstantiableParams(cls)
        p.Define('name', '', 'Name of this layer (unique among its siblings).')
        p.Define('dtype', tf.float32, 'Dtype of the variables.')
        p.Define('fprop_dtype', None, 'Dtype of the activations; None means dtype.')
        p.Define('params_init', WeightInit.Xavier(1.0), 'How variables are initialised.')
        p.Define(
            'random_seed',
            None,
            'Seed for initialisation and dropout. Set: weights are a function of (seed, layer '
            'name path, variable name), whatever container the layer sits in. None: random.',
        )
        p.Define('skip_lp_regularization', None, 'If True, no L2/L1 regularisation on my vars.')
        return p

    def __init__(self, params):
        if not isinstance(params, hyperparams.Params):
            raise TypeError(f'{type(self).__name__} takes its Params, got {type(params).__name__}.')
        if not params.name:
            raise ValueError(
                f'{type(self).__name__}.Params().name is empty; every layer needs a name '
                "(e.g. .Set(name='fc'))."
            )
        super().__init__(name=module_name(params.name))
        stack = getattr(_building, 'stack', [])
        parent = stack[-1] if stack else None
        self._params = params.Copy().Freeze()
        self._children = {}
        self._vars = {}
        if parent is None or parent._SEED_CONTAINER:
            self._seed_name = params.name
        else:
            self._seed_name = f'{parent._seed_name}/{params.name}'
        if params.random_seed is None:
            # Unseeded layers still draw their randomness from stateless ops; the base seed is
            # random per layer object.
            self._base_seed = random.getrandbits(31)
        else:
            self._base_seed = params.random_seed

    @property
    def params(self):
        """This layer's params (frozen)."""
        return self._params

    @property
    def layer_name(self):
        return self._params.name

    @property
    def seed_name(self):
        """The name path that seeds this layer's variables and randomness."""
        return self._seed_name

    @property
    def fprop_dtype(self):
        return self._params.fprop_dtype or self._params.dtype

    @property
    def children(self):
        """NestedMap of child layers (lists of children stay lists)."""
        return NestedMap(self._children)

    @property
    def vars(self):
        """NestedMap of this layer's own variables (not its children's)."""
        return NestedMap(self._vars)

    # ---- construction ------------------------------------------------------------------------

    def _CheckNewName(self, name, what):
        if not name.isidentifier():
            raise ValueError(f'{what} name {name!r} must be a Python identifier.')
        if name in self._children or name in self._vars:
            raise ValueError(f"{self.layer_name}: a child or variable named '{name}' exists.")

    def _InheritedParams(self, p):
        p = p.Copy()
        defaults = BaseLayer.Params()
        for field in _INHERITED:
            if field in p and p.Get(field) == defaults.Get(field):
                p.Set(**{field: self._params.Get(field)})
        return p

    def _Build(self, p):
        stack = getattr(_building, 'stack', None)
        if stack is None:
            stack = _building.stack = []
        stack.append(self)
        try:
            return p.Instantiate()
        finally:
            stack.pop()

    def CreateChild(self, name, params):
        """Builds child layer `name` from `params` (inheriting dtype, init and seed)."""
        self._CheckNewName(name, 'Child')
        child = self._Build(self._InheritedParams(params))
        self._children[name] = child
        setattr(self, name, child)
        return child

    def CreateChildren(self, name, params_list):
        """Builds a list (or dict) of children stored under `name`."""
        self._CheckNewName(name, 'Children')
        if isinstance(params_list, dict):
            built = {k: self._Build(self._InheritedParams(v)) for k, v in params_list.items()}
        else:
            built = [self._Build(self._InheritedParams(v)) for v in params_list]
            names = [c.layer_name for c in built]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(
                    f'{self.layer_name}.{name}: sub-layer names must be unique, {dups} repeat; '
                    "give each its own name (e.g. p.Copy().Set(name='fc1'))."
                )
        self._children[name] = built
        setattr(self, name, built)
        return built

    def CreateVariable(self, name, shape, init=None, dtype=None, trainable=True, **kwargs):
        """Creates variable `name`; its initial value is seeded by (random_seed, seed name).

        `kwargs` go to tf.Variable (`synchronization`, `aggregation`: how a tf.distribute
        strategy keeps and updates its per-replica copies)."""
        self._CheckNewName(name, 'Variable')
        init = init if init is not None else self._params.params_init
        dtype = dtype or self._params.dtype
        seed = variable_seed(self._base_seed, f'{self._seed_name}/{name}')
        with tf.init_scope():
            value = initial_value(init, shape, dtype, seed)
            var = tf.Variable(
                value, name=f'{module_name(self._seed_name)}/{name}', trainable=trainable, **kwargs
            )
        self._vars[name] = var
        return var

    def CastToFPropDtype(self, x):
        """Casts a variable (or tensor) to the activation dtype."""
        return tf.cast(x, self.fprop_dtype) if x.dtype != self.fprop_dtype else x

    # ---- running -----------------------------------------------------------------------------

    def FProp(self, *inputs):
        raise NotImplementedError(f'{type(self).__name__} does not implement FProp.')

    def ExtendStep(self, inputs, state, t, max_len):
        """Decoding: FProp of positions t, t+1, ... of a sequence, given the `state` earlier calls
        left (None on the first call, at t=0, which may cover a whole prefix). Returns (outputs,
        new state); `max_len` bounds the positions, so that a state has one shape at every step
        and the step is traced once."""
        if self._POSITION_WISE:
            return self.FProp(inputs), ()
        raise NotImplementedError(
            f'{type(self).__name__} ({self.params.name!r}) cannot decode step by step: it '
            'defines no ExtendStep (mark a position-wise layer _POSITION_WISE = True).'
        )

    @classmethod
    def FPropMeta(cls, p, *input_shapes):
        """NestedMap(flops, out_shapes, param_count, activation_bytes) from params and shapes.

        Builds no variables. `out_shapes` is a tuple (one entry per FProp output), so a
        sequence can feed them to the next layer's FPropMeta.
        """
        raise NotImplementedError(f'{cls.__name__} does not implement FPropMeta.')

    def LinkTo(self, layers_by_name):
        """Called by the container that holds this layer (a sequence, a pipeline) with every
        layer it holds by name path, after all are built: a layer that reads another's weights
        (a softmax tied to an embedding) finds it here. Default: nothing to link."""

    def ReplicaSums(self):
        """The variables holding sums of this step's batches (batch-norm statistics) that the
        replicas of a data-parallel pipeline pool before `PostTrainingStepUpdate`. Default:
        none."""
        return []

    def ReplayedState(self):
        """The variables this layer's forward assigns that are set to the same value before
        every call, so a recomputed forward assigns them alike (Keras seed generators): the
        recompute check lets those assignments be. Default: none."""
        return []

    def PostTrainingStepUpdate(self):
        """Once per training step, after the gradient update (e.g. batch-norm moving stats)."""
        for child in _flatten_children(self._children):
            child.PostTrainingStepUpdate()

    def NamedVariables(self, replica=0):
        """{path: variable} for this layer's variables and its descendants', keyed by layer
        path ('fc0/w'). The cells a pipeline cuts leave no trace in the path, so the names do
        not depend on K; `replica` picks a data-parallel pipeline's replica copies. A variable
        shared by two layers keeps its first path."""
        out, seen = {}, set()
        self._CollectNamed('', out, seen, replica)
        return out

    def _CollectNamed(self, prefix, out, seen, replica):
        for name, var in self._vars.items():
            if var.ref() in seen:
                continue
            seen.add(var.ref())
            key = prefix + name
            if key in out:
                raise ValueError(
                    f'Two variables have the layer path {key!r}; give the layers distinct names.'
                )
            out[key] = var
        for key, child in self._NamedChildren(replica):
            child._CollectNamed(f'{prefix}{key}/', out, seen, replica)

    def _NamedChildren(self, replica):
        """(path component, child) pairs: a single child by its attribute name, children in a
        list by their layer names, children in a dict by their keys."""
        del replica
        for attr, value in self._children.items():
            if isinstance(value, BaseLayer):
                yield attr, value
            elif isinstance(value, dict):
                yield from value.items()
            else:
                yield from ((child.layer_name, child) for child in value)

    def AllLayers(self):
        """This layer and all its descendants, depth first."""
        out = [self]
        for child in _flatten_children(self._children):
            out.extend(child.AllLayers())
        return out


def _flatten_children(children):
    for value in children.values():
        if isinstance(value, BaseLayer):
            yield value
        elif isinstance(value, dict):
            yield from value.values()
        else:
            yield from value


def link_layers(layers):
    """Lets each of `layers` find the others it reads (`LinkTo`), by name path."""
    by_name = {x.seed_name: x for x in layers}
    for x in layers:
        x.LinkTo(by_name)


def module_name(name):
    """`name` as a tf.Module / variable name: characters other than letters, digits and '_'
    become '_', and a leading digit gets an 'l_'."""
    cleaned = ''.join(c if c.isalnum() or c == '_' else '_' for c in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f'l_{cleaned}'


def to_shape(shape):
    """tf.TensorShape from a shape-like; nested structures are converted leaf by leaf."""
    if isinstance(shape, tf.TensorShape):
        return shape
    if isinstance(shape, (dict, NestedMap)):
        return type(shape)({k: to_shape(v) for k, v in shape.items()})
    if (
        isinstance(shape, (list, tuple))
        and shape
        and not all(d is None or isinstance(d, (int, np.integer)) for d in shape)
    ):
        return type(shape)(to_shape(s) for s in shape)
    return tf.TensorShape(shape)


def flatten_shapes(shape):
    """The TensorShapes of a (possibly nested) shape structure, in tf.nest order."""
    if isinstance(shape, tf.TensorShape):
        return [shape]
    if isinstance(shape, dict):
        return [s for k in sorted(shape) for s in flatten_shapes(shape[k])]
    return [s for item in shape for s in flatten_shapes(item)]


def num_elements(shape):
    """Elements of a fully known shape, summed over a nested structure."""
    return sum(int(s.num_elements()) for s in flatten_shapes(to_shape(shape)))


def dtype_bytes(dtype):
    return tf.as_dtype(dtype).size


def Meta(flops, out_shapes, param_count, activation_bytes):
    """The NestedMap that FPropMeta returns; `out_shapes` becomes a tuple."""
    if not isinstance(out_shapes, tuple):
        out_shapes = (out_shapes,)
    return NestedMap(
        flops=int(flops),
        out_shapes=out_shapes,
        param_count=int(param_count),
        activation_bytes=int(activation_bytes),
    )


def elementwise_meta(p, inputs, flops_per_element, param_count, keeps_activations=True):
    """FPropMeta of a layer whose output has its input's shape (norms, dropout, ...)."""
    inputs = to_shape(inputs)
    n = num_elements(inputs)
    act_bytes = n * dtype_bytes(p.fprop_dtype or p.dtype) if keeps_activations else 0
    return Meta(flops_per_element * n, inputs, param_count, act_bytes)


def check_probability(p, *names):
    """Raises a ValueError unless each named field of `p` is a drop probability in [0, 1) (named
    as the user set it, not as the keep_prob it becomes)."""
    for name in names:
        value = p.Get(name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not 0.0 <= value < 1.0:
            raise ValueError(
                f'{p.cls.__name__} {p.name!r}: {name} must be a probability in [0, 1), got '
                f'{value!r}.'
            )


def check_positive(p, *names):
    """Raises a ValueError unless each named field of `p` is a positive int."""
    for name in names:
        value = p.Get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f'{p.cls.__name__} {p.name!r}: {name} must be a positive int, got {value!r}.'
            )
