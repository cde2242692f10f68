"""AmoebaNet-D image classification, pipelined: ``python examples/amoebanet.py fit --config examples/configs/….yaml``.

LightningCLI over :class:`~lightning_gpipe.tasks.ImageClassifier` and
:class:`~lightning_gpipe.data.images.ImageClassificationData`; the data's ``num_classes`` is the model's.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_gpipe  # noqa: F401 — registers strategy="gpipe"
from lightning_gpipe.data.images import ImageClassificationData
from lightning_gpipe.tasks import ImageClassifier


class AmoebaNetCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes")


def main() -> None:
    AmoebaNetCLI(ImageClassifier, ImageClassificationData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
