"""The GPU test matrix in one command: ``python -m tests.gpu_matrix`` (from the repo root, on a machine with GPUs).

1. One GPU: ``tests/strategy/test_cuda.py`` — the engine (streams, events, recompute, memory), GPipeStrategy under
   every precision, the trace, the examples.
2. One GPU per process, NCCL between the stages: the Lightning multi-process tests below, with
   ``GPIPE_TEST_ACCELERATOR=cuda``. K = 2 needs two GPUs, pp 2 × dp 2 four; a test that needs more than there are
   is skipped with the count in its reason, and every skip is listed (``-rs``).

The engine's own multi-process tests (``tests/engine``) exercise gloo on the CPU by design and are not part of it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

ONE_GPU = ["tests/strategy/test_cuda.py"]
PER_PROCESS = [
    f"tests/strategy/test_{name}.py"
    for name in (
        # exactness against the plain run: both loss paths, schedules, loops, habits, copies, overlap, data loading
        "fit_parity",
        "compile_fit",
        "micro_batch_loss",
        "loops",
        "habits",
        "copies",
        "output",
        "overlap",
        "data_loading",
        # interleaved stages (the ring's hop K − 1 → 0 on its own link groups) and long skips (their own groups)
        "interleaved_fit",
        "interleaved_eval",
        "skips_fit",
        # sharded and tensor-parallel stages (FSDP2 and DTensor over NCCL): exact, counted, checkpointed
        "fsdp_fit",
        "fsdp_checkpoint",
        "tensor_parallel_fit",
        # what NCCL asks of the transport: 16 MiB boundaries under every schedule, a failing kernel, syncs per step
        "gpu_transport",
        "nccl_order_fit",
        "host_syncs",
        "precision",
        # checkpoints, failures, what a user sees
        "checkpoint",
        "checkpoint_formats",
        "checkpoint_errors",
        "errors",
        "faults",
        "batch_fingerprint",
        "loss_audit",
        "trace",
        "profiler",
        "teardown",
    )
]
# Not in it, CPU-only by what they check: balance (times layers on rank 0's CPU), partition_report and init/meta
# (the device names and RNG streams of the CPU), pytorch_lightning (the standalone package's CPU run), the examples.


def main(argv: list[str]) -> int:
    print(f"torch {torch.__version__}, CUDA devices: {torch.cuda.device_count()}", flush=True)
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *argv]
    codes = [subprocess.call([*pytest, *ONE_GPU])]
    env = {**os.environ, "GPIPE_TEST_ACCELERATOR": "cuda"}
    codes.append(subprocess.call([*pytest, *PER_PROCESS], env=env))
    # pytest's 5: nothing ran (every test skipped for want of GPUs), which the listed reasons explain.
    return max((c for c in codes if c != 5), default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
