"""Transformer translation: the ``Translator`` LightningModule, generated multilingual data, LightningCLI configs."""
