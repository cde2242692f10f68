"""torchmetrics under a pipeline: metric states are synchronized over the data-parallel replicas, not the stages."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn


def sync_metrics_over(module: nn.Module, group: Any) -> int:
    """Point every torchmetrics ``Metric`` of ``module`` that syncs over the whole world at ``group``; returns how many.

    Every stage of a pipeline holds the same metric states (the same output reaches each, or with
    ``output="placeholder"`` they are copied from the last stage), so a sync over the world would count each sample K
    times. A metric given its own ``process_group`` keeps it, unless that group is the world.
    """
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return 0
    changed = 0
    for m in module.modules():
        if not isinstance(m, Metric):
            continue
        if (m.process_group is None or m.process_group is dist.group.WORLD) and m.process_group is not group:
            m.process_group = group
            changed += 1
    return changed
