"""Params as text: one value's text form and back, overrides and diffs.

A value's text is a Python literal (numbers, strings, bools, None, lists, tuples, dicts),
`tf.<dtype>` or `type/<module>/<Class>`. Text is data: decoding evaluates literals only and
names only classes of tf_gpipe, of a registered params file, or subclasses of tf_gpipe's in a
loaded module, so an override or a logdir's params.txt imports and runs nothing else.
"""

import ast
import importlib
import re
import sys

import tensorflow as tf

_TYPE_TEXT = re.compile(r'^type/([\w.]+)/([\w.]+)$')


def encode(value, path):
    if isinstance(value, type):
        return f'type/{value.__module__}/{value.__qualname__}'
    if isinstance(value, tf.dtypes.DType):
        return f'tf.{value.name}'
    if isinstance(value, str):
        return '"' + value.encode('unicode_escape').decode('ascii').replace('"', '\\"') + '"'
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, list):
        return '[' + ', '.join(encode(v, path) for v in value) + ']'
    if isinstance(value, tuple):
        inner = ', '.join(encode(v, path) for v in value)
        return '(' + inner + (',)' if len(value) == 1 else ')')
    if isinstance(value, dict):
        return (
            '{' + ', '.join(f'{encode(k, path)}: {encode(v, path)}' for k, v in value.items()) + '}'
        )
    if hasattr(value, 'item') and hasattr(value, 'dtype'):  # numpy scalar
        return repr(value.item())
    raise TypeError(
        f"Parameter '{path}' holds a {type(value).__name__}, which has no text form; use an "
        'int, float, str, bool, None, list, tuple, dict, tf.DType, class or Params.'
    )


def _eval_node(node, path):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List):
        return [_eval_node(e, path) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_eval_node(e, path) for e in node.elts)
    if isinstance(node, ast.Dict):
        return {_eval_node(k, path): _eval_node(v, path) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _eval_node(node.operand, path)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.Name) and node.id in ('nan', 'inf'):
        return float(node.id)  # a float, so the checks can say what they accept (finite ...)
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == 'tf'
    ):
        return tf.as_dtype(node.attr)
    raise ValueError('not a literal')


def _ours(module_name):
    return module_name == 'tf_gpipe' or module_name.startswith(('tf_gpipe.', 'tf_gpipe_params.'))


# Modules that moved, by their old names: a params text written before (a logdir's params.txt)
# still names their classes.
MOVED_MODULES = {
    'tf_gpipe.layers.sequential': 'tf_gpipe.sequential',
    'tf_gpipe.layers.keras_layer': 'tf_gpipe.keras.layer',
    'tf_gpipe.layers.keras_node': 'tf_gpipe.keras.node',
}


def _import_type(module_name, qualname, path):
    """The class `type/<module>/<qualname>` names. Params text is data (an override, a logdir's
    params.txt): it may name a class of tf_gpipe, of a registered params file, or a subclass of
    one of tf_gpipe's (a user's layer) in a module already imported; it imports nothing else,
    so no text runs code (a params *file* is code, by design)."""
    refused = ValueError(
        f"Parameter '{path}': type/{module_name}/{qualname} is not a class of tf_gpipe, of a "
        "registered params file, or a subclass of one of tf_gpipe's in a loaded module: a "
        'params text may name only those (it imports and runs nothing else). Set it in a '
        'params file instead.'
    )
    if not _ours(module_name) and module_name not in sys.modules:
        raise refused
    module_name = MOVED_MODULES.get(module_name, module_name)
    try:
        obj = (
            importlib.import_module(module_name)
            if module_name.startswith('tf_gpipe.') or module_name == 'tf_gpipe'
            else sys.modules[module_name]
        )
        for attr in qualname.split('.'):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError, KeyError) as e:
        raise ValueError(f"Parameter '{path}': cannot import {module_name}.{qualname}: {e}") from e
    if not isinstance(obj, type) or not any(_ours(c.__module__) for c in obj.__mro__):
        raise refused
    return obj


def decode(text, current, path):
    """Parses `text` into a value of the same kind as `current` (None: any kind)."""
    m = _TYPE_TEXT.match(text)
    if m:
        value = _import_type(m.group(1), m.group(2), path)
    else:
        try:
            value = _eval_node(ast.parse(text, mode='eval').body, path)
        except (SyntaxError, ValueError, TypeError):
            if current is None or isinstance(current, str):
                return text  # An unquoted word for a string field.
            raise _type_error(path, current, text) from None
    return _check_type(value, current, path, text)


def _check_type(value, current, path, text):
    if current is None or value is None:
        return value
    if isinstance(current, bool):
        ok = isinstance(value, bool)
    elif isinstance(current, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(current, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(current, str):
        if not isinstance(value, str):
            value, ok = text, True  # e.g. `activation=RELU` or a numeric-looking string
        else:
            ok = True
    elif isinstance(current, (list, tuple)):
        ok = isinstance(value, (list, tuple))
        value = type(current)(value) if ok else value
    elif isinstance(current, dict):
        ok = isinstance(value, dict)
    elif isinstance(current, tf.dtypes.DType):
        ok = isinstance(value, tf.dtypes.DType)
    elif isinstance(current, type):
        ok = isinstance(value, type)
    else:
        ok = True
    if not ok:
        raise _type_error(path, current, text)
    return value


def _type_error(path, current, text):
    kind = type(current).__name__
    article = 'an' if kind[0] in 'aeiou' else 'a'
    return ValueError(
        f"Parameter '{path}' expects {article} {kind} (current value "
        f'{encode_or_repr(current)}), got {text!r}.'
    )


def encode_or_repr(value):
    try:
        return encode(value, '')
    except TypeError:
        return repr(value)


def TextDiff(a, b):
    """Lines that differ between `a.ToText()` and `b.ToText()`: '- name : old' / '+ name : new'."""
    left = dict(_text_items(a))
    right = dict(_text_items(b))
    out = []
    for key in sorted(set(left) | set(right)):
        if left.get(key) != right.get(key):
            if key in left:
                out.append(f'- {key} : {left[key]}')
            if key in right:
                out.append(f'+ {key} : {right[key]}')
    return '\n'.join(out) + ('\n' if out else '')


def _text_items(p):
    for line in p.ToText().splitlines():
        key, value = line.split(' : ', 1)
        yield key, value


def apply_overrides(params, overrides):
    """Applies `'a.b=1; c.d="x"'` (or newline-separated `a.b : 1`) to `params`; returns it.

    Every name must exist (a typo names the closest field) and every value must fit the
    field's type, exactly as `FromText`.
    """
    lines = []
    for item in re.split(r'[;\n]', overrides or ''):
        item = item.strip()
        if not item or item.startswith('#'):
            continue
        m = re.match(r'^([\w.\[\]]+)\s*(?:=|:)\s*(.*)$', item)
        if not m:
            raise ValueError(
                f"Override {item!r} is not of the form 'name=value' (for example "
                "'task.pipeline.num_micro_batches=8')."
            )
        lines.append(f'{m.group(1)} : {m.group(2)}')
    return params.FromText('\n'.join(lines))
