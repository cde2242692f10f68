"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from lightning_gpipe.pipe.run.weight_grad import SPLIT_EVERY_OP

# zb-h1 splits an op only where that pays (weight_grad.split_pays), which no op of the tests' tiny models does on the
# CPU: the tests split every op, in this process and the ones it starts, unless a test unsets it.
os.environ[SPLIT_EVERY_OP] = "1"
# Inductor compiles in a pool of one process per core by default: on the tests' 2 cores, beside the ranks a test
# starts, its kernels compile in the process that needs them instead.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny tensors on a shared 2-core CPU: a second intra-op thread only waits for the first (~100× slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """A test may set variables in this process (``seed_everything`` sets PL_GLOBAL_SEED); the processes later tests
    start inherit them (Lightning seeds its DistributedSampler with PL_GLOBAL_SEED), so each test gets them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
