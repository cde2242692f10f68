"""Transformer translation, pipelined: ``python examples/nmt.py fit --config examples/configs/nmt_….yaml``.

LightningCLI over :class:`~lightning_gpipe.tasks.Translator` and
:class:`~lightning_gpipe.data.translation.TranslationData`; the vocabulary's size and the longest sequence are the
model's.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_gpipe  # noqa: F401 — registers strategy="gpipe"
from lightning_gpipe.data.translation import TranslationData
from lightning_gpipe.tasks import Translator


class TranslationCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The vocabulary is trained (or loaded from its cache) when the data module is made; its size is known then.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.max_len", "model.max_len")


def main() -> None:
    TranslationCLI(Translator, TranslationData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
