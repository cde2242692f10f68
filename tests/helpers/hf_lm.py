"""Tiny HF causal LMs, their padded batches of a new length every step, and the LightningModules that train them."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gpipe.hf import (
    causal_lm_backbone,
    causal_lm_loss,
    causal_lm_tokens,
    load_pretrained,
    save_pretrained,
)

VOCAB, BATCH, LR = 64, 8, 0.01
# A mixture of experts whose loss adds its routers' auxiliary loss, weighted so that its gradient shows.
ROUTED = {"output_router_logits": True, "router_aux_loss_coef": 0.3}
# Mixtures of experts in float64: their grouped kernels take none (what HF saves does not say so).
EAGER = {"experts_implementation": "eager"}
Batch = dict[str, Tensor]


# Any family's tiny config: these where the config has them, its own steps set away from the identity (soft-capping,
# logit scales, embedding and residual multipliers) so that a step a backbone leaves out shows.
SMALL: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": VOCAB, "max_position_embeddings": 64, "n_embd": 32,
    "n_layer": 4, "n_head": 4, "n_positions": 64, "moe_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "num_experts_per_tok": 2, "n_routed_experts": 4, "shared_expert_intermediate_size": 32,
    "sliding_window": 4, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "final_logit_softcapping": 3.0, "logit_scale": 0.5, "logits_scaling": 2.0, "embedding_multiplier": 1.7,
    "residual_multiplier": 0.8, "attention_multiplier": 0.3,
}  # fmt: skip


def small_config(model_type: str, dropout: float = 0.0, **overrides: Any) -> Any:
    """A tiny config of any ``model_type`` (``SMALL``); every dropout (and a router's jitter) at ``dropout``."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    off = [name for name in vars(cfg) if "dropout" in name or "pdrop" in name or "jitter" in name]
    for name, value in {**SMALL, **dict.fromkeys(off, dropout), **overrides}.items():
        if hasattr(cfg, name):
            with contextlib.suppress(AttributeError):  # a value the config derives (a property without a setter)
                setattr(cfg, name, value)
    for name in ("layer_types", "mlp_layer_types"):  # one entry per layer, which saving the config checks
        if kinds := getattr(cfg, name, None):
            with contextlib.suppress(AttributeError):
                setattr(cfg, name, [kinds[i % len(kinds)] for i in range(cfg.num_hidden_layers)])
    cfg._experts_implementation = "eager"  # the grouped kernels of mixtures of experts take no float64
    return cfg


def config(family: str, dropout: float = 0.0, **overrides: Any) -> Any:
    """A tiny config of ``family`` (4 decoder layers); GPT-2's ties its head to the embedding, this Llama's not; any
    other model_type's from :func:`small_config`."""
    from transformers import GPT2Config, LlamaConfig

    if family not in ("gpt2", "llama"):
        # Gemma2 (and VaultGemma): tied, as Gemma's default (one tied head among the others); its window past any
        # row's length, since its eager attention gives NaN where a padded query has no key left in the window (HF's
        # own forward too).
        own = {"tie_word_embeddings": True, "sliding_window": 16} if family in ("gemma2", "vaultgemma") else {}
        return small_config(family, dropout, **{**own, **overrides})

    if family == "gpt2":
        return GPT2Config(**{
            "n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB, "n_positions": 32, "bos_token_id": 0,
            "eos_token_id": 0, "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout, **overrides,
        })  # fmt: skip
    return LlamaConfig(**{
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "attention_dropout": dropout, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **overrides,
    })  # fmt: skip


def batches(steps: int, seed: int = 0, left: bool = False) -> list[Batch]:
    """One right-padded (``left``: left-padded) batch per step, each of another length: ``attention_mask`` has zeros,
    ``labels`` -100 there (every sample keeps at least 2 tokens, so every micro-batch has labels)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        length = 6 + (step * 3) % 7
        ids = torch.randint(3, VOCAB, (BATCH, length), generator=g)
        lengths = torch.randint(2, length + 1, (BATCH,), generator=g)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
        if left:
            mask = mask.flip(1)
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def save_model(family: str, folder: Path, seed: int = 0, dropout: float = 0.0, **overrides: Any) -> None:
    """A freshly initialized model of ``family`` as a pretrained folder, as HF writes it (a mixture of experts one
    tensor per expert)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config(family, dropout, **overrides)).double().save_pretrained(folder)


class PipelinedLM(pl.LightningModule):
    """The model of ``folder`` as :func:`causal_lm_backbone`'s nn.Sequential, built in configure_model (on the
    meta device under GPipeStrategy), its weights read in on_fit_start and written to ``save_to`` at the end."""

    def __init__(self, folder: str | Path | None, save_to: str | Path | None = None, cfg: Any = None) -> None:
        super().__init__()
        self.folder, self.save_to, self.cfg = folder, save_to, cfg
        self.backbone: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.backbone is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = self.cfg if self.cfg is not None else AutoConfig.from_pretrained(self.folder, **EAGER)
        self.backbone = causal_lm_backbone(AutoModelForCausalLM.from_config(cfg))

    def on_fit_start(self) -> None:
        if self.folder is not None and self.trainer.ckpt_path is None:  # a resumed fit has its weights
            assert self.backbone is not None
            load_pretrained(self.backbone, self.folder)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        assert self.backbone is not None
        loss = self.pipeline_loss(self.backbone(batch), batch)
        self.log("train_loss", loss, batch_size=len(batch["input_ids"]))
        return loss

    def pipeline_loss(self, logits: Tensor, batch: Batch) -> Tensor:
        return causal_lm_loss(logits, batch["labels"])

    def pipeline_loss_denominator(self, batch: Batch) -> Tensor:
        return causal_lm_tokens(batch["labels"])

    def on_train_end(self) -> None:
        if self.save_to is not None:
            assert self.backbone is not None
            save_pretrained(self.backbone, self.save_to)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


class PlainLM(pl.LightningModule):
    """The reference: the HF model itself, from the same folder, trained by a plain Lightning run."""

    def __init__(self, folder: str | Path) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **EAGER)

    def on_fit_start(self) -> None:
        # HF computes the rotary frequencies in float32 whatever the model's dtype (from_pretrained(dtype=bfloat16)
        # keeps them so, as the backbone does); Lightning's bf16-true rounded them with the module's buffers.
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        if getattr(getattr(rotary, "inv_freq", None), "dtype", None) in (torch.bfloat16, torch.float16):
            fresh = type(rotary)(config=self.model.config)
            for name in ("inv_freq", "original_inv_freq"):
                if hasattr(rotary, name):
                    setattr(rotary, name, getattr(fresh, name).to(rotary.inv_freq.device))

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = causal_lm_loss(out.logits, batch["labels"])  # HF's own loss, without its cast of float64 to float32
        if getattr(out, "aux_loss", None) is not None:  # the routers' auxiliary loss, as HF's ForCausalLM adds it
            loss = loss + self.model.router_aux_loss_coef * out.aux_loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
