"""The package's shape: the runtime's modules answer from the root as before they had a package
(`from tf_gpipe import cluster`), old spellings of moved names still work, and the layering
holds: the engine imports no concrete layer, and no package reaches into another's private
names."""

import ast
import glob
import os
import subprocess
import sys

import pytest

import tf_gpipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNTIME = ('cluster', 'cluster_spec', 'distribute', 'exposure', 'local_cluster', 'memory')


@pytest.mark.parametrize('name', RUNTIME + ('placement', 'worker'))
def test_runtime_modules_answer_from_the_root(name):
    import importlib

    assert getattr(tf_gpipe, name) is importlib.import_module(f'tf_gpipe.runtime.{name}')


def test_an_unknown_root_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'clusterr'"):
        tf_gpipe.clusterr  # noqa: B018


def test_keras_layer_answers_from_layers():
    from tf_gpipe import layers
    from tf_gpipe.keras.layer import KerasLayer

    assert layers.KerasLayer is KerasLayer
    with pytest.raises(AttributeError):
        layers.KerasLayr  # noqa: B018


def test_the_old_worker_module_runs_the_worker_and_says_it_moved():
    env = {k: v for k, v in os.environ.items() if k != 'TF_CONFIG'}
    run = subprocess.run(
        [sys.executable, '-m', 'tf_gpipe.worker'],
        env=dict(env, TF_CPP_MIN_LOG_LEVEL='3'),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0  # no TF_CONFIG: the worker's own refusal
    assert 'deprecated; run python -m tf_gpipe.runtime.worker' in run.stderr
    assert 'tf_gpipe.worker: set TF_CONFIG' in run.stderr, run.stderr[-2000:]


def _package(module):
    """'gpipe' for tf_gpipe.gpipe.executor; '' for a module at the root (the framework)."""
    parts = module.split('.')
    return parts[1] if len(parts) > 2 else ''


def _modules():
    for path in sorted(glob.glob(os.path.join(ROOT, 'tf_gpipe', '**', '*.py'), recursive=True)):
        rel = os.path.relpath(path, ROOT)[: -len('.py')].replace(os.sep, '.')
        yield rel.removesuffix('.__init__'), ast.parse(open(path, encoding='utf-8').read())


def _imports(tree):
    """{local name: the tf_gpipe module (or module.attribute) it stands for}."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('tf_gpipe'):
            for alias in node.names:
                names[alias.asname or alias.name] = f'{node.module}.{alias.name}'
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith('tf_gpipe'):
                    names[alias.asname or alias.name] = alias.name
    return names


def test_the_engine_imports_no_concrete_layer():
    for module, tree in _modules():
        if _package(module) == 'gpipe':
            layers = [m for m in _imports(tree).values() if m.startswith('tf_gpipe.layers')]
            assert not layers, f'{module} imports {layers}'


def test_no_package_reaches_into_another_packages_private_names():
    found = []
    for module, tree in _modules():
        imported = _imports(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            target = imported.get(node.value.id)
            private = node.attr.startswith('_') and not node.attr.startswith('__')
            if target and private and _package(target) != _package(module):
                found.append(f'{module}: {node.value.id}.{node.attr}')
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('tf_gpipe.'):
                for alias in node.names:
                    if alias.name.startswith('_') and _package(node.module) != _package(module):
                        found.append(f'{module}: from {node.module} import {alias.name}')
    assert not found, found
