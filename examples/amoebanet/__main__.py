"""AmoebaNet-D image classification, pipelined: ``python -m examples.amoebanet fit --config <a config>``.

LightningCLI over :class:`~examples.amoebanet.classifier.ImageClassifier` and
:class:`~examples.amoebanet.data.ImageClassificationData`; the data's ``num_classes`` is the model's.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_gpipe  # noqa: F401 — registers strategy="gpipe"
from examples.amoebanet.classifier import ImageClassifier
from examples.amoebanet.data import ImageClassificationData


class AmoebaNetCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes")


def main() -> None:
    AmoebaNetCLI(ImageClassifier, ImageClassificationData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
