"""Optimizer states in single-file checkpoints: torch's position-numbered format ↔ each rank's parameters by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Per param group, (global parameter name, shape) in the order the optimizer holds them.
Layout = list[list[tuple[str, tuple[int, ...]]]]
_UNNAMED = "<not a parameter of the module>"


def layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> Layout:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[(names.get(id(p), _UNNAMED), tuple(p.shape)) for p in g["params"]] for g in optimizer.param_groups]


def is_plain(saved: Any) -> bool:
    """Whether an optimizer state is torch's own format (older GPipe checkpoints flattened it to names)."""
    return isinstance(saved, dict) and "state" in saved and "param_groups" in saved


# A plain optimizer's state dict numbers its parameters in the order it got them, consecutively across its param
# groups (state: {0: ...}, param_groups[g]["params"] = [0, 1, ...]). Built from self.parameters() or from filters
# over self.named_parameters(), that order is, within each group, the plain module's parameter order; so the union
# of the ranks' groups, sorted by that order, tells which parameter each position is. That is proved, not assumed:
# every rank's optimizer must list its own parameters in the module's order, and a checkpoint read this way must
# have the same group sizes, and state tensors shaped like the parameters they are mapped to.
def positions(layouts: list[Layout], order: list[str] | None) -> list[list[str]] | str:
    """Every group's parameter names in the plain optimizer's order, from all ranks' layouts; or why that is unknown."""
    if order is None:
        return "the plain module's parameter order is unknown (its backbone was pipelined by an earlier Trainer)"
    index = {name: i for i, name in enumerate(order)}
    if len({len(lay) for lay in layouts}) != 1:
        return f"the ranks' optimizers have different numbers of param groups {[len(lay) for lay in layouts]}"
    groups: list[list[str]] = []
    for g in range(len(layouts[0])):
        members: set[str] = set()
        for rank, lay in enumerate(layouts):
            names = [name for name, _ in lay[g]]
            unknown = [name for name in names if name not in index]
            if unknown:
                return f"param group {g} on rank {rank} holds {unknown[:3]}, not the plain module's parameters"
            at = [index[name] for name in names]
            if at != sorted(at):
                return (
                    f"param group {g} on rank {rank} lists its parameters in another order than the module's "
                    f"named_parameters() ({names[:4]}...)"
                )
            members.update(names)
        groups.append(sorted(members, key=index.__getitem__))
    return groups


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state by global parameter name, and its groups' hyperparameters."""
    saved = optimizer.state_dict()
    state: dict[str, Any] = {}
    for group, names in zip(saved["param_groups"], layout(model, optimizer)):
        state.update({name: saved["state"][i] for i, (name, _) in zip(group["params"], names) if i in saved["state"]})
    hyper = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in saved["param_groups"]]
    return {"state": state, "hyper": hyper, "named": "param_names" in optimizer.param_groups[0]}


def to_plain(parts: list[dict[str, Any]], groups: list[list[str]]) -> dict[str, Any]:
    """The state dict the plain module's optimizer would have, from every rank's ``named_state``."""
    by_name: dict[str, Any] = {}
    for part in parts:
        by_name.update(part["state"])
    state: dict[int, Any] = {}
    param_groups: list[dict[str, Any]] = []
    first = 0
    for hyper, names in zip(parts[0]["hyper"], groups):
        numbers = list(range(first, first + len(names)))
        state.update({i: by_name[name] for i, name in zip(numbers, names) if name in by_name})
        group = {**hyper, "params": numbers}
        if parts[0]["named"]:  # as torch writes it for an optimizer built from named_parameters()
            group["param_names"] = list(names)
        param_groups.append(group)
        first += len(names)
    return {"state": state, "param_groups": param_groups}


def local_plain(saved: dict[str, Any], groups: list[list[str]], layouts: list[Layout], mine: Layout) -> dict[str, Any]:
    """The part of a plain optimizer state dict this rank's optimizer loads, numbered as its own ``state_dict()``.

    Raises ValueError (the same on every rank: all checks use every rank's layout) if the checkpoint cannot be this
    optimizer's.
    """
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"it has {len(saved_groups)} param groups, this run's optimizer {len(groups)}")
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(names) for names in groups]:
        raise ValueError(f"its param groups hold {sizes} parameters, this run's {[len(n) for n in groups]}")
    name_at: dict[int, str] = {}
    for g, (group, names) in enumerate(zip(saved_groups, groups)):
        if "param_names" in group and list(group["param_names"]) != names:
            raise ValueError(
                f"param group {g} names its parameters {group['param_names'][:4]}..., this run {names[:4]}..."
            )
        name_at.update(zip(group["params"], names))
    shapes = {name: shape for lay in layouts for group in lay for name, shape in group}
    for i, state in saved["state"].items():
        if i not in name_at:
            raise ValueError(f"it has a state for parameter {i}, which no param group holds")
        name = name_at[i]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not _fits(tuple(value.shape), shapes[name]):
                raise ValueError(
                    f"its state {key!r} of parameter {i} has shape {tuple(value.shape)}, but parameter {i} is "
                    f"{name} of shape {shapes[name]}"
                )
    number = {name: i for i, name in name_at.items()}
    state, param_groups, mine_i = {}, [], 0
    for group, own in zip(saved_groups, mine):
        numbers = list(range(mine_i, mine_i + len(own)))
        state.update({i: saved["state"][number[n]] for i, (n, _) in zip(numbers, own) if number[n] in saved["state"]})
        # The local optimizer keeps its own param_names (torch's load_state_dict leaves them when these lack them).
        param_groups.append(
            {**{k: v for k, v in group.items() if k not in ("params", "param_names")}, "params": numbers}
        )
        mine_i += len(own)
    return {"state": state, "param_groups": param_groups}


def _fits(shape: tuple[int, ...], parameter: tuple[int, ...]) -> bool:
    # Scalars (Adam's step) fit any parameter; factored moments (Adafactor's rows and columns) keep its rank with
    # ones in the reduced dimensions. A state of another rank or size belongs to another parameter.
    return shape == () or (len(shape) == len(parameter) and all(s in (p, 1) for s, p in zip(shape, parameter)))
