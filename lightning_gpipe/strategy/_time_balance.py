"""balance="time" for the strategy: one micro-batch of the backbone's input, taken from ``example_input_array``."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from lightning_gpipe.pipe.microbatch import split
from lightning_gpipe.pipe.partition import costs_by_time, solve

NO_EXAMPLE = (
    "GPipeStrategy(balance='time') times each backbone layer on one micro-batch, which it takes from the "
    "LightningModule's example_input_array: set self.example_input_array to an input of forward() with a "
    "mini-batch's worth of samples, or use balance='parameters' or explicit layer counts"
)


class _Reached(Exception):
    """Raised by the hook on the backbone: forward() has produced the backbone's input, the rest is not needed."""


def backbone_input(module: nn.Module, backbone: nn.Module, example: Any) -> Any:
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
            f"GPipeStrategy(balance='time'): {type(module).__name__}.forward(example_input_array) never called the "
            "backbone; make forward() run it, or use balance='parameters' or explicit layer counts"
        )
    return captured[0]


def time_balance(
    module: nn.Module, backbone: nn.Sequential, K: int, chunks: int, device: torch.device, batch_dim: int = 0
) -> list[int]:
    """K layer counts from each backbone layer's forward + backward time on the first of M micro-batches."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise ValueError(NO_EXAMPLE)
    micro_batch = split(backbone_input(module, backbone, example), chunks, batch_dim=batch_dim)[0]
    return solve(costs_by_time(backbone, micro_batch, device=device), K)


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def agreed_time_balance(
    module: nn.Module,
    backbone: nn.Sequential,
    K: int,
    chunks: int,
    device: torch.device,
    *,
    on_meta: bool,
    rank: int,
    batch_dim: int = 0,
    broadcast: Callable[[Any], Any],
) -> list[int]:
    """:func:`time_balance` on global rank 0 only, broadcast to every rank (timings differ per process; every
    replica of a stage must hold the same layers); an error there is raised on every rank."""
    if on_meta:
        raise ValueError(
            "GPipeStrategy(balance='time') profiles the layers, but the model is on the meta device "
            "(configure_model): use balance='parameters' or explicit layer counts"
        )
    if getattr(module, "example_input_array", None) is None:
        raise ValueError(NO_EXAMPLE)
    result: list[Any] = [None, None]
    if rank == 0:
        try:
            result[0] = time_balance(module, backbone, K, chunks, device, batch_dim)
        except Exception as e:  # any error in the user's forward: the other ranks wait in the broadcast below
            result[1] = e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")
    result = broadcast(result)
    if result[1] is not None:
        raise result[1]
    return result[0]
