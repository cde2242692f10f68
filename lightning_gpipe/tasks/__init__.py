"""LightningModules of the examples: AmoebaNet-D image classification and Transformer translation."""

from lightning_gpipe.tasks.image_classifier import ImageClassifier

__all__ = ["ImageClassifier"]
