"""Length-bucketed batches with dynamic padding, sharded over data-parallel replicas with equal batch counts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

# A training pool holds this many batches' worth of examples: sorted by length inside, so batches pad little,
# while the pools themselves are shuffled, so batches still mix examples from all over the data each epoch.
POOL_BATCHES = 100

Example = tuple[int, np.ndarray, np.ndarray]  # (index, source ids, target ids)


class TokenTable:
    """Many token sequences in one flat int32 array: cheap to keep and to send to loader workers."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        self.offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.ids = np.fromiter((t for s in sequences for t in s), dtype=np.int32, count=int(self.offsets[-1]))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.ids[self.offsets[index] : self.offsets[index + 1]]


class PairedTokens(Dataset):
    """Encoded (source, target) pairs; an item is a whole batch: ``dataset[indices]`` -> list of examples."""

    def __init__(self, sources: TokenTable, targets: TokenTable) -> None:
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
        self.sources, self.targets = sources, targets

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def lengths(self) -> np.ndarray:
        """What an example costs in a batch: the longer of its source and its target with bos (or eos)."""
        return np.maximum(self.sources.lengths, self.targets.lengths + 1)

    def __getitem__(self, indices: Sequence[int]) -> list[Example]:  # type: ignore[override]
        return [(int(i), self.sources[i], self.targets[i]) for i in indices]


class PadCollate:
    """Pads a batch to its own longest source and target: ``src``, ``tgt_in`` (bos + target), ``tgt_out``
    (target + eos) and ``index`` (position in the split), all LongTensors."""

    def __init__(self, pad_id: int, bos_id: int, eos_id: int) -> None:
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    def __call__(self, examples: list[Example]) -> dict[str, Tensor]:
        n = len(examples)
        src_len = max(len(src) for _, src, _ in examples)
        tgt_len = max(len(tgt) for _, _, tgt in examples) + 1
        src = torch.full((n, src_len), self.pad_id, dtype=torch.long)
        tgt_in = torch.full((n, tgt_len), self.pad_id, dtype=torch.long)
        tgt_out = torch.full((n, tgt_len), self.pad_id, dtype=torch.long)
        for row, (_, s, t) in enumerate(examples):
            src[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
            target = torch.from_numpy(t.astype(np.int64))
            tgt_in[row, 0], tgt_in[row, 1 : len(t) + 1] = self.bos_id, target
            tgt_out[row, : len(t)], tgt_out[row, len(t)] = target, self.eos_id
        index = torch.tensor([i for i, _, _ in examples], dtype=torch.long)
        return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out, "index": index}


def plan_batches(
    order: np.ndarray, lengths: np.ndarray, batch_size: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Cuts ``order`` (indices, sorted by length) into batches of at most ``batch_size`` examples and at most
    ``max_tokens`` padded tokens (examples × longest); an example longer than ``max_tokens`` goes alone."""
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i, length in zip(order.tolist(), lengths[order].tolist()):
        full = batch_size is not None and len(batch) >= batch_size
        if batch and (full or (max_tokens is not None and (len(batch) + 1) * max(longest, length) > max_tokens)):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, length)
    if batch:
        batches.append(batch)
    return batches


def fit_count(batches: list[list[int]], count: int) -> list[list[int]]:
    """Exactly ``count`` batches: drops the last ones, or halves the largest until there are enough (halving never
    adds padding nor tokens). Raises ValueError when there are fewer than ``count`` examples."""
    batches = batches[:count]
    while len(batches) < count:
        largest = max(range(len(batches)), key=lambda b: len(batches[b]), default=None)
        if largest is None or len(batches[largest]) < 2:
            examples = sum(len(b) for b in batches)
            raise ValueError(f"{examples} examples cannot fill {count} batches; use more examples or fewer replicas")
        batch = batches[largest]
        batches[largest : largest + 1] = [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
    return batches


class BucketBatchSampler(DistributedSampler):
    """Yields this replica's batches (lists of indices) of length-sorted examples, the same on every pipeline stage.

    A pure function of (lengths, seed, epoch, num_replicas, rank): every replica plans all batches of the epoch,
    takes every ``num_replicas``-th from ``rank`` on, and all replicas get the same number, so collectives stay in
    step. Training (``shuffle=True``, ``drop_last=True``): shuffled pools sorted by length, batch order shuffled, the
    epoch's batch count held at that of epoch 0 (``len()`` stays true) by dropping or halving batches. Evaluation
    (``shuffle=False``, ``drop_last=False``): all examples sorted by length, every one exactly once across the
    replicas, halving batches until their count divides evenly.

    It subclasses DistributedSampler, and the DataLoader takes it as ``sampler=`` (with ``batch_size=None``): Lightning
    then neither injects its own DistributedSampler nor rebuilds the loader, and it calls ``set_epoch`` on it.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool | None = None,
    ) -> None:
        if batch_size is None and max_tokens is None:
            raise ValueError("BucketBatchSampler needs batch_size (sentences), max_tokens (padded tokens) or both")
        if (batch_size is not None and batch_size < 1) or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"batch_size={batch_size} and max_tokens={max_tokens} must be positive where given")
        drop_last = shuffle if drop_last is None else drop_last
        super().__init__(lengths, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.max_tokens = batch_size, max_tokens
        first = self._plan(0)
        replicas = self.num_replicas
        self.per_replica = len(first) // replicas if drop_last else -(-len(first) // replicas)
        if self.per_replica == 0:
            raise ValueError(
                f"{len(self.lengths)} examples make {len(first)} batches, fewer than the {replicas} data-parallel "
                "replicas: use more examples or a smaller batch_size / max_tokens"
            )

    def _plan(self, epoch: int) -> list[list[int]]:
        if not self.shuffle:
            return plan_batches(np.argsort(self.lengths, kind="stable"), self.lengths, self.batch_size, self.max_tokens)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))
        typical = self.batch_size or max(1, int(self.max_tokens or 1) // max(1, int(np.median(self.lengths))))
        pool = POOL_BATCHES * typical
        batches: list[list[int]] = []
        for start in range(0, len(order), pool):
            chunk = order[start : start + pool]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches += plan_batches(chunk, self.lengths, self.batch_size, self.max_tokens)
        return [batches[b] for b in rng.permutation(len(batches))]

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This replica's batches of ``epoch`` (default: the one set by ``set_epoch``)."""
        planned = fit_count(self._plan(self.epoch if epoch is None else epoch), self.per_replica * self.num_replicas)
        return planned[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]
        return iter(self.batches())

    def __len__(self) -> int:
        return self.per_replica
