"""A LightningCLI entry point for the CLI tests: the tiny pipelined model and data of tests/helpers/tiny_fit.py."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

import lightning_gpipe  # noqa: F401 — registers strategy="gpipe", as a user's entry point would
from tests.helpers.tiny_fit import BATCH, TinyPipelined, dataset


class ReportingTiny(TinyPipelined):
    """Writes what the strategy was configured with, so the test can check the YAML and the overrides."""

    def __init__(self, lr: float = 0.1, report: str = "") -> None:
        super().__init__(lr=lr)
        self.report = report

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=BATCH)

    def on_fit_end(self) -> None:
        if self.report:
            strategy = self.trainer.strategy
            facts = {"chunks": strategy.chunks, "K": strategy.pipeline_parallel_size, "stage": strategy.stage.index}
            Path(f"{self.report}.{self.global_rank}").write_text(json.dumps(facts))


if __name__ == "__main__":
    LightningCLI(ReportingTiny, save_config_callback=None)
