"""Prediction under a pipeline: predictions are returned and written once per replica, by its stage 0."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter


def mute_prediction_output(trainer: pl.Trainer) -> list[BasePredictionWriter]:
    """On a stage other than the first: the predictions are stage 0's again, and would be returned and written
    twice. Returns the writers muted, for :func:`unmute`."""
    trainer.predict_loop.return_predictions = False
    muted = []
    for writer in trainer.callbacks:  # type: ignore[attr-defined]  # set by its callback connector, not declared
        if isinstance(writer, BasePredictionWriter):
            writer.write_on_batch_end = writer.write_on_epoch_end = _skip  # type: ignore[method-assign]
            muted.append(writer)
    return muted


def unmute(writers: list[BasePredictionWriter]) -> None:
    for writer in writers:
        del writer.write_on_batch_end, writer.write_on_epoch_end  # back to the class's methods


def _skip(*args: Any, **kwargs: Any) -> None:
    pass
