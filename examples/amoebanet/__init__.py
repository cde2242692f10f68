"""AmoebaNet-D image classification: the ``ImageClassifier`` LightningModule, image data, LightningCLI configs."""
