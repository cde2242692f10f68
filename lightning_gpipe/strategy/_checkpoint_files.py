"""Checkpoints of a pipelined LightningModule: a torch.distributed.checkpoint folder, or one ordinary file.

Every rank holds its stage's layers under their global names (``backbone.6.weight``) plus the replicated
parameters, so the union of the ranks' state dicts is the plain module's state dict. In a folder, optimizer states
are flattened to the same global names (``state.backbone.6.weight.exp_avg``), which keeps the stages' states apart
and lets a checkpoint written with one layout (K stages × D replicas) be read with any other. A single file holds
them as a plain Trainer does (see ``optimizer_format``), so either kind of run resumes the other's.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

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
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_gpipe.pipe._torch_internals import optimizer_state_dict
from lightning_gpipe.strategy import _optimizer_format as optimizer_format
from lightning_gpipe.strategy._weight_copies import Owners

METADATA = "meta.pt"  # the same name Lightning's own sharded checkpoints use
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# The checkpoint's entries that hold the module's state: Lightning's WeightAveraging callback puts the average under
# "state_dict" and the live weights under "current_model_state". Each rank holds its part, under global names.
MODEL_STATES = ("state_dict", "current_model_state")


def local_state(model: nn.Module, optimizers: list[torch.optim.Optimizer], to_load: bool = False) -> dict[str, Any]:
    """This rank's model and optimizer states, under global names. ``to_load``: a template to load into, so an
    optimizer that has not stepped yet gets its state tensors made (torch's zero step); saved, it stays as it is."""
    state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    for i, optimizer in enumerate(optimizers):
        if to_load:
            state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer, options=_FLAT)
        else:
            state[f"optimizer_{i}"] = optimizer_state_dict(model, optimizer, _FLAT)
    return state


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


def has_tensors(path: Path) -> bool:
    """A DCP folder whose tensors are complete: torch writes ``.metadata`` once every rank has written its shards."""
    return path.is_dir() and (path / ".metadata").is_file()


def save(
    checkpoint: dict[str, Any],
    path: Path,
    model: nn.Module,
    optimizers: list,
    rank: int,
    sharded: bool,
    order: list[str] | None,
    stage: nn.Module,
    stage_ranks: Sequence[Sequence[int]],
) -> None:
    """A folder (``sharded``) or one file; either raises the same error on every rank when any rank fails, so none
    is left waiting at a collective. ``order``: the plain module's parameter names in order, if known. Every key of
    the module's state is written by its owner (``_weight_copies.Owners``: this rank's ``stage``; ``stage_ranks``,
    each stage's global ranks, replica 0 first)."""
    states = model_states(checkpoint, model)
    owners = Owners(model, stage, stage_ranks, {k for state in states.values() for k in state})
    mine = {name: owners.owned(state) for name, state in states.items()}
    if sharded:
        save_sharded(checkpoint, path, model, optimizers, rank, mine)
    else:
        save_single_file(checkpoint, path, model, optimizers, rank, order, mine)


def model_states(checkpoint: dict[str, Any], model: nn.Module) -> dict[str, dict[str, Any]]:
    """This rank's module states in ``checkpoint`` (as Lightning and its callbacks left them), by entry."""
    states = {name: checkpoint[name] for name in MODEL_STATES if isinstance(checkpoint.get(name), dict)}
    states.setdefault("state_dict", get_model_state_dict(model))
    return states


def save_sharded(
    checkpoint: dict[str, Any], path: Path, model: nn.Module, optimizers: list, rank: int, mine: dict[str, Any]
) -> None:
    """A DCP folder: each module state key written by its owner, optimizer states de-duplicated, the rest in
    meta.pt."""

    def failed(causes: str) -> str:
        return (
            f"could not save the checkpoint folder {str(path)!r} ({causes}); it is incomplete (no {METADATA}) and "
            "cannot be resumed. Save to a directory that is writable, with free space, from every rank's machine "
            "(trainer.save_checkpoint(path), ModelCheckpoint(dirpath=...))"
        )

    def prepare() -> dict[str, Any]:
        path.mkdir(parents=True, exist_ok=True)
        return {**local_state(model, optimizers), **mine}

    agreed(lambda: path.unlink() if rank == 0 and path.is_file() else None, failed)  # an old single-file checkpoint
    checkpoint = {k: v for k, v in checkpoint.items() if k not in (*MODEL_STATES, "optimizer_states")}
    state = agreed(prepare, failed)
    agreed(lambda: dcp.save(state, checkpoint_id=path), failed)  # DCP raises on every rank alike; agreed for safety
    agreed(lambda: torch.save(checkpoint, path / METADATA) if rank == 0 else None, failed)


def save_single_file(
    checkpoint: dict[str, Any],
    path: Path,
    model: nn.Module,
    optimizers: list,
    rank: int,
    order: list[str] | None,
    mine: dict[str, Any],
) -> None:
    """One ordinary Lightning checkpoint on rank 0, as a plain (single-device) Trainer writes it: the plain module's
    keys, and each optimizer's state in torch's position-numbered format when the positions are provable."""

    def failed(causes: str) -> str:
        return (
            f"could not save the checkpoint {str(path)!r} ({causes}); it was not written. Save to a path that is "
            "writable, with free space, from rank 0's machine (trainer.save_checkpoint(path), "
            "ModelCheckpoint(dirpath=...))"
        )

    layouts = _gather([optimizer_format.layout(model, optimizer) for optimizer in optimizers])
    plans = [optimizer_format.positions([lay[i] for lay in layouts], order) for i in range(len(optimizers))]

    def part() -> dict[str, Any]:
        state: dict[str, Any] = dict(mine)
        for i, (optimizer, plan) in enumerate(zip(optimizers, plans)):
            if isinstance(plan, list):
                state[f"optimizer_{i}"] = optimizer_format.named_state(model, optimizer)
            else:
                state[f"optimizer_{i}"] = optimizer_state_dict(model, optimizer, _FLAT)
        return _to_cpu(_whole(state))

    gathered = _gather(agreed(part, failed))

    def write() -> None:
        merged = dict(checkpoint)
        for name in mine:  # each key from its owner alone
            merged[name] = {k: v for part in gathered for k, v in part[name].items()}
        merged["optimizer_states"] = []
        for i, plan in enumerate(plans):
            parts = [part[f"optimizer_{i}"] for part in gathered]
            if isinstance(plan, list):
                merged["optimizer_states"].append(optimizer_format.to_plain(parts, plan))
            else:
                warnings.warn(
                    f"GPipeStrategy: {str(path)!r} stores optimizer {i}'s state by parameter name, as its positions "
                    f"are not provable: {plan}. Pipelined runs resume it, a plain (single-device or DDP) Trainer "
                    "cannot; build the optimizer from self.parameters(), or from filters over "
                    "self.named_parameters(), in the module's order for a checkpoint both can read",
                    stacklevel=2,
                )
                merged["optimizer_states"].append({k: v for part in parts for k, v in part.items()})
        if path.is_dir():
            shutil.rmtree(path)  # an old checkpoint folder of the same name
        path.parent.mkdir(parents=True, exist_ok=True)  # as Lightning's CheckpointIO does
        torch.save(merged, path)

    agreed(write if rank == 0 else lambda: None, failed)


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a checkpoint to resume from, naming the fix; None if it is one."""
    if path.is_file() or is_sharded(path):
        return None
    if not path.exists():
        return f"no checkpoint at {str(path)!r} (a Lightning .ckpt file, or a GPipeStrategy checkpoint folder)"
    if not path.is_dir():
        return f"{str(path)!r} is neither a checkpoint file nor a checkpoint folder"
    weights = (
        f"Its weights are complete (torch's .metadata is there): start a fresh run from them with "
        f"lightning_gpipe.strategy._checkpoint_files.load_weights(Path({str(path)!r}), module)"
        if has_tensors(path)
        else "Its tensors are incomplete too (no .metadata)"
    )
    return (
        f"cannot resume from the folder {str(path)!r}: it has no {METADATA}, the file rank 0 writes last in a "
        f"GPipeStrategy checkpoint folder (loops, callbacks, epoch). Its save was interrupted, or it is not a "
        f"checkpoint; resume from another checkpoint (ckpt_path=...). {weights}"
    )


def load(path: Path, model: nn.Module, optimizers: list, strict: bool, order: list[str] | None) -> dict[str, Any]:
    """Restore this rank's part from either kind of checkpoint; returns the rest (loops, callbacks, epoch...).

    Checks the path, reads it and maps plain optimizer states on every rank alike, so that a bad checkpoint raises
    one error everywhere before any rank restores anything.
    """
    problems = _gather(checkpoint_problem(path))
    seen = [rank for rank, problem in enumerate(problems) if problem]
    if seen:
        where = "" if len(seen) == len(problems) else f" (seen from ranks {seen}: give every rank the same files)"
        raise FileNotFoundError(f"{problems[seen[0]]}{where}")
    layouts = _gather([optimizer_format.layout(model, optimizer) for optimizer in optimizers])
    state = local_state(model, optimizers, to_load=True)  # the keys this rank needs, and tensors to load into
    plain: dict[int, dict[str, Any]] = {}
    if is_sharded(path):
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for name in MODEL_STATES[1:]:  # saved only by some callbacks: restored where saved
            if any(k.startswith(f"{name}.") for k in stored):
                state[name] = {k: v.detach().clone() for k, v in state["state_dict"].items() if torch.is_tensor(v)}
        dcp.load(state, checkpoint_id=path)
        rest = torch.load(path / METADATA, weights_only=False)
        rest.update({name: state[name] for name in MODEL_STATES[1:] if name in state})
    else:
        full = agreed(
            lambda: torch.load(path, map_location="cpu", weights_only=False),
            lambda causes: f"could not read the checkpoint {str(path)!r} ({causes})",
        )
        local = state["state_dict"]
        state["state_dict"] = {k: _shard_like(v, local[k]) for k, v in full["state_dict"].items() if k in local}
        for i, saved in enumerate(full.get("optimizer_states", [])[: len(optimizers)]):
            if optimizer_format.is_plain(saved):
                plain[i] = _plain_optimizer_state(path, saved, [lay[i] for lay in layouts], order, i)
            else:  # written by an earlier version: flattened to global names
                local = state[f"optimizer_{i}"]
                state[f"optimizer_{i}"] = {k: _shard_like(v, local[k]) for k, v in saved.items() if k in local}
        rest = {k: v for k, v in full.items() if k not in (*MODEL_STATES, "optimizer_states")}
        for name in MODEL_STATES[1:]:
            if isinstance(full.get(name), dict):
                rest[name] = {k: v for k, v in full[name].items() if k in state["state_dict"]}
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    rest["state_dict"] = state["state_dict"]  # this rank's part, for the hooks that read it (on_load_checkpoint)
    for i, optimizer in enumerate(optimizers):
        if i in plain:
            optimizer.load_state_dict(plain[i])
            _shard_optimizer_state(optimizer)
        else:
            set_optimizer_state_dict(model, optimizer, state[f"optimizer_{i}"], options=_FLAT)
    return rest


def _plain_optimizer_state(
    path: Path, saved: dict[str, Any], layouts: list, order: list[str] | None, i: int
) -> dict[str, Any]:
    """This rank's part of a position-numbered optimizer state (a plain Trainer's), or one clear error on every rank."""
    groups = optimizer_format.positions(layouts, order)
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        if isinstance(groups, str):
            raise ValueError(groups)
        return optimizer_format.local_plain(saved, groups, layouts, layouts[rank])
    except ValueError as e:
        raise ValueError(
            f"cannot restore optimizer {i} from {str(path)!r}: its state numbers parameters by position, as a plain "
            f"(single-device or DDP) Trainer writes it, and this run cannot match the positions with parameters "
            f"exactly: {e}. Configure the optimizer as the run that saved it did, from self.parameters() or from "
            "filters over self.named_parameters() in the module's order; or start afresh from its weights alone "
            "with lightning_gpipe.strategy._checkpoint_files.load_weights(path, module)"
        ) from None


def load_weights(path: Path, model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """Copy the weights this rank holds from either kind of checkpoint, except keys starting with ``skip``.

    For fine-tuning from another run: the optimizer, loops and callbacks start afresh, and the skipped modules (a
    classifier sized for other classes) keep their new initialization. Returns the keys loaded.
    """
    wanted = {k: v for k, v in get_model_state_dict(model).items() if not k.startswith(skip)}
    mine = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in wanted.items()}
    if has_tensors(path):
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        shapes = {k.removeprefix("state_dict."): tuple(m.size) for k, m in stored.items() if hasattr(m, "size")}
        full = None
    elif path.is_file():
        full = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        shapes = {k: tuple(v.shape) for k, v in full.items() if isinstance(v, torch.Tensor)}
    else:
        raise FileNotFoundError(f"no checkpoint at {str(path)!r} (a Lightning .ckpt file or a sharded folder)")
    missing = sorted(k for k in wanted if k not in shapes)
    differ = sorted(k for k in wanted if k in shapes and shapes[k] != mine[k])
    if missing or differ:
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit this model: {len(missing)} missing keys {missing[:4]}, "
            f"{len(differ)} of other shapes {[(k, shapes[k], mine[k]) for k in differ[:4]]}; build the "
            f"model with the checkpoint's architecture (skipped: {list(skip)})"
        )
    # Every key left is a tensor here and in the checkpoint: a non-tensor (extra state) was missing or differed.
    tensors = {k: v for k, v in wanted.items() if isinstance(v, torch.Tensor)}
    if full is None:
        loaded: dict[str, dict[str, Any]] = {"state_dict": {k: v.detach().clone() for k, v in tensors.items()}}
        dcp.load(loaded, checkpoint_id=path)
        state = loaded["state_dict"]
    else:
        state = {k: _shard_like(full[k], v) for k, v in tensors.items()}  # full: torch.load's Any
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    return sorted(state)


def _whole(obj: Any) -> Any:
    """``obj`` with each sharded tensor (FSDP's DTensor) gathered whole: collective over its replicas, which must
    hold the same structure, in the same order."""
    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: _whole(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_whole(v) for v in obj)
    return obj


def _shard_like(value: Any, local: Any) -> Any:
    """A whole tensor read from a file, as this rank holds it: its shard where ``local`` is sharded (no
    communication: every replica read the whole tensor)."""
    if isinstance(local, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return distribute_tensor(value.to(local.device), local.device_mesh, local.placements, src_data_rank=None)
    return value


def _shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of a whole state: each sharded parameter's moments cut to its shard."""
    for p, state in optimizer.state.items():
        if isinstance(p, DTensor):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    state[key] = _shard_like(value, p)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# Checkpoint steps that fail alike on every rank: one rank's error must not leave the others at a collective.

T = TypeVar("T")


def agreed(action: Callable[[], T], message: Callable[[str], str]) -> T:
    """``action()`` on this rank, then one collective: if it raised on any rank, every rank raises RuntimeError.

    The message is ``message(causes)``, where ``causes`` names each rank that failed and its error. Ranks that did
    not fail raise too, so none goes on to a collective the failed rank never reaches (gloo would report a closed
    connection there, NCCL would wait for its timeout).
    """
    result: Any = None
    error: Exception | None = None
    try:
        result = action()
    except Exception as e:
        error = e
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if dist.is_available() and dist.is_initialized():
        causes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(causes, mine)
    else:
        causes = [mine]
    failed = [(rank, cause) for rank, cause in enumerate(causes) if cause is not None]
    if failed:
        raise RuntimeError(message(_describe(failed, len(causes)))) from error
    return result


def _describe(failed: list[tuple[int, str]], world_size: int) -> str:
    texts = {cause for _, cause in failed}
    if len(failed) == world_size and len(texts) == 1:
        return f"every rank: {texts.pop()}"
    by_text: dict[str, list[int]] = {}
    for rank, cause in failed:
        by_text.setdefault(cause, []).append(rank)
    return "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {text}"
        for text, ranks in by_text.items()
    )
