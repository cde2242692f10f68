"""HuggingFace decoder-only language models pipelined by GPipeStrategy (needs ``pip install "lightning-gpipe[hf]"``).

:func:`causal_lm_backbone` turns a causal LM of 53 families (Llama's layout and GPT-2's; their table: docs/guide.md)
into the ``nn.Sequential`` the strategy splits: the embedding on the first stage, the decoder layers, the final norm
and LM head on the last, so that :func:`causal_lm_loss` runs inside the pipeline (a mixture of experts' routers'
auxiliary loss too: :class:`RoutedLogits`). :func:`load_pretrained` and
:func:`save_pretrained` read and write a HF folder per stage. Importing this module needs no transformers.
"""

from lightning_gpipe.hf._backbone import (
    CausalLMDecoderLayer,
    CausalLMHead,
    CausalLMInput,
    causal_lm_backbone,
    causal_lm_loss,
    causal_lm_tokens,
)
from lightning_gpipe.hf._pretrained import load_pretrained, named_hf_tensors, save_pretrained
from lightning_gpipe.hf._router import RoutedLogits

__all__ = [
    "CausalLMDecoderLayer",
    "CausalLMHead",
    "CausalLMInput",
    "RoutedLogits",
    "causal_lm_backbone",
    "causal_lm_loss",
    "causal_lm_tokens",
    "load_pretrained",
    "named_hf_tensors",
    "save_pretrained",
]
