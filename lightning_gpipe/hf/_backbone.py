"""A HuggingFace decoder-only language model as an nn.Sequential: embedding, decoder layers, final norm and head."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

INSTALL = 'pip install "lightning-gpipe[hf]"'
# model_type → the structure its causal LM shares: Llama's (model.embed_tokens, model.layers, model.norm,
# model.rotary_emb, lm_head) or GPT-2's (transformer.wte, .wpe, .drop, .h, .ln_f, lm_head).
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gpt2": "gpt2"}
GUIDE = 'docs/guide.md, "Pipelining a HuggingFace model"'

# What crosses every boundary: the hidden states, the 2-d attention mask and the positions (small integer tensors).
# The 4-d mask and the rotary embeddings are computed from them on each stage (once per micro-batch), not sent:
# they cost little to compute and, for the mask, T² per sample to send.
Carried = tuple[Tensor, Tensor, Tensor]


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"lightning_gpipe.hf needs HuggingFace transformers: {INSTALL}") from e
    return transformers


class _PerMicroBatch:
    """What every decoder layer of a stage needs for one micro-batch, computed by its first layer and reused by the
    others: they receive the very same mask and position tensors. One entry: a stage runs a micro-batch's layers
    one after the other, and a miss only recomputes."""

    def __init__(self, config: Any, rotary_class: type[nn.Module] | None) -> None:
        self.config = config
        self.rotary_class = rotary_class
        self.rotary: dict[torch.device, nn.Module] = {}
        self.key: tuple[Any, ...] = ()
        self.masks: dict[str, Any] = {}
        self.rope: tuple[Tensor, Tensor] | None = None

    def get(self, hidden: Tensor, mask: Tensor, positions: Tensor) -> _PerMicroBatch:
        key = (mask, positions, mask._version, positions._version, hidden.dtype, hidden.device, hidden.shape)
        same = len(self.key) == len(key) and all(
            a is b if isinstance(a, Tensor) else a == b for a, b in zip(self.key, key)
        )
        if not same:
            self.key, self.masks, self.rope = key, {}, None
        return self

    def mask(self, kind: str, hidden: Tensor, mask: Tensor, positions: Tensor) -> Any:
        if hidden.is_meta:  # counting FLOPs at setup: the mask's values cannot be read; is_causal costs the same
            return None
        if kind not in self.masks:
            from transformers import masking_utils

            fn = masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention" else None
            self.masks[kind] = _call_mask(fn or masking_utils.create_causal_mask, self.config, hidden, mask, positions)
        return self.masks[kind]

    def position_embeddings(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.rope is None:
            assert self.rotary_class is not None
            if hidden.device not in self.rotary:  # built here, not with the model: on the meta device it has no values
                with torch.device("cpu"):  # as the model computes its frequencies, whatever the default device
                    rotary = self.rotary_class(config=self.config)
                self.rotary[hidden.device] = rotary.to(hidden.device)
            self.rope = self.rotary[hidden.device](hidden, positions)
        return self.rope


def _call_mask(fn: Callable[..., Any], config: Any, hidden: Tensor, mask: Tensor, positions: Tensor) -> Any:
    """``create_causal_mask`` as the model calls it, across transformers' renames of its cache arguments."""
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": mask, "position_ids": positions}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    for name in ("cache", "past_key_values"):
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return fn(**kwargs)


class HFLayer(nn.Module):
    """Base of the backbone's layers: ``hf_names`` maps each child's name to its module's name in the HF model."""

    hf_names: dict[str, str]
    config: Any


class CausalLMInput(HFLayer):
    """Layer 0: the token (and, for GPT-2, position) embeddings; takes ``input_ids`` or a batch mapping with
    ``input_ids`` and optionally ``attention_mask`` and ``position_ids``."""

    def __init__(self, config: Any, family: str, modules: Mapping[str, nn.Module], hf_names: dict[str, str]) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.config, self.family, self.hf_names = config, family, hf_names

    def forward(self, batch: Tensor | Mapping[str, Tensor]) -> Carried:
        ids = batch if isinstance(batch, Tensor) else batch["input_ids"]
        mask = None if isinstance(batch, Tensor) else batch.get("attention_mask")
        positions = None if isinstance(batch, Tensor) else batch.get("position_ids")
        if mask is None:  # the model's own default: every token attends to every earlier one
            mask = torch.ones_like(ids)
        if positions is None:  # the model's default, one row per sample (the micro-batches split dim 0)
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).contiguous()
        part = self.get_submodule
        if self.family == "gpt2":
            hidden = part("drop")(part("wte")(ids) + part("wpe")(positions))
        else:
            hidden = part("embed_tokens")(ids)
        return hidden, mask, positions


class CausalLMDecoderLayer(HFLayer):
    """One decoder layer of the model, called as the model's loop calls it; passes the mask and positions on."""

    per_micro_batch: _PerMicroBatch

    def __init__(self, layer: nn.Module, index: int, per_micro_batch: _PerMicroBatch, family: str, prefix: str) -> None:
        super().__init__()
        self.layer = layer
        self.config, self.family, self.hf_names = per_micro_batch.config, family, {"layer": f"{prefix}.{index}"}
        self.mask_kind = _mask_kind(per_micro_batch.config, index)
        self.per_micro_batch = per_micro_batch  # one for every layer of the backbone (not a module: no weights)

    def forward(self, x: Carried) -> Carried:
        hidden, mask, positions = x
        shared = self.per_micro_batch.get(hidden, mask, positions)
        causal = shared.mask(self.mask_kind, hidden, mask, positions)
        if self.family == "gpt2":
            out = self.layer(hidden, attention_mask=causal, position_ids=positions)
        else:
            rope = shared.position_embeddings(hidden, positions)
            out = self.layer(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        return (out[0] if isinstance(out, tuple) else out), mask, positions


class CausalLMHead(HFLayer):
    """The last layer: the final norm and the LM head; returns the logits [N, T, V]."""

    def __init__(
        self, config: Any, norm: nn.Module, lm_head: nn.Module, hf_names: dict[str, str], tied_to: str | None
    ) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.config, self.hf_names = config, hf_names
        self.tied_to = tied_to  # the embedding's name in the HF model when the head's weight is it

    def forward(self, x: Carried) -> Tensor:
        return self.lm_head(self.norm(x[0]))


def _mask_kind(config: Any, index: int) -> str:
    """Which of the model's masks layer ``index`` attends with (Qwen's per-layer types, Mistral's sliding window)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return str(layer_types[index])
    if getattr(config, "model_type", "") == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _refuse(model: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"causal_lm_backbone({type(model).__name__}): {why}. It covers the causal LMs of "
        f"{', '.join(sorted(FAMILIES))} (Llama's structure, which Qwen2/3 and Mistral share, and GPT-2's); for another "
        f"model wrap its blocks as {GUIDE} shows (a layer taking and returning one tuple)"
    )


def causal_lm_backbone(model: nn.Module) -> nn.Sequential:
    """The HuggingFace causal LM ``model`` as the nn.Sequential GPipeStrategy pipelines.

    Layer 0 embeds a batch (``input_ids``, or a mapping with ``input_ids`` and optionally ``attention_mask`` and
    ``position_ids``, e.g. the whole batch of a HF collator); layers 1 … L are the model's decoder layers, each
    passing on ``(hidden, attention_mask, position_ids)``; the last applies the final norm and the LM head and
    returns the logits [N, T, V], so the loss (:func:`causal_lm_loss`) runs inside the pipeline. The layers take
    the model's modules, not copies: keep no reference to ``model`` in the LightningModule (each rank must hold only
    its stage). With ``tie_word_embeddings`` the head's weight is the embedding's, a tie across the first and last
    stage that GPipeStrategy sums the gradients of. Shapes may change every step.
    """
    require_transformers()
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise _refuse(model, f"model_type {model_type!r} is not one it knows")
    family = FAMILIES[model_type]
    base = getattr(model, "transformer" if family == "gpt2" else "model", None)
    lm_head = getattr(model, "lm_head", None)
    if base is None or lm_head is None:
        raise _refuse(model, "it needs the causal LM (the ...ForCausalLM class, with its lm_head), not the base model")
    if getattr(base, "gradient_checkpointing", False):
        raise _refuse(
            model,
            "the model's own gradient checkpointing is on; call model.gradient_checkpointing_disable(): the pipeline "
            "re-materializes already (GPipeStrategy(activation_checkpointing=...))",
        )
    if family == "gpt2" and getattr(config, "add_cross_attention", False):
        raise _refuse(model, "GPT-2 with cross-attention is an encoder-decoder's decoder, not a causal LM")
    config.architectures = [type(model).__name__]  # what save_pretrained writes, for from_pretrained
    if family == "gpt2":
        blocks, prefix, rotary = base.h, "transformer.h", None
        embed = CausalLMInput(
            config,
            family,
            {"wte": base.wte, "wpe": base.wpe, "drop": base.drop},
            {"wte": "transformer.wte", "wpe": "transformer.wpe", "drop": "transformer.drop"},
        )
        tied = "transformer.wte.weight" if lm_head.weight is base.wte.weight else None
        head = CausalLMHead(config, base.ln_f, lm_head, {"norm": "transformer.ln_f", "lm_head": "lm_head"}, tied)
    else:
        blocks, prefix, rotary = base.layers, "model.layers", type(base.rotary_emb)
        embed = CausalLMInput(
            config, family, {"embed_tokens": base.embed_tokens}, {"embed_tokens": "model.embed_tokens"}
        )
        tied = "model.embed_tokens.weight" if lm_head.weight is base.embed_tokens.weight else None
        head = CausalLMHead(config, base.norm, lm_head, {"norm": "model.norm", "lm_head": "lm_head"}, tied)
    shared = _PerMicroBatch(config, rotary)
    layers = [CausalLMDecoderLayer(b, i, shared, family, prefix) for i, b in enumerate(blocks)]
    return nn.Sequential(embed, *layers, head)


def causal_lm_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """The next-token cross-entropy averaged over the labels that are not ``ignore_index``, as HF's causal LMs
    compute it (labels shifted left inside), in at least float32 (HF's casts float64 logits down to float32)."""
    shifted = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return nn.functional.cross_entropy(
        logits.flatten(0, -2).to(dtype), shifted.flatten().to(logits.device), ignore_index=ignore_index
    )


def causal_lm_tokens(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """How many tokens :func:`causal_lm_loss` averages over: its ``pipeline_loss_denominator``."""
    return (labels[..., 1:] != ignore_index).sum()
