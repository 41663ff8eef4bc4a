"""Registry of model params classes: key `<task>.<file>.<Class>` for `params/<task>/<file>.py`.

Params files are not a package of ours: `LoadParamsDir(dir)` imports every `<task>/<file>.py`
under a directory (the checkout's `params/` or a user's --params_dir) by path, and the
`@RegisterSingleTaskModel` decorator records each class under its key. Files are told apart by
their path, so a user's `lm/synthetic.py` loads beside the built-in one; a key defined in two
files is an error that names both (nothing is silently replaced).
"""

import difflib
import hashlib
import importlib.util
import inspect
import os
import sys
import traceback

from tf_gpipe import base_model_params

_REGISTRY = {}
_SOURCES = {}  # key -> the file that defined it
_LOADING = []  # (task, file, path) of the params file being imported, innermost last
_BROKEN = {}  # path -> why the params file could not be imported


class DuplicateModelError(ValueError):
    """A model key registered by two classes."""


def RegisterSingleTaskModel(cls):
    """Class decorator: registers a SingleTaskModelParams subclass under <task>.<file>.<Class>."""
    if not (isinstance(cls, type) and issubclass(cls, base_model_params.SingleTaskModelParams)):
        raise TypeError(f'{cls!r} is not a SingleTaskModelParams subclass.')
    if _LOADING:
        task, file, path = _LOADING[-1]
    else:  # Imported as a module: use its last two package components.
        parts = cls.__module__.split('.')
        task, file = (parts[-2], parts[-1]) if len(parts) >= 2 else ('default', parts[-1])
        path = _source(cls)
    key = f'{task}.{file}.{cls.__name__}'
    if key in _REGISTRY and (
        _SOURCES[key] != path or (_LOADING and _REGISTRY[key].__module__ == cls.__module__)
    ):
        where = f'in {_SOURCES[key]} and in {path}' if _SOURCES[key] != path else f'in {path}'
        raise DuplicateModelError(
            f'Model key {key} is defined twice: {where}. Rename one of the classes (or '
            'files): a key names one model.'
        )
    _REGISTRY[key] = cls
    _SOURCES[key] = path
    return cls


def _source(cls):
    try:
        return os.path.abspath(inspect.getsourcefile(cls) or cls.__module__)
    except (TypeError, OSError):  # defined interactively (a notebook, python -c, exec)
        return cls.__module__


def LoadParamsDir(params_dir):
    """Imports every params/<task>/<file>.py under `params_dir` (idempotent)."""
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f'Params directory {params_dir!r} does not exist.')
    for task in sorted(os.listdir(params_dir)):
        task_dir = os.path.join(params_dir, task)
        if not os.path.isdir(task_dir) or task.startswith(('_', '.')):
            continue
        for name in sorted(os.listdir(task_dir)):
            if not name.endswith('.py') or name.startswith('_'):
                continue
            file = name[:-3]
            path = os.path.abspath(os.path.join(task_dir, name))
            # One module per file path: a user's lm/synthetic.py is not the built-in one.
            digest = hashlib.sha1(path.encode()).hexdigest()[:12]
            module_name = f'tf_gpipe_params.{task}.{file}_{digest}'
            if module_name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            _LOADING.append((task, file, path))
            try:
                spec.loader.exec_module(module)
                _BROKEN.pop(path, None)
            except Exception as e:  # noqa: BLE001 - a broken file must not block the others
                del sys.modules[module_name]
                for key in [k for k, source in _SOURCES.items() if source == path]:
                    del _REGISTRY[key], _SOURCES[key]  # a fixed file can be loaded again
                if isinstance(e, DuplicateModelError):
                    raise
                # The other files' models stay usable; asking for a key that is not registered
                # names this file and why it failed.
                _BROKEN[path] = _why(e, path)
            finally:
                _LOADING.pop()


def GetAllRegisteredKeys():
    return sorted(_REGISTRY)


def GetClass(key):
    """The registered class for `key`; an unknown key names the closest registered ones."""
    if key in _REGISTRY:
        return _REGISTRY[key]
    close = difflib.get_close_matches(key, list(_REGISTRY), n=3, cutoff=0.5)
    hint = f' Did you mean {" or ".join(repr(c) for c in close)}?' if close else ''
    known = ', '.join(sorted(_REGISTRY)) or 'none (load a params directory: --params_dir)'
    broken = ''.join(f' {path} failed to load: {why}.' for path, why in sorted(_BROKEN.items()))
    if broken:
        broken = f' Params files that could not be imported (the model may be there):{broken}'
    raise LookupError(f'Unknown model {key!r}.{hint} Registered models: {known}.{broken}')


def BrokenFiles():
    """{path: why} of the params files that failed to import (their models are missing)."""
    return dict(_BROKEN)


def _why(error, path):
    """'line N: SyntaxError: ...' for an error raised while importing `path`."""
    line = getattr(error, 'lineno', None) if isinstance(error, SyntaxError) else None
    if line is None:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
        line = frames[-1].lineno if frames else None
    where = f'line {line}: ' if line else ''
    return f'{where}{type(error).__name__}: {error}'.splitlines()[0]


def GetParams(key, dataset='Train'):
    """(task params, input params) of model `key` for 'Train' or 'Test'."""
    model = GetClass(key)()
    return CallParams(model, 'Task'), CallParams(model, dataset)


def CallParams(model, method):
    """model.<method>() (Task, Train, Test); an error raised inside a params file names the
    file and line, e.g. "params/lm/mine.py, line 12, in Task: ... has no param 'max_stepz'"."""
    try:
        return getattr(model, method)()
    except (AttributeError, ValueError, TypeError, KeyError, LookupError) as e:
        source = inspect.getsourcefile(type(model))
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == source]
        if not frames:
            raise
        where = frames[-1]
        message = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
        try:
            path = os.path.relpath(where.filename)
            path = where.filename if path.startswith('..') else path
            named = type(e)(
                f'{path}, line {where.lineno}, in {type(model).__name__}.{where.name}: {message}'
            )
        except Exception:  # an exception type that takes other arguments: leave it be
            raise e from None
        raise named.with_traceback(e.__traceback__) from None
