"""GPipe(keras model): a Sequential's layers, or a functional model's calls (keras/functional.py),
cut into K cells and run by the PipelinedLayer.

The returned `GPipeModel` is a keras.Model: compile/fit/evaluate/predict, callbacks, save and
load work as for any Keras model. Its call runs the pipeline (the same schedule, recompute and
gradient accumulation as every other tf_gpipe model). fit computes the compiled loss per
micro-batch on the last cell, each micro-batch's share of the plain model's loss (train_steps);
metrics see the merged output, so every example updates them once.
"""

import keras
import tensorflow as tf

from tf_gpipe import fprop_context
from tf_gpipe.gpipe import partition
from tf_gpipe.gpipe.pipelined_layer import RECOMPUTE_POLICIES, PipelinedLayer
from tf_gpipe.keras import checks, functional, layer_sequence
from tf_gpipe.keras import clones as keras_clones
from tf_gpipe.keras import masks as keras_masks
from tf_gpipe.keras.layer import KerasLayer, layer_config, make_layer
from tf_gpipe.keras.train_steps import TrainSteps
from tf_gpipe.nested_map import NestedMap
from tf_gpipe.runtime import placement

try:  # True while Keras traces a model on placeholders only to learn its output spec.
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
except ImportError:  # pragma: no cover - other Keras layouts

    def in_symbolic_scope():
        return False


# Batch sizes the partitioner costs layers at: FPropMeta costs scale with the batch, so one
# example gives the same balance; measured times need a batch big enough to time.
_COST_BATCH = {'time': 32}


def GPipe(sequential, **options):
    """A keras.Model running `sequential` as a K-cell GPipe pipeline; options: see GPipeModel."""
    return GPipeModel(sequential, **options)


@keras.saving.register_keras_serializable(package='tf_gpipe')
class GPipeModel(TrainSteps, keras.Model):
    """A Keras model as a K-cell GPipe pipeline with M micro-batches.

    Args:
      sequential: a keras.Sequential (nested Sequentials are flattened; one built with
        keras.Input, or given `input_shape`) or a functional keras.Model (any graph of calls;
        several inputs and outputs; models used as layers are inlined). Its current weights are
        copied onto the cells' devices; train the returned model.
      num_partitions: K, the number of cells, balanced by `partition_by`. None (and no `balance`): one
        cell per device of `devices` or of the current device mesh.
      balance: explicit layers per cell, e.g. [3, 3, 2, 2] (overrides num_partitions).
      cut_after: explicit cuts by layer name: a cell ends after each named layer's call,
        e.g. ['conv3_block4_out', 'conv4_block6_out'] (K = len + 1).
      num_micro_batches: M; any batch size works (min(M, N) micro-batches whose sizes differ by
        at most one), the last partial batch of an epoch and a small predict() included.
      recompute: 'always' | 'except_last' | 'never' (see PipelinedLayer).
      schedule: 'gpipe' | '1f1b' | 'interleaved_1f1b' | 'zero_bubble'. Other than 'gpipe',
        fit() computes the compiled loss per micro-batch on the last stage (its mean over each
        micro-batch, weighted by size: the plain loss for 'sum_over_batch_size' reductions).
      virtual_stages: v for 'interleaved_1f1b' (K*v cells, cell c on device c mod K).
      devices: K device names (None: the current mesh, see tf_gpipe.cluster).
      partition_by: 'flops' | 'params' | 'activation_bytes' | 'uniform' | 'time'.
      jit_compile: compile each cell's forward and backward with XLA.
      tick_loop: run a training step as a loop over clock ticks (PipelinedLayer.tick_loop):
        start-up flat in M. None (the default): the loop from 8 micro-batches on when the
        devices are in one process, not across TF tasks (slower there); True / False: always /
        never.
      eval_loop: run evaluate() and predict() as a loop over ticks (PipelinedLayer.eval_loop):
        start-up flat in M, a steady step about 1.1x the unrolled one's with tiny layers.
        None (the default): the loop when the devices are in one process, not across TF
        tasks (slower there); True / False: always / never.
      cell_grappler: run Grappler on the cells' functions too (PipelinedLayer.cell_grappler);
        False (the default): a shorter first step, the same numbers.
      input_shape: input shape without the batch dimension, for an unbuilt Sequential.
    """

    def __init__(
        self,
        sequential,
        *,
        num_partitions=None,
        balance=None,
        cut_after=None,
        num_micro_batches=1,
        recompute='except_last',
        schedule='gpipe',
        virtual_stages=1,
        devices=None,
        partition_by='flops',
        jit_compile=False,
        tick_loop=None,
        eval_loop=None,
        cell_grappler=False,
        input_shape=None,
        input_dtype=None,
        name=None,
        **kwargs,
    ):
        layer_sequence.check_options(kwargs)
        # A functional model, or a Sequential holding one (a keras.applications backbone) or
        # making Keras masks, is cut as a graph of calls (whose steps carry masks); a plain
        # Sequential as a chain of layers.
        is_functional = layer_sequence.check_model(sequential) or any(
            functional.is_graph(layer) or layer_sequence.makes_mask(layer)
            for layer in layer_sequence.flat_layers(sequential)
        )
        if recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f'recompute must be one of {RECOMPUTE_POLICIES}, got {recompute!r}.')
        input_names, reach = None, None
        if is_functional:
            originals, sub, in_specs, out_spec, reach = layer_sequence.functional_sub(sequential)
            batch_shape, dtype = in_specs[0]
            if len(in_specs) > 1:
                if partition_by == 'time':
                    raise ValueError(
                        "partition_by='time' times layers on one input; this model has "
                        f"{len(in_specs)}. Use 'flops', 'params' or balance=[...]."
                    )
                input_names = [t.name for t in sequential.inputs]
        else:
            originals = layer_sequence.flat_layers(sequential)
            if not originals:
                raise ValueError(f'The Sequential {sequential.name!r} has no layers to pipeline.')
            batch_shape, dtype = layer_sequence.batch_shape(sequential, input_shape, input_dtype)
            in_shapes, out_spec = layer_sequence.layer_shapes(originals, batch_shape, dtype)
            checks.check_supported(originals, in_shapes)
            sub = [
                KerasLayer.Params().Set(
                    name=layer_name,
                    keras_layer=type(layer),
                    config=layer_config(layer),
                    input_shape=shape,
                    input_dtype=layer_dtype,
                    autocast=False,
                )
                for layer_name, layer, (shape, layer_dtype) in zip(
                    layer_sequence.param_names(originals), originals, in_shapes
                )
            ]
        if cut_after is not None:
            balance = layer_sequence.balance_from_cuts(originals, cut_after, balance)
        num_partitions, splits = layer_sequence.splits(originals, num_partitions, balance, devices)
        super().__init__(name=name or f'{sequential.name}_gpipe', **kwargs)
        # A functional model is saved as its own config (the graph), a Sequential by layers.
        # The model given, for to_keras() (untracked: its weights are not this model's).
        object.__setattr__(self, '_original', sequential)
        # (Untracked: Keras's tracker would wrap it, and deserializing the wrapper loses it.)
        object.__setattr__(
            self,
            '_source',
            keras.saving.serialize_keras_object(sequential) if is_functional else None,
        )
        cost_batch = _COST_BATCH.get(partition_by, 1)
        pipe_p = PipelinedLayer.Params().Set(
            name='gpipe',
            sub=sub,
            num_partitions=num_partitions,
            splits=splits,
            partition_by=partition_by,
            input_shape=(
                (cost_batch,) + tuple(batch_shape[1:])
                if input_names is None
                else tuple((cost_batch,) + tuple(shape[1:]) for shape, _ in in_specs)
            ),
            input_dtype=tf.as_dtype(dtype),
            num_micro_batches=num_micro_batches,
            recompute=recompute,
            schedule=schedule,
            virtual_stages=virtual_stages,
            devices=devices,
            jit_compile=jit_compile,
            tick_loop=tick_loop,
            eval_loop=eval_loop,
            cell_grappler=cell_grappler,
        )
        with tf.init_scope():
            pipe = pipe_p.Instantiate()
        # Not tracked by Keras: the Keras layers below are the model's weights.
        object.__setattr__(self, '_pipe', pipe)
        clones = [
            layer.keras_layer
            for cell in pipe.cells
            for layer in cell.AllLayers()
            if isinstance(layer, KerasLayer)
        ]
        wrappers = [
            layer
            for cell in pipe.cells
            for layer in cell.AllLayers()
            if isinstance(layer, KerasLayer)
        ]
        first_use = {}
        for i, (original, wrapper) in enumerate(zip(originals, wrappers)):
            if id(original) in first_use:  # a layer used twice: one set of weights
                wrapper.ShareFrom(wrappers[first_use[id(original)]])
                clones[i] = wrapper.keras_layer
                continue
            first_use[id(original)] = i
            if getattr(original, 'built', False) and isinstance(original, keras.layers.Layer):
                keras_clones.check_clone(original, clones[i])
                keras_clones.copy_state(original, clones[i])
        self.partition_layers = clones
        object.__setattr__(self, '_reach', reach)  # per output: the steps it depends on
        self._out_spec = out_spec
        # The plain model's output structure (a dict, nested lists) and names: Keras maps
        # compile()'s per-output losses and metrics by them and names history's keys after them.
        # (Untracked: TF's tracking would wrap a dict, and Keras matches loss dicts by type.)
        object.__setattr__(
            self,
            '_out_template',
            layer_sequence.output_template(sequential) if is_functional else None,
        )
        if getattr(sequential, 'output_names', None):
            self.output_names = list(sequential.output_names)
        self._options = dict(
            num_micro_batches=num_micro_batches,
            recompute=recompute,
            schedule=schedule,
            virtual_stages=virtual_stages,
            devices=devices,
            partition_by=partition_by,
            jit_compile=jit_compile,
            tick_loop=tick_loop,
            eval_loop=eval_loop,
            cell_grappler=cell_grappler,
        )
        self._batch_shape, self._input_dtype = tuple(batch_shape), dtype
        self._input_names = input_names  # several inputs: their names, in order
        self.supports_jit = False  # One XLA cluster over K devices is not a pipeline.
        self.built = True

    # ---- introspection -----------------------------------------------------------------------

    @property
    def pipeline(self):
        """The PipelinedLayer that runs this model."""
        return self._pipe

    @property
    def num_partitions(self):
        return self._pipe.num_cells

    @property
    def balance(self):
        """Number of layers in each partition."""
        ends = self._pipe.splits
        return [int(b - a) for a, b in partition.blocks(ends)]

    @property
    def devices(self):
        return self._pipe.devices

    @property
    def num_micro_batches(self):
        return self._options['num_micro_batches']

    def partition_table(self):
        """The cells as a table: layers, params, flops and activation bytes per example, device."""
        return self._pipe.PartitionTable()

    def summary(self, *args, **kwargs):
        """Keras's summary of the layers, then the cells: layers, params, device per cell."""
        super().summary(*args, **kwargs)
        print_fn = kwargs.get('print_fn') or print
        o = self._options
        print_fn(
            f'GPipe: {self.num_partitions} cells, {o["num_micro_batches"]} micro-batches, '
            f'schedule={o["schedule"]!r}, recompute={o["recompute"]!r}\n'
            f'{self.partition_table()}'
        )

    # ---- running -----------------------------------------------------------------------------

    def _Inputs(self, inputs):
        """The model inputs as a tuple (several inputs: a list, a tuple or a dict by name)."""
        if self._input_names is None:
            return (inputs,)
        if isinstance(inputs, dict):
            return tuple(inputs[name] for name in self._input_names)
        if not isinstance(inputs, (list, tuple)) or len(inputs) != len(self._input_names):
            raise ValueError(
                f'{self.name} takes {len(self._input_names)} inputs '
                f'({", ".join(self._input_names)}), as a list, tuple or dict.'
            )
        return tuple(inputs)

    def _Outputs(self, outputs):
        """The pipeline's outputs as the plain model returns them: a list for several, and an
        output that carries a Keras mask (NestedMap(value=, mask=)) with its mask attached."""

        def one(out):
            if isinstance(out, NestedMap):
                return keras_masks.attach(out.value, out.mask)
            return out

        flat = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return self._Pack([one(out) for out in flat])

    def _Pack(self, flat):
        """Flat outputs in the plain model's structure (one output: itself)."""
        if self._out_template is None:
            return flat[0]
        return keras.tree.pack_sequence_as(self._out_template, list(flat))

    def _Unmasked(self, outputs):
        """Outputs for a per-micro-batch loss, which cannot honour a mask exactly."""
        if layer_sequence.carries_mask(outputs):
            raise ValueError(
                f'{self.name}: an output carries a Keras mask, and Keras averages a masked loss '
                'over the unmasked entries of the whole batch; schedule='
                f'{self._options["schedule"]!r} computes the loss per micro-batch, which cannot '
                "match that. Use schedule='gpipe' (the loss on the merged output)."
            )
        return self._Outputs(outputs)

    def call(self, inputs, training=None):
        inputs = self._Inputs(inputs)
        if in_symbolic_scope():  # Keras wants the output spec only: skip tracing the cells.
            zeros = [
                tf.zeros(tf.concat([tf.shape(inputs[0])[:1], s.shape[1:]], 0), s.dtype)
                for s in tf.nest.flatten(self._out_spec)
            ]
            return self._Pack(zeros)
        if training:
            return self._TrainingCall(inputs)
        with fprop_context.scope(training=False):
            return self._Outputs(self._pipe.FProp(*inputs))

    def compute_output_spec(self, inputs, training=None):
        batch = tf.nest.flatten(inputs)[0].shape[0]
        specs = [
            keras.KerasTensor((batch,) + tuple(s.shape[1:]), dtype=s.dtype)
            for s in tf.nest.flatten(self._out_spec)
        ]
        return self._Pack(specs)

    def build(self, input_shape=None):
        """Built at construction (every cell's weights already exist)."""

    def compile(self, *args, **kwargs):
        if kwargs.get('jit_compile') is True:
            raise ValueError(
                'compile(jit_compile=True) would compile the whole K-device pipeline as one XLA '
                'cluster. Use GPipe(..., jit_compile=True) to compile each cell with XLA.'
            )
        kwargs['jit_compile'] = False
        self._CheckStrategy()
        super().compile(*args, **kwargs)
        if self.optimizer is not None:  # Slots next to their variables, on the cells' devices.
            placement.build_optimizer(self.optimizer, self.trainable_variables)

    def _CheckStrategy(self):
        """compile() under the strategy the pipeline was built under, or under none."""
        mesh = self._pipe.mesh
        current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        built = None if mesh is None else mesh.strategy()
        if current is not built:
            where = 'outside any strategy' if built is None else 'inside mesh.strategy().scope()'
            now = (
                f'inside the scope of a {type(current).__name__}'
                if current is not None
                else 'outside any strategy'
            )
            raise ValueError(
                f'{self.name} was built {where} and is compiled {now}: Keras would make the '
                'optimizer for another set of replicas. Build and compile it in the same place: '
                'for data parallelism both inside mesh.strategy().scope() (mesh = '
                'cluster.DeviceMesh.from_local(num_replicas=R, num_stages=K)).'
            )

    def compile_from_config(self, config):
        """Compiles a loaded model as it was saved (Keras skips custom compile methods)."""
        self.compile(**keras.saving.deserialize_keras_object(config))

    # ---- back to one device ------------------------------------------------------------------

    def to_keras(self):
        """The original architecture as a plain keras.Model on one device, with this model's
        trained weights and layer state (batch norm's averages, seeds): to serve, export or
        fine-tune without tf_gpipe. A clone of the model GPipe was given (its nesting too)."""
        with tf.init_scope():
            model = keras.models.clone_model(
                self._original, clone_function=lambda one: make_layer(type(one), layer_config(one))
            )
            if not model.built:  # a Sequential given without keras.Input
                model.build(self._batch_shape)
            if self._source is None:
                targets = layer_sequence.flat_layers(model)
            else:
                targets = [step.layer for step in functional.steps_of(model)[0]]
            done = set()
            for source, target in zip(self.partition_layers, targets):
                if isinstance(target, keras.layers.Layer) and id(target) not in done:
                    done.add(id(target))
                    keras_clones.copy_state(source, target)
        return model

    def export(self, filepath, *args, **kwargs):
        """Keras's export of `to_keras()`: a single-device artifact (a SavedModel with a
        `serve` endpoint by default) that loads without tf_gpipe; arguments as keras.Model's."""
        return self.to_keras().export(filepath, *args, **kwargs)

    # ---- saving ------------------------------------------------------------------------------

    def get_config(self):
        config = dict(
            name=self.name,
            layers=[keras.saving.serialize_keras_object(layer) for layer in self.partition_layers],
            input_shape=list(self._batch_shape[1:]),
            input_dtype=self._input_dtype,
            balance=self.balance,
            **self._options,
        )
        if self._source is not None:
            config['functional'] = self._source
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        layer_configs = config.pop('layers')
        if 'functional' in config:  # the graph again (fresh weights; Keras loads the saved)
            model = keras.saving.deserialize_keras_object(
                config.pop('functional'), custom_objects=custom_objects
            )
            return cls(model, **config)
        layers = [
            keras.saving.deserialize_keras_object(c, custom_objects=custom_objects)
            for c in layer_configs
        ]
        # Unbuilt: the layers get their weights only on their devices (then Keras loads them).
        return cls(keras.Sequential(layers), **config)
