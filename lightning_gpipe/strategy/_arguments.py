"""Input checks of GPipeStrategy: each raises one error that names the problem and the fix, before any work."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.microbatch import tensors
from lightning_gpipe.pipe.schedule import CHECKPOINT_MODES


def check_strategy_args(chunks: Any, pipeline_parallel_size: Any, checkpoint: Any, output: Any, batch_dim: Any) -> None:
    """GPipeStrategy's own arguments, at construction."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"GPipeStrategy(chunks={chunks!r}): chunks, M, must be an int ≥ 1")
    if pipeline_parallel_size != "auto" and (not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1):
        raise ValueError(f"GPipeStrategy(pipeline_parallel_size={pipeline_parallel_size!r}): give an int ≥ 1 or 'auto'")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"GPipeStrategy(checkpoint={checkpoint!r}): choose one of {list(CHECKPOINT_MODES)}")
    if output not in ("all", "placeholder"):
        raise ValueError(f"GPipeStrategy(output={output!r}): choose 'all' or 'placeholder'")
    if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
        raise ValueError(
            f"GPipeStrategy(batch_dim={batch_dim!r}): the dimension that holds the samples, an int ≥ 0 (0 batch-first, "
            "1 for time-major (T, N, ...) tensors)"
        )


def find_backbone(module: nn.Module, path: str) -> tuple[nn.Module, str, nn.Module]:
    """The module at the dotted ``path``, its parent and attribute name; it must be an nn.Sequential."""
    *parents, name = path.split(".")
    parent: nn.Module | None = module
    for attr in parents:
        parent = getattr(parent, attr, None)
        if parent is None:
            break
    found = getattr(parent, name, None) if parent is not None else None
    if found is None:
        sequential = [n for n, m in module.named_modules() if isinstance(m, nn.Sequential) and n]
        # Only the outermost ones: layers inside a Sequential are not candidates for a backbone.
        candidates = [n for n in sequential if not any(n.startswith(f"{o}.") for o in sequential)]
        raise AttributeError(
            f"GPipeStrategy(backbone={path!r}): {type(module).__name__} has no attribute {path!r}. "
            f"nn.Sequential attributes found: {candidates or 'none'}; pass one of them as GPipeStrategy(backbone=...)"
        )
    if not isinstance(found, nn.Sequential | GPipeStage):
        raise TypeError(
            f"GPipeStrategy(backbone={path!r}) is a {type(found).__name__}, not an nn.Sequential: "
            "express the part to pipeline as an nn.Sequential of layers"
        )
    assert parent is not None
    return parent, name, found


def reject_unsupported(module: nn.Module, backbone: str, *, sync_batchnorm: bool, deferred_batch_norm: bool) -> None:
    if type(module).__name__ == "OptimizedModule":
        raise TypeError(
            "GPipeStrategy cannot pipeline a torch.compile'd LightningModule: compile inside configure_model() instead"
        )
    if not sync_batchnorm:
        return
    # Refused rather than ignored: replicas would silently normalize with their own statistics.
    if not deferred_batch_norm:
        raise ValueError(
            "Trainer(sync_batchnorm=True) with GPipeStrategy synchronizes its deferred BatchNorm layers; "
            "set GPipeStrategy(deferred_batch_norm=True) or drop sync_batchnorm"
        )
    outside = [
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not name.startswith(f"{backbone}.")
    ]
    if outside:
        raise ValueError(
            f"Trainer(sync_batchnorm=True): GPipeStrategy synchronizes the BatchNorm layers of self.{backbone} over "
            f"the data-parallel replicas, but these are outside it: {outside}; move them into the backbone or drop "
            "sync_batchnorm"
        )


def reject_closure_replaying_optimizers(optimizers: list[Any]) -> None:
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "GPipeStrategy cannot run LBFGS: it re-evaluates the closure a data-dependent number of times, and "
                "every evaluation is a pipeline step all stages must take together; use a first-order optimizer"
            )


_P = 2**31 - 1  # row sums are reduced modulo this prime before they are weighted, so int64 never overflows
_CHUNK = 2**21  # weighted terms stay below 2**41: 2**21 of them sum below 2**62


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a matrix of integer words (int32 where the rows allow it). A large tensor's rows are
    half rows, so a flip within a row moves words between rows; a small one's are single words. No copy for a
    contiguous tensor."""
    t = t.detach().contiguous()
    t = t.reshape(1) if t.dim() == 0 else t
    if t.numel() == 0:
        return torch.zeros(1, 1, dtype=torch.int32, device=t.device)
    row_bytes = t.shape[-1] * t.element_size()
    word = torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.int8
    words = t.view(word)
    if words.numel() <= 2**16:  # labels, token ids: every word is weighted by its own position
        return words.reshape(-1, 1)
    cols = words.shape[-1]
    return words.reshape(-1, cols // 2) if cols % 2 == 0 else words.reshape(-1, cols)


def _weighted_row_sum(words: torch.Tensor) -> torch.Tensor:
    """Σ_r (r mod 1009 + 1)·(row r's sum mod P), exactly: integer sums do not depend on the reduction order."""
    row_sums = words.sum(1, dtype=torch.int64).remainder(_P)  # each row sum stays below 2**63 (< 2**32 words)
    weights = torch.arange(row_sums.numel(), device=row_sums.device) % 1009 + 1
    terms = row_sums * weights
    pad = (-terms.numel()) % _CHUNK
    if pad and terms.numel() > _CHUNK:
        terms = torch.cat([terms, terms.new_zeros(pad)])
    return terms.reshape(-1, min(_CHUNK, terms.numel())).sum(1).remainder(_P).sum()


def batch_fingerprint(batch: Any) -> int:
    """A 63-bit digest of every tensor in ``batch`` (bytes, shapes, dtypes), exactly the same wherever it is
    computed: ranks with other thread counts or devices agree. The order of samples and a flip within a row count.
    """
    leaves = tensors(batch)
    # One host transfer per step: the sums stay on the batch's device until they are stacked.
    on_device = [_weighted_row_sum(_rows(t)) for t in leaves]
    sums = torch.stack([v.to(on_device[0].device) for v in on_device]).cpu().tolist() if leaves else []
    described = [(tuple(t.shape), str(t.dtype), s) for t, s in zip(leaves, sums, strict=True)]
    digest = hashlib.blake2b(repr(described).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_same_batch(batch: Any, K: int, group: Any) -> None:
    """Every stage of a pipeline must see the same batch; a fingerprint catches per-rank augmentation early."""
    if K == 1:
        return
    signature = torch.tensor([batch_fingerprint(batch)], dtype=torch.int64)
    gathered = [torch.empty_like(signature) for _ in range(K)]
    dist.all_gather(gathered, signature, group=group)
    differ = [k for k, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if differ:
        raise RuntimeError(
            f"stage(s) {differ} of this pipeline got a different batch than stage 0: every stage of a pipeline must "
            "load the same batch. Random augmentation seeded by the global rank (seed_everything(workers=True)) or "
            "a custom sampler sharding over all ranks causes this; seed per data-parallel replica, or shard over "
            "data_parallel_size (GPipeStrategy.distributed_sampler_kwargs)"
        )
