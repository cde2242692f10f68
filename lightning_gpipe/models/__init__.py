"""Reference models for the pipeline, each an nn.Sequential that can be cut between any two of its modules."""

from lightning_gpipe.models.amoebanet import amoebanet_d, replace_classifier
from lightning_gpipe.models.decoding import beam_decode, greedy_decode
from lightning_gpipe.models.transformer import transformer_nmt, transformer_nmt_num_parameters

__all__ = [
    "amoebanet_d",
    "beam_decode",
    "greedy_decode",
    "replace_classifier",
    "transformer_nmt",
    "transformer_nmt_num_parameters",
]
