"""Tasks: a pipelined network with its loss, metrics, learner and loop settings."""

from tf_gpipe.tasks.base_task import BaseTask
from tf_gpipe.tasks.image import ImageClassifier
from tf_gpipe.tasks.lm import LanguageModel
from tf_gpipe.tasks.mt import TranslationModel

__all__ = ['BaseTask', 'ImageClassifier', 'LanguageModel', 'TranslationModel']
