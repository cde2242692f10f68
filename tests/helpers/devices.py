"""Where the Lightning multi-process tests run: ``GPIPE_TEST_ACCELERATOR=cpu`` (gloo, the default) or ``cuda``
(NCCL, one GPU per process; a test needing more GPUs than there are is skipped, saying how many)."""

from __future__ import annotations

import os

import pytest
import torch

ACCELERATOR = os.environ.get("GPIPE_TEST_ACCELERATOR", "cpu")
if ACCELERATOR not in ("cpu", "cuda"):
    raise ValueError(f"GPIPE_TEST_ACCELERATOR={ACCELERATOR!r}: choose 'cpu' or 'cuda'")


def on_cuda() -> bool:
    return ACCELERATOR == "cuda"


def require_devices(processes: int) -> None:
    """Skip, naming the shortfall, where the run needs one GPU per process and fewer exist."""
    if on_cuda() and torch.cuda.device_count() < processes:
        pytest.skip(
            f"GPIPE_TEST_ACCELERATOR=cuda: needs {processes} CUDA devices (one per process), "
            f"found {torch.cuda.device_count()}"
        )
