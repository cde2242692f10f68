"""What GPipeStrategy shows of its split: a rank-zero table at setup, the whole model in Lightning's summary, and the
compiled layers' graphs at the end of fit."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary, get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_gpipe.pipe.schedule.registry import Placement, chunk_of, rank_of
from lightning_gpipe.pipe.skips import skip_layers
from lightning_gpipe.strategy._balance import MEASURES, UNITS, Plan
from lightning_gpipe.strategy._lightning_internals import logger, summarize_with

Table = list[tuple[str, list[str]]]


@dataclass(frozen=True)
class WholeModel:
    """What the summary and the table need of the whole model, read before the stage drops other stages' layers."""

    path: str  # the backbone's attribute path
    backbone_type: str
    layer_names: list[str]
    layer_parameters: list[dict[int, int]]  # per layer: id → elements of each of its parameters
    total: int  # the whole LightningModule's parameters, each shared one once
    trainable: int
    # The backbone's and its ancestors' parameters by qualified name: the summary rows the split would shrink.
    by_module: dict[str, int]
    skips: dict[str, tuple[int, int]]  # declared long skips: name → (the layer that stashes it, the one that pops it)

    @classmethod
    def read(cls, module: nn.Module, path: str, backbone: nn.Sequential) -> WholeModel:
        """From ``module``, real or on the meta device."""
        return cls(
            path,
            type(backbone).__name__,
            list(backbone._modules),
            [{id(p): p.numel() for p in layer.parameters()} for layer in backbone],
            _unique_numel(module.parameters()),
            _unique_numel(p for p in module.parameters() if p.requires_grad),
            {name: _unique_numel(module.get_submodule(name).parameters()) for name in _ancestors(path)},
            skip_layers(backbone),
        )


@dataclass(frozen=True)
class PartitionReport:
    """The split: which layers each of the stages holds, their parameters and cost; with virtual stages the stages
    are the vK virtual stages, rank k holding stages k, k + K, … (in a V, ``placement="v"``: k and 2K − 1 − k)."""

    whole: WholeModel
    plan: Plan
    counts: list[int]  # layers per stage
    costs: list[float] | None  # per layer, by plan.kind; None where they could not be had
    ranks: int | None = None  # K, the pipeline's ranks (None: one stage each)
    placement: Placement = "loop"

    @property
    def virtual_stages(self) -> int:
        return len(self.counts) // self.K_ranks

    def holder(self, s: int) -> int:
        """The pipeline rank that holds stage ``s``."""
        return rank_of(s, self.K_ranks, self.placement)

    @property
    def path(self) -> str:
        return self.whole.path

    @property
    def stage_parameters(self) -> list[int]:
        """Each stage's parameters, a weight tied within the stage once (tied across stages: on each)."""
        per_layer = self.whole.layer_parameters
        return [sum({k: v for layer in per_layer[a:b] for k, v in layer.items()}.values()) for a, b in self._ranges()]

    @property
    def stage_costs(self) -> list[float] | None:
        return [float(sum(self.costs[a:b])) for a, b in self._ranges()] if self.costs is not None else None

    def _ranges(self) -> list[tuple[int, int]]:
        return list(itertools.pairwise(itertools.accumulate(self.counts, initial=0)))

    @property
    def K(self) -> int:
        """The stages: K, or vK with interleaving."""
        return len(self.counts)

    @property
    def K_ranks(self) -> int:
        """K, the pipeline's ranks."""
        return self.ranks or len(self.counts)

    def layer_range(self, k: int) -> str:
        a = sum(self.counts[:k])
        b = a + self.counts[k] - 1
        names = self.whole.layer_names
        return f"{a} ({names[a]})" if a == b else f"{a}–{b} ({names[a]} … {names[b]})"

    @property
    def weighed_costs(self) -> list[float] | None:
        """Each stage's cost as the split weighed it: the last stage's × ``plan.last_stage_scale``."""
        costs = self.stage_costs
        return [*costs[:-1], costs[-1] * self.plan.last_stage_scale] if costs else costs

    @property
    def _weighed(self) -> bool:
        return self.plan.last_stage_scale != 1.0

    def header(self) -> str:
        note = f" ({self.plan.note})" if self.plan.note else ""
        costs = self.weighed_costs
        worst = ""
        if costs and sum(costs):
            worst = f"; the costliest stage is {max(costs) * len(costs) / sum(costs):.2f}× the mean"
            if self._weighed:  # the Cost column is what was measured; the Share column and this, as weighed
                worst += " of the weighed costs (the Share column; the Cost column is as measured)"
        v = self.virtual_stages
        held = f"k and {2 * self.K_ranks - 1} − k" if self.placement == "v" else f"k, k + {self.K_ranks}, …"
        interleaved = f" (virtual_stages={v}: rank k holds stages {held})" if v > 1 else ""
        split = f"split into {self.K} stages{interleaved} by {MEASURES[self.plan.kind]}"
        return f"GPipeStrategy: self.{self.path} {split}{note}{worst}"

    def table(self, devices: Callable[[int], str] | None = None) -> Table:
        """Columns stage → layers, parameters, cost (and its share), and the ranks (devices) that hold it."""
        costs, weighed = self.stage_costs, self.weighed_costs
        total = sum(weighed) if weighed else 0.0
        columns: Table = [("Stage", [str(k) for k in range(self.K)])]
        if self.virtual_stages > 1:
            chunk = [chunk_of(k, self.K_ranks, self.placement) for k in range(self.K)]
            columns.append(("Chunk", [f"{self.holder(k)}{chr(ord('a') + chunk[k])}" for k in range(self.K)]))
        columns += [
            ("Layers", [self.layer_range(k) for k in range(self.K)]),
            ("Params", [get_human_readable_count(n).strip() for n in self.stage_parameters]),
        ]
        if costs is not None:
            unit = UNITS[self.plan.kind]
            columns.append(("Cost", [_cost(c, unit) for c in costs]))
            assert weighed is not None
            share = f"Share (last × {self.plan.last_stage_scale:g})" if self._weighed else "Share"
            columns.append((share, [f"{100 * c / total:.1f}%" if total else "-" for c in weighed]))
        if skips := self.stage_skips():
            columns.append(("Long skips", skips))
        if devices is not None:
            columns.append(("Ranks", [devices(self.holder(k)) for k in range(self.K)]))
        return columns

    def stage_skips(self) -> list[str]:
        """Per stage, the declared skips it sends straight to a later stage (→) and receives (←); [] when none
        crosses stages."""
        stage_of = [k for k, count in enumerate(self.counts) for _ in range(count)]
        out: list[list[str]] = [[] for _ in self.counts]
        for s, p in sorted({(stage_of[i], stage_of[j]) for i, j in self.whole.skips.values()}):
            if s != p:
                names = ", ".join(n for n, (i, j) in self.whole.skips.items() if (stage_of[i], stage_of[j]) == (s, p))
                out[s].append(f"{names} → {p}")
                out[p].append(f"{names} ← {s}")
        return ["; ".join(entries) for entries in out] if any(out) else []

    def log(self, devices: Callable[[int], str] | None = None) -> None:
        logger.info(f"{self.header()}\n{format_table(self.table(devices))}")


def format_table(columns: Table) -> str:
    """Columns as Lightning's model summary draws them: a header row, a rule, one row per entry."""
    widths = [max(len(name), *(len(v) for v in values)) for name, values in columns]
    rows = [" | ".join(name.ljust(w) for (name, _), w in zip(columns, widths))]
    rows.append("-" * len(rows[0]))
    for i in range(len(columns[0][1])):
        rows.append(" | ".join(values[i].ljust(w) for (_, values), w in zip(columns, widths)))
    return "\n".join(rows)


def stage_ranks(ranks: Sequence[Sequence[int]], devices: list[Any], per_node: int, nodes: int) -> Callable[[int], str]:
    """Stage k's global ranks (``ranks[k]``), each with its device (Lightning gives rank r ``devices[r % per_node]``
    on node ``r // per_node``)."""

    def device(r: int) -> str:
        where = str(devices[r % per_node]) if devices else "?"
        return f"node {r // per_node} {where}" if nodes > 1 else where

    return lambda k: ", ".join(f"{r} ({device(r)})" for r in ranks[k])


def show_partition(report: PartitionReport, trainer: Any, strategy: Any, log: bool) -> None:
    """The table once on global rank 0 (``log``: the split was just made), and the summary on every setup."""
    if log and strategy.global_rank == 0:
        devices = list(strategy.parallel_devices or [])
        per_node = max(1, strategy.num_processes)
        report.log(stage_ranks(strategy._mesh.stage_ranks, devices, per_node, strategy.num_nodes))
    summarize_with(trainer, lambda module, depth: PipelineSummary(module, report, depth))


def show_compilations(graphs: dict[str, int], header_group: dist.ProcessGroup | None) -> None:
    """Collective over the pipeline's ranks: global rank 0 logs how many graphs dynamo compiled for the compiled
    layers of all K stages (``graphs``: this stage's, ``GPipeStage.compilations``); nothing without any."""
    stages: list[dict[str, int]] = [graphs]
    if header_group is not None:
        stages = [{} for _ in range(dist.get_world_size(header_group))]
        dist.all_gather_object(stages, graphs, group=header_group)
    counts = {name: n for stage in stages for name, n in stage.items()}
    if not counts:
        return
    most = max(counts, key=lambda name: counts[name])
    # A layer of 0 ran the graph another layer of its class compiled (or ran eagerly: the guide's "Compiled layers").
    rank_zero_info(
        f"GPipeStrategy: {len(counts)} compiled layers in {len(stages)} stages, {sum(counts.values())} graphs "
        f"compiled (per stage {[sum(s.values()) for s in stages]}; most in one layer: {most}, {counts[most]}; "
        f"none: {sum(n == 0 for n in counts.values())} layers)"
    )


@dataclass
class _Row:
    """Duck-typed stand-in for Lightning's LayerSummary: a row of the summary without a hooked module."""

    layer_type: str
    num_parameters: int
    training: bool
    in_size: str = "?"
    out_size: str = "?"


class PipelineSummary(ModelSummary):
    """Lightning's model summary of the whole pipelined model, whichever stage summarizes it.

    The backbone's row counts all K stages, one row per stage follows it, and the totals are the whole model's. No
    example forward: it would have to run through every stage at fit start to give sizes the stages cannot see.
    """

    def __init__(self, model: Any, report: PartitionReport, max_depth: int = 1) -> None:
        self._report = report
        super().__init__(model, max_depth)
        rows: dict[str, Any] = {}
        path = report.path
        for name, layer in self._layer_summary.items():
            if name.startswith(path + "."):  # this stage's own layers: the stage rows below stand for them
                continue
            whole = report.whole.by_module.get(name, layer.num_parameters)
            rows[name] = layer if whole == layer.num_parameters else _Row(layer.layer_type, whole, layer.training)
            if name == path:
                rows[name] = _Row(f"{report.whole.backbone_type} in {report.K} stages", whole, layer.training)
                for k in range(report.K):
                    row = _Row(f"layers {report.layer_range(k)}", report.stage_parameters[k], layer.training)
                    rows[f"{path} · stage {k}"] = row
        self._layer_summary = rows

    def _forward_example_input(self) -> None:
        pass

    @property
    def total_parameters(self) -> int:
        return self._report.whole.total

    @property
    def trainable_parameters(self) -> int:
        return self._report.whole.trainable

    @property
    def total_layer_params(self) -> int:
        return sum(n for name, n in zip(self.layer_names, self.param_nums) if " · stage " not in name)

    def _get_summary_data(self) -> Table:
        # The FLOPs column needs the example forward; the stages' rows show each one's share of the parameters.
        hidden = ("FLOPs", "In sizes", "Out sizes")
        return [(name, values) for name, values in super()._get_summary_data() if name not in hidden]


def _cost(c: float, unit: str) -> str:
    """``"2.9 M FLOPs"``, ``"653 K parameters"``, ``"1.27 ms"``: counts as Lightning's summary writes them."""
    if unit == "s":
        return f"{c * 1e3:.3g} ms"
    if c != int(c):  # a user's cost function may give fractions
        return f"{c:.4g} {unit}"
    return f"{get_human_readable_count(int(c)).strip()} {unit}"


def _ancestors(path: str) -> list[str]:
    """``"a.b.c"`` → ``["a", "a.b", "a.b.c"]``."""
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _unique_numel(params: Any) -> int:
    seen: dict[int, int] = {}
    for p in params:
        seen.setdefault(id(p), p.numel())
    return sum(seen.values())
