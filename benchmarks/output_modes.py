"""Cost of giving every stage the pipeline's output (output="all") vs zeros of its shape ("placeholder"), at K=2."""

# A large-vocabulary head: the output is N × T × V logits, which "all" sends from the last stage to every other one.
# Run from the repo root: python -m benchmarks.output_modes [--vocab 32000]

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.machine import Runner, Timing, add_timing_args, launch, machine_info, measure, stats
from benchmarks.report import RESULTS
from lightning_gpipe.pipe import GPipeStage

D_MODEL, LAYERS, BATCH, SEQ, M = 256, 6, 16, 32, 4


def build_model(vocab: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Embedding(vocab, D_MODEL)]
    layers += [
        nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))
        for _ in range(LAYERS)
    ]
    layers.append(nn.Linear(D_MODEL, vocab))
    return nn.Sequential(*layers)


def run_job(rank: int, world: int, job: dict) -> dict:
    vocab = job["vocab"]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    y = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    model = build_model(vocab)
    half = len(model) // 2
    stage = GPipeStage(model, chunks=M, balance=[half, len(model) - half], output="all")

    def step(mode: str) -> Any:
        stage.output_mode = mode
        logits = stage(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if stage.is_last:
            loss.backward()
        stage.backward()
        return loss.item()

    def runner(mode: str) -> Runner:
        return Runner(lambda: stage.zero_grad(set_to_none=True), lambda: step(mode))

    m = measure({"all": runner("all"), "loss": runner("placeholder")}, job["timing"])
    return {"records": m.records, "first": m.first, "paused_s": m.paused_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", default=str(RESULTS / "output_modes.json"))
    args = parser.parse_args()
    timing = Timing.from_args(parser, args)
    info = machine_info()
    output_mb = BATCH * SEQ * args.vocab * 4 / 2**20
    print(
        f"# {info['cpu_model']}, {info['usable_cores']} usable cores, torch {info['torch']}, {info['date']}\n"
        f"# K=2, M={M}, batch {BATCH}x{SEQ}, d={D_MODEL}, vocab {args.vocab}: output {output_mb:.1f} MiB fp32",
        flush=True,
    )
    raw = launch(run_job, 2, {"timing": timing, "vocab": args.vocab})
    rows = {mode: stats(recs, BATCH) for mode, recs in raw["records"].items()}
    ratio = rows["all"]["median_ms"] / rows["loss"]["median_ms"]
    print(f"{'output':<8} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'clean/timed':>12}")
    for mode, r in rows.items():
        print(
            f"{mode:<8} {r['median_ms']:>10.1f} {r['min_ms']:>9.1f} {r['max_ms']:>9.1f} "
            f"{r['clean_steps']:>5}/{r['timed_steps']:<6}"
        )
    print(
        f"step time all / loss: {ratio:.3f} (loss: first step {raw['first']['all']:.6f} vs {raw['first']['loss']:.6f})"
    )
    out = {"machine": info, "vocab": args.vocab, "output_mib": output_mb, "rows": rows, "all_over_loss": ratio}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
