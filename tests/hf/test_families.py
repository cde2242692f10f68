"""Every HuggingFace family causal_lm_backbone covers gives the HF model's logits and gradients; the others tried are
refused with their reason.

Each family runs as a tiny random model of the installed transformers in float64, with its own knobs set away from
the identity (soft-capping, logit scales, embedding and residual multipliers) so that a forward step the backbone
leaves out shows; mixture-of-experts models with the eager experts (the grouped kernels take no float64).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_gpipe.hf import causal_lm_backbone, causal_lm_loss
from lightning_gpipe.hf._backbone import FAMILIES, REFUSED, ROUTER_LOSS
from tests.helpers.hf_lm import ROUTED, VOCAB, small_config

transformers = pytest.importorskip(
    "transformers", reason="the HuggingFace tests need transformers: pip install -e '.[hf]'"
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

V = VOCAB


def tiny(model_type: str, device: str = "cpu") -> Any:
    """A tiny random model of ``model_type`` with two decoder layers (``small_config``), in float64."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            small_config(model_type, num_hidden_layers=2, n_layer=2), torch_dtype=torch.float64
        )
    return model.eval()  # dropout is 0 anyway; a router's noise, where one has it, is drawn in training only


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # padded on the right: each row its own length
    mask[2, -1] = 0
    labels = torch.where(mask.bool(), ids, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_gives_the_hf_models_logits_and_gradients(model_type: str) -> None:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"model_type {model_type!r} is not in transformers {transformers.__version__}")
    model = tiny(model_type)
    plain = copy.deepcopy(model)
    backbone = causal_lm_backbone(model)  # the model's own modules
    data = batch()
    args = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]}
    want = plain(**args).logits
    got = backbone(data)
    keep = data["attention_mask"].bool()
    assert rel(got[keep], want[keep]) <= 1e-12, rel(got[keep], want[keep])
    causal_lm_loss(got, data["labels"]).backward()
    causal_lm_loss(want, data["labels"]).backward()
    mine = dict(model.named_parameters())
    checked = 0
    for name, p in plain.named_parameters():
        if p.grad is None:
            assert mine[name].grad is None or not mine[name].grad.any(), name
            continue
        assert mine[name].grad is not None, name
        assert rel(mine[name].grad, p.grad) <= 1e-10, (name, rel(mine[name].grad, p.grad))
        checked += 1
    assert checked >= 2 * 3, checked  # the embedding, the head and every layer's weights at least


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_every_other_family_tried_is_refused_with_its_reason(model_type: str) -> None:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"model_type {model_type!r} is not in transformers {transformers.__version__}")
    with pytest.raises(ValueError, match=f"model_type '{model_type}' cannot be split as it is: ") as caught:
        causal_lm_backbone(tiny(model_type, device="meta"))
    assert REFUSED[model_type] in str(caught.value)


@pytest.mark.parametrize("model_type", sorted(ROUTER_LOSS))
def test_the_routers_auxiliary_loss_is_the_hf_models(model_type: str) -> None:
    """With ``output_router_logits`` each mixture of experts adds its load-balancing loss (coefficient 0.3, so that its
    gradient shows) as its ForCausalLM does: the loss, and every parameter's gradient, on a padded batch."""
    torch.manual_seed(0)
    cfg = small_config(model_type, **ROUTED, aux_loss_coef=0.3)  # JetMoE names it aux_loss_coef; Flint: 4 layers
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float64)
    plain = copy.deepcopy(model)
    backbone = causal_lm_backbone(model)
    data = batch()
    out = plain(input_ids=data["input_ids"], attention_mask=data["attention_mask"])
    coef = getattr(plain, "router_aux_loss_coef", None) or plain.aux_loss_coef
    want = causal_lm_loss(out.logits, data["labels"]) + coef * out.aux_loss
    got = causal_lm_loss(backbone(data), data["labels"])
    # The float32 sums of the router probabilities are taken per sample here, over the whole batch in HF's.
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    want.backward()
    got.backward()
    mine = dict(model.named_parameters())
    routers = [n for n, p in plain.named_parameters() if p.grad is not None and ("gate" in n or "router" in n)]
    assert routers, "the routers' weights get a gradient"
    for name, p in plain.named_parameters():
        if p.grad is not None:
            assert rel(mine[name].grad, p.grad) <= 1e-10, (name, rel(mine[name].grad, p.grad))


def test_a_routers_auxiliary_loss_not_tried_is_refused() -> None:
    model = tiny("doge", device="meta")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match=r"output_router_logits is on.*not tried on 'doge'.*set it to False"):
        causal_lm_backbone(model)


def test_the_routers_auxiliary_loss_needs_every_forward_before_a_loss() -> None:
    """Inside the pipeline one micro-batch's loss needs the whole batch's routing: a loss before every forward ran (any
    schedule but "fill-drain" with the loss inside) names the way out; so does a micro-batch the loss weights 0 whose
    tokens the routers route."""
    from lightning_gpipe.hf._router import RECORDS
    from lightning_gpipe.pipe.context import MicroBatchInfo, new_step, running, weighted_loss

    torch.manual_seed(0)
    cfg = small_config("mixtral", num_hidden_layers=2, **ROUTED)
    backbone = causal_lm_backbone(transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float64))
    data, step = batch(), new_step()
    with running(MicroBatchInfo(step, 0, 2)):
        out = backbone(data)  # micro-batch 0 of 2 recorded; 1 not yet
    before_every_forward = pytest.raises(RuntimeError, match=r"all 2 micro-batches.*forward of 1.*'fill-drain'")
    with running(MicroBatchInfo(step, 0, 2)), weighted_loss(0.5), before_every_forward:
        causal_lm_loss(out, data["labels"])
    with running(MicroBatchInfo(step, 1, 2)):
        backbone(data)
    unweighted = pytest.raises(ValueError, match=r"no token the loss counts.*but has tokens the routers route")
    with running(MicroBatchInfo(step, 0, 2)), weighted_loss(0.0), unweighted:
        causal_lm_loss(out, data["labels"])
    assert sorted(RECORDS.parts) == [0, 1]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_load_pretrained_reads_what_hf_saves(model_type: str, tmp_path: Path) -> None:
    """HF's save_pretrained renames some tensors and writes a mixture of experts one tensor per expert (its checkpoint
    conversion, reverted); load_pretrained reads each family's folder into another backbone as from_pretrained would."""
    from lightning_gpipe.hf import load_pretrained, named_hf_tensors

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"model_type {model_type!r} is not in transformers {transformers.__version__}")
    saved = tiny(model_type)
    saved.save_pretrained(tmp_path)
    torch.manual_seed(1)
    other = transformers.AutoModelForCausalLM.from_config(saved.config, torch_dtype=torch.float64)
    backbone = causal_lm_backbone(other)
    want = saved.state_dict()
    assert any((t - want[n]).abs().max() > 0 for n, t in named_hf_tensors(backbone))
    load_pretrained(backbone, tmp_path)
    assert all(torch.equal(t, want[n]) for n, t in named_hf_tensors(backbone))


def test_the_guides_table_lists_every_family_tried() -> None:
    """docs/guide.md's table of families names each covered and each refused model_type once, and counts them."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "guide.md").read_text()
    start = text.index("  | families | what differs")
    rows = text[start : text.index("\n\n", start)].splitlines()[2:]
    named = [n.strip() for row in rows for n in row.split("|")[1].replace("refused:", "").split(",")]
    assert sorted(named) == sorted({*FAMILIES, *REFUSED})
    assert f"with no adapters to write: {len(FAMILIES)} families" in text
