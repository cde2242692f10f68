"""``python -m tests.gpu_matrix`` runs; without GPUs every one of its tests is skipped, with a reason saying so."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the matrix runs for real: run it by hand")
def test_gpu_matrix_without_gpus_skips_with_explicit_reasons() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_matrix"], cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "CUDA devices: 0" in out
    assert "test_cuda.py" in out and "needs a CUDA device" in out
    for processes in (2, 3, 4):
        assert f"needs {processes} CUDA devices (one per process), found 0" in out, out[-3000:]
    assert " failed" not in out and " error" not in out, out[-3000:]
