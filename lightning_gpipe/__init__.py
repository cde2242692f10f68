"""GPipe pipeline parallelism for PyTorch Lightning; the engine in ``lightning_gpipe.pipe`` needs torch only."""

from typing import Any

from lightning_gpipe.pipe import PipelineError, PipelineStage, PipelineTimeout

__version__ = "0.1.0.dev0"
__all__ = ["GPipeStrategy", "PipelineError", "PipelineStage", "PipelineTimeout", "__version__"]


def __getattr__(name: str) -> Any:
    # Lightning is imported only when the strategy is asked for, so the engine stays usable without it.
    if name == "GPipeStrategy":
        from lightning_gpipe.strategy import GPipeStrategy

        return GPipeStrategy
    raise AttributeError(f"module 'lightning_gpipe' has no attribute {name!r}")
