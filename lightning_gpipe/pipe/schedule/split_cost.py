"""What zero-bubble's split of one op costs and saves: the cost gate the runtime splits by and the plan prices with.

Deferring an op's weight gradient (W) out of its backward's input-gradient half (I) shortens a zb-h1 step by about
2(K − 1) times that W, while every rank that splits pays the split's cost on each of its M micro-batches
(:func:`pays`). ``run.weight_grad`` decides each op by it at run time, ``split.plan`` prices a candidate's W with it.
"""

from __future__ import annotations

import torch

# What a split op costs its rank beyond its products, in seconds: its hooks, the kept tensors, W's closure and the
# accumulation of its results, and W's products run apart from I's; about 0.1 ms an op, measured on the CPU and on an
# H100 (benchmarks/README.md, "zb-h1's split"): on a GPU the host does not run ahead of the device's small products.
HOST_SECONDS = 1e-4
# One CPU thread's floating-point operations a second on a matrix product, two a multiply-add (66-131 GFLOP/s at
# sizes 128-512 on the benchmarks' machines); a GPU's come from its multiprocessors and clock (:func:`_gpu_flops`).
CPU_THREAD_FLOPS = 1e11
# A convolution's halves computed apart take about 0.2 of its backward more on the CPU, where oneDNN's one call
# shares work between them: 0.4 of its W.
CONV_EXTRA = 0.4


def _gpu_flops(device: torch.device, dtype: torch.dtype) -> float:
    """A GPU's floating-point operations a second on a matrix product in ``dtype``: its FP32 units' peak (128 fused
    multiply-adds, two operations each, per multiprocessor and clock), 16 times that on the tensor cores of float16
    and bfloat16 (8 times before Ampere, and for TF32 where matmuls may use it): an estimate from the device's
    properties, the same on every replica, where a timing would differ and the replicas would split differently."""
    props = torch.cuda.get_device_properties(device)
    clock_hz = getattr(props, "clock_rate", 1_500_000) * 1e3  # kHz
    fp32 = props.multi_processor_count * clock_hz * 128 * 2
    if dtype in (torch.float16, torch.bfloat16):
        return fp32 * (16 if props.major >= 8 else 8)
    if dtype == torch.float32 and props.major >= 8 and torch.backends.cuda.matmul.allow_tf32:
        return fp32 * 8
    return fp32 / 2 if dtype == torch.float64 else fp32


def w_cost(flops: float, conv: bool, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """An op's W in seconds (``flops`` operations in ``dtype`` on ``device``) and the share of it that computing
    its halves apart adds (a convolution's on the CPU: ``CONV_EXTRA``; none elsewhere)."""
    if device.type == "cuda":
        return flops / _gpu_flops(device, dtype), 0.0
    return flops / (CPU_THREAD_FLOPS * torch.get_num_threads()), CONV_EXTRA if conv else 0.0


def pays(t_w: float, extra: float, K: int, M: int) -> bool:
    """Whether deferring a W of ``t_w`` seconds a micro-batch pays. Moving time t out of every I of the ranks that
    split shortens the step by 2(K − 1)·t (the simulated step is linear in it: ``tests/engine/test_split_pays.py``),
    while those ranks pay the split's cost on each of their M micro-batches: ``HOST_SECONDS`` and ``extra``·t_w. On
    a GPU as on the CPU: small products leave the host no time to run ahead of the device."""
    return t_w * (2 * (K - 1) - M * extra) > M * HOST_SECONDS
