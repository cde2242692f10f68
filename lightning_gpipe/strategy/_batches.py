"""The batches of a pipeline's stages: compared by fingerprint (``check_batches``), loaded once by stage 0 for all."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_gpipe.pipe.comm.batch_feed import BatchFeed
from lightning_gpipe.pipe.microbatch import tensors
from lightning_gpipe.strategy._arguments import CheckBatches
from lightning_gpipe.strategy._lightning_internals import logger
from lightning_gpipe.strategy._mesh import PipelineMesh


class BatchCheck:
    """When the stages compare their batches: ``"first"`` training step of every epoch (the sampler and the
    workers' seeds are set up per epoch, so a per-rank difference shows there), ``"always"`` (every training step),
    or ``"never"``. Each check is an all-gather over the pipeline and a host sync."""

    def __init__(self, when: CheckBatches) -> None:
        self.when = when
        self._epoch: int | None = None

    def start_fit(self) -> None:
        self._epoch = None

    def __call__(self, batch: Any, epoch: int, K: int, group: dist.ProcessGroup) -> None:
        """Before a training step of ``epoch``; every stage of the pipeline calls it (collective when it checks)."""
        if self.when == "never" or (self.when == "first" and epoch == self._epoch):
            return
        self._epoch = epoch
        check_same_batch(batch, K, group)


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


# A stateful loader's state would be stage 0's, taken up to the feed's depth batches ahead of the step: resuming
# from it would skip batches, so the fed loader offers none (Lightning then saves no loader state, as for a DataLoader).
_HIDDEN = frozenset({"state_dict", "load_state_dict"})


class FedLoader:
    """A data loader whose batches come through a ``BatchFeed``: Lightning sees the loader itself (its length,
    sampler and workers' settings), while iterating it opens a stream of the feed."""

    def __init__(self, loader: Any, feed: BatchFeed) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "feed", feed)

    def __iter__(self) -> Iterator[Any]:
        # Keyed by this wrapper: one loader passed for training and validation gets one per loop.
        return self.feed.stream(self.loader, key=self)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in _HIDDEN:
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.loader, name, value)  # Lightning sets worker_init_fn on the loader it was given


def open_feed(mesh: PipelineMesh, is_first: bool, log: bool) -> BatchFeed | None:
    """This rank's part of its pipeline's feed, where ``data_loading="first_stage"`` gave the mesh an input group."""
    if mesh.input_group is None:
        return None
    if log and mesh.rank == 0:
        logger.info(
            f"GPipeStrategy: each pipeline's batches are loaded once, on its stage 0 (up to two ahead), and sent to "
            f"its {mesh.K - 1} other stage(s) (data_loading='first_stage')"
        )
    return BatchFeed(mesh.input_group, is_first, mesh.timeout_s)
