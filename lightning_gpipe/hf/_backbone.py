"""A HuggingFace decoder-only language model as an nn.Sequential: embedding, decoder layers, final norm and head."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_gpipe.hf._router import RoutedLogits, Routers, record, router_loss, routers

INSTALL = 'pip install "lightning-gpipe[hf]"'
GUIDE = 'docs/guide.md, "Pipelining a HuggingFace model"'


@dataclass(frozen=True)
class Family:
    """How a model_type's causal LM is laid out, and what its forward does around the decoder layers that is not
    in a module: ``structure`` "llama" (model.embed_tokens, .layers, .norm, .rotary_emb; lm_head) or "gpt2"
    (transformer.wte, .wpe, .drop, .h, .ln_f; lm_head); ``sliding_by_config``: without ``config.layer_types``, a
    ``config.sliding_window`` makes every layer attend within it; ``embedding_multiplier``: the base model scales the
    embeddings by its ``embedding_multiplier``; ``logits``: what its ForCausalLM does to the head's output, "softcap"
    (tanh soft-capping at ``config.final_logit_softcapping``), "logit_scale" (times the model's ``logit_scale``),
    "divide_scaling" or "multiply_scaling" (by ``config.logits_scaling``)."""

    structure: Literal["llama", "gpt2"] = "llama"
    sliding_by_config: bool = False  # every layer attends within config.sliding_window when it is set (Mistral's)
    embedding_multiplier: bool = False
    logits: Literal["softcap", "logit_scale", "divide_scaling", "multiply_scaling"] | None = None


_LLAMA, _SOFTCAP = Family(), Family(logits="softcap")
_GRANITE = Family(embedding_multiplier=True, logits="divide_scaling")
# Every model_type tried: a tiny random model in float64 gives the HF model's logits and gradients, with padding
# (tests/hf/test_families.py; the guide's table). Mixture-of-experts ones without the routers' auxiliary loss.
_LLAMA_TYPES = """
    apertus arcee bitnet cwm diffllama ernie4_5 exaone exaone4 flint gemma glm glm4 helium hunyuan_v1_dense internlm3
    jais2 llama ministral nemotron olmo olmo2 qwen2 qwen3 seed_oss smollm3 stablelm
    ernie4_5_moe flex_olmo glm4_moe gpt_oss hunyuan_v1_moe jetmoe olmoe qwen2_moe
""".split()  # noqa: SIM905 (a list, one per line, would take 40); the second line: mixtures of experts
FAMILIES: dict[str, Family] = {
    **dict.fromkeys(_LLAMA_TYPES, _LLAMA),
    **dict.fromkeys(
        ("doge", "ministral3", "mistral", "phi3", "starcoder2", "mixtral", "phimoe", "qwen3_moe"),
        Family(sliding_by_config=True),
    ),
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma"), _SOFTCAP),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), Family(logits="logit_scale")),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared"), _GRANITE),
    "hyperclovax": Family(embedding_multiplier=True, logits="multiply_scaling"),
    "gpt2": Family(structure="gpt2"),
}
# Their routers' auxiliary loss (config.output_router_logits) is HF's load_balancing_loss_func, exact here (_router.py).
_ROUTED = "ernie4_5_moe flex_olmo flint gpt_oss granitemoe granitemoeshared jetmoe mixtral olmoe phimoe qwen2_moe"
ROUTER_LOSS = frozenset([*_ROUTED.split(), "qwen3_moe"])
# Tried and refused, with the reason (what differs from the layouts above; other model_types were not tried).
_NOT_LLAMA = "its final norm (or embedding, or layer list) is not where the Llama layout has it"
_STATE = "its recurrent (linear-attention or Mamba) layers take masks and caches the model builds its own way"
REFUSED: dict[str, str] = {
    "nanochat": "its forward applies the final norm before the layers as well as after them",
    "phi": f"{_NOT_LLAMA} (model.final_layernorm), and its embeddings pass a dropout in the forward",
    "persimmon": _NOT_LLAMA,
    "lfm2": _NOT_LLAMA,
    "gpt_neox": f"{_NOT_LLAMA} (GPT-NeoX's: gpt_neox.embed_in, .layers, .final_layer_norm, embed_out)",
    "falcon": f"{_NOT_LLAMA} (Falcon's: transformer.word_embeddings, .h, .ln_f)",
    "opt": f"{_NOT_LLAMA} (OPT's: model.decoder.embed_tokens, .layers, learned positions)",
    "minicpm3": "its layers do not take the rotary embeddings the way Llama's layers do",
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "olmo_hybrid", "granitemoehybrid", "jamba", "bamba"), _STATE),
}

# What crosses every boundary: the hidden states, the 2-d attention mask and the positions (small integer tensors).
# The 4-d mask and the rotary embeddings are computed from them on each stage (once per micro-batch), not sent:
# they cost little to compute and, for the mask, T² per sample to send.
Carried = tuple[Tensor, ...]  # and, with the routers' auxiliary loss, each sample's routing sums (_router.py)


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

    def __init__(self, config: Any, rotary_class: type[nn.Module] | None, family: Family) -> None:
        self.config, self.family = config, family
        self.rotary_class = rotary_class
        self.rotary: dict[torch.device, nn.Module] = {}
        self.key: tuple[Any, ...] = ()
        self.masks: dict[str, Any] = {}
        self.rope: dict[str | None, tuple[Tensor, Tensor]] = {}
        # Gemma3's, OLMo3's: one rotary module whose frequencies differ per layer type, asked for each.
        self.per_type = rotary_class is not None and "layer_type" in inspect.signature(rotary_class.forward).parameters

    def get(self, hidden: Tensor, mask: Tensor, positions: Tensor) -> _PerMicroBatch:
        key = (mask, positions, mask._version, positions._version, hidden.dtype, hidden.device, hidden.shape)
        same = len(self.key) == len(key) and all(
            a is b if isinstance(a, Tensor) else a == b for a, b in zip(self.key, key)
        )
        if not same:
            self.key, self.masks, self.rope = key, {}, {}
        return self

    def mask(self, kind: str, hidden: Tensor, mask: Tensor, positions: Tensor) -> Any:
        if hidden.is_meta:  # counting FLOPs at setup: the mask's values cannot be read; is_causal costs the same
            return None
        if kind not in self.masks:
            from transformers import masking_utils

            fn = masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention" else None
            self.masks[kind] = _call_mask(fn or masking_utils.create_causal_mask, self.config, hidden, mask, positions)
        return self.masks[kind]

    def position_embeddings(self, hidden: Tensor, positions: Tensor, layer_type: str) -> tuple[Tensor, Tensor]:
        kind = layer_type if self.per_type else None
        if kind not in self.rope:
            assert self.rotary_class is not None
            if hidden.device not in self.rotary:  # built here, not with the model: on the meta device it has no values
                with torch.device("cpu"):  # as the model computes its frequencies, whatever the default device
                    rotary = self.rotary_class(config=self.config)
                self.rotary[hidden.device] = rotary.to(hidden.device)
            extra = (kind,) if self.per_type else ()
            self.rope[kind] = self.rotary[hidden.device](hidden, positions, *extra)
        return self.rope[kind]


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
    """Base of the backbone's layers: ``hf_names`` maps each child's name to its module's name in the HF model;
    ``conversions``: how HF's save_pretrained renames and splits the model's tensors (its checkpoint conversion: a
    mixture of experts saved one tensor per expert), for load_pretrained to read such a folder."""

    hf_names: dict[str, str]
    config: Any
    conversions: list[Any] = []  # noqa: RUF012 (set per backbone, never changed in place)


class CausalLMInput(HFLayer):
    """Layer 0: the token (and, for GPT-2, position) embeddings; takes ``input_ids`` or a batch mapping with
    ``input_ids`` and optionally ``attention_mask`` and ``position_ids``."""

    def __init__(
        self,
        config: Any,
        family: str,
        modules: Mapping[str, nn.Module],
        hf_names: dict[str, str],
        multiplier: float | None = None,
        routers: Routers | None = None,
    ) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.config, self.family, self.hf_names = config, family, hf_names
        self.multiplier = multiplier  # Granite's embedding_multiplier, as its base model applies it
        self.routers = routers  # with the routers' auxiliary loss: the per-sample routing sums start here

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
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self.routers is not None:
            return hidden, mask, positions, self.routers.start(ids.shape[0], ids.device)
        return hidden, mask, positions


class CausalLMDecoderLayer(HFLayer):
    """One decoder layer of the model, called as the model's loop calls it; passes the mask and positions on."""

    per_micro_batch: _PerMicroBatch

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        per_micro_batch: _PerMicroBatch,
        family: str,
        prefix: str,
        routers: Routers | None = None,
    ) -> None:
        super().__init__()
        self.layer, self.routers = layer, routers
        self.config, self.family, self.hf_names = per_micro_batch.config, family, {"layer": f"{prefix}.{index}"}
        self.mask_kind = _mask_kind(per_micro_batch.config, index, per_micro_batch.family.sliding_by_config)
        self.per_micro_batch = per_micro_batch  # one for every layer of the backbone (not a module: no weights)

    def forward(self, x: Carried) -> Carried:
        hidden, mask, positions, *routing = x
        shared = self.per_micro_batch.get(hidden, mask, positions)
        causal = shared.mask(self.mask_kind, hidden, mask, positions)
        with self.routers.capture(self.layer) if self.routers else contextlib.nullcontext([]) as captured:
            if self.family == "gpt2":
                out = self.layer(hidden, attention_mask=causal, position_ids=positions)
            else:
                rope = shared.position_embeddings(hidden, positions, self.mask_kind)
                out = self.layer(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        hidden = out[0] if isinstance(out, tuple) else out
        if self.routers is None:
            return hidden, mask, positions
        return hidden, mask, positions, routing[0] + self.routers.sums(captured, mask)


class CausalLMHead(HFLayer):
    """The last layer: the final norm and the LM head; returns the logits [N, T, V]."""

    def __init__(
        self,
        config: Any,
        norm: nn.Module,
        lm_head: nn.Module,
        hf_names: dict[str, str],
        tied_to: str | None,
        logits: Callable[[Tensor], Tensor] | None = None,
        routers: Routers | None = None,
    ) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.config, self.hf_names = config, hf_names
        self.tied_to = tied_to  # the embedding's name in the HF model when the head's weight is it
        self.logits = logits  # what the family's ForCausalLM does to the head's output (Family.logits)
        self.routers = routers

    def forward(self, x: Carried) -> Tensor | RoutedLogits:
        logits = self.lm_head(self.norm(x[0]))
        logits = logits if self.logits is None else self.logits(logits)
        if self.routers is None:
            return logits
        routing = self.routers.finish(x[3])
        record(routing, self.training)
        return RoutedLogits(logits, routing)


def _logits(model: nn.Module, config: Any, kind: str | None) -> Callable[[Tensor], Tensor] | None:
    """The family's change to the head's logits, with the same operations in the same order as its ForCausalLM."""
    if kind == "softcap":
        cap = getattr(config, "final_logit_softcapping", None)
        return None if cap is None else partial(_softcap, cap=cap)
    if kind == "logit_scale":
        return partial(torch.mul, other=model.logit_scale)  # type: ignore[arg-type]
    if kind == "divide_scaling":
        return partial(torch.div, other=config.logits_scaling)
    if kind == "multiply_scaling":
        return partial(torch.mul, other=config.logits_scaling)
    return None


def _softcap(logits: Tensor, cap: float) -> Tensor:
    return torch.tanh(logits / cap) * cap


def _mask_kind(config: Any, index: int, sliding_by_config: bool) -> str:
    """Which of the model's masks layer ``index`` attends with (Qwen's per-layer types, Mistral's sliding window);
    also its layer type for a rotary module that differs per type."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return str(layer_types[index])
    if sliding_by_config and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _refuse(model: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"causal_lm_backbone({type(model).__name__}): {why}. It covers {len(FAMILIES)} families (their table: "
        f"{GUIDE}); for another model wrap its blocks as the guide shows (a layer taking and returning one tuple)"
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
    if model_type in REFUSED:
        raise _refuse(model, f"model_type {model_type!r} cannot be split as it is: {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        raise _refuse(model, f"model_type {model_type!r} has not been tried")
    if getattr(config, "output_router_logits", False) and model_type not in ROUTER_LOSS:
        raise _refuse(
            model,
            "config.output_router_logits is on, so the HF model adds its routers' auxiliary loss, which the pipeline "
            f"computes for {', '.join(sorted(ROUTER_LOSS))} only (not tried on {model_type!r}); set it to False (the "
            "loss is then the HF model's without it, exactly)",
        )
    spec = FAMILIES[model_type]
    family = spec.structure
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
        blocks, prefix, rotary, found = base.h, "transformer.h", None, None
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
        multiplier = base.embedding_multiplier if spec.embedding_multiplier else None
        found = routers(model, base)
        names = {"embed_tokens": "model.embed_tokens"}
        embed = CausalLMInput(config, family, {"embed_tokens": base.embed_tokens}, names, multiplier, found)
        tied = "model.embed_tokens.weight" if lm_head.weight is base.embed_tokens.weight else None
        logits = _logits(model, config, spec.logits)
        head_names = {"norm": "model.norm", "lm_head": "lm_head"}
        head = CausalLMHead(config, base.norm, lm_head, head_names, tied, logits, found)
    shared = _PerMicroBatch(config, rotary, spec)
    layers = [embed, *(CausalLMDecoderLayer(b, i, shared, family, prefix, found) for i, b in enumerate(blocks)), head]
    conversions = _conversions(model)
    for layer in layers:
        layer.conversions = conversions
    return nn.Sequential(*layers)


def _conversions(model: nn.Module) -> list[Any]:
    """What HF's save_pretrained reverts before it writes ``model`` (its revert_weight_conversion, for a model not
    loaded by from_pretrained): renames and per-expert splits of the fused tensors."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    mapping = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
    return [c for c in mapping if not isinstance(c, PrefixChange)]


def causal_lm_loss(logits: Tensor | RoutedLogits, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """The next-token cross-entropy averaged over the labels that are not ``ignore_index``, as HF's causal LMs
    compute it (labels shifted left inside), in at least float32 (HF's casts float64 logits down to float32); on a
    :class:`RoutedLogits` output plus the routers' auxiliary loss times its coefficient, as the HF model adds it."""
    output = logits
    if isinstance(output, RoutedLogits):
        logits = output.logits
    assert isinstance(logits, Tensor)
    shifted = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    loss = nn.functional.cross_entropy(
        logits.flatten(0, -2).to(dtype), shifted.flatten().to(logits.device), ignore_index=ignore_index
    )
    return router_loss(output.routing, loss) if isinstance(output, RoutedLogits) else loss


def causal_lm_tokens(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """How many tokens :func:`causal_lm_loss` averages over: its ``pipeline_loss_denominator``."""
    return (labels[..., 1:] != ignore_index).sum()
