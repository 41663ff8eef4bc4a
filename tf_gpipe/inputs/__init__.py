"""Input generators: built-in synthetic tasks (offline) and tfds datasets."""

from tf_gpipe.inputs.base_input import BaseInputGenerator
from tf_gpipe.inputs.synthetic import SyntheticLm, SyntheticMt, SyntheticShapes
from tf_gpipe.inputs.tfds_input import TfdsImage, TfdsInput, TfdsLm, TfdsTranslation

__all__ = [
    'BaseInputGenerator',
    'SyntheticLm',
    'SyntheticMt',
    'SyntheticShapes',
    'TfdsImage',
    'TfdsInput',
    'TfdsLm',
    'TfdsTranslation',
]
