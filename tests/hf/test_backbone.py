"""causal_lm_backbone in one process: the same logits and loss as the HF model, refusals, weights in and out."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.hf import causal_lm_backbone, causal_lm_loss, load_pretrained, named_hf_tensors, save_pretrained
from tests.helpers.hf_lm import VOCAB, batches, config

transformers = pytest.importorskip(
    "transformers", reason="the HuggingFace tests need transformers: pip install -e '.[hf]'"
)


def tiny(kind: str) -> Any:
    """Tiny models of each structure the helper covers; Qwen3 and Mistral with a sliding window shorter than T."""
    torch.manual_seed(0)
    common = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(
                **common, num_hidden_layers=4, head_dim=8, vocab_size=VOCAB, sliding_window=3, use_sliding_window=True,
                layer_types=["full_attention", "sliding_attention"] * 2,
            )
        )  # fmt: skip
    if kind == "mistral":
        cfg = transformers.MistralConfig(**common, num_hidden_layers=2, vocab_size=VOCAB, sliding_window=3)
        return transformers.MistralForCausalLM(cfg)
    return transformers.AutoModelForCausalLM.from_config(config(kind))


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen3", "mistral"])
def test_logits_and_loss_equal_the_hf_model(kind: str) -> None:
    model = tiny(kind).double()
    plain = copy.deepcopy(model)
    backbone = causal_lm_backbone(model)
    assert len(backbone) == model.config.num_hidden_layers + 2
    for batch in batches(3):  # padded, a new length every time
        args = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        want = plain(**args).logits
        got = backbone(batch)
        assert (got - want).abs().max().item() <= 1e-12
        # HF's loss computes in float32 (it casts float64 logits down): equal to that precision.
        hf_loss = plain(**args, labels=batch["labels"]).loss
        assert causal_lm_loss(got, batch["labels"]).item() == pytest.approx(hf_loss.item(), abs=1e-6)


def test_dropout_runs_in_the_layers() -> None:
    """With dropout (GPT-2's embedding, attention and residuals) training mode draws masks: the parity test of K = 2
    against K = 1 with dropout compares runs that use them."""
    backbone = causal_lm_backbone(transformers.AutoModelForCausalLM.from_config(config("gpt2", dropout=0.1)))
    batch = batches(1)[0]
    assert not torch.equal(backbone(batch), backbone(batch))
    assert torch.equal(backbone.eval()(batch), backbone(batch))


def test_other_models_are_refused_by_name() -> None:
    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2, vocab_size=VOCAB)
    )
    with pytest.raises(ValueError, match=r"model_type 'opt' cannot be split as it is: .*OPT's.*Pipelining a Hugg"):
        causal_lm_backbone(opt)
    bert = transformers.BertLMHeadModel(
        transformers.BertConfig(hidden_size=16, num_hidden_layers=1, intermediate_size=32, num_attention_heads=2)
    )
    with pytest.raises(ValueError, match=r"model_type 'bert' has not been tried.*covers \d+ families"):
        causal_lm_backbone(bert)
    with pytest.raises(ValueError, match=r"the \.\.\.ForCausalLM class"):
        causal_lm_backbone(transformers.LlamaModel(config("llama")))
    model = tiny("llama")
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        causal_lm_backbone(model)


def test_without_transformers_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Using the helper needs transformers (importing it does not: this module imports it first, and the main test
    run, without transformers, collects it)."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        ImportError, match=r'lightning_gpipe.hf needs HuggingFace transformers: pip install "lightning-gpipe\[hf\]"'
    ):
        causal_lm_backbone(nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_and_load_round_trip(family: str, tmp_path: Path) -> None:
    """save_pretrained writes what from_pretrained loads; load_pretrained reads HF's own folders, one file or shards
    (a tied head from the embedding), straight into the parameters."""
    model = tiny(family)
    plain = copy.deepcopy(model)
    backbone = causal_lm_backbone(model)
    save_pretrained(backbone, tmp_path / "ours")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert loaded.config.tie_word_embeddings == plain.config.tie_word_embeddings
    for k, v in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    plain.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for folder in (tmp_path / "ours", tmp_path / "sharded"):
        fresh = causal_lm_backbone(transformers.AutoModelForCausalLM.from_config(config(family)).double())
        load_pretrained(fresh, folder)  # float32 files into float64 parameters: converted in chunks
        for (name, got), (_, want) in zip(named_hf_tensors(fresh), named_hf_tensors(backbone)):
            assert torch.equal(got, want.double()), name
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] or family == "llama"


def test_load_names_what_the_folder_lacks(tmp_path: Path) -> None:
    tiny("gpt2").save_pretrained(tmp_path)
    backbone = causal_lm_backbone(transformers.AutoModelForCausalLM.from_config(config("gpt2", n_layer=5)))
    with pytest.raises(KeyError, match=r"lacks 12 of this rank's weights \(transformer\.h\.4\.ln_1\.weight"):
        load_pretrained(backbone, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors"):
        load_pretrained(backbone, tmp_path / "nothing")
    wider = causal_lm_backbone(transformers.AutoModelForCausalLM.from_config(config("gpt2", n_embd=64)))
    with pytest.raises(
        ValueError, match=r"transformer\.wte\.weight has shape \(64, 32\), the model's tensor \(64, 64\)"
    ):
        load_pretrained(wider, tmp_path)


def test_a_backbone_not_made_by_the_helper_is_refused() -> None:
    with pytest.raises(TypeError, match=r"holds no layer of lightning_gpipe\.hf\.causal_lm_backbone"):
        save_pretrained(nn.Linear(2, 2), "unused")
