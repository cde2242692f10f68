"""Transformer translation, pipelined: ``python -m examples.nmt fit --config examples/nmt/configs/….yaml``.

LightningCLI over :class:`~examples.nmt.translator.Translator` and
:class:`~examples.nmt.data.translation.TranslationData`; the vocabulary's size and the longest sequence are the
model's.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_gpipe  # noqa: F401 — registers strategy="gpipe"
from examples.nmt.data.translation import TranslationData
from examples.nmt.translator import Translator


class TranslationCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The vocabulary is trained (or loaded from its cache) when the data module is made; its size is known then.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.max_len", "model.max_len")


def main() -> None:
    TranslationCLI(Translator, TranslationData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
