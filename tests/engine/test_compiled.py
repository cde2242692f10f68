"""Compiled layers in the pipeline (``pipe/run/compiled.py``): the same run as the plain model, few graphs, refusals."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from tests.helpers.launch import run_distributed

D = 16
# (N, T) per step: a new sequence length each of the first five steps, then again; M = 3 splits N unevenly but never
# into a micro-batch of one sample (dynamo specializes size 1: a graph of its own).
SHAPES = [(7, 5), (8, 9), (6, 3), (7, 7), (8, 11), (6, 5), (7, 9), (8, 3), (6, 7), (7, 11)]
TOL = 1e-9  # float64


class Block(nn.Module):
    """A pre-norm Transformer block (attention and MLP), batch-first (N, T, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Dropped(nn.Module):
    """A residual MLP with dropout between its two products."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), Block(), Block(), nn.Linear(D, D)).double()


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def parity_worker(rank: int, world: int, mode: str, inside: bool) -> dict:
    """Ten steps of the compiled pipeline (K = world, aot_eager) beside the plain model, SGD: the largest relative
    difference of the gradients and weights this stage holds, and each compiled layer's graphs."""
    plain = model()
    stage = GPipeStage(
        copy.deepcopy(plain), chunks=3, balance=[2, 2], checkpoint=mode, compile={"backend": "aot_eager"}
    )
    opt, ref_opt = torch.optim.SGD(stage.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    ref = dict(plain.named_parameters())
    errs = {"grad": 0.0, "weight": 0.0}
    for step, (N, T) in enumerate(SHAPES):
        x, target = randn(N, T, D, seed=step), randn(N, T, D, seed=100 + step)
        ref_opt.zero_grad()
        ((plain(x) - target) ** 2).mean().backward()
        opt.zero_grad()
        if inside:
            sizes = stage.micro_batch_sizes(x)
            parts = target.split(sizes)

            def loss(y: torch.Tensor, m: int, parts: tuple = parts, sizes: list = sizes, N: int = N) -> torch.Tensor:
                return ((y - parts[m]) ** 2).mean() * sizes[m] / N

            stage.forward_backward(x, loss, schedule="1f1b")
        else:
            out = stage(x)
            if out is not None:
                ((out - target) ** 2).mean().backward()
            stage.backward()
        for name, p in stage.named_parameters():
            errs["grad"] = max(errs["grad"], rel_err(p.grad, ref[name].grad))
        opt.step()
        ref_opt.step()
    for name, p in stage.named_parameters():
        errs["weight"] = max(errs["weight"], rel_err(p.detach(), ref[name].detach()))
    return {**errs, "graphs": stage.compilations, "checked": len(list(stage.parameters()))}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("mode", "inside"), [("always", False), ("except_last", True), ("never", False)])
def test_compiled_pipeline_equals_the_plain_model(mode: str, inside: bool) -> None:
    """K = 2, compiled layers (aot_eager), float64: ten steps of new sequence lengths and uneven micro-batches give
    the plain model's gradients and weights, the loss outside and inside (1F1B); at most two graphs per layer."""
    for rank, r in enumerate(run_distributed(parity_worker, 2, mode, inside, timeout=380)):
        assert r["grad"] <= TOL and r["weight"] <= TOL, (rank, r)
        assert r["checked"] > 4 and len(r["graphs"]) == 2, r  # two compiled layers a stage
        assert all(1 <= n <= 2 for n in r["graphs"].values()), r


def dropout_run(mode: str, balance: list[int], seed: int = 7) -> dict[str, list]:
    """Two steps of four residual MLPs with dropout, compiled (inductor): the output and this stage's gradients."""
    torch.manual_seed(0)
    layers = nn.Sequential(*(Dropped(0.3) for _ in range(4))).double()  # one class: one graph for the four
    stage = GPipeStage(layers, chunks=2, balance=balance, checkpoint=mode, output="all", compile=True)
    got: dict[str, list] = {}
    for step, (N, T) in enumerate(SHAPES[:2]):
        torch.manual_seed(seed + step)
        out = stage(randn(N, T, D, seed=step))
        (out**2).mean().backward()
        stage.backward()
        got[f"out{step}"] = out.detach().tolist()
    got.update({name: p.grad.tolist() for name, p in stage.named_parameters()})
    return got


def dropout_worker(rank: int, world: int, mode: str) -> dict[str, list]:
    return dropout_run(mode, [2, 2])


@pytest.mark.timeout(600)
def test_compiled_dropout_draws_the_same_masks_whatever_the_layout_and_the_recompute() -> None:
    """Under inductor, whose random numbers are not eager's: K = 2 with every micro-batch recomputed gives K = 1's
    output and gradients with none recomputed, so the recompute drew the forward's masks."""
    reference = {k: torch.tensor(v) for k, v in dropout_run("never", [4]).items()}
    assert not torch.equal(torch.tensor(dropout_run("never", [4], seed=8)["out0"]), reference["out0"])  # it drops
    for rank, lists in enumerate(run_distributed(dropout_worker, 2, "always", timeout=560)):
        got = {k: torch.tensor(v) for k, v in lists.items()}
        for key in ("out0", "out1"):
            assert rel_err(got.pop(key), reference[key]) <= TOL, (rank, key)
        assert got, "a stage without parameters checked nothing"
        for name, grad in got.items():
            assert rel_err(grad, reference[name]) <= TOL, (rank, name)


def test_a_layer_past_dynamos_recompile_limit_is_named_with_its_shapes() -> None:
    """Dynamo's warning names a function; ours the layer and the shapes that crossed the limit."""
    stage = GPipeStage(model(), chunks=1, balance=[4], compile={"backend": "eager", "dynamic": False})
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for T in (3, 4):
                stage(randn(2, T, D, seed=T))
    torch._dynamo.reset()
    heard = [str(w.message) for w in caught if "stopped compiling" in str(w.message)]
    # Layer 0 (a Linear: torch.nn's classes share one wrapper, so layer 3 is silent) and layer 1, a Block of its own.
    assert [h.split(" stopped")[0] for h in heard] == ["layer '0'", "layer '1'"], heard
    assert "at input shapes [(2, 4, 16)], after 1 graphs: torch._dynamo hit config.recompile_limit (1)" in heard[0]


def test_refusals_name_the_problem_and_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"\['fullgraf'\] are not torch.compile's options"):
        GPipeStage(model(), chunks=2, balance=[4], compile={"fullgraf": True})
    with pytest.raises(TypeError, match="compile must be True, False or a dict"):
        GPipeStage(model(), chunks=2, balance=[4], compile="inductor")  # type: ignore[arg-type]
    whole = model()
    whole.compile()
    with pytest.raises(TypeError, match=r"the nn\.Sequential backbone itself is compiled.*compile its layers instead"):
        GPipeStage(whole, chunks=2, balance=[4])
    with pytest.raises(TypeError, match=r"the nn\.Sequential backbone itself is compiled"):
        GPipeStage(torch.compile(model()), chunks=2, balance=[4])  # type: ignore[arg-type]
    layers = model()
    layers[1] = torch.compile(layers[1])  # as a user compiles a block in __init__
    stage = GPipeStage(layers, chunks=2, balance=[4])
    assert list(stage.compilations) == ["1"]
    with pytest.raises(ValueError, match=r"schedule='zb-h1' splits each backward op by op.*compiled layers \(1\)"):
        stage.forward_backward(randn(4, 3, D, seed=0), lambda y, m: y.sum(), schedule="zb-h1")


class Normed(nn.Module):
    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(D, D), nn.BatchNorm1d(D, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.lin(x)))


class Twice(Normed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.bn(self.lin(x)))


def normed() -> nn.Sequential:
    from lightning_gpipe.pipe import Pop, Stash

    torch.manual_seed(0)
    return nn.Sequential(Normed(), Stash("s"), Normed(None), Pop("s", "add"), Normed(), nn.Linear(D, D)).double()


def steps(stage: GPipeStage, sizes: list[int]) -> None:
    for step, N in enumerate(sizes):
        stage.zero_grad()
        stage(randn(N, D, seed=step)).square().sum().backward()
        stage.backward()


def test_deferred_batch_norm_compiles_and_long_skips_stay_eager() -> None:
    """A layer with BatchNorm compiles and its statistics stay deferred (one update a mini-batch, momentum None's
    cumulative average too): gradients, running statistics and counts equal the eager pipeline's over five steps of
    uneven micro-batches, recomputed or not, in one graph a layer. A layer that stashes or pops a long skip stays
    eager under compile=, named in a warning, and is refused compiled by hand."""
    options = {"backend": "aot_eager"}
    for mode in ("always", "never"):
        eager = GPipeStage(normed(), chunks=3, balance=[6], checkpoint=mode)
        with pytest.warns(UserWarning, match=r"layers 1 \(Stash\), 3 \(Pop\) run eagerly: they stash or pop"):
            stage = GPipeStage(normed(), chunks=3, balance=[6], checkpoint=mode, compile=options)
        sizes = [9, 8, 7, 10, 9]
        steps(eager, sizes)
        steps(stage, sizes)
        for (name, p), q in zip(stage.named_parameters(), eager.parameters()):
            assert rel_err(p.grad, q.grad) <= TOL, (mode, name)
        for (name, b), c in zip(stage.named_buffers(), eager.buffers()):
            assert rel_err(b.double(), c.double()) <= TOL, (mode, name)
        assert stage.get_buffer("2.bn.num_batches_tracked").item() == len(sizes)
        assert stage.compilations.keys() == {"0", "2", "4", "5"} and all(n <= 1 for n in stage.compilations.values())
    by_hand = normed()
    by_hand[1].compile(**options)
    with pytest.raises(TypeError, match=r"layer 1 .* is compiled, but it stashes or pops a long skip"):
        GPipeStage(by_hand, chunks=3, balance=[6])
    torch.manual_seed(0)
    twice = GPipeStage(nn.Sequential(Twice()).double(), chunks=2, balance=[1], compile=options)
    with pytest.raises(RuntimeError, match="a BatchNorm1d ran 2 times in one call of its compiled layer"):
        twice(randn(6, D, seed=0))


def test_batch_norm_not_deferred_compiles_as_written() -> None:
    """deferred_batch_norm=False: the compiled layers update their running statistics once per micro-batch, as the
    plain module does per call; gradients and statistics are the plain module's, recomputed or not."""
    plain = nn.Sequential(*(Normed() for _ in range(3))).double()
    for mode in ("always", "never"):
        options = {"backend": "aot_eager"}
        stage = GPipeStage(copy.deepcopy(plain), chunks=3, balance=[3], checkpoint=mode, compile=options,
                           deferred_batch_norm=False)  # fmt: skip
        ref = copy.deepcopy(plain)
        x = randn(9, D, seed=1)
        sum(ref(part).square().sum() for part in x.split(3)).backward()
        stage(x).square().sum().backward()
        stage.backward()
        for (name, p), r in zip(stage.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, r.grad) <= TOL, (mode, name)
        for name, r in ref.named_buffers():
            assert torch.equal(stage.get_buffer(name), r), (mode, name)


def conv_bn_worker(rank: int, world: int) -> dict:
    """Residual conv-BatchNorm blocks at K = 2, compiled (aot_eager) and eager, every micro-batch recomputed: the
    largest relative difference of gradients and running statistics; then the refused synchronization."""
    import torch.distributed as dist

    from lightning_gpipe.pipe.state.batchnorm import sync_deferred_batch_norm

    torch.manual_seed(0)
    plain = nn.Sequential(*(ConvNormed() for _ in range(4))).double()
    stages = [GPipeStage(copy.deepcopy(plain), chunks=3, balance=[2, 2], checkpoint="always", compile=c)
              for c in (False, {"backend": "aot_eager"})]  # fmt: skip
    for step, N in enumerate([7, 8, 6]):  # never a micro-batch of one sample
        x = randn(N, 4, 6, 6, seed=step)
        for stage in stages:
            out = stage(x)
            if out is not None:
                out.square().mean().backward()
            stage.backward()
    eager, compiled = stages
    errs = [rel_err(p.grad, q.grad) for p, q in zip(compiled.parameters(), eager.parameters())]
    errs += [rel_err(b.double(), c.double()) for b, c in zip(compiled.buffers(), eager.buffers())]
    try:
        sync_deferred_batch_norm(compiled, dist.group.WORLD)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"max": max(errs), "checked": len(errs), "refused": refused, "graphs": compiled.compilations}


class ConvNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


@pytest.mark.timeout(300)
def test_compiled_batch_norm_at_two_stages_equals_the_eager_pipeline() -> None:
    for rank, r in enumerate(run_distributed(conv_bn_worker, 2, timeout=280)):
        assert r["max"] <= TOL and r["checked"] >= 8, (rank, r)
        assert "runs inside a compiled layer, which cannot issue the collectives" in r["refused"], r
        assert r["graphs"].keys() == ({"0", "1"} if rank == 0 else {"2", "3"}) and all(
            n <= 1 for n in r["graphs"].values()
        ), r


@pytest.mark.timeout(300)
def test_compiled_layers_with_weights_tied_across_stages_equal_the_plain_model() -> None:
    """Layer 0's weight used again by layers 4 and 7 (both on the other stage at K = 2), every layer compiled
    (aot_eager), interleaved 1F1B at v = 2 so that one tie is also within a rank: three SGD steps of new lengths give
    the plain model's gradients and weights."""
    from tests.helpers.chunked import F64, parity_worker, tied

    case = (tied, 4, [2, 2, 2, 2], F64, "sgd", "always")
    results = run_distributed(parity_worker, 2, 2, [case], "interleaved-1f1b", False, {"backend": "aot_eager"},
                              timeout=280)  # fmt: skip
    for rank, [(_, r)] in enumerate(results):
        assert r["shared"] and all(e <= TOL for e in r["errs"].values()), (rank, r)


def timm_worker(rank: int, world: int) -> dict:
    """timm's MLP-Mixer blocks, each wrapped by ``torch.compile(block)`` as a user would (aot_eager), pipelined at K = 2
    beside the same blocks uncompiled: the largest relative gradient difference of this stage's parameters."""
    from timm.models.mlp_mixer import MlpMixer

    torch.manual_seed(0)
    mixer = MlpMixer(num_classes=5, img_size=32, patch_size=8, num_blocks=4, embed_dim=16).double()
    plain = copy.deepcopy(mixer.blocks)
    blocks = nn.Sequential(*(torch.compile(b, backend="aot_eager") for b in mixer.blocks))
    stage = GPipeStage(blocks, chunks=3, balance=[2, 2], checkpoint="always")
    x = mixer.stem(randn(7, 3, 32, 32, seed=0)).detach()
    plain(x).square().mean().backward()
    out = stage(x)
    if out is not None:
        out.square().mean().backward()
    stage.backward()
    # The stage's layers under their global names, wrapped: "2._orig_mod.norm1.weight" is the plain "2.norm1.weight".
    ref = dict(plain.named_parameters())
    errs = [rel_err(p.grad, ref[n.replace("._orig_mod", "")].grad) for n, p in stage.named_parameters()]
    return {"max": max(errs), "checked": len(errs), "graphs": stage.compilations}


@pytest.mark.timeout(300)
def test_a_timm_model_compiled_by_its_user_equals_its_plain_blocks() -> None:
    for rank, r in enumerate(run_distributed(timm_worker, 2, timeout=280)):
        assert r["max"] <= TOL and r["checked"] > 4, (rank, r)
        # The blocks are of one class: the stage's first compiles the graph the second reuses.
        assert list(r["graphs"]) == (["0", "1"] if rank == 0 else ["2", "3"]) and sum(r["graphs"].values()) >= 1, r
