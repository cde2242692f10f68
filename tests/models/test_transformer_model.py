"""T(L, H, A) for translation: cut anywhere, masks, tying, the trainability fixes, greedy decoding, size, pipelined."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_gpipe.models.transformer import (
    _causal_mask,
    _key_mask,
    transformer_nmt,
    transformer_nmt_num_parameters,
)
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.dp.grads import sum_over_pipeline
from lightning_gpipe.strategy._materialize import materialize
from tests.helpers.launch import run_distributed
from tests.helpers.transformer import PAD, D, V, batch, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def loss_fn(logits: Tensor, tgt_out: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)


def run_cut(model: nn.Sequential, cuts: list[int], x: tuple[Tensor, Tensor], tgt_out: Tensor) -> Tensor:
    """Forward piece by piece with detached boundaries, then backward piece by piece, as a pipeline does."""
    bounds = [0, *cuts, len(model)]
    inputs, outputs = [], []
    for a, b in itertools.pairwise(bounds):
        x = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), x)
        inputs.append(x)
        x = model[a:b](x)
        outputs.append(x)
    logits = x
    loss_fn(logits, tgt_out).backward()
    for k in range(len(inputs) - 1, 0, -1):
        ins = [t for t in tree_flatten(inputs[k])[0] if t.requires_grad]
        outs = [t for t in tree_flatten(outputs[k - 1])[0] if t.requires_grad]
        assert len(ins) == len(outs)
        # An input the piece does not use (the memory before dec_norm) gets zeros, as the engine sends.
        torch.autograd.backward(outs, [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins])
    return logits.detach()


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_layers_are_named_and_flat() -> None:
    model = tiny()
    names = [n for n, _ in model.named_children()]
    assert names == [
        "src_embed", "enc0", "enc1", "enc_norm", "tgt_embed", "dec0", "dec1", "dec_norm", "project",
    ]  # fmt: skip
    src, tgt_in, _ = batch(3, 7, 5)
    assert model((src, tgt_in)).shape == (3, 5, V)
    # Embedding × sqrt(d_model) plus the fixed sinusoids: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(…).
    x, src_pad, ids = model.src_embed((src, tgt_in))
    pos = torch.arange(7.0)[:, None] / 10000 ** (torch.arange(0, D, 2) / D)
    pe = torch.stack([pos.sin(), pos.cos()], dim=-1).flatten(1)
    torch.testing.assert_close(x, model.src_embed.weight[src] * math.sqrt(D) + pe)
    assert torch.equal(src_pad, src == PAD) and ids is tgt_in


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_cut_anywhere_equals_whole(dropout: float) -> None:
    """Every 2-piece cut and some 3-piece cuts: the same logits and gradients, bit for bit (dropout: same seed)."""
    model = tiny(dropout=dropout)
    src, tgt_in, tgt_out = batch(4, 7, 6)
    torch.manual_seed(5)
    ref = model((src, tgt_in))
    loss_fn(ref, tgt_out).backward()
    ref_grads = grads(model)
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    if dropout:  # the seed really matters: another seed, other logits
        torch.manual_seed(6)
        assert not torch.equal(model((src, tgt_in)), ref)
    for cuts in [[i] for i in range(1, len(model))] + [[2, 5], [4, 5], [1, 8], [3, 6]]:
        model.zero_grad()
        torch.manual_seed(5)
        logits = run_cut(model, cuts, (src, tgt_in), tgt_out)
        assert torch.equal(logits, ref.detach()), cuts
        for n, g in grads(model).items():
            assert torch.equal(g, ref_grads[n]), (cuts, n)


def test_eval_mode_matches_train_mode_without_dropout() -> None:
    """No fast path: eval and no_grad run the same maths as training (dropout 0)."""
    model = tiny()
    src, tgt_in, _ = batch(3, 6, 5)
    train = model((src, tgt_in))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model((src, tgt_in)), train.detach())


def test_padding_does_not_change_real_positions() -> None:
    model = tiny()
    src, tgt_in, _ = batch(4, 8, 7, seed=1)
    logits = model((src, tgt_in))
    for n in range(1, 4):  # each ragged row alone, without any padding
        s, t = int((src[n] != PAD).sum()), int((tgt_in[n] != PAD).sum())
        alone = model((src[n : n + 1, :s], tgt_in[n : n + 1, :t]))
        torch.testing.assert_close(logits[n : n + 1, :t], alone, rtol=0, atol=1e-5)


def test_pad_embeddings_never_reach_real_positions() -> None:
    """Pads in the middle and at the start: the key masks, not causality, must keep them out."""
    model = tiny()
    src, tgt_in, _ = batch(2, 8, 7, seed=2)
    src[:, [0, 3, 4]] = PAD
    tgt_in[:, [2, 5]] = PAD
    real = tgt_in != PAD
    before = model((src, tgt_in))
    with torch.no_grad():
        model.src_embed.weight[PAD] += 3.0 * torch.randn(D)
        model.tgt_embed.weight[PAD] += 3.0 * torch.randn(D)
    after = model((src, tgt_in))
    torch.testing.assert_close(after[real], before[real], rtol=0, atol=1e-5)
    assert (after[~real] - before[~real]).abs().amax(dim=-1).min() > 1e-3  # the pads' own logits do change


def test_all_padding_rows_stay_finite() -> None:
    model = tiny()
    src, tgt_in, tgt_out = batch(3, 6, 5)
    src[1] = PAD
    tgt_in[2] = PAD
    logits = model((src, tgt_in))
    loss_fn(logits, tgt_out).backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_masks_leave_no_query_without_keys() -> None:
    """Some SDPA kernels give NaN for a fully masked row; the masks never make one, and real positions are exact."""
    pad = torch.tensor([[False, False, True, True], [True, True, True, True], [True, False, True, False]])
    assert _key_mask(pad)[:, 0, 0].tolist() == [[True, True, False, False], [True] * 4, [False, True, False, True]]
    causal = _causal_mask(pad)[:, 0]
    assert causal.shape == (3, 4, 4) and causal.any(dim=-1).all()
    earlier = torch.ones(4, 4, dtype=torch.bool).tril()
    for n, i in (~pad).nonzero().tolist():  # a real query sees exactly the real keys up to itself
        assert torch.equal(causal[n, i], ~pad[n] & earlier[i]), (n, i)


def test_decoder_is_causal() -> None:
    model = tiny()
    src, tgt_in, _ = batch(2, 6, 8)
    ref = model((src, tgt_in))
    for j in (1, 4, 7):
        changed = tgt_in.clone()
        changed[:, j] = (changed[:, j] + 7) % (V - 3) + 3
        out = model((src, changed))
        torch.testing.assert_close(out[:, :j], ref[:, :j], rtol=0, atol=1e-6)
        assert (out[:, j:] - ref[:, j:]).abs().amax(dim=-1).min() > 1e-4, j


def test_tied_embeddings_share_one_parameter() -> None:
    tied = tiny(tie_embeddings=True)
    w = tied.src_embed.weight
    assert w is tied.tgt_embed.weight and w is tied.project.weight
    assert len(list(tied.parameters())) == len(list(tiny().parameters())) - 2
    assert any(p is w for p in tied[:1].parameters()) and any(p is w for p in tied[-1:].parameters())
    # Its gradient is the sum of what the three untied tables would get with the same values.
    untied = tiny(tie_embeddings=False)
    untied_params = dict(untied.named_parameters())
    with torch.no_grad():
        for name, p in tied.named_parameters():
            untied_params[name].copy_(p)
        untied.tgt_embed.weight.copy_(w)
        untied.project.weight.copy_(w)
    src, tgt_in, tgt_out = batch(3, 6, 5)
    loss_fn(tied((src, tgt_in)), tgt_out).backward()
    loss_fn(untied((src, tgt_in)), tgt_out).backward()
    parts = [untied.src_embed.weight.grad, untied.tgt_embed.weight.grad, untied.project.weight.grad]
    assert all(g.abs().sum() > 0 for g in parts)
    torch.testing.assert_close(w.grad, sum(parts), rtol=0, atol=1e-6)


def test_sequence_lengths_change_between_calls() -> None:
    model = tiny(max_len=16)
    for N, S, T in ((2, 5, 3), (3, 9, 11), (1, 2, 16), (4, 16, 1)):
        src, tgt_in, tgt_out = batch(N, S, T, seed=S)
        logits = model((src, tgt_in))
        assert logits.shape == (N, T, V)
        loss_fn(logits, tgt_out).backward()
    with pytest.raises(ValueError, match="max_len=16"):
        model((torch.ones(1, 17, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)))
    with pytest.raises(TypeError, match="pair"):
        model(torch.ones(1, 3, dtype=torch.long))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("meta", [False, True], ids=["built", "meta+materialize"])
@pytest.mark.parametrize(("L", "scale", "tie"), [(2, True, False), (8, True, True), (2, False, True)])
def test_init_follows_the_recipe(meta: bool, L: int, scale: bool, tie: bool) -> None:
    """Xavier weights, zero biases, tables of std d^-1/2, w2 / sqrt(2L): built, or on meta and then materialized."""
    d, H = 64, 256
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = transformer_nmt(L, H, 4, d_model=d, vocab_size=400, tie_embeddings=tie, scale_ffn_init=scale)
    if meta:  # built outside configure_model(): every module's own reset_parameters() is the recipe, and is named
        with pytest.warns(UserWarning, match="outside configure_model"):
            n = materialize(model, dict(model.named_modules()), torch.device("cpu"), seed=3)
        assert n == sum(p.numel() for p in model.parameters())
    params = dict(model.named_parameters(remove_duplicate=False))

    def cat(suffix: str) -> Tensor:
        return torch.cat([p.flatten() for k, p in params.items() if k.endswith(suffix)])

    def xavier(fan_in: int, fan_out: int, gain: float = 1.0) -> tuple[float, float]:  # (std, bound) of U(-a, a)
        a = gain * math.sqrt(6 / (fan_in + fan_out))
        return a / math.sqrt(3), a

    gain = 1 / math.sqrt(2 * L) if scale else 1.0
    for suffix, (std, bound) in (
        ("attn.q.weight", xavier(d, d)),
        ("attn.out.weight", xavier(d, d)),
        ("ffn.w1.weight", xavier(d, H)),
        ("ffn.w2.weight", xavier(H, d, gain)),
    ):
        w = cat(suffix)
        assert w.std().item() == pytest.approx(std, rel=0.05), suffix
        assert bound * 0.99 < w.abs().max().item() <= bound, suffix
    assert all(not p.any() for k, p in params.items() if k.endswith("bias"))
    assert all((p == 1).all() for k, p in params.items() if "norm" in k and k.endswith("weight"))
    for k in ("src_embed.weight", "tgt_embed.weight", "project.weight"):
        assert params[k].std().item() == pytest.approx(d**-0.5, rel=0.05) and abs(params[k].mean()) < 0.01, k
    assert (params["src_embed.weight"] is params["project.weight"]) == tie
    assert not torch.equal(params["enc0.attn.q.weight"], params["enc1.attn.q.weight"])
    src, tgt_in, _ = batch(2, 5, 4)
    assert torch.isfinite(model((src, tgt_in))).all()


def test_logit_clip_bounds_the_output_and_keeps_gradients() -> None:
    plain, clipped = tiny(), tiny(logit_clip=3.0)
    for m in (plain, clipped):
        with torch.no_grad():
            m.project.weight.mul_(20)  # large logits
    src, tgt_in, tgt_out = batch(3, 6, 5)
    z, c = plain((src, tgt_in)), clipped((src, tgt_in))
    assert z.abs().max() > 10 and c.abs().max() <= 3.0
    torch.testing.assert_close(c, 3.0 * torch.tanh(z / 3.0))
    loss_fn(c, tgt_out).backward()
    assert (clipped.project.weight.grad.abs().sum(dim=1) > 0).all()  # saturated rows still learn
    with pytest.raises(ValueError, match="logit_clip"):
        tiny(logit_clip=0.0)


def test_parameter_count_of_t_6_8192_16() -> None:
    """The paper's T(6, 8192, 16) with d_model 1024 and a 32k vocabulary: 375M parameters (its Table)."""
    for tie in (False, True):
        with torch.device("meta"):
            model = transformer_nmt(6, 8192, 16, d_model=1024, vocab_size=32000, tie_embeddings=tie)
        n = sum(p.numel() for p in model.parameters())
        assert n == transformer_nmt_num_parameters(6, 8192, d_model=1024, vocab_size=32000, tie_embeddings=tie)
        assert round(n / 1e6) == (375 if not tie else 310)
    small = sum(p.numel() for p in tiny().parameters())
    assert small == transformer_nmt_num_parameters(2, 64, d_model=D, vocab_size=V)


def pipeline_worker(rank: int, world_size: int) -> float:
    warnings.simplefilter("ignore")
    model = tiny(seed=7, tie_embeddings=True)
    ref = copy.deepcopy(model)
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    err = 0.0
    for step, (mode, (N, S, T)) in enumerate((("always", (6, 7, 5)), ("never", (5, 4, 9)))):
        stage = GPipeStage(model, chunks=3, balance=[5, 4], checkpoint=mode, output="all")
        src, tgt_in, tgt_out = batch(N, S, T, seed=step)
        ref.zero_grad()
        ref_logits = ref((src, tgt_in))
        loss_fn(ref_logits, tgt_out).backward()
        stage.zero_grad()
        logits = stage((src, tgt_in))
        loss_fn(logits, tgt_out).backward()
        stage.backward()
        tied = model.src_embed.weight
        assert any(p is tied for p in stage.parameters())  # on both stages
        sum_over_pipeline([tied], None if world_size == 1 else torch.distributed.group.WORLD)
        err = max(err, (logits - ref_logits).abs().max().item() / ref_logits.abs().max().item())
        # Floored at 1e-3 of the largest gradient: the key biases' gradients are zero in exact arithmetic (softmax
        # ignores a constant per query), so theirs is rounding noise with no scale of its own.
        floor = 1e-3 * max(ref_grads[n].grad.abs().max().item() for n, _ in stage.named_parameters())
        for name, p in stage.named_parameters():
            r = ref_grads[name].grad
            err = max(err, (p.grad - r).abs().max().item() / max(r.abs().max().item(), floor))
    return err


@pytest.mark.timeout(60)
def test_two_stage_pipeline_equals_whole_model() -> None:
    """K=2, M=3, tied weight on both stages (gradient summed over the pipeline), S and T changing."""
    errs = run_distributed(pipeline_worker, 2, timeout=50)
    assert max(errs) <= 1e-5, errs
