"""Cost of giving every stage the pipeline's output (output="all") vs zeros of its shape ("placeholder"), at K=2."""

# A large-vocabulary head: the output is N × T × V logits, which "all" sends from the last stage to every other one.
# Run from the repo root: python -m benchmarks.studies.output_modes [--vocab 32000] [--smoke] [--out-dir DIR]

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._lib import report
from benchmarks._lib.machine import Runner, Timing, add_timing_args, launch, measure, stats
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
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out-dir", default=str(report.RESULTS), help="writes output_modes.json and .md there")
    where.add_argument("--out", default=None, help="the JSON's path instead (the Markdown beside it, same stem)")
    parser.add_argument("--smoke", action="store_true", help="a 1000-word vocabulary, 5 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        args.vocab, args.steps, args.max_steps, args.warmup, args.wait_quiet = 1000, 5, 5, 1, 0.0
    timing = Timing.from_args(parser, args)
    info = report.environment(threads_per_process=1, processes="2, one per stage (gloo, 127.0.0.1)")
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
    command = report.command_line("studies.output_modes")
    out = {"command": command, "environment": info, "vocab": args.vocab, "output_mib": output_mb, "rows": rows}
    out |= {"all_over_loss": ratio, "first_loss": raw["first"]}
    md = [f"# output='all' vs 'placeholder' at K=2: the pipeline's output ({output_mb:.1f} MiB) to every stage", ""]
    md += [*report.environment_lines(info), f"- Command: `{command}`"]
    md += [f"- M={M}, batch {BATCH}x{SEQ}, d={D_MODEL}, vocab {args.vocab}; the modes alternate step by step", ""]
    md += [report.markdown_table([{"output": MODES[m], **r} for m, r in rows.items()], COLUMNS), ""]
    md += [f"Step time all / placeholder: {ratio:.3f}."]
    path = Path(args.out) if args.out else Path(args.out_dir) / "output_modes.json"
    paths = report.write(path.stem, out, "\n".join(md), out_dir=path.parent)
    print(f"# wrote {', '.join(paths.values())}")


MODES = {"all": "`all` (logits sent to every stage)", "loss": "`placeholder` (a header only; zeros there)"}
COLUMNS: list[report.Column] = [
    ("output", "output", ""),
    ("median_ms", "median ms", ".1f"),
    ("min_ms", "min ms", ".1f"),
    ("max_ms", "max ms", ".1f"),
    ("clean_steps", "clean steps", ""),
    ("timed_steps", "timed steps", ""),
]


if __name__ == "__main__":
    main()
