"""Installs tf_gpipe: GPipe pipeline parallelism for TensorFlow 2, in the style of Lingvo."""

from setuptools import find_packages, setup

setup(
    name='tf_gpipe',
    version='0.1.0',
    description='GPipe pipeline parallelism for TensorFlow 2 (Lingvo-style params and layers).',
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    python_requires='>=3.10',
    packages=find_packages(include=['tf_gpipe', 'tf_gpipe.*']),
    install_requires=[
        'tensorflow>=2.16',
        'keras>=3',
        'tensorflow-datasets',
        'absl-py',
        'grpcio',  # cluster_spec.is_tf_server asks a worker over TF's own transport
        'sacrebleu>=2.4',  # the decoder's corpus BLEU
        'tensorboard',
        'numpy',
    ],
    # `tf_gpipe_trainer` / `tf_gpipe_worker` on the PATH: tools/ installed as scripts (flags stay there).
    scripts=[
        'tools/tf_gpipe_trainer',
        'tools/trainer.py',
        'tools/tf_gpipe_worker',
        'tools/worker.py',
    ],
    extras_require={
        'test': ['pytest', 'pytest-xdist', 'ruff'],
        'plot': ['matplotlib'],
        'docs': ['sphinx', 'myst-parser'],
    },
)
