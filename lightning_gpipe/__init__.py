"""GPipe pipeline parallelism for PyTorch Lightning; the engine in ``lightning_gpipe.pipe`` needs torch only."""

from lightning_gpipe.pipe import PipelineError, PipelineStage, PipelineTimeout

__version__ = "0.1.0.dev0"
__all__ = ["PipelineError", "PipelineStage", "PipelineTimeout", "__version__"]
