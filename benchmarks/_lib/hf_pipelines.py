"""peers_hf.py's HF Llama split two ways: causal_lm_backbone's stages (ours) and a pruned copy per stage (torch's)."""

# torch's side is split as its users split a HF model (torchtitan's way): a deep copy of the whole model per stage,
# the modules the stage does not hold deleted (stage 0 keeps the embedding and the first half of the decoder layers,
# the last the second half, the final norm and the LM head), and the stage's forward is the HF model's own
# (LlamaModel.forward: embedding, causal mask, rotary embeddings, the layers, the norm), so each stage computes the
# mask and the rotary embeddings once per micro-batch, exactly as the model does. Its stages run under one
# torch.utils.checkpoint each (every micro-batch recomputed), as peers.py's; the loss per micro-batch on the last stage.

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks._lib import workloads as wl
from lightning_gpipe.hf import causal_lm_backbone, causal_lm_loss, named_hf_tensors
from lightning_gpipe.pipe import GPipeStage

# A tiny-but-not-trivial Llama (8.4 M parameters; a plain step on 16 × 64 tokens takes about 0.9 s on one core).
LLAMA = {"hidden": 256, "ffn": 768, "layers": 8, "heads": 8, "kv_heads": 4, "vocab": 4096, "batch": 16, "seq": 64}
SMOKE_LLAMA = {"hidden": 32, "ffn": 64, "layers": 4, "heads": 4, "kv_heads": 2, "vocab": 128, "batch": 8, "seq": 16}


def build_llama(shape: dict) -> nn.Module:
    """The HF model, random init (seeded), fp32, no dropout, no KV cache (training)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape["hidden"], intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
        tie_word_embeddings=False, use_cache=False, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(wl.SEED)
    return LlamaForCausalLM(config).train()


def tokens(shape: dict, length: int, seed: int = wl.SEED + 1) -> Tensor:
    """A batch of token ids, the same on every rank; the labels are the ids (shifted inside the loss)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape["vocab"], (shape["batch"], length), generator=g)


def balance(shape: dict) -> list[int]:
    """The backbone's layers (embedding, decoder layers, head) in two halves: the same split as torch's stages."""
    half = shape["layers"] // 2
    return [1 + half, half + 1]


# -------------------------------------------------------------------------------------------------------- ours
def ours(model: nn.Module, shape: dict, M: int, group: Any, checkpoint: str) -> GPipeStage:
    backbone = causal_lm_backbone(copy.deepcopy(model))
    return GPipeStage(backbone, chunks=M, balance=balance(shape), checkpoint=checkpoint, group=group)


def ours_step(stage: GPipeStage, ids: Tensor, schedule: str) -> float | None:
    """``forward_backward`` with causal_lm_loss per micro-batch on the last stage, weighted by its share of the
    labelled tokens (every token is labelled: n_m / N), so the M terms add up to the whole batch's mean."""
    per_micro = wl.per_micro_batch(causal_lm_loss, ids, stage.micro_batch_sizes(ids))
    losses = stage.forward_backward(ids if stage.is_first else None, per_micro, schedule=schedule)  # type: ignore[arg-type]
    return torch.stack(losses).sum().item() if stage.is_last else None


def ours_grads(stage: GPipeStage) -> dict[str, Tensor | None]:
    return {name: t.grad for name, t in named_hf_tensors(stage) if isinstance(t, nn.Parameter)}


# ------------------------------------------------------------------------------------------------------ torch's
class TorchStage(nn.Module):
    """One stage of torch's pipeline: the pruned copy of the HF model, run by its own forward under one checkpoint."""

    def __init__(self, model: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def run(self, x: Tensor) -> Tensor:
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = self.model.model(**inputs, use_cache=False).last_hidden_state
        return self.model.lm_head(hidden) if self.last else hidden

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.run, x, use_reentrant=False)


def torch_stage(model: nn.Module, shape: dict, rank: int) -> tuple[TorchStage, dict[str, nn.Parameter]]:
    """Rank ``rank``'s stage module (K = 2) and its parameters under their names in the HF model."""
    pruned = copy.deepcopy(model)
    named = dict(pruned.named_parameters())
    base, half = pruned.model, shape["layers"] // 2
    base.layers = nn.ModuleList(list(base.layers)[:half] if rank == 0 else list(base.layers)[half:])
    if rank == 0:
        base.norm, pruned.lm_head = nn.Identity(), None  # the final norm and the head live on the last stage
    else:
        base.embed_tokens = None  # fed inputs_embeds: the hidden states stage 0 sends
    stage = TorchStage(pruned, first=rank == 0, last=rank == 1)
    held = {id(p) for p in stage.parameters()}
    return stage, {n: p for n, p in named.items() if id(p) in held}


def build_torch(
    model: nn.Module, shape: dict, rank: int, M: int, group: Any, schedule: str
) -> tuple[Any, TorchStage, dict[str, nn.Parameter]]:
    """torch's K = 2 pipeline on this rank: ``ScheduleGPipe`` or (``"1f1b"``) ``Schedule1F1B``, its stage module,
    and the module's parameters under their names in the HF model."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module, names = torch_stage(model, shape, rank)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"), group=group)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return cls(stage, n_microbatches=M, loss_fn=causal_lm_loss), module, names


def torch_grads(names: dict[str, nn.Parameter]) -> dict[str, Tensor | None]:
    return {n: p.grad for n, p in names.items()}


def torch_step(schedule: Any, last: bool, ids: Tensor) -> float | None:
    """One step of torch's schedule; the mean of the per-micro-batch token means (equal micro-batches: the whole
    batch's mean, which torch's schedule also back-propagates, dividing each micro-batch's gradient by M)."""
    if last:
        losses: list[Tensor] = []
        schedule.step(target=ids, losses=losses, return_outputs=False)
        return torch.stack([loss.detach() for loss in losses]).mean().item()
    schedule.step(ids, return_outputs=False)
    return None


# -------------------------------------------------------------------------------------------------------- plain
def plain_step(model: nn.Module, ids: Tensor) -> float:
    loss = causal_lm_loss(model(input_ids=ids).logits, ids)
    loss.backward()
    return loss.item()


def plain_grads(model: nn.Module) -> dict[str, Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def max_grad_diff(got: dict[str, Tensor | None], ref: dict[str, Tensor | None]) -> float:
    """The largest absolute difference from the reference's gradients, over the tensors this rank holds."""
    diffs = [(g - ref[n]).abs().max().item() for n, g in got.items() if g is not None and ref[n] is not None]
    missing = [n for n, g in got.items() if g is None]
    return float("inf") if missing or not diffs else max(diffs)


# ------------------------------------------------------------------------------------------- variable lengths
def torch_rebuilt_step(module: TorchStage, rank: int, M: int, group: Any, ids: Tensor) -> float | None:
    """A new torch PipelineStage + Schedule1F1B around the same stage module, then one step (shapes inferred anew)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(module, rank, 2, torch.device("cpu"), group=group)
    return torch_step(Schedule1F1B(stage, n_microbatches=M, loss_fn=causal_lm_loss), rank == 1, ids)


def probe_worker(spec: dict) -> None:
    """One rank of a probe (peers_variable.start_probes' worker): torch's Schedule1F1B built for the first length,
    stepped at each length in turn; what each step did goes to rank<k>.json after every step."""
    rank, path = spec["rank"], Path(spec["dir"]) / f"rank{spec['rank']}.json"
    fd = os.open(Path(spec["dir"]) / f"out{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)  # gloo's C++ abort message goes to stderr: keep it
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=spec["pg_timeout"])
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=2, timeout=timeout)
    shape = spec["shape"]
    model = build_llama(shape)
    schedule, module, _ = build_torch(model, shape, rank, spec["M"], None, "1f1b")
    steps: list[dict] = []
    for i, length in enumerate(spec["lengths"]):
        ids = tokens(shape, length, seed=1000 + i)
        module.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        try:
            loss = torch_step(schedule, rank == 1, ids)
            rec = {"step": i, "L": length, "ms": (time.perf_counter() - t0) * 1e3, "loss": loss}
            if rank == 1:
                rec["plain_loss"] = plain_step(copy.deepcopy(model), ids)
                rec["rel_diff_vs_plain"] = abs(loss - rec["plain_loss"]) / abs(rec["plain_loss"])  # type: ignore[operator]
        except Exception as e:  # what torch does is the result
            rec = {"step": i, "L": length, "error": f"{type(e).__name__}: {e}".strip()}
        steps.append(rec)
        path.write_text(json.dumps(steps))
        if "error" in rec:
            break
    with contextlib.suppress(Exception):  # a peer already gone
        dist.destroy_process_group()
