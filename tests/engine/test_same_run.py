"""The same run as the unpartitioned model on one process, for every K, M and re-materialization mode (GPipe calls
this transparency): the core guarantee, on the engine."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch

from lightning_gpipe.pipe import GPipeStage, micro_batch_sizes
from tests.helpers import models
from tests.helpers.launch import run_distributed
from tests.helpers.parity import (
    BALANCES,
    MICRO,
    MODES,
    TOL,
    check_cases,
    compare_running_stats,
    rel_err,
    run_case,
    target,
)


def parity_worker(rank: int, world_size: int) -> list[tuple[tuple, dict[str, float]]]:
    results = []
    warnings.simplefilter("ignore")  # N < M warns by design; test_microbatch checks the warning itself
    for kind, M, mode in itertools.product(models.MODELS, MICRO, MODES):
        balance: list[int] | str = "parameters" if (kind == "mlp" and mode == "never") else BALANCES[world_size]
        output = "last" if kind == "ids" else "all"
        pre = kind == "mlp"
        case = (kind, M, mode, str(balance), output, pre)
        results.append((case, run_case(kind, M, mode, balance, output, pre)))
    return results


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.timeout(400)
def test_pipeline_equals_plain_model(K: int) -> None:
    """K stages, M ∈ {1, 2, 4, 8}, every re-materialization mode, uneven and too-small batches, changing shapes."""
    checked = check_cases(run_distributed(parity_worker, K, timeout=380))
    # Every parameter of every model, at every step of every case, was compared on exactly one stage.
    params = sum(len(list(make().parameters())) for make in models.MODELS.values())
    assert checked == params * len(MICRO) * len(MODES) * 3


def dropout_run(mode: str, balance: list[int], seed: int = 7) -> dict[str, torch.Tensor]:
    """One training step of an MLP with dropout 0.5: this stage's gradients and the output (every stage gets it)."""
    torch.manual_seed(0)
    stage = GPipeStage(models.mlp(dropout=0.5), chunks=4, balance=balance, checkpoint=mode, output="all")
    torch.manual_seed(seed)
    out = stage(models.make_input("mlp", 10))
    after_phase = torch.get_rng_state()
    models.loss_fn(out, target(out, 0)).backward()
    stage.backward()
    torch.manual_seed(seed)
    # The pipeline drew nothing from the caller's stream: as without a pipeline, on every stage, whatever K.
    assert torch.equal(after_phase, torch.get_rng_state())
    return {"out": out.detach(), **{n: p.grad.clone() for n, p in stage.named_parameters()}}


def dropout_worker(rank: int, world_size: int, mode: str) -> dict[str, list]:
    got = dropout_run(mode, [3, 5] if world_size == 2 else [2, 2, 1, 3])
    return {k: v.tolist() for k, v in got.items()}  # tensors would need this process alive to be received


@pytest.mark.timeout(200)
def test_dropout_masks_do_not_depend_on_the_layout_or_the_recompute() -> None:
    """Every layer draws from a seed of (step, micro-batch, its name): K = 1, 2, 4 and every re-materialization mode
    give the same output and gradients (same seed), so changing K does not change a run with dropout."""
    reference = dropout_run("never", [8])
    assert not torch.equal(reference["out"], dropout_run("never", [8], seed=8)["out"])  # the seed matters
    for mode in MODES:
        for world in (2, 4):
            for rank, lists in enumerate(run_distributed(dropout_worker, world, mode, timeout=100)):
                got = {k: torch.tensor(v) for k, v in lists.items()}
                assert rel_err(got.pop("out"), reference["out"]) <= TOL, (mode, world, rank)
                assert got, "a stage without parameters checked nothing"
                for name, grad in got.items():
                    assert rel_err(grad, reference[name]) <= TOL, (mode, world, rank, name)


def test_consecutive_steps_draw_new_masks() -> None:
    torch.manual_seed(0)
    stage = GPipeStage(models.mlp(dropout=0.5), chunks=2, balance=[8])
    x = models.make_input("mlp", 10)
    with torch.no_grad():
        assert not torch.equal(stage(x), stage(x))


def batchnorm_worker(rank: int, world_size: int, mode: str, M: int) -> dict[str, float]:
    """Deferred BN: micro-batch normalization (gradients as if each micro-batch ran alone), mini-batch statistics."""
    torch.manual_seed(0)
    model = models.with_bn()
    ref = copy.deepcopy(model)
    stage = GPipeStage(model, chunks=M, balance=[2, 4], checkpoint=mode, output="all")
    ref_params = dict(ref.named_parameters())
    errs = {"grad": 0.0, "mean": 0.0, "var": 0.0, "tracked": 0.0, "eval": 0.0}
    full_bn = {i: copy.deepcopy(ref[i]) for i in (1, 4)}  # each sees every step's whole mini-batch at once
    for step, N in enumerate((10, 13)):
        x = models.make_input("mlp", N, seed=step)
        inputs: dict[int, list[torch.Tensor]] = {1: [], 4: []}
        hooks = [ref[i].register_forward_pre_hook(lambda _, a, got=got: got.append(a[0])) for i, got in inputs.items()]
        ref_out = torch.cat([ref(mb) for mb in x.split(micro_batch_sizes(N, M))])
        for h in hooks:
            h.remove()
        for i, bn in full_bn.items():
            bn(torch.cat(inputs[i]))
        tgt = target(ref_out, step)
        ref.zero_grad()
        models.loss_fn(ref_out, tgt).backward()
        stage.zero_grad()
        out = stage(x)
        models.loss_fn(out, tgt).backward()
        stage.backward()
        errs["grad"] = max([errs["grad"]] + [rel_err(p.grad, ref_params[n].grad) for n, p in stage.named_parameters()])
    compare_running_stats(stage, full_bn, errs)
    stage.eval()
    ref.eval()
    for i, bn in full_bn.items():
        ref[i].load_state_dict(bn.state_dict())
    with torch.no_grad():
        x = models.make_input("mlp", 9, seed=5)
        errs["eval"] = rel_err(stage(x), ref(x))
    return errs


@pytest.mark.timeout(200)
def test_deferred_batchnorm_in_the_pipeline() -> None:
    """Running statistics equal nn.BatchNorm on the whole mini-batch (uneven too), updated once per step."""
    for mode, M in (("always", 4), ("except_last", 3), ("never", 2)):
        for rank, errs in enumerate(run_distributed(batchnorm_worker, 2, mode, M, timeout=100)):
            assert all(v <= TOL for v in errs.values()), (mode, M, rank, errs)


class _Ramp(torch.nn.Module):
    """Scales its features by a ramp it makes without a dtype, as a positional encoding does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.linspace(0.1, 1.1, x.shape[-1])


def test_a_recompute_runs_under_the_forwards_default_dtype() -> None:
    """Lightning's "64-true" (and "bf16-true") set the default dtype around training_step only; the backward, which
    recomputes, runs outside it. The recompute makes the forward's tensors, the plain model's gradients to 1e-12."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), _Ramp(), torch.nn.Tanh(), torch.nn.Linear(8, 8)).double()
    stage = GPipeStage(copy.deepcopy(plain), chunks=2, balance=[4], checkpoint="always")
    x = torch.randn(6, 8, dtype=torch.float64)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        plain(x).square().sum().backward()
        out = stage(x)
    finally:
        torch.set_default_dtype(before)
    out.square().sum().backward()
    stage.backward()
    assert torch.get_default_dtype() == before
    for (name, p), ref in zip(stage.named_parameters(), plain.parameters()):
        assert rel_err(p.grad, ref.grad) <= 1e-12, name
