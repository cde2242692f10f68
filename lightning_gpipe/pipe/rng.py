"""Randomness that does not depend on the layout: each layer draws from a seed of (step, micro-batch, its name).

Without this, stage k's dropout draws from stage k's own stream, so the masks -- and the run -- change with K.
Every stage draws one step seed per phase from its global generator (all stages consume the same amount, so the
code outside the pipeline keeps seeing the same random stream on every stage); stage 0's is the one used, sent
with each micro-batch. Before layer ``name`` runs micro-batch m, the generators of the CPU and of the stage's device
are seeded with ``mix(mix(step seed, m), crc32(name))``; a phase restores the global streams when it ends.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_MASK = (1 << 64) - 1


def mix(a: int, b: int) -> int:
    """A 63-bit seed from two integers (SplitMix64's finalizer over a golden-ratio combination)."""
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def name_key(name: str) -> int:
    return zlib.crc32(name.encode())


def draw_step_seed() -> int:
    """One draw from the global CPU generator (every stage makes it, so their streams stay alike)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


def _cuda_generators(device: torch.device) -> list[int]:
    """The CUDA generators a stage on ``device`` draws from besides the CPU's: its device's (none on the CPU)."""
    return [device.index if device.index is not None else 0] if device.type == "cuda" else []


def reseed(seed: int, device: torch.device) -> None:
    torch.default_generator.manual_seed(seed)
    for index in _cuda_generators(device):
        torch.cuda.default_generators[index].manual_seed(seed)


@contextmanager
def restored_streams(device: torch.device) -> Iterator[None]:
    """The global CPU (and the stage's CUDA device's) generator as it was before the block."""
    with torch.random.fork_rng(devices=_cuda_generators(device)):
        yield
