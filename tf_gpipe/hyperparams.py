"""Lingvo-compatible hyper-parameters: `Params` and `InstantiableParams` (their text form is
params_text's).

A `Params` is an ordered set of defined, documented fields. Values are read and written as
attributes; unknown names raise an AttributeError that names the closest defined field. `ToText()`
writes one `dotted.name : value` line per leaf and `FromText()` reads it back, so a whole model
configuration (nested params and lists of layer params included) round-trips through text.
"""

import difflib
import re

from absl import logging

from tf_gpipe import params_text
from tf_gpipe.params_text import TextDiff, apply_overrides  # noqa: F401 (public here too)

_IDENTIFIER = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')
# One path component in text: `name` or `name[3]`.
_COMPONENT = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$')
_LIST_HEADER = re.compile(r'^<list of (\d+) Params>$')


def _closest(name, candidates):
    """' (did you mean 'x'?)' for the closest candidate, or a list of the valid names."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    shown = ', '.join(sorted(candidates)[:20])
    return f' (valid names: {shown})' if shown else ' (no names are defined)'


class _Param:
    """One defined field: name, value and documentation."""

    __slots__ = ('name', 'value', 'description')

    def __init__(self, name, value, description):
        self.name = name
        self.value = value
        self.description = description


def _copy_value(value):
    if isinstance(value, Params):
        return value.Copy()
    if isinstance(value, list):
        return [_copy_value(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, '_fields'):
        return tuple(_copy_value(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _copy_value(v)) for k, v in value.items())
    # Scalars, strings, dtypes, classes and functions are immutable or shared on purpose.
    return value


def _is_params_list(value):
    return isinstance(value, (list, tuple)) and value and all(isinstance(v, Params) for v in value)


def _split_path(path):
    """'a.b[1].c' -> ['a', 'b', 1, 'c']."""
    parts = []
    for component in path.split('.'):
        m = _COMPONENT.match(component.strip())
        if not m:
            raise ValueError(f"Malformed parameter name '{path}': '{component}' is not a name.")
        parts.append(m.group(1))
        parts.extend(int(i) for i in re.findall(r'\[(\d+)\]', m.group(2)))
    return parts


def _join_path(parts):
    text = ''
    for part in parts:
        if isinstance(part, int):
            text += f'[{part}]'
        else:
            text += ('.' if text else '') + part
    return text


class Params:
    """A set of named, documented hyper-parameters (Lingvo's `hyperparams.Params`)."""

    def __init__(self):
        object.__setattr__(self, '_params', {})
        object.__setattr__(self, '_immutable', False)
        object.__setattr__(self, '_aliases', {})  # old path (tuple) -> new path (tuple)
        object.__setattr__(self, '_moved', {})  # name -> where it went (for error messages)

    # ---- definition and access --------------------------------------------------------------

    def Define(self, name, default_value, description):
        """Defines a new field `name` with a default value and a line of documentation."""
        if self._immutable:
            raise TypeError(f"Cannot Define '{name}': this Params is frozen.")
        if not isinstance(name, str) or not _IDENTIFIER.match(name):
            raise ValueError(f'Parameter name {name!r} is not a valid Python identifier.')
        if name in self._params:
            raise AttributeError(f"Parameter '{name}' is already defined.")
        if name.startswith('_') or hasattr(Params, name):
            raise AttributeError(f"'{name}' is reserved by Params; pick another name.")
        self._params[name] = _Param(name, default_value, description)

    def DefineAlias(self, old, new):
        """An old dotted name that still works, with a deprecation warning naming `new` (a
        dotted path from this Params): `p.DefineAlias('learner', 'train.learner')`. An old
        name may be dotted too ('train.eval_steps'), for Set/Get/overrides/text."""
        if '.' in old:  # attribute access on the nested params: an error that says where
            parts = self._Dealias(_split_path(old), warn=False)
            parent = self
            for i, part in enumerate(parts[:-1]):
                parent = _step(parent, part, parts[: i + 1])
            parent._moved[parts[-1]] = new
        self._aliases[tuple(_split_path(old))] = tuple(_split_path(new))
        return self

    def _Dealias(self, parts, prefix=(), warn=True):
        """`parts` with every deprecated prefix replaced by its new path (warning once each)."""
        parts, node, i = list(parts), self, 0
        while isinstance(node, Params) and i < len(parts):
            for old, new in sorted(node._aliases.items(), key=lambda kv: -len(kv[0])):
                if tuple(parts[i : i + len(old)]) == old:
                    if warn:
                        _deprecated(
                            prefix + tuple(parts[: i + len(old)]), prefix + tuple(parts[:i]) + new
                        )
                    parts[i : i + len(old)] = list(new)
                    break
            if i == len(parts) - 1 or not isinstance(parts[i], (str, int)):
                break
            try:
                node = _step(node, parts[i], parts[: i + 1])
            except (AttributeError, IndexError):
                break
            i += 1
        return parts

    def _Missing(self, name, params):
        if name in self._moved:
            return (
                f"Params has no parameter '{name}': it moved to '{self._moved[name]}' of the "
                "enclosing params (Lingvo's tree)"
            )
        return f"Params has no parameter '{name}'{_closest(name, params)}"

    def __getattr__(self, name):
        if name.startswith('__'):
            raise AttributeError(name)
        params = object.__getattribute__(self, '_params')
        if name in params:
            return params[name].value
        aliases = object.__getattribute__(self, '_aliases')
        if (name,) in aliases:
            _deprecated((name,), aliases[(name,)])
            return self.Get(_join_path(aliases[(name,)]))
        raise AttributeError(self._Missing(name, params) + '.')

    def __setattr__(self, name, value):
        if self._immutable:
            raise TypeError(f"Cannot set '{name}': this Params is frozen (Copy() it to change).")
        if name not in self._params:
            if (name,) in self._aliases:
                _deprecated((name,), self._aliases[(name,)])
                self.Set(**{_join_path(self._aliases[(name,)]): value})
                return
            raise AttributeError(self._Missing(name, self._params) + '; Define() it first.')
        self._params[name].value = value

    def __contains__(self, name):
        return name in self._params

    def __len__(self):
        return len(self._params)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._params))

    def _Resolve(self, path):
        """Walks a dotted path (deprecated names replaced); returns (container, last key)."""
        parts = _split_path(path) if isinstance(path, str) else path
        parts = self._Dealias(parts)
        node = self
        for i, part in enumerate(parts[:-1]):
            node = _step(node, part, parts[: i + 1])
        return node, parts[-1]

    def Set(self, **kwargs):
        """Sets several fields (dotted names reach nested params: `Set(**{'a.b': 3})`); returns self."""
        for path, value in kwargs.items():
            node, key = self._Resolve(path)
            _assign(node, key, value, path)
        return self

    def Get(self, name):
        """The value of a field; dotted names reach nested params."""
        node, key = self._Resolve(name)
        return _step(node, key, [name])

    def Delete(self, *names):
        """Removes fields; dotted names reach nested params. Returns self."""
        for path in names:
            node, key = self._Resolve(path)
            if not isinstance(node, Params):
                raise TypeError(f"'{path}' is not a field of a Params.")
            if node._immutable:
                raise TypeError(f"Cannot delete '{path}': this Params is frozen.")
            if key not in node._params:
                raise AttributeError(
                    f"Params has no parameter '{key}'{_closest(key, node._params)}."
                )
            del node._params[key]
        return self

    def Copy(self):
        """A deep copy (nested params and params lists are copied too); never frozen."""
        new = object.__new__(type(self))
        object.__setattr__(new, '_params', {})
        object.__setattr__(new, '_immutable', False)
        object.__setattr__(new, '_aliases', dict(self._aliases))
        object.__setattr__(new, '_moved', dict(self._moved))
        for name, param in self._params.items():
            new._params[name] = _Param(name, _copy_value(param.value), param.description)
        return new

    def Freeze(self):
        """Makes these params and all nested params read-only (set -> TypeError)."""
        object.__setattr__(self, '_immutable', True)
        for _, value in self.IterParams():
            for nested in value if _is_params_list(value) else [value]:
                if isinstance(nested, Params):
                    nested.Freeze()
        return self

    def IsImmutable(self):
        return self._immutable

    def IterParams(self):
        """Yields (name, value) of the top-level fields in definition order."""
        for name, param in self._params.items():
            yield name, param.value

    def GetKeys(self):
        return sorted(self._params)

    def Description(self, name):
        return self._params[name].description

    # ---- comparison and printing -------------------------------------------------------------

    def __eq__(self, other):
        if not isinstance(other, Params):
            return NotImplemented
        if self._params.keys() != other._params.keys():
            return False
        return all(_values_equal(p.value, other._params[k].value) for k, p in self._params.items())

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None

    def __str__(self):
        return self._ToString(0)

    __repr__ = __str__

    def _ToString(self, indent):
        pad = '  ' * (indent + 1)
        lines = ['{']
        for name, value in self.IterParams():
            lines.append(f'{pad}{name}: {_format_nested(value, indent + 1)}')
        lines.append('  ' * indent + '}')
        return '\n'.join(lines)

    # ---- text round trip ---------------------------------------------------------------------

    def ToText(self):
        """One `dotted.name : value` line per leaf, nested params and params lists included."""
        lines = []
        self._ToTextLines([], lines)
        return '\n'.join(lines) + '\n'

    def _ToTextLines(self, prefix, lines):
        for name, value in self.IterParams():
            path = prefix + [name]
            if isinstance(value, Params):
                value._ToTextLines(path, lines)
            elif _is_params_list(value):
                lines.append(f'{_join_path(path)} : <list of {len(value)} Params>')
                for i, item in enumerate(value):
                    item._ToTextLines(path + [i], lines)
            else:
                lines.append(f'{_join_path(path)} : {params_text.encode(value, _join_path(path))}')

    def FromText(self, text):
        """Sets fields from `ToText()` lines (`a.b : 1`, `#` comments allowed); returns self.

        Values are parsed as Python literals, `tf.<dtype>` and `type/<module>/<Class>`; a
        field that holds a string also takes an unquoted word. The parsed value must fit the
        field's current type (an int field refuses 'abc') — the error names field and type.
        """
        entries = []
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith('#'):
                continue
            if ':' not in line:
                raise ValueError(f"Line {lineno} {raw!r} is not of the form 'name : value'.")
            key, value = line.split(':', 1)
            entries.append((_split_path(key.strip()), key.strip(), value.strip()))
        by_key = {k: v for _, k, v in entries}
        # Parents before children, and `cls` before its siblings, so structure exists before
        # leaves are set and a changed class gets its own fresh params.
        entries.sort(key=lambda e: (len(e[0]), e[0][-1] != 'cls'))
        for parts, key, value in entries:
            self._ApplyText(parts, key, value, by_key)
        return self

    def _ApplyText(self, parts, key, text, by_key):
        node, last = self._Resolve(parts)
        header = _LIST_HEADER.match(text)
        if header:
            _resize_params_list(node, last, int(header.group(1)), key, by_key)
            return
        current_exists = isinstance(node, Params) and last in node._params
        if isinstance(node, Params) and not current_exists:
            if getattr(node, '_open', False):
                node.Define(last, params_text.decode(text, None, key), '')
                return
            raise AttributeError(
                f"Unknown parameter '{key}': '{last}'{_closest(last, node._params)}."
            )
        current = _step(node, last, parts)
        value = params_text.decode(text, current, key)
        if last == 'cls' and isinstance(node, InstantiableParams) and value is not node.cls:
            _replace_params(self, parts[:-1], value)
            return
        _assign(node, last, value, key)


_WARNED = set()


def _deprecated(old, new):
    old, new = _join_path(old), _join_path(new)
    if old not in _WARNED:
        _WARNED.add(old)
        logging.warning("Parameter '%s' is deprecated; use '%s' (Lingvo's tree).", old, new)


def _step(node, part, parts_so_far):
    if isinstance(part, int):
        if not isinstance(node, (list, tuple)):
            raise AttributeError(f"'{_join_path(parts_so_far[:-1])}' is not a list.")
        if part >= len(node):
            raise IndexError(
                f"'{_join_path(parts_so_far)}': index {part} out of range (the list has "
                f'{len(node)} items).'
            )
        return node[part]
    if not isinstance(node, Params):
        raise AttributeError(
            f"'{_join_path(parts_so_far[:-1])}' is not a Params, so it has no '{part}'."
        )
    if part not in node._params:
        raise AttributeError(
            f"Params has no parameter '{_join_path(parts_so_far)}'{_closest(part, node._params)}."
        )
    return node._params[part].value


def _assign(node, key, value, path):
    if isinstance(key, int):
        if not isinstance(node, list):
            raise TypeError(f"Cannot set '{path}': it is an item of a tuple, not a list.")
        node[key] = value
    else:
        setattr(node, key, value)


def _resize_params_list(node, key, n, path, by_key):
    current = _step(node, key, [path])
    current = list(current) if isinstance(current, (list, tuple)) else []
    new = []
    for i in range(n):
        cls_text = by_key.get(f'{path}[{i}].cls')
        cls = params_text.decode(cls_text, None, f'{path}[{i}].cls') if cls_text else None
        old = current[i] if i < len(current) else None
        if isinstance(old, Params) and (cls is None or getattr(old, 'cls', None) is cls):
            new.append(old)
        elif cls is not None:
            new.append(cls.Params())
        else:
            fresh = Params()
            object.__setattr__(fresh, '_open', True)  # Fields are defined as they are read.
            new.append(fresh)
    _assign(node, key, new, path)


def _replace_params(root, parts, cls):
    """Replaces the params at `parts` by `cls.Params()`, keeping its name."""
    if not parts:
        raise ValueError('The top-level cls cannot be changed by FromText; build cls.Params().')
    node, last = root._Resolve(parts)
    old = _step(node, last, parts)
    new = cls.Params()
    if 'name' in old and 'name' in new:
        new.name = old.name
    _assign(node, last, new, _join_path(parts))


def _values_equal(a, b):
    if isinstance(a, Params) or isinstance(b, Params):
        return isinstance(a, Params) and isinstance(b, Params) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_values_equal(x, y) for x, y in zip(a, b))
        )
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays compare elementwise
        return a is b


def _format_nested(value, indent):
    if isinstance(value, Params):
        return value._ToString(indent)
    if _is_params_list(value):
        pad = '  ' * (indent + 1)
        items = [pad + v._ToString(indent + 1) for v in value]
        return '[\n' + ',\n'.join(items) + '\n' + '  ' * indent + ']'
    return params_text.encode(value, '')


class InstantiableParams(Params):
    """Params that know the class they configure: `p.Instantiate()` returns `p.cls(p)`."""

    def __init__(self, cls=None):
        super().__init__()
        self.Define('cls', cls, 'Class that these params configure.')

    def Instantiate(self, **kwargs):
        if self.cls is None:
            raise ValueError('Params.cls is not set; nothing to instantiate.')
        return self.cls(self, **kwargs)
