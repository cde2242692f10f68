"""A HuggingFace GPT-2 built in configure_model under GPipeStrategy starts from transformers' own initialization.

transformers 5 skips a model's weight initialization on the meta device; before, such a GPT-2 at K = 2 got each
layer's torch default (embeddings of std 1, not 0.02; residual projections of std 0.02, not 0.02/√(2·n_layer)).
Random tensors cannot equal the eager model's bytes (the strategy seeds each recorded call by its place, so that every
layout draws the same): they must come from the same distribution, and equal the whole model materialized in one
process; tensors without randomness (LayerNorm's ones, zero biases) must equal the eager model's.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.strategy._materialize import materialize, record_init
from tests.helpers.init_summary import MARK, assert_same_distribution, summary
from tests.helpers.launch import quiet_trainer, run_distributed

pytest.importorskip("transformers", reason="the HuggingFace tests need transformers: pip install -e '.[hf]'")

SEED, LAYERS, VOCAB, T = 5, 2, 64, 6


class Block(nn.Module):
    """docs/guide.md's adapter, without a mask: a GPT-2 block passing the hidden states (its attention is causal)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: Tensor) -> Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out  # transformers 4 returns a tuple


class TinyGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.initial: dict[str, dict[str, Any]] | None = None

    def configure_model(self) -> None:
        if hasattr(self, "backbone"):
            return
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=LAYERS, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=T, bos_token_id=0, eos_token_id=0
        )
        gpt2 = GPT2LMHeadModel(config)
        t = gpt2.transformer
        self.wte, self.wpe, self.ln_f, self.lm_head = t.wte, t.wpe, t.ln_f, gpt2.lm_head
        self.backbone = nn.Sequential(*(Block(b) for b in t.h))

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        ids = batch[0]
        hidden = self.backbone(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))
        logits = self.lm_head(self.ln_f(hidden))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def on_train_start(self) -> None:
        self.initial = summary(self)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def built_normally(seed: int) -> dict[str, dict[str, Any]]:
    pl.seed_everything(seed, verbose=False)
    module = TinyGPT2()
    module.configure_model()
    return summary(module)


def hf_worker(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    ids = torch.randint(0, VOCAB, (8, T), generator=torch.Generator().manual_seed(0))
    lazy = "transformers.modeling_utils" not in sys.modules  # configure_model() imports it, inside the recording
    pl.seed_everything(SEED, verbose=False)
    module = TinyGPT2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = quiet_trainer(devices=2, strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=2), max_steps=1)
        trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=4))
    from transformers import modeling_utils

    # Left as if imported outside the recording: torch's own functions, transformers' own init_weights.
    saved = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", {})  # transformers 5
    restored = all(getattr(torch.nn.init, name) is f for name, f in saved.items())
    restored &= modeling_utils.PreTrainedModel.init_weights.__module__ == "transformers.modeling_utils"
    return {
        "initial": module.initial,
        "warnings": [str(w.message) for w in caught if MARK in str(w.message)],
        "lazy": lazy,
        "restored": restored,
    }


@pytest.mark.timeout(150)
def test_a_gpt2_built_in_configure_model_gets_transformers_initialization() -> None:
    results = run_distributed(hf_worker, 2, timeout=130, lightning=True)
    assert [(r["warnings"], r["lazy"]) for r in results] == [([], True)] * 2
    got = {k: v for r in results for k, v in r["initial"].items()}
    normal, other_seed = built_normally(SEED), built_normally(SEED + 1)
    module = TinyGPT2()
    with torch.device("meta"), record_init() as record:
        module.configure_model()
    materialize(module, dict(module.named_modules()), torch.device("cpu"), SEED, record)
    whole = summary(module)
    assert set(got) == set(normal) == set(whole)
    assert all(len(r["initial"]) < len(normal) for r in results)  # each stage holds one of the two blocks
    for k, v in got.items():
        assert v["sha"] == whole[k]["sha"], k  # layout-independent: the whole model materialized in one process
        if normal[k]["sha"] == other_seed[k]["sha"]:  # no randomness: LayerNorm ones, zero biases
            assert v["sha"] == normal[k]["sha"], k
        else:
            assert_same_distribution(v, normal[k], k)
    # GPT-2's scheme, as the issue states it (before: 1.0, 1.0 and 0.02).
    assert got["wte.weight"]["std"] == pytest.approx(0.02, rel=0.15)
    assert got["wpe.weight"]["std"] == pytest.approx(0.02, rel=0.3)
    residual = 0.02 / (2 * LAYERS) ** 0.5
    for i in range(LAYERS):
        assert got[f"backbone.{i}.block.attn.c_proj.weight"]["std"] == pytest.approx(residual, rel=0.3)
        assert got[f"backbone.{i}.block.mlp.c_proj.weight"]["std"] == pytest.approx(residual, rel=0.15)
    # Before, transformers imported inside the recording kept the recorder's wrappers of torch.nn.init for good.
    assert [r["restored"] for r in results] == [True, True]
