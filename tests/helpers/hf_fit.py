"""Trains a HF causal LM pipelined and plain, and compares the folders and models they end with."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.hf_lm import EAGER, PipelinedLM, PlainLM, batches
from tests.helpers.launch import quiet_trainer

TOL = 1e-9  # float64, relative


def pipelined_worker(
    rank: int,
    world_size: int,
    folder: str,
    save_to: str,
    pp: int,
    steps: int,
    chunks: int = 4,
    schedule: str = "gpipe",
    data_parallel: str = "ddp",
    left: bool = False,
) -> float:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    v = 2 if schedule == "interleaved-1f1b" else 1
    strategy = GPipeStrategy(
        chunks=chunks, pipeline_parallel_size=pp, schedule=schedule, virtual_stages=v, data_parallel=data_parallel
    )
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=steps, precision="64-true")
    data = batches(steps * (world_size // pp), left=left)
    trainer.fit(PipelinedLM(folder, save_to), DataLoader(data, batch_size=None))
    return float(trainer.callback_metrics["train_loss"])


class PairedPlainLM(PlainLM):
    """DDP over the replicas, as one process: each step's batch is the list of theirs, its loss the mean."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return sum(super(PairedPlainLM, self).training_step(b, batch_idx) for b in batch) / len(batch)


def plain_run(folder: Path, steps: int, replicas: int = 1, left: bool = False, precision: str = "64-true") -> Any:
    items = batches(steps * replicas, left=left)
    # The pipelined run's order: Lightning shards a training loader over the replicas with a shuffling
    # DistributedSampler (seed 0, epoch 0); at step s replica d takes the s-th item of its share.
    shares = [list(DistributedSampler(items, replicas, d, shuffle=True, seed=0)) for d in range(replicas)]
    data: list[Any] = [[items[share[s]] for share in shares] for s in range(steps)]
    module = PairedPlainLM(folder)
    quiet_trainer(max_steps=steps, precision=precision).fit(
        module, DataLoader(data, batch_size=None, collate_fn=lambda b: b)
    )
    return module.model


def compare(saved: Path, plain: Any, relative: bool = False, trained_from: Path | None = None) -> dict[str, float]:
    """Every weight and the logits of ``from_pretrained(saved)`` against the plain run's model (in float64; each
    relative to the tensor's largest value if ``relative``)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64, **EAGER).double()
    # from_pretrained keeps some tensors in float32 (routers, attention sinks: _keep_in_fp32_modules_strict), which
    # Lightning's "64-true" made float64 in both runs: compare what was written.
    # (A folder HF's save_pretrained wrote holds a mixture of experts per expert: from_pretrained fused those.)
    names = set(loaded.state_dict())
    written = {k: v for f in saved.glob("*.safetensors") for k, v in load_file(f).items() if k in names}
    loaded.load_state_dict(written, strict=False)
    plain = plain.double()
    got, want = loaded.state_dict(), plain.state_dict()
    assert set(got) == set(want)
    scale = {k: want[k].abs().max().item() if relative else 1.0 for k in want}
    errors = {k: (got[k] - want[k]).abs().max().item() / max(scale[k], 1e-30) for k in want}
    batch = batches(1, seed=7)[0]
    with torch.no_grad():
        args = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        want_logits = plain.eval()(**args).logits
        diff = (loaded.eval()(**args).logits - want_logits).abs().max().item()
        errors["logits"] = diff / (want_logits.abs().max().item() if relative else 1.0)
    start = torch_initial(trained_from or saved.parent / "pretrained")
    moved = max((want[k] - v).abs().max().item() for k, v in start.items())
    assert moved > 1e-3  # the runs trained
    return errors


def torch_initial(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **EAGER).state_dict()
