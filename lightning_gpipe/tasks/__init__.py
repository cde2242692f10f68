"""LightningModules of the examples: AmoebaNet-D image classification and Transformer translation."""

from lightning_gpipe.tasks.image_classifier import ImageClassifier
from lightning_gpipe.tasks.translator import Translator

__all__ = ["ImageClassifier", "Translator"]
