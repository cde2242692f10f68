"""Built in configure_model under GPipeStrategy, a HF model is materialized per stage with transformers' own
initialization, and a pretrained folder is read into it per stage: each rank's tensor memory peaks at its stage's
parameters (plus the largest tensor's temporary), never at the model's.

The peak is the running total of the CPU tensor bytes allocated since configure_model() began and not yet freed, as
torch's allocator reports every allocation and free to the profiler (``profile_memory=True``, on the thread that
runs Lightning's setup and hooks, where materialization and loading happen): a peak over time, every tensor counted
(parameters, buffers, the temporaries of initialization and loading), not an end state. The resident
set's peak (VmHWM after a reset at the same start) is reported beside it, not asserted: it also holds the pages that
glibc keeps after a temporary is freed, and the Python objects and modules that Lightning's setup brings in.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.hf_lm import PipelinedLM, batches
from tests.helpers.launch import quiet_trainer, run_distributed

transformers = pytest.importorskip(
    "transformers", reason="the HuggingFace tests need transformers: pip install -e '.[hf]'"
)
LOAD = "load_pretrained"


def big_config() -> Any:
    """22 M parameters (88 MB in float32) whose embedding and head (8192 × 512 each) are 38 % of a stage, as the
    vocabulary of a small LLM is: a temporary the size of one of them would show (the limit allows 10 %)."""
    return transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=8192, tie_word_embeddings=False, initializer_range=0.02, pad_token_id=0,
    )  # fmt: skip


def vm(key: str) -> int:
    """A line of /proc/self/status in bytes (VmRSS, VmHWM)."""
    line = next(s for s in Path("/proc/self/status").read_text().splitlines() if s.startswith(f"{key}:"))
    return int(line.split()[1]) * 1024


def _nodes(nodes: list[Any], inside: bool = False) -> Iterator[tuple[Any, bool]]:
    for node in nodes:
        within = inside or node.name == LOAD
        yield node, within
        yield from _nodes(node.children, within)


def peaks(profiler: Any) -> dict[str, int]:
    """From the profiler's allocation events: the most CPU tensor bytes held at once up to the load, and during it.

    The running total is summed here from each event's size, matched by address: the events' own total counts one
    allocator only (a storage made from a file's bytes, as safetensors' ``load_file`` makes it, reports 0), and a
    tensor allocated before the profiler started is not counted when it is freed."""
    from torch._C._profiler import _EventType

    tree = profiler.profiler.kineto_results.experimental_event_tree()
    events = sorted(
        (node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr, within)
        for node, within in _nodes(tree)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu"
    )
    live: dict[int, int] = {}
    held, before, during = 0, [0], []
    for _, size, ptr, within in events:
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            held += size
        elif ptr in live:
            held -= live.pop(ptr)
        (during if within else before).append(held)
    # Reading in place allocates nothing, and then the load holds the level it started at.
    return {"materialized": max(before), "loaded": max([before[-1], *during]), "held": held}


class Measured(PipelinedLM):
    def configure_model(self) -> None:
        if self.backbone is None:
            from torch.profiler import ProfilerActivity, profile

            Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here (Linux ≥ 4.0)
            self.rss = vm("VmRSS")
            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.__enter__()
        super().configure_model()

    def on_fit_start(self) -> None:
        tensors = [*self.parameters(), *self.buffers()]
        self.stage_bytes = sum(t.nelement() * t.element_size() for t in tensors if not t.is_meta)
        named = dict(self.named_parameters())
        self.init = {  # transformers' _init_weights: normal(0, initializer_range), norms one, padding row zero
            n: (p.std().item(), p.mean().item())
            for n, p in named.items()
            if n.endswith(("q_proj.weight", "norm.weight"))
        }
        if "backbone.0.embed_tokens.weight" in named:
            self.init["padding row"] = (named["backbone.0.embed_tokens.weight"][0].abs().max().item(), 0.0)
        with torch.profiler.record_function(LOAD):
            super().on_fit_start()
        self.profiler.__exit__(None, None, None)
        self.hwm = vm("VmHWM") - self.rss


def memory_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    module = Measured(folder, cfg=big_config())
    trainer = quiet_trainer(devices=2, strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=2), max_steps=1)
    trainer.fit(module, DataLoader(batches(1), batch_size=None))
    return {"stage": module.stage_bytes, "peak": peaks(module.profiler), "hwm": module.hwm, "init": module.init}


@pytest.mark.timeout(200)
def test_each_rank_materializes_and_reads_only_its_stage(tmp_path: Path) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(big_config()).save_pretrained(tmp_path)
    whole = sum(p.nelement() * 4 for p in transformers.LlamaForCausalLM(big_config()).parameters())
    results = run_distributed(memory_worker, 2, str(tmp_path), timeout=180, lightning=True)
    for rank, r in enumerate(results):
        stage, peak = r["stage"], r["peak"]
        ratios = {k: round(v / stage, 3) for k, v in peak.items()} | {"VmHWM": round(r["hwm"] / stage, 3)}
        assert r["stage"] < 0.6 * whole, (rank, r["stage"], whole)
        assert peak["held"] >= stage, (rank, ratios)  # the stage's tensors were counted
        assert max(peak["materialized"], peak["loaded"]) <= 1.1 * stage, (rank, ratios)
        for name, (std, mean) in r["init"].items():
            if name.endswith("q_proj.weight"):
                assert std == pytest.approx(0.02, rel=0.05), name
            else:  # the norms' ones, the padding row's zeros
                assert (std, mean) in [(0.0, 1.0), (0.0, 0.0)], name
    assert {"padding row"} <= set(results[0]["init"])
