"""memory.py's models, batches, loss and balance costs, which memory_schedules.py measures under both schedules."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._lib.memory_probe import counting_saved, storages
from lightning_gpipe.models import amoebanet_d, transformer_nmt

# Per model: what its size scales (as in the paper: the Transformer's layers L, AmoebaNet-D's filters D), the rest of
# the model and the batch, the size of the per-stage table, and the step and minimum of the size search.
FAMILIES: dict[str, dict[str, Any]] = {
    "transformer": dict(unit="L", d=128, ffn=512, heads=4, vocab=2000, N=32, T=32, size=3, step=1, min=1, p=1),
    "amoebanet": dict(unit="D", L=6, classes=10, N=32, side=64, size=24, step=8, min=8, p=2),
}
SMOKE: dict[str, dict[str, Any]] = {
    "transformer": dict(unit="L", d=32, ffn=64, heads=2, vocab=200, N=8, T=8, size=2, step=1, min=1, p=1),
    "amoebanet": dict(unit="D", L=3, classes=4, N=8, side=64, size=8, step=8, min=8, p=2),
}


def build(name: str, spec: dict, size: int) -> tuple[nn.Sequential, Any, torch.Tensor]:
    """The model at ``size`` (seeded), an input batch and the target."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "transformer":
        V, N, T = spec["vocab"], spec["N"], spec["T"]
        model = transformer_nmt(size, spec["ffn"], spec["heads"], d_model=spec["d"], vocab_size=V, dropout=0.0)
        src, tgt = torch.randint(1, V, (N, T), generator=g), torch.randint(1, V, (N, T + 1), generator=g)
        return model, (src, tgt[:, :-1]), tgt[:, 1:]
    model = amoebanet_d(spec["classes"], num_layers=spec["L"], num_filters=size)
    x = torch.randn(spec["N"], 3, spec["side"], spec["side"], generator=g)
    return model, x, torch.randint(0, spec["classes"], (spec["N"],), generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, target.flatten())


def layer_costs(model: nn.Sequential, x: Any, micro: int, batch: int) -> list[float]:
    """The balance's cost of each layer, from a forward pass on ``micro`` samples.

    16 B × its parameters (weights, gradients, Adam's two moments) + the bytes it saves for backward on one
    micro-batch; the last layer also carries 3× the joined output, for the loss (memory.py's METHOD).
    """
    x = tuple(t[:micro] for t in x) if isinstance(x, tuple) else x[:micro]
    costs = []
    for layer in model:
        saved: dict[int, int] = {}
        with counting_saved(storages(layer.parameters()), saved):
            x = layer(x)
        costs.append(4.0 * sum(p.numel() * p.element_size() for p in layer.parameters()) + sum(saved.values()))
    costs[-1] += 3.0 * x.untyped_storage().nbytes() * batch / micro
    return costs
