"""HuggingFace decoder-only language models pipelined by GPipeStrategy (needs ``pip install "lightning-gpipe[hf]"``).

:func:`causal_lm_backbone` turns a Llama-structured (Llama, Qwen2/3, Mistral) or GPT-2 causal LM into the
``nn.Sequential`` the strategy splits: the embedding on the first stage, the decoder layers, the final norm and LM
head on the last, so that :func:`causal_lm_loss` runs inside the pipeline. :func:`load_pretrained` and
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

__all__ = [
    "CausalLMDecoderLayer",
    "CausalLMHead",
    "CausalLMInput",
    "causal_lm_backbone",
    "causal_lm_loss",
    "causal_lm_tokens",
    "load_pretrained",
    "named_hf_tensors",
    "save_pretrained",
]
