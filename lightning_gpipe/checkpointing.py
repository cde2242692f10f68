"""Checkpoints of a pipelined LightningModule: a torch.distributed.checkpoint folder, or one ordinary file.

Every rank holds its stage's layers under their global names (``backbone.6.weight``) plus the replicated
parameters, so the union of the ranks' state dicts is the plain module's state dict. Optimizer states are flattened
to the same global names (``state.backbone.6.weight.exp_avg``), which keeps the stages' states apart and lets a
checkpoint written with one layout (K stages × D replicas) be read with any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

METADATA = "meta.pt"  # the same name Lightning's own sharded checkpoints use
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def local_state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """This rank's model and optimizer states, under global names."""
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer, options=_FLAT)
    return state


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


def save_sharded(checkpoint: dict[str, Any], path: Path, model: nn.Module, optimizers: list, rank: int) -> None:
    """A DCP folder: tensors written once (keys replicated on several ranks are de-duplicated), the rest in meta.pt."""
    path.mkdir(parents=True, exist_ok=True)
    checkpoint = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    dcp.save(local_state(model, optimizers), checkpoint_id=path)
    if rank == 0:
        torch.save(checkpoint, path / METADATA)


def save_single_file(checkpoint: dict[str, Any], path: Path, model: nn.Module, optimizers: list, rank: int) -> None:
    """One ordinary Lightning checkpoint on rank 0 whose ``state_dict`` has exactly the plain module's keys."""
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _to_cpu(local_state(model, optimizers)))
    if rank != 0:
        return
    merged: dict[str, dict[str, Any]] = {}
    for part in gathered:
        for key, value in (part or {}).items():
            merged.setdefault(key, {}).update(value)
    checkpoint = dict(checkpoint)
    checkpoint["state_dict"] = merged.pop("state_dict")
    checkpoint["optimizer_states"] = [merged[f"optimizer_{i}"] for i in range(len(optimizers))]
    torch.save(checkpoint, path)


def load(path: Path, model: nn.Module, optimizers: list, strict: bool) -> dict[str, Any]:
    """Restore this rank's part from either kind of checkpoint; returns the rest (loops, callbacks, epoch...)."""
    state = local_state(model, optimizers)  # the keys this rank needs, and tensors to load into
    if is_sharded(path):
        dcp.load(state, checkpoint_id=path)
        rest = torch.load(path / METADATA, weights_only=False)
    else:
        full = torch.load(path, map_location="cpu", weights_only=False)
        state["state_dict"] = {k: v for k, v in full["state_dict"].items() if k in state["state_dict"]}
        for i, saved in enumerate(full.get("optimizer_states", [])[: len(optimizers)]):
            state[f"optimizer_{i}"] = {k: v for k, v in saved.items() if k in state[f"optimizer_{i}"]}
        rest = {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")}
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{i}"], options=_FLAT)
    return rest


def load_weights(path: Path, model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy the weights this rank holds from either kind of checkpoint, except keys starting with ``skip``.

    For fine-tuning from another run: the optimizer, loops and callbacks start afresh, and the skipped modules (a
    classifier sized for other classes) keep their new initialization. Returns the keys loaded.
    """
    wanted = {k: v for k, v in get_model_state_dict(model).items() if not k.startswith(skip)}
    if is_sharded(path):
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        shapes = {k.removeprefix("state_dict."): tuple(m.size) for k, m in stored.items() if hasattr(m, "size")}
        full = None
    elif path.is_file():
        full = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        shapes = {k: tuple(v.shape) for k, v in full.items() if isinstance(v, torch.Tensor)}
    else:
        raise FileNotFoundError(f"no checkpoint at {str(path)!r} (a Lightning .ckpt file or a sharded folder)")
    missing = sorted(k for k in wanted if k not in shapes)
    differ = sorted(k for k in wanted if k in shapes and shapes[k] != tuple(wanted[k].shape))
    if missing or differ:
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit this model: {len(missing)} missing keys {missing[:4]}, "
            f"{len(differ)} of other shapes {[(k, shapes[k], tuple(wanted[k].shape)) for k in differ[:4]]}; build the "
            f"model with the checkpoint's architecture (skipped: {list(skip)})"
        )
    if full is None:
        loaded = {"state_dict": {k: v.detach().clone() for k, v in wanted.items()}}
        dcp.load(loaded, checkpoint_id=path)
        state = loaded["state_dict"]
    else:
        state = {k: full[k] for k in wanted}
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    return sorted(state)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
