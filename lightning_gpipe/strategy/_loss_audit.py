"""The loss may reach the backbone's layers only through the backbone's output: each rank holds only its stage."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn


def direct_uses(loss: Tensor, stage: nn.Module, replicated: Iterable[nn.Parameter]) -> list[str]:
    """This stage's parameters that ``loss`` uses other than through the backbone's output (an L2 penalty over
    ``self.parameters()``, ``F.linear(h, self.backbone[0].weight)``), by their names in the stage.

    The walk ends at the backbone's output: the stage hands the step a tensor without history on every rank, so
    whatever the graph reaches below the loss was used by the step itself. Weights the stage shares with a module
    outside the backbone (``replicated``) are meant to be used there and are summed over the stages already.
    """
    own = {id(p): name for name, p in stage.named_parameters()}
    for p in replicated:
        own.pop(id(p), None)
    found: list[str] = []
    seen: set[object] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf the graph ends in
        if variable is not None and id(variable) in own:
            found.append(own[id(variable)])
        todo.extend(child for child, _ in node.next_functions)
    return sorted(found)


def check_loss(loss: Tensor, stage: nn.Module, replicated: Iterable[nn.Parameter], path: str, index: int) -> None:
    """Raise, naming the parameters and the fix, if ``loss`` uses this stage's layers directly."""
    used = direct_uses(loss, stage, replicated)
    if used:
        shown = ", ".join(f"{path}.{name}" for name in used[:5]) + (
            f" and {len(used) - 5} more" if len(used) > 5 else ""
        )
        raise RuntimeError(
            f"GPipeStrategy: the training step's loss uses parameters of self.{path} directly ({shown} on stage "
            f"{index}), not only through the backbone's output, e.g. a penalty over self.parameters(). Each rank "
            "holds only its stage's layers, so such a term would cover one stage and differ from the plain run. "
            "Use the optimizer's weight_decay instead, or leave the backbone's parameters out of the term."
        )
