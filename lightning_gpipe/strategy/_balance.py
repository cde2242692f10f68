"""GPipeStrategy's balance: "auto", "flops", "time" by one micro-batch of example_input_array, or parameters."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_gpipe.pipe.microbatch import batch_size, micro_batch_sizes, split, split_by_sizes
from lightning_gpipe.pipe.split.balance import (
    Balance,
    Solver,
    costs_by_flops,
    costs_by_function,
    costs_by_parameters,
    costs_by_time,
    solve,
)
from lightning_gpipe.strategy._arguments import BALANCE_NAMES, StrategyBalance

MEASURES = {
    "flops": "forward FLOPs on one micro-batch of example_input_array",
    "time": "forward + backward time on one micro-batch of example_input_array, measured on rank 0",
    "parameters": "parameter count",
    "explicit": "the given layer counts (cost shown: parameter count)",
    "function": "the given cost function",
    "planned": "the 'auto' plan (the shortest simulated step of the forward + backward times measured on rank 0)",
}
UNITS = {
    "flops": "FLOPs",
    "time": "s",
    "parameters": "parameters",
    "explicit": "parameters",
    "function": "cost",
    "planned": "s",
}


def no_example(kind: str) -> str:
    what = "times each backbone layer" if kind == "time" else "counts each backbone layer's FLOPs"
    return (
        f"GPipeStrategy(balance={kind!r}) {what} on one micro-batch, which it takes from the "
        "LightningModule's example_input_array: set self.example_input_array to an input of forward() with a "
        "mini-batch's worth of samples, or use balance='parameters' or explicit layer counts"
    )


class _Reached(Exception):
    """Raised by the hook on the backbone: forward() has produced the backbone's input, the rest is not needed."""


def backbone_input(module: nn.Module, backbone: nn.Module, example: Any, kind: str = "time") -> Any:
    """What ``backbone`` receives when ``module`` runs forward on ``example``; no state, stream or mode changes."""
    captured: list[Any] = []

    def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
        captured.append(args[0] if len(args) == 1 else args)
        raise _Reached

    modes = {m: m.training for m in module.modules()}
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    device = first.device if first is not None else torch.device("cpu")
    example = move_data_to_device(example, device)
    cuda = [device.index or 0] if device.type == "cuda" else []
    handle = backbone.register_forward_pre_hook(hook)
    # eval and no_grad: the layers before the backbone (dropout, BatchNorm) must not draw random numbers or update
    # running statistics; only the shapes of what they produce matter here.
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            module.eval()
            try:
                if isinstance(example, (list, tuple)):
                    module(*example)
                elif isinstance(example, dict):
                    module(**example)
                else:
                    module(example)
            except _Reached:
                pass
    finally:
        handle.remove()
        for m, training in modes.items():
            m.training = training
    if not captured:
        raise ValueError(
            f"GPipeStrategy(balance={kind!r}): {type(module).__name__}.forward(example_input_array) never called the "
            "backbone; make forward() run it, or use balance='parameters' or explicit layer counts"
        )
    return captured[0]


def layer_costs(
    module: nn.Module, backbone: nn.Sequential, kind: str, chunks: int, device: torch.device, batch_dim: int = 0
) -> list[float]:
    """Each backbone layer's cost by ``kind`` ("time" or "flops") on the first of M micro-batches of the example."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise ValueError(no_example(kind))
    x = backbone_input(module, backbone, example, kind)
    if kind == "time":
        return costs_by_time(backbone, split(x, chunks, batch_dim=batch_dim)[0], device=device)
    # No warning for an example of fewer than `chunks` samples: FLOPs grow with the samples alike on every layer.
    sizes = micro_batch_sizes(batch_size(x, batch_dim), chunks)
    return costs_by_flops(backbone, split_by_sizes(x, sizes, batch_dim)[0])


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def agreed_costs(
    module: nn.Module,
    backbone: nn.Sequential,
    kind: str,
    chunks: int,
    device: torch.device,
    *,
    rank: int,
    batch_dim: int,
    broadcast: Callable[[Any], Any],
) -> tuple[list[float] | None, BaseException | None]:
    """:func:`layer_costs` on global rank 0 only, broadcast to every rank with the error it raised, if any (timings
    differ per process, and every replica of a stage must hold the same layers)."""
    result: list[Any] = [None, None]
    if rank == 0:
        try:
            result[0] = layer_costs(module, backbone, kind, chunks, device, batch_dim)
        except Exception as e:  # any error in the user's forward: the other ranks wait in the broadcast below
            result[1] = e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")
    costs, error = broadcast(result)
    return costs, error


@dataclass(frozen=True)
class Plan:
    """How the backbone is split: what GPipeStage gets, and what the setup log says about it."""

    balance: Balance  # layer counts, or "parameters" / a cost function for the engine to solve
    kind: str  # a key of MEASURES
    costs: list[float] | None = None  # per layer, when measured here
    note: str = ""  # what balance="auto" chose, and why; how the costs were split
    last_stage_scale: float = 1.0  # how the split weighed the last stage's costs (the log shows them so)


def plan_balance(
    module: nn.Module,
    backbone: nn.Sequential,
    balance: StrategyBalance,
    K: int,
    chunks: int,
    device: torch.device,
    *,
    on_meta: bool,
    rank: int,
    batch_dim: int,
    broadcast: Callable[[Any], Any],
    last_stage_scale: float = 1.0,
    solver: tuple[Solver, str] | None = None,
) -> Plan:
    """The same :class:`Plan` on every rank (collective for "auto", "flops" and "time"); measured costs split by
    ``solver``'s function, ``(costs, K) -> counts`` (``chunks.solve_virtual_stages``: the shortest simulated step), and
    its description goes into the note; else by ``solve`` (the cheapest costliest stage), the last stage's layers
    weighed by ``last_stage_scale``, as the log weighs them."""
    if isinstance(balance, str) and balance in ("auto", "flops", "time"):
        kind = "flops" if balance == "auto" else balance
        if any(isinstance(p, DTensor) for p in backbone.parameters()):  # rank 0 alone would wait for its peers
            if balance == "auto":
                note = "balance='auto' chose 'parameters': the layers are split over tensor-parallel ranks"
                return Plan("parameters", "parameters", note=note)
            raise ValueError(
                f"GPipeStrategy(balance={balance!r}) measures each layer on rank 0 alone, but the backbone's layers "
                "are split over tensor-parallel ranks (DTensor parameters), whose collectives need every rank: use "
                "balance='parameters' or explicit layer counts"
            )
        if balance == "auto" and getattr(module, "example_input_array", None) is None:
            note = "balance='auto' chose 'parameters': the LightningModule has no example_input_array to count FLOPs on"
            return Plan("parameters", "parameters", note=note)
        if kind == "time" and on_meta:
            raise ValueError(
                "GPipeStrategy(balance='time') profiles the layers, but the model is on the meta device "
                "(configure_model): use balance='flops', 'parameters' or explicit layer counts"
            )
        if getattr(module, "example_input_array", None) is None:
            raise ValueError(no_example(kind))
        costs, error = agreed_costs(
            module, backbone, kind, chunks, device, rank=rank, batch_dim=batch_dim, broadcast=broadcast
        )
        if error is None and costs is not None:
            # Solved on every rank from the same costs: an error here (K > L) is raised alike everywhere.
            chose = "balance='auto' chose 'flops': the LightningModule has an example_input_array"
            note = chose if balance == "auto" else ""
            if last_stage_scale != 1.0:
                recompute = "the loss inside the pipeline: only the stages before the last recompute"
                note = f"{note}; {recompute}, so the last stage's costs count × {last_stage_scale:g}".lstrip("; ")
            if solver is not None:
                split, how = solver
                return Plan(split(costs, K), kind, costs, f"{note}; {how}".lstrip("; "), last_stage_scale)
            return Plan(solve(costs, K, last_stage_scale), kind, costs, note, last_stage_scale)
        if balance != "auto":
            raise error if error is not None else RuntimeError("no layer costs were measured")
        if rank == 0:
            warnings.warn(
                f"GPipeStrategy(balance='auto'): counting each backbone layer's FLOPs on example_input_array failed "
                f"({type(error).__name__}: {error}); splitting by parameter count instead. Pass balance='flops' to "
                "raise the error, or 'parameters' or explicit layer counts to silence this",
                stacklevel=2,
            )
        return Plan("parameters", "parameters", note="balance='auto' fell back to 'parameters': counting FLOPs failed")
    if balance == "parameters":
        return Plan("parameters", "parameters")
    if isinstance(balance, str):
        raise ValueError(f"GPipeStrategy(balance={balance!r}): choose one of {list(BALANCE_NAMES)}, or layer counts")
    return Plan(balance, "function" if callable(balance) else "explicit")


def shown_costs(plan: Plan, backbone: nn.Sequential) -> list[float] | None:
    """The per-layer costs the log shows; None when they cannot be had (the log must never fail the setup)."""
    if plan.costs is not None:
        return plan.costs
    try:
        if plan.kind == "function":
            assert callable(plan.balance) and not isinstance(plan.balance, str)
            return costs_by_function(backbone, plan.balance)
        return costs_by_parameters(backbone)
    except Exception:
        return None
