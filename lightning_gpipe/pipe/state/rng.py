"""Randomness that does not depend on the layout: each layer draws from a seed of (step, micro-batch, its name).

Without this, stage k's dropout draws from stage k's own stream, so the masks -- and the run -- change with K.
Every stage takes one step seed per phase from :class:`StepSeeds`, the pipeline's own stream, which never draws from
the user's generators: the code outside the pipeline sees the random stream that a run without a pipeline (DDP)
sees. Stage 0's seed is the one used, sent with each micro-batch. Before layer ``name`` runs micro-batch m, the
generators of the CPU and of the stage's device are seeded with ``mix(mix(step seed, m), crc32(name))``; a phase
restores the global streams when it ends.
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


class StepSeeds:
    """The pipeline's stream of step seeds: the n-th is ``mix(initial seed, n)``, with the initial seed of the global
    CPU generator (``torch.initial_seed()``, read without drawing). Stages seeded alike (``seed_everything``, or
    torch's default) draw alike; ``torch.manual_seed`` restarts the stream, as it restarts the user's."""

    def __init__(self) -> None:
        self._initial: int | None = None
        self._n = 0

    def draw(self) -> int:
        initial = torch.initial_seed()
        if initial != self._initial:
            self._initial, self._n = initial, 0
        self._n += 1
        return mix(mix(initial, _STREAM), self._n)


_STREAM = 0x5EED  # keeps the step seeds apart from the layers' own mix(seed, ·) keys


def _cuda_generators(device: torch.device) -> list[int]:
    """The CUDA generators a stage on ``device`` draws from besides the CPU's: its device's (none on the CPU)."""
    return [device.index if device.index is not None else 0] if device.type == "cuda" else []


def cuda_devices_of(*tensors: torch.Tensor) -> list[int]:
    """The CUDA devices ``tensors`` live on: the generators a run on them draws from, which a measurement forks."""
    return sorted({t.get_device() for t in tensors if t.device.type == "cuda"})


def reseed(seed: int, device: torch.device) -> None:
    torch.default_generator.manual_seed(seed)
    for index in _cuda_generators(device):
        torch.cuda.default_generators[index].manual_seed(seed)


@contextmanager
def restored_streams(device: torch.device) -> Iterator[None]:
    """The global CPU (and the stage's CUDA device's) generator as it was before the block."""
    with torch.random.fork_rng(devices=_cuda_generators(device)):
        yield
