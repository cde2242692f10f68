"""GPipeStrategy's prediction hooks: predictions are returned and written once per replica, by its stage 0."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter


class PredictHooks:
    """Mixed into GPipeStrategy: the other stages computed the same predictions, and would otherwise return them
    again and write duplicate files."""

    stage: Any
    lightning_module: Any
    _muted_writers: list[BasePredictionWriter]

    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        self._muted_writers = []
        if self.stage.is_first:
            return
        trainer = self.lightning_module.trainer
        trainer.predict_loop._return_predictions = False
        for writer in trainer.callbacks:
            if isinstance(writer, BasePredictionWriter):
                writer.write_on_batch_end = writer.write_on_epoch_end = _skip  # type: ignore[method-assign]
                self._muted_writers.append(writer)

    def on_predict_end(self) -> None:
        for writer in self._muted_writers:
            del writer.write_on_batch_end, writer.write_on_epoch_end  # back to the class's methods
        self._muted_writers = []
        super().on_predict_end()  # type: ignore[misc]


def _skip(*args: Any, **kwargs: Any) -> None:
    pass
