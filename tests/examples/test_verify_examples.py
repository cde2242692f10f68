"""``python -m lightning_gpipe.verify`` on the examples, as a user runs it on their LightningCLI configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.example_cli import verify

# The NMT example's CPU configuration at width 32, on 400 generated sentences: the check, not the training, matters.
SMALL_NMT = ("--data.train_size", "400", "--data.batch_size", "16", "--model.d_model", "32", "--model.ffn_dim", "64")


@pytest.mark.timeout(200)
def test_the_translator_is_the_same_run_and_its_key_biases_are_rounding(tmp_path: Path) -> None:
    """Its attention keys' biases get no gradient but rounding (softmax ignores a shift shared by all keys), which
    Adam turns into whole steps: named as noise and left out; every other parameter within 1e-9 (float64)."""
    run = verify("nmt", *SMALL_NMT, cwd=tmp_path, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "verdict: same run" in run.stdout, run.stdout[-3000:]
    assert "have no gradient but rounding" in run.stdout and "attn.k.bias" in run.stdout, run.stdout[-3000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("chunks", "verdict"), [("1", "same run"), ("4", "by design")])
def test_amoebanets_batchnorm_differs_by_design_at_m_above_1(tmp_path: Path, chunks: str, verdict: str) -> None:
    run = verify("amoebanet", "--trainer.strategy.init_args.chunks", chunks, cwd=tmp_path, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"verdict: {verdict}" in run.stdout, run.stdout[-3000:]
    if verdict == "by design":
        assert "BatchNorm" in run.stdout and "at M = 1 the runs agree" in run.stdout
