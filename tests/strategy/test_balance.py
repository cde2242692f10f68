"""GPipeStrategy(balance="time" / "flops" / "auto"): costs from one micro-batch of example_input_array, one split."""

from __future__ import annotations

import logging
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_gpipe.pipe.split.balance import costs_by_time, solve
from lightning_gpipe.strategy._balance import (
    Plan,
    backbone_input,
    layer_costs,
    no_example,
    plan_balance,
)
from tests.helpers.balance_models import BATCH, LR, STEPS, D, Uneven, dataset, uneven_backbone
from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.models import Busy


class SlowElsewhere(nn.Module):
    """Identity, but slow on every rank except 0: a rank that timed the layers itself would split differently."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() != 0:
            time.sleep(0.02)
        return x


class Net(nn.Module):
    """The Busy layer (about 100 Linears' worth) is second: as rank 0 times them, the exact split at K=2 is [2, 4]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.prefix = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Dropout(0.5))
        self.backbone = nn.Sequential(nn.Linear(D, D), Busy(), *[nn.Linear(D, D) for _ in range(3)], SlowElsewhere())
        self.backbone[1].w.requires_grad_(False)  # its 100th power would blow up under SGD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(self.prefix(x))


class Timed(pl.LightningModule):
    def __init__(self, example: bool = True) -> None:
        super().__init__()
        net = Net()
        self.prefix, self.backbone = net.prefix, net.backbone
        self.prefix[2].p = 0.0  # the reference below has no dropout to replay
        if example:
            self.example_input_array = torch.randn(BATCH, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(self.prefix(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def reference(dp: int) -> dict[str, torch.Tensor]:
    net = Net()
    net.prefix[2].p = 0.0
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x_all, y_all = dataset().tensors
    shards = [torch.tensor(list(DistributedSampler(dataset(), num_replicas=dp, rank=d, seed=0))) for d in range(dp)]
    for step in range(STEPS):
        opt.zero_grad()
        for shard in shards:  # BatchNorm: each replica normalizes its own batch, as DDP without sync would
            idx = shard[step * BATCH : (step + 1) * BATCH]
            (F.mse_loss(net(x_all[idx]), y_all[idx]) / dp).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def timed_fit_worker(rank: int, world_size: int) -> dict[str, object]:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    module = Timed()
    strategy = GPipeStrategy(chunks=4, pipeline_parallel_size=2, balance="time")
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    expected = reference(world_size // 2)
    err = max(((p - expected[n]).abs().max() / expected[n].abs().max()).item() for n, p in module.named_parameters())
    return {"balance": strategy.stage.balance, "err": err}


@pytest.mark.timeout(200)
def test_time_balance_splits_alike_on_every_rank_and_trains_exactly() -> None:
    """pp 2 × dp 2: timings differ per process, but every stage and replica holds the split rank 0 measured."""
    results = run_distributed(timed_fit_worker, 4, timeout=180, lightning=True)
    # Layer 0 costs next to nothing beside Busy: a timing spike on rank 0 may move it either way, but every rank
    # must hold what rank 0 measured.
    assert results[0]["balance"] in ([2, 4], [1, 5]), results
    assert [r["balance"] for r in results] == [results[0]["balance"]] * 4, results
    for r in results:
        assert r["err"] <= 1e-6, results


def bad_example_worker(rank: int, world_size: int, example: torch.Tensor | None) -> str:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    module = Timed()
    module.example_input_array = example
    trainer = quiet_trainer(devices=world_size, strategy=GPipeStrategy(chunks=2, balance="time"), max_steps=1)
    try:
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(120)
def test_time_balance_without_an_example_input_fails_on_every_rank() -> None:
    assert (
        run_distributed(bad_example_worker, 2, None, timeout=100, lightning=True)
        == [f"ValueError: {no_example('time')}"] * 2
    )


@pytest.mark.timeout(120)
def test_an_error_in_forward_on_rank_0_is_raised_on_every_rank() -> None:
    """Only rank 0 runs the example through forward: the others must not wait for it until the timeout."""
    errors = run_distributed(bad_example_worker, 2, torch.randn(BATCH, D + 1), timeout=100, lightning=True)
    assert len(set(errors)) == 1 and "RuntimeError" in errors[0] and "shapes cannot be multiplied" in errors[0], errors


def test_the_backbone_input_is_taken_without_changing_state_streams_or_modes() -> None:
    module = Timed()
    module.prefix[2].p = 0.5
    module.prefix[1].eval()  # a mode of its own, which must survive
    buffers = {k: v.clone() for k, v in module.state_dict().items() if "running" in k or "num_batches" in k}
    state = torch.get_rng_state()
    x = backbone_input(module, module.backbone, module.example_input_array)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in buffers.items())
    assert module.training and module.prefix[2].training and not module.prefix[1].training
    assert x.shape == (BATCH, D)
    with torch.no_grad():  # the input the backbone sees in eval mode
        module.eval()
        assert torch.equal(x, module.prefix(module.example_input_array))


def test_time_balance_isolates_the_costly_layer_and_profiles_one_micro_batch() -> None:
    module = Timed()
    seen: list[int] = []
    module.backbone[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    costs = layer_costs(module, module.backbone, "time", 4, torch.device("cpu"))
    # Busy, ~100x a Linear(8, 8), is the costliest; how the tiny layers around it compare is up to the machine's
    # timing noise (a fresh-clone CI once saw Busy under 3x the rest), so the split is left to test_partition.
    assert costs.index(max(costs)) == 1, costs
    assert set(seen) == {BATCH // 4}


def test_forward_that_skips_the_backbone_is_named() -> None:
    module = Timed()
    with pytest.raises(ValueError, match=r"Timed.forward\(example_input_array\) never called the backbone"):
        backbone_input(module, nn.Sequential(nn.Linear(D, D)), module.example_input_array)


def test_costs_by_time_on_a_device_puts_every_layer_back() -> None:
    module = Net()
    params = {k: v.detach().clone() for k, v in module.backbone.named_parameters()}
    costs = costs_by_time(module.backbone, torch.randn(2, D), device=torch.device("cpu"), repeat=3)
    assert len(costs) == 6 and costs[1] > max(costs[2:5])  # medians of 3: one preemption cannot swap them
    assert all(p.device.type == "cpu" and torch.equal(p, params[k]) for k, p in module.backbone.named_parameters())
    assert all(p.grad is None for p in module.backbone.parameters())


@pytest.mark.timeout(60)
def test_time_balance_splits_a_time_major_input_along_its_batch_dimension() -> None:
    """With batch_dim=1 the profiled micro-batch holds N/M samples in dim 1 and the whole time axis in dim 0."""

    class TimeMajor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
            self.example_input_array = torch.randn(3, BATCH, D)  # (T, N, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

    module = TimeMajor()
    seen: list[tuple[int, ...]] = []
    module.backbone[0].register_forward_pre_hook(lambda _, args: seen.append(tuple(args[0].shape)))
    layer_costs(module, module.backbone, "time", 4, torch.device("cpu"), batch_dim=1)
    assert set(seen) == {(3, BATCH // 4, D)}, seen


def uneven_reference() -> dict[str, torch.Tensor]:
    net = uneven_backbone()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x_all, y_all = dataset().tensors
    order = torch.tensor(list(DistributedSampler(dataset(), num_replicas=1, rank=0, seed=0)))  # as Lightning's
    for step in range(STEPS):
        opt.zero_grad()
        batch = order[step * BATCH : (step + 1) * BATCH]
        F.mse_loss(net(x_all[batch]), y_all[batch]).backward()
        opt.step()
    return {f"backbone.{k}": v.detach().clone() for k, v in net.named_parameters()}


def uneven_fit_worker(rank: int, world_size: int, balance: str, example: bool) -> dict[str, object]:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch.strategies.gpipe").addHandler(handler)
    module = Uneven(example)
    strategy = GPipeStrategy(chunks=4, pipeline_parallel_size=2, balance=balance)
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    expected = uneven_reference()
    err = max(((p - expected[n]).abs().max() / expected[n].abs().max()).item() for n, p in module.named_parameters())
    return {"balance": strategy.stage.balance, "err": err, "log": messages}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("balance", "example", "split", "said"),
    [
        ("flops", True, [5, 2], "by forward FLOPs on one micro-batch of example_input_array;"),
        ("auto", True, [5, 2], "(balance='auto' chose 'flops': the LightningModule has an example_input_array)"),
        ("auto", False, [3, 4], "(balance='auto' chose 'parameters': the LightningModule has no example_input_array"),
    ],
)
def test_flops_and_auto_split_alike_on_every_rank_log_it_and_train_exactly(
    balance: str, example: bool, split: list[int], said: str
) -> None:
    """Either split trains as the plain model does; only rank 0 logs the partition."""
    results = run_distributed(uneven_fit_worker, 2, balance, example, timeout=180, lightning=True)
    assert [r["balance"] for r in results] == [split] * 2, results
    assert all(r["err"] <= 1e-6 for r in results), results
    logged = [m for m in results[0]["log"] if "split into" in m]
    assert len(logged) == 1 and said in logged[0], results[0]["log"]
    rows = [line.split(" | ") for line in logged[0].splitlines()[3:]]  # after the header, the columns, the rule
    a = split[0]
    assert [(r[0].strip(), r[1].strip(), r[-1].strip()) for r in rows] == [
        ("0", f"0–{a - 1} (0 … {a - 1})", "0 (cpu)"),
        ("1", f"{a}–6 ({a} … 6)", "1 (cpu)"),
    ], logged[0]
    assert not [m for m in results[1]["log"] if "split into" in m], results[1]["log"]


def plan(module: nn.Module, balance: object, on_meta: bool = False):  # type: ignore[no-untyped-def]
    return plan_balance(
        module, module.backbone, balance, 2, 4, torch.device("cpu"),  # type: ignore[arg-type]
        on_meta=on_meta, rank=0, batch_dim=0, broadcast=lambda obj: obj,
    )  # fmt: skip


def test_flops_counts_a_model_built_on_the_meta_device_and_time_refuses_it() -> None:
    with torch.device("meta"):
        module = Uneven()
    module.example_input_array = torch.randn(BATCH, D)  # on the CPU, as a user's would be
    assert plan(module, "auto", on_meta=True).balance == [5, 2]
    with pytest.raises(ValueError, match=r"the model is on the meta device \(configure_model\): use balance='flops'"):
        plan(module, "time", on_meta=True)


def test_auto_falls_back_to_parameters_when_counting_fails_and_flops_raises() -> None:
    module = Uneven()
    module.example_input_array = torch.randn(BATCH, D + 1)  # does not fit the first Linear
    with pytest.warns(UserWarning, match=r"balance='auto'\): counting each backbone layer's FLOPs .* failed"):
        chosen = plan(module, "auto")
    assert chosen.balance == "parameters" and "fell back to 'parameters'" in chosen.note
    with pytest.raises(RuntimeError, match=r"balance='flops': layer 0 \(Linear\) failed while its FLOPs were counted"):
        plan(module, "flops")
    module.example_input_array = None
    with pytest.raises(ValueError, match=r"GPipeStrategy\(balance='flops'\) counts each backbone layer's FLOPs"):
        plan(module, "flops")


def test_the_loss_inside_cuts_for_the_schedules_simulated_step() -> None:
    """With the loss inside the pipeline the last stage runs F + B per micro-batch, the others F + R + B: seven equal
    layers split [3, 4] by the simulated step of the schedule, where the loss outside splits them [4, 3]; the
    setup says why. On the benchmarks' Transformer costs the simulated cut differs from the cheapest costliest
    stage's, and is a shorter simulated step."""
    from types import SimpleNamespace

    from lightning_gpipe.pipe.split.virtual_stages import SIMULATION_TOLERANCE, simulated_step, solve_virtual_stages
    from lightning_gpipe.strategy._rank_pipeline import StageOptions, _plan
    from lightning_gpipe.strategy.gpipe import GPipeStrategy
    from tests.helpers.tiny_fit import lightning_module

    module = Uneven()
    module.backbone = nn.Sequential(*[nn.Linear(D, D) for _ in range(7)])
    cpu = torch.device("cpu")

    def plan(inside: bool, schedule: str = "gpipe", M: int = 4) -> Plan:
        options = StageOptions(M, "flops", "except_last", 0, True, "all", inside, schedule, 1)  # type: ignore[arg-type]
        return _plan(module, module.backbone, options, SimpleNamespace(K=2, rank=0), cpu, False, lambda obj: obj)  # type: ignore[arg-type]

    outside, inside = plan(False), plan(True)
    assert (outside.balance, inside.balance) == ([4, 3], [3, 4])
    assert inside.note.endswith("so the last stage's costs count × 0.75; split for the shortest simulated gpipe step")
    assert "simulated" not in outside.note and (outside.last_stage_scale, inside.last_stage_scale) == (1.0, 0.75)
    # A profile of the benchmarks' Transformer (ms per layer): the last stage's costs weighed × 3/4, the cheapest
    # costliest stage is [9, 8], which ran with twice the bubble of [10, 7] (benchmarks/README.md).
    profile = [1.1, 9.0, 10.5, 8.4, 8.7, 8.3, 8.5, 0.3, 1.3, 10.9, 12.6, 10.1, 12.5, 11.7, 10.5, 0.2, 20.0]
    assert solve(profile, 2, 0.75) == [9, 8]
    for schedule in ("gpipe", "1f1b"):  # 7 % and 2.2 % shorter steps simulated
        cut = solve_virtual_stages(profile, 2, 1, 8, "except_last", schedule)
        assert cut == [10, 7], schedule
        step = simulated_step(profile, cut, 2, 1, 8, "except_last", schedule)
        assert step < (1 - SIMULATION_TOLERANCE) * simulated_step(profile, [9, 8], 2, 1, 8, "except_last", schedule)
    # zb-h1's W fills the cool-down, where the heavier last stage waited: the two within the model's tolerance, the
    # cheapest costliest stage's split stays
    assert solve_virtual_stages(profile, 2, 1, 8, "except_last", "zb-h1") == [9, 8]
    # The README's main command by FLOPs (M FLOPs: layers 0–4, dec0, dec1 … project): its two cuts nearest the
    # middle simulate within 0.1 % of each other, and solve's, which ran a third faster, stays
    nmt = [311.0, 211.0, 408.0]
    assert simulated_step(nmt, [2, 1], 2, 1, 4, "except_last", "gpipe") < simulated_step(
        nmt, [1, 2], 2, 1, 4, "except_last", "gpipe"
    )
    assert solve_virtual_stages(nmt, 2, 1, 4, "except_last", "gpipe") == solve(nmt, 2, 0.75) == [1, 2]
    strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=1)
    for hooked, inside_expected in ((True, True), (False, False)):
        strategy._lightning_module = lightning_module(hooked=hooked)
        assert StageOptions.of(strategy).pipeline_loss is inside_expected
    strategy.pipeline_loss = False
    strategy._lightning_module = lightning_module(hooked=True)
    assert StageOptions.of(strategy).pipeline_loss is False


def test_interleaving_splits_for_the_simulated_step_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """With virtual_stages = 2 the measured costs are split by ``solve_virtual_stages`` (each rank's virtual stages
    together), not by the per-chunk optimum; one chunk per rank with the loss inside, for the simulated 1F1B step."""
    from types import SimpleNamespace

    from lightning_gpipe.pipe.split.virtual_stages import solve_virtual_stages
    from lightning_gpipe.strategy import _balance
    from lightning_gpipe.strategy._rank_pipeline import StageOptions, _plan
    from tests.helpers.layer_costs import TRANSFORMER

    module = Uneven()
    module.backbone = nn.Sequential(*[nn.Linear(D, D) for _ in TRANSFORMER])
    monkeypatch.setattr(_balance, "agreed_costs", lambda *args, **kwargs: (list(TRANSFORMER), None))
    cpu = torch.device("cpu")

    def plan(K: int, schedule: str, v: int) -> Plan:
        options = StageOptions(8, "flops", "except_last", 0, True, "all", True, schedule, v)  # type: ignore[arg-type]
        return _plan(module, module.backbone, options, SimpleNamespace(K=K, rank=0), cpu, False, lambda obj: obj)  # type: ignore[arg-type]

    interleaved, one_chunk = plan(2, "interleaved-1f1b", 2), plan(4, "1f1b", 1)
    assert (
        interleaved.balance == solve_virtual_stages(TRANSFORMER, 2, 2, 8, "except_last") != solve(TRANSFORMER, 4, 0.75)
    )
    assert "shortest simulated interleaved-1f1b step (each rank's virtual stages together)" in interleaved.note
    assert one_chunk.balance == solve_virtual_stages(TRANSFORMER, 4, 1, 8, "except_last", "1f1b")
    assert one_chunk.note.endswith("split for the shortest simulated 1f1b step")
    assert (interleaved.last_stage_scale, one_chunk.last_stage_scale) == (1.0, 0.75)  # as the log weighs the costs
