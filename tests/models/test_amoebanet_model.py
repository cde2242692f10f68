"""AmoebaNet-D: GPipe's parameter counts, (current, previous) pairs at every boundary, same maths when cut anywhere."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.models import amoebanet_d, replace_classifier
from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from tests.helpers.launch import run_distributed

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]  # fixture: tests/conftest.py

TINY = {"num_classes": 5, "num_layers": 3, "num_filters": 8}
# Cuts of the 9-module tiny model into 2 and 3 pieces: after the stem (a plain tensor), inside the stem reductions,
# on both sides of each reduction cell, and just before the classifier.
CUTS = [(1,), (2,), (3,), (4,), (5,), (6,), (7,), (8,), (1, 5), (3, 7), (4, 6), (2, 8)]


def _tiny(seed: int = 0, **kwargs: object) -> nn.Sequential:
    torch.manual_seed(seed)
    return amoebanet_d(**{**TINY, **kwargs})  # type: ignore[arg-type]


def _images(N: int, side: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(N, 3, side, side, generator=torch.Generator().manual_seed(seed))


def _run_pieces(model: nn.Sequential, cuts: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    bounds = [0, *cuts, len(model)]
    for start, stop in itertools.pairwise(bounds):
        x = model[start:stop](x)
    return x


def _output_and_grads(model: nn.Sequential, cuts: tuple[int, ...], x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(seed)  # drop-path masks
    out = _run_pieces(model, cuts, x)
    out.square().mean().backward()
    return [out.detach(), *(p.grad for p in model.parameters())]


# ------------------------------------------------------------------------------------------------ parameter counts
@pytest.mark.parametrize(
    ("L", "D", "published"),
    [(18, 208, "81.5M"), (18, 256, "122.5M"), (18, 416, "319.0M"), (18, 544, "542.7M"), (36, 544, "1.06B"),
     (72, 512, "1.84B")],
)  # fmt: skip
def test_parameter_counts_match_gpipe_table_1(L: int, D: int, published: str) -> None:
    with torch.device("meta"):
        model = amoebanet_d(num_classes=1000, num_layers=L, num_filters=D)
    n = sum(p.numel() for p in model.parameters())
    shown = f"{n / 1e6:.1f}M" if published.endswith("M") else f"{n / 1e9:.2f}B"
    assert shown == published, f"AmoebaNet-D ({L}, {D}): {n:,} parameters"


def test_imagenet_side_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = amoebanet_d(num_classes=1000, num_layers=6, num_filters=16)
        out = model(torch.empty(2, 3, 224, 224))
    assert out.shape == (2, 1000)


# ------------------------------------------------------------------------------------------------------ structure
def test_named_flat_sequential_with_classifier_last() -> None:
    model = amoebanet_d(num_classes=7, num_layers=6, num_filters=8)
    names = list(model._modules)
    stem = ["stem", "stem_reduce1", "stem_reduce2"]
    assert names == [*stem, "cell0", "cell1", "reduce1", "cell2", "cell3", "reduce2", "cell4", "cell5", "classifier"]
    assert isinstance(model.classifier.fc, nn.Linear) and model.classifier.fc.out_features == 7
    assert model[-1] is model.classifier


@pytest.mark.parametrize("side", [32, 64])
def test_every_boundary_carries_a_tensor_or_a_batch_first_pair(side: int) -> None:
    model = _tiny(num_layers=6, num_filters=16).eval()
    N = 3
    x = _images(N, side)
    with torch.no_grad():
        for i, layer in enumerate(model):
            current = x if isinstance(x, torch.Tensor) else x[0]
            x = layer(x)
            last = i == len(model) - 1
            leaves = [x] if isinstance(x, torch.Tensor) else list(x)
            if 0 < i < len(model) - 1:  # every cell hands on (its output, its current input) as the next "previous"
                assert isinstance(x, tuple) and len(x) == 2 and x[1] is current, (i, type(x))
            assert all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == N for t in leaves), i
            assert last or all(t.dim() == 4 for t in leaves), i
    assert x.shape == (N, 5)
    assert torch.isfinite(x).all()


# ------------------------------------------------------------------------------------------ cutting changes nothing
@pytest.mark.parametrize("mode", ["eval", "train", "train+drop_path"])
def test_cut_into_pieces_is_the_same_model(mode: str) -> None:
    model = _tiny(num_layers=3, num_filters=8, drop_path=0.5 if mode == "train+drop_path" else 0.0)
    model.train(mode != "eval")
    x = _images(4, 32)
    whole = _output_and_grads(model, (), x, seed=7)
    assert all(g is not None and torch.isfinite(g).all() for g in whole)
    assert any(g.abs().sum() > 0 for g in whole[1:])
    for cuts in CUTS:
        pieces = _output_and_grads(model, cuts, x, seed=7)
        for a, b in zip(pieces, whole):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, cuts=cuts: f"cut at {cuts}: {m}")


def test_drop_path_is_off_by_default_and_only_in_training() -> None:
    x = _images(4, 32)
    plain, dropping = _tiny(seed=3), _tiny(seed=3, drop_path=0.5)
    assert plain.state_dict().keys() == dropping.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(dropping.eval()(x), plain.eval()(x), rtol=0, atol=0)
        plain.train(), dropping.train()
        torch.manual_seed(0)
        a, b = plain(x), dropping(x)
        torch.manual_seed(1)
        assert torch.equal(plain(x), a)  # no randomness without drop-path
        assert not torch.allclose(dropping(x), b)
    rates = [c.drop_path for c in dropping if hasattr(c, "drop_path")]
    assert rates == sorted(rates) and rates[-1] == 0.5 and rates[0] > 0  # deeper cells drop more


# ------------------------------------------------------------------------------------------------ transfer learning
def test_replace_classifier_keeps_the_rest() -> None:
    model = _tiny(num_classes=5)
    before = copy.deepcopy(model.state_dict())
    old_fc = model.classifier.fc
    assert replace_classifier(model, 11) is model
    assert list(model._modules)[-1] == "classifier"
    assert model.classifier.fc is not old_fc and model.classifier.fc.out_features == 11
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        if not name.startswith("classifier."):
            assert torch.equal(after[name], value), name
    assert after["classifier.fc.weight"].shape == (11, old_fc.in_features)
    assert model.eval()(_images(2, 32)).shape == (2, 11)


def test_replace_classifier_on_the_meta_device_and_bad_input() -> None:
    with torch.device("meta"):
        model = amoebanet_d(num_classes=1000, num_layers=3, num_filters=16)
    replace_classifier(model, 10)
    assert model.classifier.fc.weight.device.type == "meta" and model.classifier.fc.out_features == 10
    with pytest.raises(TypeError, match="amoebanet_d"):
        replace_classifier(nn.Sequential(nn.Linear(2, 2)), 3)
    with pytest.raises(ValueError, match="num_classes"):
        replace_classifier(model, 0)


# -------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"num_layers": 4}, "multiple of 3"), ({"num_filters": 10}, "multiple of 4"), ({"num_filters": 4}, "at least 8"),
     ({"drop_path": 1.0}, r"\[0, 1\)"), ({"num_classes": 0}, "num_classes")],
)  # fmt: skip
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        amoebanet_d(**{**TINY, **kwargs})


def test_image_side_must_be_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        _tiny()(_images(2, 48))


# ------------------------------------------------------------------------------------------- in the real pipeline
def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def pipeline_worker(rank: int, world_size: int) -> dict[str, float]:
    """K=2, M=2: eval output, then one training step's output and gradients, against the model run per micro-batch."""
    model = _tiny(num_layers=3, num_filters=8)
    ref = copy.deepcopy(model)
    stage = GPipeStage(model, chunks=2, balance=[4, 5], output="all")
    errs: dict[str, float] = {}
    x = _images(6, 32, seed=1)
    stage.eval(), ref.eval()
    with torch.no_grad():
        errs["eval"] = _rel_err(stage(x), ref(x))
    stage.train(), ref.train()
    # Deferred BatchNorm normalizes each micro-batch on its own, as running the plain model per micro-batch does.
    ref_out = torch.cat([ref(mb) for mb in x.split(micro_batch_sizes(len(x), 2))])
    target = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(2))
    F.mse_loss(ref_out, target).backward()
    out = stage(x)
    F.mse_loss(out, target).backward()
    stage.backward()
    errs["out"] = _rel_err(out.detach(), ref_out.detach())
    ref_params = dict(ref.named_parameters())
    named = list(stage.named_parameters())
    errs["grad"] = max(_rel_err(p.grad, ref_params[n].grad) for n, p in named)
    errs["params"] = float(len(named))
    return errs


@pytest.mark.timeout(60)
def test_two_stage_pipeline_matches_the_plain_model() -> None:
    per_rank = run_distributed(pipeline_worker, 2, timeout=50)
    assert sum(r.pop("params") for r in per_rank) == len(list(_tiny().parameters()))
    for rank, errs in enumerate(per_rank):
        assert all(v <= 1e-5 for v in errs.values()), (rank, errs)
