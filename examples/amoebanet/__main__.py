"""AmoebaNet-D image classification, pipelined: ``python -m examples.amoebanet fit --config <a config>``.

LightningCLI over :class:`~examples.amoebanet.classifier.ImageClassifier` and
:class:`~examples.amoebanet.data.ImageClassificationData`; the data's ``num_classes`` and batch shape are the model's.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_gpipe  # noqa: F401 — registers strategy="gpipe"
from examples.amoebanet.classifier import ImageClassifier
from examples.amoebanet.data import ImageClassificationData


def batch_shape(batch_size: int, image_size: int) -> list[int]:
    return [batch_size, 3, image_size, image_size]


class AmoebaNetCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes")
        # The module's example input (GPipeStrategy's balance="auto" counts each layer's FLOPs on it).
        parser.link_arguments(("data.batch_size", "data.image_size"), "model.batch_shape", compute_fn=batch_shape)


def main() -> None:
    AmoebaNetCLI(ImageClassifier, ImageClassificationData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
