"""Registry of model params classes: key `<task>.<file>.<Class>` for `params/<task>/<file>.py`.

Params files are not a package of ours: `LoadParamsDir(dir)` imports every `<task>/<file>.py`
under a directory (the checkout's `params/` or a user's --params_dir) by path, and the
`@RegisterSingleTaskModel` decorator records each class under its key.
"""

import difflib
import importlib.util
import os
import sys

from tf_gpipe import base_model_params

_REGISTRY = {}
_LOADING = []  # (task, file) of the params file being imported, innermost last


def RegisterSingleTaskModel(cls):
    """Class decorator: registers a SingleTaskModelParams subclass under <task>.<file>.<Class>."""
    if not (isinstance(cls, type) and issubclass(cls, base_model_params.SingleTaskModelParams)):
        raise TypeError(f'{cls!r} is not a SingleTaskModelParams subclass.')
    if _LOADING:
        task, file = _LOADING[-1]
    else:  # Imported as a module: use its last two package components.
        parts = cls.__module__.split('.')
        task, file = (parts[-2], parts[-1]) if len(parts) >= 2 else ('default', parts[-1])
    key = f'{task}.{file}.{cls.__name__}'
    if key in _REGISTRY and _REGISTRY[key].__qualname__ != cls.__qualname__:
        raise ValueError(f'Model key {key} is registered twice.')
    _REGISTRY[key] = cls
    return cls


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
            module_name = f'tf_gpipe_params.{task}.{file}'
            if module_name in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(module_name, os.path.join(task_dir, name))
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            _LOADING.append((task, file))
            try:
                spec.loader.exec_module(module)
            except Exception:
                del sys.modules[module_name]
                raise
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
    raise LookupError(f'Unknown model {key!r}.{hint} Registered models: {known}.')


def GetParams(key, dataset='Train'):
    """(task params, input params) of model `key` for 'Train' or 'Test'."""
    model = GetClass(key)()
    return model.Task(), getattr(model, dataset)()
