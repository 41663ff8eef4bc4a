"""NestedMap: a dict with attribute access, and a tf.nest structure (Lingvo's NestedMap).

Cells of a pipeline pass NestedMaps to each other (activations plus paddings, encoder outputs,
...); `tf.nest` and `tf.function` treat them as ordinary dicts, so they flow through graphs.
"""

import difflib

import tensorflow as tf

_RESERVED = frozenset(dir(dict)) | {
    'Flatten',
    'FlattenItems',
    'Pack',
    'Transform',
    'Filter',
    'DeepCopy',
    'IsCompatible',
    'GetItem',
    'Get',
    'Set',
}


class NestedMap(dict):
    """A dict whose keys are also attributes; nested values may be NestedMaps, lists, tuples."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key in self:
            self._CheckKey(key)

    @staticmethod
    def _CheckKey(key):
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f'NestedMap keys must be identifiers, got {key!r}.')
        if key in _RESERVED:
            raise ValueError(f"'{key}' is a reserved NestedMap attribute; pick another key.")

    def __setitem__(self, key, value):
        self._CheckKey(key)
        super().__setitem__(key, value)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self.keys()), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f' (keys: {sorted(self)})'
            raise AttributeError(f"NestedMap has no key '{name}'{hint}.") from None

    def __setattr__(self, name, value):
        self[name] = value

    def __delattr__(self, name):
        try:
            del self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self.keys()))

    def copy(self):
        return NestedMap(self)

    def DeepCopy(self):
        """Copies the structure (maps, lists, tuples); leaves are shared."""
        return tf.nest.map_structure(lambda x: x, self)

    def GetItem(self, key):
        """Gets a value by dotted path ('a.b.c')."""
        value = self
        for part in key.split('.'):
            value = value[part]
        return value

    def Flatten(self):
        """The leaves, in tf.nest order (keys sorted)."""
        return tf.nest.flatten(self)

    def FlattenItems(self):
        """(dotted path, leaf) pairs in the order of Flatten()."""
        return list(_items_with_paths(self, ''))

    def Pack(self, leaves):
        """A NestedMap of this structure whose leaves are `leaves` (as from Flatten())."""
        return tf.nest.pack_sequence_as(self, list(leaves))

    def Transform(self, fn):
        """A NestedMap of this structure with `fn` applied to every leaf."""
        return tf.nest.map_structure(fn, self)

    def Filter(self, fn):
        """A NestedMap with only the leaves for which fn(leaf) is true. Lists and tuples are
        filtered element by element, as Lingvo does; maps and sequences left empty are dropped."""
        return _filtered(self, fn) or NestedMap()

    def IsCompatible(self, other):
        """True when `other` has the same nested structure."""
        try:
            tf.nest.assert_same_structure(self, other)
        except (ValueError, TypeError):
            return False
        return True


def _filtered(value, fn):
    """`value` with only the leaves fn accepts; None when nothing is left (a leaf or container)."""
    if isinstance(value, dict):
        out = type(value)() if isinstance(value, NestedMap) else {}
        for key, item in value.items():
            kept = _filtered(item, fn)
            if kept is not None:
                out[key] = kept
        return out or None
    if isinstance(value, (list, tuple)):
        kept = [k for k in (_filtered(item, fn) for item in value) if k is not None]
        if not kept:
            return None
        return tuple(kept) if isinstance(value, tuple) else kept  # a namedtuple loses fields
    return value if fn(value) else None


def _items_with_paths(value, prefix):
    """(dotted path, leaf) in tf.nest's order: dict keys sorted, sequences in order."""
    if isinstance(value, dict):
        items = ((k, value[k]) for k in sorted(value))
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        yield prefix, value
        return
    for key, item in items:
        yield from _items_with_paths(item, f'{prefix}.{key}' if prefix else str(key))
