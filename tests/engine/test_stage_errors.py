"""Errors that say what went wrong: a tensor without the batch dimension at a boundary, a scalar or None output, a
failing balance function, a peer that died during the status check, a bad batch_dim, and a 0-dim input's gradient.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.errors import PipelineError
from tests.helpers.launch import run_distributed
from tests.helpers.models import D
from tests.helpers.stage_models import TOL, randn, rel_err, six_layers, time_major_backbone


class ToTimeMajor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


class Returns(nn.Module):
    """Returns a scalar or None: what a backbone that computes its own loss looks like to the pipeline."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        return x.square().mean() if self.what == "scalar" else None


# ------------------------------------------------------------------------------------------------------ error cases
class Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("cannot cost this layer")
        self.lock = threading.Lock()


def _raise(exc: BaseException) -> float:
    raise exc


def _train(stage: GPipeStage, x: Any) -> None:
    out = stage(x)
    if out is not None:
        out.square().mean().backward()
    stage.backward()


ERROR_CASES: dict[str, tuple[Callable[[], nn.Sequential], dict[str, Any], Callable[[], Any]]] = {
    # h_n is (layers, N, H): split along time (batch_dim=0 on time-major input), its dim 0 is not the samples.
    "gru_without_batch_dim": (time_major_backbone, {"balance": [2, 3]}, lambda: randn(5, 7, D)),
    "transposed": (
        lambda: nn.Sequential(ToTimeMajor(), nn.Linear(D, D), nn.Linear(D, D)),
        {"balance": [1, 2]},
        lambda: randn(6, 4, D),
    ),
    "scalar_output": (lambda: nn.Sequential(nn.Linear(D, D), Returns("scalar")), {"balance": [1, 1]}, None),
    "none_output": (lambda: nn.Sequential(nn.Linear(D, D), Returns("none")), {"balance": [1, 1]}, None),
    "balance_raises": (six_layers, {"balance": lambda i, layer: 1 / 0}, None),
    "balance_unpicklable": (six_layers, {"balance": lambda i, layer: _raise(Unpicklable())}, None),
}


def error_worker(rank: int, world_size: int) -> dict[str, str]:
    got = {}
    for name, (build, kwargs, make_input) in ERROR_CASES.items():
        # A fresh group per case: a failed pipeline may leave unreceived messages on its own.
        group = dist.new_group(backend="gloo")
        try:
            stage = GPipeStage(build(), chunks=2, group=group, timeout=20, **kwargs)
            _train(stage, make_input() if make_input else randn(4, D))
            got[name] = "no error"
        except Exception as e:
            got[name] = f"{type(e).__name__}: {e}"
    return got


@pytest.fixture(scope="module")
def errors() -> list[dict[str, str]]:
    return run_distributed(error_worker, 2, timeout=100)


FIX = "pass batch_dim=1 (GPipeStrategy(batch_dim=1)) for time-major (T, N, …) tensors, or return batch-first tensors"


@pytest.mark.timeout(120)
def test_time_major_tensor_without_batch_dim_is_a_clear_error_on_every_rank(errors: list[dict[str, str]]) -> None:
    for got in errors:
        message = got["gru_without_batch_dim"]
        assert message.startswith("PipelineError: stage 0 failed in the forward phase (micro-batch 0)"), message
        assert "layer 1 (GRUBoth) returned a tensor of shape (1, 7, 8) at output[1]" in message, message
        assert "this micro-batch has 3 samples" in message and FIX in message, message
        message = got["transposed"]
        assert "layer 0 (ToTimeMajor) returned a tensor of shape (4, 3, 8)" in message and FIX in message, message


@pytest.mark.timeout(120)
def test_scalar_or_none_output_names_the_last_layer_on_every_rank(errors: list[dict[str, str]]) -> None:
    for got in errors:
        for case, what in (("scalar_output", "a 0-dim tensor"), ("none_output", "None")):
            message = got[case]
            assert message.startswith("PipelineError: stage 1 failed in the forward phase"), message
            assert f"layer 1 (Returns), the last layer of the pipelined module, returned {what}" in message, message
            assert "must return per-sample tensors" in message and "after the backbone" in message, message


@pytest.mark.timeout(120)
def test_failing_balance_function_raises_on_every_rank(errors: list[dict[str, str]]) -> None:
    for got in errors:
        assert got["balance_raises"].startswith("RuntimeError: the balance cost function"), got["balance_raises"]
        assert "ZeroDivisionError: division by zero" in got["balance_raises"]
        assert "Unpicklable: cannot cost this layer" in got["balance_unpicklable"], got["balance_unpicklable"]


# ----------------------------------------------------------------------------------------------------- a dead peer
class ExitOnStage1(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            time.sleep(0.5)  # stage 0 is in its end-of-phase status check by now
            os._exit(3)
        return x


def dying_peer_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), ExitOnStage1(), nn.Linear(D, D))
    stage = GPipeStage(model, chunks=2, balance=[2, 2], timeout=10)
    start = time.monotonic()
    try:
        stage(randn(4, D))
    except PipelineError as e:
        return {"type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - start}
    return {"type": "none", "elapsed": time.monotonic() - start}


@pytest.mark.timeout(60)
def test_status_check_says_a_peer_died_not_that_it_waited() -> None:
    got = run_distributed(dying_peer_worker, 2, timeout=40, pg_timeout=20, expect_errors=True, allow_missing=True)[0]
    assert isinstance(got, dict), got
    assert got["type"] == "PipelineTimeout", got
    assert "lost its connection" in got["message"] and "died or exited" in got["message"], got["message"]
    assert "waited" not in got["message"], got["message"]
    assert got["elapsed"] < 5, got


# --------------------------------------------------------------------------------------------------- one process
@pytest.mark.timeout(30)
def test_bad_batch_dim_is_rejected() -> None:
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="batch_dim must be an int"):
            GPipeStage(six_layers(), batch_dim=bad)


@pytest.mark.timeout(30)
def test_0_dim_input_gets_the_gradient_of_every_micro_batch() -> None:
    """A 0-dim input (a scale) is used whole by every micro-batch: its gradient is their sum."""
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh())
    ref = copy.deepcopy(model)
    stage = GPipeStage(nn.Sequential(Scaled(model)), chunks=3, checkpoint="always")
    x, scale, ref_scale = randn(7, D), torch.tensor(1.5, requires_grad=True), torch.tensor(1.5, requires_grad=True)
    stage((x, scale)).square().sum().backward()
    stage.backward()
    (ref(x) * ref_scale).square().sum().backward()
    assert rel_err(scale.grad, ref_scale.grad) <= TOL


class Scaled(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, scale = batch
        return self.inner(x) * scale


@pytest.mark.timeout(10)
def test_a_sublayer_of_another_stages_layer_names_that_stage() -> None:
    from lightning_gpipe.pipe.split.indexing import RemoteLayer

    remote = RemoteLayer("layer 0 (Sequential) is on stage 0; this rank is stage 1 and holds layers 3–5")
    with pytest.raises(TypeError, match=r"layer 0 \(Sequential\) is on stage 0.*sublayer \[0\] is only there"):
        remote[0]
    assert list(remote.parameters()) == [] and remote.requires_grad_(False) is remote
