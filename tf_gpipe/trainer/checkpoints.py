"""Checkpoints keyed by layer path: the same names whatever K, M, schedule or replicas.

A checkpoint holds `task/<layer path>/<variable>` for every variable of the task (weights,
batch-norm averages), `optimizer/task/<layer path>/<variable>/<slot>` for the optimizer's slots
beside them, `optimizer/iterations`, the optimizer's name, the step and the input's position.
It is a standard TF object-based checkpoint (tf.train.Checkpoint / CheckpointManager), so
`tf.train.list_variables` reads it; only replica 0's copies are written, and the others are set
equal to them on restore.
"""

import collections
import difflib
import math
import re

import tensorflow as tf

_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'
OPTIMIZER_NAME_KEY = 'optimizer_name'


class _OptimizerName(tf.train.experimental.PythonState):
    """The optimizer's name, saved as a string (no variable: a multi-worker strategy would
    broadcast a variable's initial value, which its collectives cannot do for strings)."""

    def __init__(self, value):
        self.value = value

    def serialize(self):
        return self.value

    def deserialize(self, string_value):
        self.value = string_value.decode() if isinstance(string_value, bytes) else string_value


def _optimizer_name(reader):
    """The optimizer name a checkpoint was written with (either way it was saved), or None."""
    for key in (OPTIMIZER_NAME_KEY + '/.ATTRIBUTES/py_state', OPTIMIZER_NAME_KEY + _SUFFIX):
        if reader.has_tensor(key):
            value = reader.get_tensor(key)
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def _key(var):
    """A hashable identity for a tf.Variable or a Keras variable (which has no ref())."""
    return var.ref() if hasattr(var, 'ref') else id(var)


class _Node(tf.Module):
    """One level of the name tree (a tf.Module tracks what is set on it)."""


def _component_error(path, part):
    return ValueError(
        f'Checkpoint name {path!r}: {part!r} is an attribute of tf.Module, so it cannot be a '
        'path component; rename that layer or variable.'
    )


def _tree(named):
    """A tf.Module tree whose attribute paths are the keys of `named` ('a/b/c' -> root.a.b.c)."""
    root = _Node()
    reserved = set(dir(_Node()))
    for path, var in named.items():
        node, parts = root, path.split('/')
        for part in parts[:-1]:
            if part in reserved:
                raise _component_error(path, part)
            child = getattr(node, part, None)
            if child is None:
                child = _Node()
                setattr(node, part, child)
            elif not isinstance(child, _Node):
                raise ValueError(f'Checkpoint name {path!r} passes through variable {part!r}.')
            node = child
        if parts[-1] in reserved:
            raise _component_error(path, parts[-1])
        setattr(node, parts[-1], var)
    return root


def _keras_slot_base(var):
    """The prefix Keras gives the optimizer variables made from `var` (documented in
    `Optimizer.add_optimizer_variables`: '<variable path with / as _>_<slot>'; a tf.Variable,
    which has no path: its name with / and : as _). Pinned by
    tests/test_checkpoints.py::test_optimizer_slots_belong_to_their_variables."""
    if hasattr(var, 'path'):
        return var.path.replace('/', '_')
    return str(var.name).replace('/', '_').replace(':', '_')


def optimizer_slots(optimizer, variables):
    """([{slot name: slot variable}] aligned with `variables`, [other optimizer variables]).

    Keras names slots by their variable's name, which replicas' copies share: the k-th variable
    of a name owns the k-th slot of that name (Keras builds slots in the variables' order).
    """
    bases = collections.defaultdict(list)
    for i, var in enumerate(variables):
        bases[_keras_slot_base(var)].append(i)
    # Longest base first, so 'fc_w_0' does not claim 'fc_w_0_x_0_momentum'.
    ordered = sorted(bases, key=len, reverse=True)
    taken = collections.defaultdict(int)
    slots = [dict() for _ in variables]
    others = []
    for ov in optimizer.variables:
        name = ov.name.split('/')[-1].split(':')[0]
        base = next((b for b in ordered if name.startswith(b + '_')), None)
        if base is None:
            others.append(ov)
            continue
        slot = name[len(base) + 1 :]
        k = taken[(base, slot)]
        taken[(base, slot)] += 1
        if k >= len(bases[base]):
            raise RuntimeError(
                f'Optimizer variable {ov.name!r} has no model variable left to belong to; this '
                'Keras version names optimizer slots differently (see tests/test_checkpoints.py).'
            )
        index = bases[base][k]
        if tuple(ov.shape) != tuple(variables[index].shape):
            raise RuntimeError(
                f'Optimizer variable {ov.name!r} {tuple(ov.shape)} does not match its variable '
                f'{variables[index].name!r} {tuple(variables[index].shape)}.'
            )
        slots[index][slot] = ov
    return slots, others


def _named_slots(slots_by_key, others, named):
    """{'task/<path>/<slot>': slot} for the variables `named`, and the optimizer's other
    variables by name ('iterations', ...)."""
    out = {}
    for path, var in named.items():
        for slot, ov in slots_by_key.get(_key(var), {}).items():
            out[f'{path}/{slot}'] = ov
    for ov in others:
        name = ov.name.split('/')[-1].split(':')[0]
        out['iterations' if name == 'iteration' else name] = ov
    return out


class NamedCheckpoint:
    """A task and its optimizer saved by layer path (see the module docstring)."""

    def __init__(self, task, optimizer, optimizer_name, trainable, num_replicas=1, **items):
        self.named = {f'task/{k}': v for k, v in task.NamedVariables().items()}
        copies = [
            {f'task/{k}': v for k, v in task.NamedVariables(r).items()}
            for r in range(1, num_replicas)
        ]
        slots, others = optimizer_slots(optimizer, trainable)
        slots_by_key = {_key(v): s for v, s in zip(trainable, slots)}
        self.slots = _named_slots(slots_by_key, others, self.named)
        # Replica r's variables and slots, to set equal to replica 0's after a restore.
        self._pairs = []
        for copy in copies:
            if sorted(copy) != sorted(self.named):
                raise RuntimeError('Replica copies do not have replica 0 names.')
            self._pairs += [(self.named[k], copy[k]) for k in self.named]
            copy_slots = _named_slots(slots_by_key, others, copy)
            self._pairs += [(self.slots[k], copy_slots[k]) for k in self.slots if k in copy_slots]
        _check_complete(task, optimizer, self.named, self.slots, self._pairs)
        self.optimizer_name = optimizer_name
        self._name_var = _OptimizerName(optimizer_name)
        self.checkpoint = tf.train.Checkpoint(
            task=_tree({k[len('task/') :]: v for k, v in self.named.items()}),
            optimizer=_tree(self.slots),
            optimizer_name=self._name_var,
            **items,
        )

    def Shapes(self):
        """{name: shape} of the task's variables, as a checkpoint lists them."""
        return {k: tuple(v.shape) for k, v in self.named.items()}

    def CheckCompatible(self, path):
        """Raises RuntimeError (one line) if checkpoint `path` is of another model or
        optimizer; reading errors (a truncated file) propagate as they are."""
        reader = tf.train.load_checkpoint(path)
        saved = {
            k[: -len(_SUFFIX)]: tuple(shape)
            for k, shape in reader.get_variable_to_shape_map().items()
            if k.endswith(_SUFFIX) and k.startswith('task/')
        }
        ours = self.Shapes()
        missing = sorted(set(ours) - set(saved))
        extra = sorted(set(saved) - set(ours))
        if missing or extra:
            hint = ''
            if missing and extra:
                close = difflib.get_close_matches(missing[0], extra, n=1)
                hint = f" (the model's {missing[0]!r} is not in it"
                hint += f'; closest there: {close[0]!r})' if close else ')'
            raise RuntimeError(
                f"Checkpoint {path} is of another model: {len(missing)} of this model's "
                f'{len(ours)} variables are not in it and {len(extra)} of its are not in the '
                f'model{hint}. Use another --logdir, or warm-start from it with '
                'task.train.init_from_checkpoint_rules.'
            )
        for name, shape in sorted(ours.items()):
            if saved[name] != shape:
                raise RuntimeError(
                    f'Checkpoint {path}: {name} has shape {saved[name]}, the model {shape}. '
                    'Is it a checkpoint of another model size?'
                )
        theirs = _optimizer_name(reader)
        if theirs is not None:
            if theirs != self.optimizer_name:
                raise RuntimeError(
                    f"Checkpoint {path} was written with optimizer '{theirs}', this model uses "
                    f"'{self.optimizer_name}'. Set task.train.learner.optimizer={theirs} to resume, "
                    'or start in a new --logdir and warm-start the weights with '
                    'task.train.init_from_checkpoint_rules.'
                )

    def Restore(self, path):
        """Restores `path` (checked first) and sets the replicas' copies equal to replica 0."""
        self.CheckCompatible(path)
        self.checkpoint.restore(path).assert_existing_objects_matched()
        self.SyncReplicas()

    def SyncReplicas(self):
        for src, dst in self._pairs:
            dst.assign(src)


def _check_complete(task, optimizer, named, slots, pairs):
    """Every variable of the task and optimizer is written or is a replica copy of one (every
    copy is the second of a pair)."""
    covered = {_key(v) for v in [*named.values(), *slots.values()]}
    covered |= {_key(dst) for _, dst in pairs}
    missing = [v.name for v in [*task.variables, *optimizer.variables] if _key(v) not in covered]
    if missing:
        raise RuntimeError(
            f'{len(missing)} variables would be left out of the checkpoint (e.g. {missing[:3]}); '
            'a layer keeps a variable outside CreateVariable.'
        )


def Inspect(path):
    """(step or None, optimizer name or None, [(name, shape, dtype)]) of checkpoint `path`."""
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    rows, step, optimizer = [], None, _optimizer_name(reader)
    for key, shape in sorted(reader.get_variable_to_shape_map().items()):
        if not key.endswith(_SUFFIX):
            continue
        name = key[: -len(_SUFFIX)]
        if name == 'global_step':
            step = int(reader.get_tensor(key))
        elif name == OPTIMIZER_NAME_KEY:
            continue
        rows.append((name, tuple(shape), dtypes[key].name))
    return step, optimizer, rows


def WarmStart(named, rules):
    """Loads variables from other checkpoints by name-mapping rules (Lingvo's
    init_from_checkpoint_rules): {checkpoint path: ([(regex, format)], [ignore regex])}. A
    model variable whose name fully matches a regex (and no ignore regex) is loaded from the
    checkpoint name `format % match.groups()`. Returns [(variable, checkpoint name, path)]."""
    loaded = []
    for path, (mappings, ignores) in rules.items():
        reader = tf.train.load_checkpoint(path)
        shapes = reader.get_variable_to_shape_map()
        available = {k[: -len(_SUFFIX)] if k.endswith(_SUFFIX) else k: k for k in shapes}
        matched_any = False
        for name, var in named.items():
            if any(re.fullmatch(i, name) for i in ignores):
                continue
            for regex, fmt in mappings:
                m = re.fullmatch(regex, name)
                if not m:
                    continue
                source = fmt % m.groups()
                if source not in available:
                    close = difflib.get_close_matches(source, list(available), n=1)
                    raise ValueError(
                        f'Warm start: {name} maps to {source!r}, which {path} does not hold'
                        + (f' (closest: {close[0]!r}).' if close else '.')
                    )
                value = reader.get_tensor(available[source])
                if tuple(value.shape) != tuple(var.shape):
                    raise ValueError(
                        f'Warm start: {name} {tuple(var.shape)} cannot take {source!r} '
                        f'{tuple(value.shape)} from {path}.'
                    )
                var.assign(value)
                loaded.append((name, source, path))
                matched_any = True
                break
        if not matched_any:
            raise ValueError(
                f'Warm start from {path}: no model variable matches the rules {mappings}; '
                f'model names look like {next(iter(named))!r}.'
            )
    return loaded


def Resolve(path):
    """A checkpoint prefix from a prefix, a directory holding checkpoints, or a logdir."""
    if tf.io.gfile.isdir(path):
        for d in (path, f'{path}/checkpoints'):
            latest = tf.train.latest_checkpoint(d)
            if latest:
                return latest
        raise FileNotFoundError(f'No checkpoint in {path} (nor in {path}/checkpoints).')
    if not tf.io.gfile.glob(f'{path}.index'):
        raise FileNotFoundError(f'{path} is not a checkpoint (no {path}.index).')
    return path


def InspectText(path):
    """What a checkpoint holds, as text: step, optimizer, then name / shape / dtype per
    variable and the parameter count of the task's variables."""
    path = Resolve(path)
    try:
        step, optimizer, rows = Inspect(path)
    except tf.errors.OpError as e:  # a truncated or foreign file where the index should be
        raise ValueError(
            f'{path} is not a readable checkpoint ({str(e).splitlines()[0]}). Pass a checkpoint '
            'prefix (ckpt-N, beside ckpt-N.index) or a directory holding checkpoints.'
        ) from None
    width = max([len(r[0]) for r in rows] + [4])
    lines = [f'{path}: step {step}, optimizer {optimizer}, {len(rows)} variables', '']
    lines.append(f'{"name":<{width}}  {"shape":<16}  dtype')
    params = 0
    for name, shape, dtype in rows:
        lines.append(f'{name:<{width}}  {str(list(shape)):<16}  {dtype}')
        if name.startswith('task/') and dtype.startswith(('float', 'bfloat')):
            params += int(math.prod(shape))
    lines += ['', f'task parameters (floating point): {params:,}']
    return '\n'.join(lines)
