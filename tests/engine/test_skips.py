"""Long skips (``pipe.skips``): the guide's U-Net at K = 3 is the plain model's run, and its skips go straight from
the stage that stashes them to the stage that pops them -- stage 1 carries no skip byte."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gpipe.pipe import GPipeStage, Pop, Stash, pop, resolve_balance, skippable, stash
from lightning_gpipe.pipe.comm.nccl_order import ENV
from lightning_gpipe.pipe.skips import plan_skips
from tests.helpers.guide_unet import images, make, run_step
from tests.helpers.launch import run_distributed

# Stage 0: the encoder's two blocks, both stashes; stage 1: the bottleneck and the first up-convolution, no skip;
# stage 2: both pops and the decoder.
BALANCE = [6, 2, 6]
# (N, H): uneven micro-batches, a new image size every step.
STEPS = [(7, 8), (5, 12), (9, 4)]


def by_hand(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The U-Net written without skips: what Stash and Pop must compute."""
    full = model[0](x)
    half = model[3](model[2](full))
    h = model[6](model[5](half))
    h = model[9](torch.cat([model[7](h), half], 1))
    h = model[12](torch.cat([model[10](h), full], 1))
    return model[13](h)


def test_plain_model_runs_as_written() -> None:
    model = make()
    x, _ = images(2, 8, seed=0)
    torch.testing.assert_close(model(x), by_hand(model, x), rtol=0, atol=0)
    y = model(x)  # a second forward: nothing left over from the first
    torch.testing.assert_close(y, by_hand(model, x), rtol=0, atol=0)


def test_balance_by_flops_and_time_run_the_skips() -> None:
    model = make(torch.float32)
    x, _ = images(2, 8, seed=0, dtype=torch.float32)
    for how in ("flops", "time"):
        assert sum(resolve_balance(model, 3, how, sample=x)) == len(model)


def test_routes() -> None:
    plans = plan_skips(make(), BALANCE)
    assert plans is not None
    assert plans[0].sends == {2: ("full", "half")} and plans[0].receives == {}
    assert plans[1].sends == {} and plans[1].receives == {}
    assert plans[2].receives == {0: ("full", "half")}
    within = plan_skips(make(), [14])
    assert within is not None and within[0].sends == {} and within[0].receives == {}
    assert plan_skips(nn.Sequential(nn.Linear(2, 2)), [1]) is None


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([Stash("a"), nn.Identity()], "skip 'a' is stashed by layer 0 (Stash) and popped by no layer"),
        ([Pop("a"), Stash("a")], "skip 'a' is popped by layer 0 (Pop) before layer 1 (Stash) stashes it"),
        (
            [Stash("a"), Stash("a"), Pop("a")],
            "skip 'a' is stashed by layer 0 (Stash) and layer 1 (Stash) and popped by layer 2 (Pop)",
        ),
    ],
)
def test_declarations_that_cannotrun_step(layers: list[nn.Module], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        GPipeStage(nn.Sequential(*layers), chunks=1)


class Undeclared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash("b", x)
        return x


class PopsB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        skippable(self, pop=["b"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + pop("b")


def test_undeclared_and_missing_skips_are_errors() -> None:
    x = torch.randn(2, 3)
    stage = GPipeStage(nn.Sequential(Stash("a"), Undeclared(), Pop("a", merge="add")), chunks=1)
    with pytest.raises(
        RuntimeError, match=r"layer 1 \(Undeclared\) .* calls stash\('b'\) without declaring it.*skippable"
    ):
        stage(x)
    stage.reset()
    quiet = skippable(nn.Identity(), stash=["b"])  # declared, never called
    stage = GPipeStage(nn.Sequential(quiet, PopsB()), chunks=1)
    with pytest.raises(RuntimeError, match=r"layer 1 \(PopsB\) pops skip 'b', which is not there"):
        stage(x)


# ----------------------------------------------------------------------------------------------- K = 3 parity
def parity_worker(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {"errs": {}, "bytes": {}}
    for path, mode in cases:
        model = make()
        ref = copy.deepcopy(model)
        stage = GPipeStage(model, chunks=3, balance=BALANCE, checkpoint=mode)
        opt, ref_opt = torch.optim.Adam(stage.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
        refs = dict(ref.named_parameters())
        err = 0.0
        for step, (N, H) in enumerate(STEPS):
            x, target = images(N, H, seed=step)
            ref_opt.zero_grad()
            ref_loss = nn.functional.mse_loss(ref(x), target)
            ref_loss.backward()
            opt.zero_grad()
            loss = run_step(stage, x, target, path)
            if loss is not None:
                err = max(err, (loss - ref_loss).abs().item() / ref_loss.item())
            for name, p in stage.named_parameters():
                err = max(err, ((p.grad - refs[name].grad).abs().max() / refs[name].grad.abs().max()).item())
            opt.step()
            ref_opt.step()
        for name, p in stage.named_parameters():
            err = max(err, ((p - refs[name]).abs().max() / refs[name].abs().max()).item())
        with torch.no_grad():  # a forward-only pipeline routes the skips too
            x, _ = images(4, 8, seed=9)
            stage.output_mode = "all"
            err = max(err, (stage(x) - ref(x)).abs().max().item())
        transport = stage._executor.links.transport  # type: ignore[union-attr]
        out["errs"][f"{path}/{mode}"] = err
        out["bytes"][f"{path}/{mode}"] = (dict(transport.bytes_sent), dict(transport.bytes_received))
    return out


def link_bytes() -> dict[str, tuple[int, int]]:
    """From the plain model's shapes: the bytes of stage 1's input and output and of the two skips, summed over the
    training steps and over the evaluation (which sends no gradient back)."""
    model = make()
    sums = {"train": [0, 0, 0], "eval": [0, 0, 0]}
    with torch.no_grad():
        for kind, (N, H) in [*(("train", s) for s in STEPS), ("eval", (4, 8))]:
            x, _ = images(N, H, seed=0)
            full = model[0](x)
            half = model[3](model[2](full))
            a = model[5](half)
            b = model[7](model[6](a))
            for i, t in enumerate((a, b, full.nbytes + half.nbytes)):
                sums[kind][i] += t if isinstance(t, int) else t.nbytes
    return {
        k: (sums["train"][i], sums["train"][i] + sums["eval"][i]) for i, k in enumerate(("input", "output", "skips"))
    }


@pytest.mark.parametrize(
    "cases",
    [
        [("outside", "except_last"), ("1f1b", "always")],
        [("gpipe", "never"), ("zb-h1", "except_last")],
    ],
)
def test_unet_k3_is_the_plainrun_step(cases: list[tuple[str, str]]) -> None:
    results = run_distributed(parity_worker, 3, cases, timeout=180)
    for rank, r in enumerate(results):
        for case, err in r["errs"].items():
            assert err <= 1e-9, (rank, case, err)
    (a_train, a_all), (b_train, b_all), (s_train, s_all) = (b for b in link_bytes().values())
    shared = images(4, 8, seed=0)[0].nbytes  # the evaluation's output (3 channels), shared with every stage
    for case in results[0]["bytes"]:
        (sent0, received0), (sent1, received1), (sent2, received2) = (r["bytes"][case] for r in results)
        # Stage 1 carries the chain only: its input from stage 0 and its output to stage 2 (training and
        # evaluation), their gradients back (training).
        assert received1 == {0: a_all, 2: b_train + shared} and sent1 == {0: a_train, 2: b_all}, (
            case,
            sent1,
            received1,
        )
        # The skips go from stage 0 to stage 2, their gradients back.
        assert sent0 == {1: a_all, 2: s_all} and received0 == {1: a_train, 2: s_train + shared}, (
            case,
            sent0,
            received0,
        )
        assert received2 == {1: b_all, 0: s_all} and sent2 == {1: b_train + shared, 0: s_train + shared}, (case, sent2)


def test_unet_k3_under_nccl_ordering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each skip pair on groups of its own: NCCL's in-order queues (modelled on gloo) neither hang nor mismatch."""
    monkeypatch.setenv(ENV, "1")
    results = run_distributed(parity_worker, 3, [("1f1b", "except_last"), ("outside", "always")], timeout=180)
    for rank, r in enumerate(results):
        for case, err in r["errs"].items():
            assert err <= 1e-9, (rank, case, err)


def interleaved_worker(rank: int, world_size: int) -> dict[str, Any]:
    """K = 2, v = 2, stages [3, 3, 2, 6]: 'full' goes from stage 0 (rank 0) to stage 3 (rank 1), 'half' from stage 1
    to stage 3, two chunks of rank 1: handed over in the process."""
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for mode in ("except_last", "always"):
        model = make()
        ref = copy.deepcopy(model)
        stage = GPipeStage(model, chunks=4, balance=[3, 3, 2, 6], checkpoint=mode, virtual_stages=2)
        refs = dict(ref.named_parameters())
        err = 0.0
        for step, (N, H) in enumerate(STEPS):
            x, target = images(N, H, seed=step)
            ref.zero_grad()
            nn.functional.mse_loss(ref(x), target).backward()
            stage.zero_grad()
            run_step(stage, x, target, "interleaved-1f1b")
            for name, p in stage.named_parameters():
                err = max(err, ((p.grad - refs[name].grad).abs().max() / refs[name].grad.abs().max()).item())
        transport = stage._executor.links.transport  # type: ignore[union-attr]
        out[mode] = (err, dict(transport.bytes_sent))
    return out


def test_interleaved_routes_skips_between_ranks_and_hands_them_between_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    results = run_distributed(interleaved_worker, 2, timeout=180)
    for rank, r in enumerate(results):
        for mode, (err, _) in r.items():
            assert err <= 1e-9, (rank, mode, err)
    # Each way, per step: stage 0's output and stage 2's (or their gradients), stage 1's output (or its gradient) and
    # 'full' (or its gradient), float64, c = 8 channels; 'half' never leaves rank 1.
    per_step = [8 * N * (8 * (H // 2) ** 2 + 16 * (H // 2) ** 2 + 16 * (H // 4) ** 2 + 8 * H**2) for N, H in STEPS]
    for r in results:
        _, sent = r["except_last"]
        assert list(sent.values()) == [sum(per_step)], sent


def failing_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Stage 2 fails right after its input gradient went to stage 1, before the skips' gradients go to stage 0,
    which then waits for them (not for a neighbour): the failure notice must reach it on the skips' tag."""
    import time

    from lightning_gpipe.pipe.comm.links import Links

    warnings.simplefilter("ignore")
    if rank == 2:

        def fail(*args: Any, **kwargs: Any) -> None:
            raise ValueError("boom")

        Links.send_skip_grads = fail  # type: ignore[method-assign]
    stage = GPipeStage(make(), chunks=3, balance=BALANCE, timeout=30)
    x, target = images(6, 8, seed=0)
    start = time.monotonic()
    try:
        run_step(stage, x, target, "1f1b")
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start}
    return {"type": None}


@pytest.mark.timeout(60)
def test_a_failure_reaches_the_stage_waiting_for_a_skip_gradient() -> None:
    results = run_distributed(failing_worker, 3, timeout=50)
    for rank, r in enumerate(results):
        assert r["type"] == "PipelineError" and "stage 2 failed" in r["message"] and "boom" in r["message"], (rank, r)
        assert r["elapsed"] < 10, (rank, r)
