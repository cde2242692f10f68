"""Built in configure_model under GPipeStrategy, a HF model is materialized per stage with transformers' own
initialization, and a pretrained folder is read into it per stage: each rank's tensor memory grows by its stage's
parameters (measured as glibc's heap in use after materialization and after the load), not the model's."""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.hf.lm import PipelinedLM, batches

transformers = pytest.importorskip(
    "transformers", reason="the HuggingFace tests need transformers: pip install -e '.[hf]'"
)


def big_config() -> Any:
    """31 M parameters (125 MB in float32); no tensor above 5 % of a stage, so the one a rank reads or initializes at
    a time stays within the 10 % allowed."""
    return transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        vocab_size=1024, tie_word_embeddings=False, initializer_range=0.02, pad_token_id=0,
    )  # fmt: skip


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back: every CPU tensor's memory (torch allocates it there),
    not Python's small objects nor the pages of loaded libraries, which the resident set also counts."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class Measured(PipelinedLM):
    def configure_model(self) -> None:
        if self.backbone is None:
            self.heap = [heap_in_use()]
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
        self.heap.append(heap_in_use())  # materialized
        super().on_fit_start()
        self.heap.append(heap_in_use())  # the pretrained weights read in


def memory_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    module = Measured(folder, cfg=big_config())
    trainer = quiet_trainer(devices=2, strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=2), max_steps=1)
    trainer.fit(module, DataLoader(batches(1), batch_size=None))
    before, materialized, loaded = module.heap
    return {"stage": module.stage_bytes, "heap": (materialized - before, loaded - before), "init": module.init}


@pytest.mark.timeout(200)
def test_each_rank_materializes_and_reads_only_its_stage(tmp_path: Path) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(big_config()).save_pretrained(tmp_path)
    whole = sum(p.nelement() * 4 for p in transformers.LlamaForCausalLM(big_config()).parameters())
    results = run_distributed(memory_worker, 2, str(tmp_path), timeout=180, lightning=True)
    for rank, r in enumerate(results):
        assert r["stage"] < 0.6 * whole, (rank, r["stage"], whole)
        assert max(r["heap"]) <= 1.1 * r["stage"], (rank, [h / r["stage"] for h in r["heap"]])
        for name, (std, mean) in r["init"].items():
            if name.endswith("q_proj.weight"):
                assert std == pytest.approx(0.02, rel=0.05), name
            else:  # the norms' ones, the padding row's zeros
                assert (std, mean) in [(0.0, 1.0), (0.0, 0.0)], name
    assert {"padding row"} <= set(results[0]["init"])
