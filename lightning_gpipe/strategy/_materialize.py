"""Meta-device models: materialize only this rank's tensors, each initialized the same whatever the layout.

A tensor gets the initialization ``configure_model()`` gave it (recorded by :func:`record_init`): when that was
exactly its module's ``reset_parameters()`` (every torch.nn layer, and this package's models), by calling
``reset_parameters()`` seeded by the module's name; otherwise (a timm ResNet's fan-out kaiming and zeroed residual
BatchNorms, a torchvision loop in ``__init__``, a ViT's position embedding) by replaying the recorded calls. What
neither can reproduce is reset with ``reset_parameters()`` under a warning that names it, or refused.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable, Mapping
from itertools import chain

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_gpipe.strategy._init_record import InitRecord, Unreplayable, record_init

__all__ = ["InitRecord", "has_meta_tensors", "materialize", "module_seed", "record_init"]

_WAY_OUT = (
    "To keep the model's own initialization, initialize these tensors in configure_model() through torch (tensor "
    "methods, or torch.nn.init's functions called as nn.init.<name>), give their modules a reset_parameters() that "
    "does it, or build them in __init__ instead; or load the intended weights after setup (in on_fit_start, or "
    "with Trainer.fit(ckpt_path=...))."
)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def module_seed(seed: int, name: str) -> int:
    """The seed of one module's initialization: its qualified name's, not its place in a rank's share of the model."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _reset_fn(module: nn.Module) -> Callable[[], None] | None:
    # nn.MultiheadAttention keeps its initializer private.
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def _direct(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    params = [(k, p, True) for k, p in module._parameters.items() if p is not None]
    return params + [(k, b, False) for k, b in module._buffers.items() if b is not None]


def _reset_is_own_init(record: InitRecord, module: nn.Module, tensor: torch.Tensor, cache: dict) -> bool:
    """Whether ``module.reset_parameters()`` writes ``tensor`` with exactly the calls configure_model() wrote it
    with, and those calls set it whole from nothing else: then the reset draws from the same distribution."""
    if id(module) not in cache:
        cache[id(module)] = None
        reset = _reset_fn(module)
        if reset is not None:
            try:  # on the meta tensors still: it computes nothing, only what it would call is kept
                with torch.device("meta"), record_init(known=[t for _, t, _ in _direct(module)]) as own:
                    reset()
                cache[id(module)] = own
            except Exception:  # a reset that cannot run on meta tensors cannot be compared: replay instead
                pass
    own = cache[id(module)]
    if own is None or not record.overwritten_alone(tensor):
        return False
    try:
        return bool(record.write_calls(tensor) == own.write_calls(tensor))
    except Exception:  # arguments whose == is not a bool
        return False


def _warn(reasons: Mapping[str, str]) -> None:
    by_reason: dict[str, list[str]] = {}
    for name, why in reasons.items():
        by_reason.setdefault(why, []).append(name)
    listed = "; ".join(
        f"{', '.join(names[:6])}{f' and {len(names) - 6} more' if len(names) > 6 else ''}: {why}"
        for why, names in by_reason.items()
    )
    warnings.warn(
        "GPipeStrategy built the model on the meta device (configure_model) and could not give these tensors the "
        "initialization the model gives them without the strategy, so their modules were initialized by "
        f"reset_parameters() (seeded by name) or left as made: {listed}. {_WAY_OUT}",
        UserWarning,
        stacklevel=3,
    )


def materialize(
    root: nn.Module, whole: Mapping[str, nn.Module], device: torch.device, seed: int, record: InitRecord | None = None
) -> int:
    """Give every meta tensor of ``root`` real memory on ``device``, initialized as ``record`` (the recording of
    the ``configure_model()`` that built it) says; returns the number of elements materialized.

    Tensors whose recorded initialization is their module's ``reset_parameters()`` get that, seeded by
    :func:`module_seed`; the others get their recorded calls replayed, each call seeded from ``seed`` and its place
    in the record: both the same on every rank whatever the layout. Tensors with no record (built on the meta device
    outside configure_model) or whose record cannot be replayed get ``reset_parameters()`` and a warning naming them;
    a module without one is refused.

    ``whole`` maps qualified names to the modules of the whole model (``dict(model.named_modules())`` taken before
    this rank dropped the other stages' layers), in the model's order. A module of another stage is reset too when
    it holds one of this rank's tensors (a weight tied across stages): every holder of a tied weight then runs the
    same initializers in the same order and gets the same value. Ties survive: one new tensor per old one.
    """
    local = {id(t): t for t in chain(root.parameters(), root.buffers()) if t.is_meta}
    if not local:
        return 0
    current = dict(root.named_modules())
    holders = [
        (name, current.get(name, module))
        for name, module in whole.items()
        if any(id(t) in local for _, t, _ in _direct(current.get(name, module)))
    ]
    names: dict[int, str] = {}  # each local tensor's first qualified name, and the modules holding it, in order
    held_by: dict[int, list[nn.Module]] = {}
    for name, module in holders:
        for key, t, _ in _direct(module):
            if id(t) in local:
                names.setdefault(id(t), f"{name}.{key}" if name else key)
                held_by.setdefault(id(t), []).append(module)

    # Which tensors get reset_parameters(); the others are replayed. Decided while all is still on meta.
    resets: set[int] = set()
    reasons: dict[int, str] = {}
    cache: dict[int, InitRecord | None] = {}
    for i, t in local.items():
        if record is None or not record.knows(t):
            reasons[i] = "built on the meta device outside configure_model(), so its initialization is unknown"
        elif _reset_is_own_init(record, held_by[i][-1], t, cache):
            resets.add(i)
    _check_resettable(reasons, names, held_by)

    fresh: dict[int, torch.Tensor] = {}
    slots: dict[int, list[tuple[nn.Module, str, bool]]] = {}  # each tensor's places in the modules holding it
    for module in dict.fromkeys(m for ms in held_by.values() for m in ms):
        for key, t, is_param in _direct(module):
            if id(t) not in local:
                continue
            if id(t) not in fresh:
                # A split tensor (tensor parallelism's DTensor) is made whole first, initialized as on one device,
                # then cut into this rank's part: the same values in every layout.
                empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                fresh[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if is_param else empty
            slots.setdefault(id(t), []).append((module, key, is_param))
            _install(module, key, is_param, fresh[id(t)])

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        _reset(holders, {id(m) for i in local if i in resets or i in reasons for m in held_by[i]}, seed)
        replayed: set[int] = set()
        failed: dict[int, str] = {}
        for i, t in local.items():
            if i in resets or i in reasons:
                continue
            try:  # into the new tensor itself where it can: one copy of the tensor, never two
                value, note = record.replay(t, device, seed, into=fresh[i].detach())  # type: ignore[union-attr]
            except Unreplayable as e:
                failed[i] = str(e)
                continue
            if value.data_ptr() != fresh[i].data_ptr():  # replayed elsewhere
                fresh[i].copy_(value)
            del value
            if note is None:
                replayed.add(i)
            elif all(_reset_fn(m) for m in held_by[i]):  # maybe an initializer the record could not see
                failed[i] = f"{note}; reset_parameters() instead"
            else:  # what the model does too: its values are whatever the memory held
                reasons[i] = f"{note}; left so (its module has no reset_parameters())"
        if failed:  # their modules get reset_parameters(), keeping the module's other replayed tensors
            _check_resettable(failed, names, held_by)
            reasons |= failed
            modules = {id(m) for i in failed for m in held_by[i]}
            kept = {i: fresh[i].clone() for i in replayed if any(id(m) in modules for m in held_by[i])}
            _reset(holders, modules, seed)
            for i, value in kept.items():
                fresh[i].copy_(value)
    if reasons:
        _warn({names[i]: why for i, why in reasons.items()})
    for i, t in local.items():
        if isinstance(t, DTensor):
            full = fresh[i].detach()
            part = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
            fresh[i] = nn.Parameter(part, requires_grad=t.requires_grad) if isinstance(fresh[i], nn.Parameter) else part
            for module, key, is_param in slots[i]:
                _install(module, key, is_param, fresh[i])
            del full
    return sum(t.numel() for i, t in fresh.items() if i in local)


def _install(module: nn.Module, key: str, is_param: bool, tensor: torch.Tensor) -> None:
    if is_param and isinstance(tensor, nn.Parameter):
        module._parameters[key] = tensor
    else:
        module._buffers[key] = tensor


def _reset(holders: list[tuple[str, nn.Module]], modules: set[int], seed: int) -> None:
    """reset_parameters() of the ``modules`` (ids), in the model's order, each seeded by its name."""
    for name, module in holders:
        if id(module) in modules:
            torch.manual_seed(module_seed(seed, name))
            reset = _reset_fn(module)
            assert reset is not None
            reset()


def _check_resettable(reasons: Mapping[int, str], names: Mapping[int, str], held_by: Mapping) -> None:
    missing = {
        f"{names[i]} ({type(m).__name__}): {why}"
        for i, why in reasons.items()
        for m in held_by[i]
        if _reset_fn(m) is None
    }
    if missing:
        raise TypeError(
            "GPipeStrategy built the model on the meta device (configure_model) and cannot initialize these tensors "
            "as the model would, nor with their module's reset_parameters(), which it lacks: "
            f"{'; '.join(sorted(missing))}. {_WAY_OUT}"
        )
