"""What a user sees of the split: the rank-zero table at setup and Lightning's model summary of the whole model."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_gpipe.strategy._balance import Plan, plan_balance, shown_costs
from lightning_gpipe.strategy._partition_report import PartitionReport, WholeModel, stage_ranks
from tests.helpers.balance_models import BATCH, SPREAD, D, Uneven, dataset
from tests.helpers.launch import quiet_trainer, run_distributed


def report_of(module: nn.Module, balance: object, counts: list[int]) -> PartitionReport:
    plan = plan_balance(
        module, module.backbone, balance, 2, 4, torch.device("cpu"),  # type: ignore[arg-type]
        on_meta=False, rank=0, batch_dim=0, broadcast=lambda obj: obj,
    )  # fmt: skip
    whole = WholeModel.read(module, "backbone", module.backbone)  # type: ignore[arg-type]
    return PartitionReport(whole, plan, counts, shown_costs(plan, module.backbone))  # type: ignore[arg-type]


def rows(report: PartitionReport, ranks: object = None) -> list[list[str]]:
    columns = report.table(ranks)  # type: ignore[arg-type]
    return [[name for name, _ in columns]] + [[values[i] for _, values in columns] for i in range(report.K)]


def test_the_table_names_each_stages_layers_parameters_cost_and_ranks() -> None:
    module = Uneven()
    report = report_of(module, "flops", [5, 2])
    linear, out = 2 * (BATCH // 4) * D * D, (BATCH // 4) * D  # one micro-batch of 2 samples
    first = 4 * (linear + out) + SPREAD * out
    assert first == 1600
    second = sum(report.costs[5:])  # type: ignore[index]
    assert report.header() == (
        "GPipeStrategy: self.backbone split into 2 stages by forward FLOPs on one micro-batch of example_input_array; "
        f"the costliest stage is {2 * max(first, second) / (first + second):.2f}× the mean"
    )
    ranks = stage_ranks([[0, 2], [1, 3]], [torch.device("cpu")] * 2, per_node=2, nodes=2)
    shares = [f"{100 * c / (first + second):.1f}%" for c in (first, second)]
    assert rows(report, ranks) == [
        ["Stage", "Layers", "Params", "Cost", "Share", "Ranks"],
        ["0", "0–4 (0 … 4)", "288", "1.6 K FLOPs", shares[0], "0 (node 0 cpu), 2 (node 1 cpu)"],
        ["1", "5–6 (5 … 6)", "72", "8.7 K FLOPs", shares[1], "1 (node 0 cpu), 3 (node 1 cpu)"],
    ]
    # Explicit counts show the parameter count; a single layer is named alone.
    explicit = report_of(module, [6, 1], [6, 1])
    assert "by the given layer counts (cost shown: parameter count);" in explicit.header()
    assert rows(explicit)[2] == ["1", "6 (6)", "0", "0 parameters", "0.0%"]
    function = report_of(module, lambda i, layer: float(i), [5, 2])
    assert "by the given cost function;" in function.header() and rows(function)[2][3:] == ["11 cost", "52.4%"]
    # A cost function that fails when the log calls it again: the split is still shown, without costs.
    failing = report_of(module, lambda i, layer: 1 / 0, [5, 2])
    assert failing.header().endswith("by the given cost function")
    assert rows(failing) == [["Stage", "Layers", "Params"], ["0", "0–4 (0 … 4)", "288"], ["1", "5–6 (5 … 6)", "72"]]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        embed, head = nn.Embedding(10, D), nn.Linear(D, 10, bias=False)
        head.weight = embed.weight  # one table on the first and the last stage
        self.backbone = nn.Sequential(embed, nn.Linear(D, D), head)
        self.frozen = nn.Linear(D, 1)
        self.frozen.requires_grad_(False)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_tied_weight_counts_once_in_the_total_and_on_each_stage_that_holds_it(device: str) -> None:
    with torch.device(device):
        module = Tied()
    whole = WholeModel.read(module, "backbone", module.backbone)
    assert (whole.total, whole.trainable) == (10 * D + D * D + D + D + 1, 10 * D + D * D + D)
    assert whole.by_module == {"backbone": 10 * D + D * D + D}
    report = PartitionReport(whole, Plan([2, 1], "explicit"), [2, 1], None)
    assert report.stage_parameters == [10 * D + D * D + D, 10 * D]


def summary_worker(rank: int, world_size: int) -> list[str]:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch.callbacks.model_summary").addHandler(handler)
    from lightning.pytorch.callbacks import ModelSummary

    strategy = GPipeStrategy(chunks=4, pipeline_parallel_size=2, balance=[5, 2])
    # Named, since Lightning's default is RichModelSummary (printed, not logged) wherever rich is installed.
    summary = ModelSummary()
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=1, callbacks=[summary])
    trainer.fit(Uneven(), DataLoader(dataset(), batch_size=BATCH))
    return messages


@pytest.mark.timeout(200)
def test_the_model_summary_shows_the_whole_model_and_each_stages_share() -> None:
    """Rank 0 holds stage 0 only, yet the summary counts every parameter: the backbone's row all stages, a row per
    stage after it; no example forward (Uneven has an example_input_array) runs through the pipeline at fit start."""
    logged = run_distributed(summary_worker, 2, timeout=180, lightning=True)
    assert logged[1] == [], logged  # rank 0 prints it
    (summary,) = logged[0]
    table = [[c.strip() for c in line.split("|")] for line in summary.splitlines() if "|" in line]
    assert table == [
        ["", "Name", "Type", "Params", "Mode"],
        ["0", "backbone", "Sequential in 2 stages", "360", "train"],
        ["1", "backbone · stage 0", "layers 0–4 (0 … 4)", "288", "train"],
        ["2", "backbone · stage 1", "layers 5–6 (5 … 6)", "72", "train"],
    ], summary
    plain = sum(p.numel() for p in Uneven().parameters())
    totals = {line.split(maxsplit=1)[1]: line.split()[0] for line in summary.splitlines() if "params" in line}
    assert totals["Total params"] == str(plain) and totals["Trainable params"] == str(plain), totals


def test_the_compiled_layers_graphs_are_shown_at_the_end_of_fit(caplog: pytest.LogCaptureFixture) -> None:
    """One line on rank 0 for all stages (one stage here: no group), nothing when no layer is compiled."""
    import logging

    from lightning_gpipe.strategy._partition_report import show_compilations

    with caplog.at_level(logging.INFO):
        show_compilations({}, None)
        assert not caplog.records
        show_compilations({"0": 1, "1": 0, "2": 2}, None)
    assert caplog.messages == [
        "GPipeStrategy: 3 compiled layers in 1 stages, 3 graphs compiled (per stage [3]; most in one layer: 2, 2; "
        "none: 1 layers)"
    ]
