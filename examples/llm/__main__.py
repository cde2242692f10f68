"""HF causal LM fine-tuning, pipelined: ``python -m examples.llm fit --config examples/llm/configs/cpu.yaml``.

LightningCLI over :class:`~examples.llm.causal_lm.CausalLM` and :class:`~examples.llm.causal_lm.TextData`; the
vocabulary's size (bytes as tokens) and the longest line are the model's.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_gpipe  # noqa: F401 — registers strategy="gpipe"
from examples.llm.causal_lm import CausalLM, TextData


class CausalLMCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.max_len", "model.max_len")


def main() -> None:
    CausalLMCLI(CausalLM, TextData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
