"""GPipe pipeline parallelism for PyTorch Lightning; the engine in ``lightning_gpipe.pipe`` needs torch only."""

from importlib.util import find_spec
from typing import Any

from lightning_gpipe.pipe import GPipeStage, PipelineError, PipelineTimeout

__version__ = "0.1.0.dev0"
__all__ = ["GPipeStage", "GPipeStrategy", "PipelineError", "PipelineTimeout", "__version__"]

# Importing the package registers Trainer(strategy="gpipe") (and `strategy: gpipe` in LightningCLI YAML), as the
# README promises; without Lightning installed the engine still imports.
if find_spec("lightning") is not None:
    from lightning_gpipe.strategy import GPipeStrategy


def __getattr__(name: str) -> Any:
    # Reached only without Lightning: say what is missing instead of a bare AttributeError.
    if name == "GPipeStrategy":
        raise ImportError("GPipeStrategy needs Lightning: pip install 'lightning>=2.6,<2.7'")
    raise AttributeError(f"module 'lightning_gpipe' has no attribute {name!r}")
