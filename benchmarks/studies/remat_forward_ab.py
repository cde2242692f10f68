"""A/B: a checkpointed micro-batch's forward under ``no_grad`` vs in the recompute's grad mode with nothing saved."""

# rematerialize.first_forward takes the second on accelerators (the same kernels as the recompute) and the first on
# the CPU. This measures what the second would cost on the CPU: peers.py's model (8 Transformer encoder layers, d 256,
# batch 64 × 32), K = 2, M = 8, stage.forward_backward under each schedule, the two forwards alternating step by step in
# the same two processes. `python -m benchmarks.studies.remat_forward_ab` (about 3 min on 2 cores; `--smoke`: a small
# stack, seconds; `--out-dir DIR`); results in benchmarks/results/remat_forward_ab/README.md.

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from benchmarks._lib import report
from benchmarks._lib.machine import launch

FULL = {"layers": 8, "d": 256, "heads": 4, "ffn": 1024, "batch": 64, "seq": 32, "M": 8, "steps": 14, "warmup": 3}
SMOKE = {"layers": 2, "d": 32, "heads": 2, "ffn": 64, "batch": 8, "seq": 8, "M": 4, "steps": 3, "warmup": 1}
FORWARDS = ("no_grad", "grad mode, nothing saved")


def run_job(rank: int, world: int, job: dict) -> dict[str, list[float]]:
    import lightning_gpipe.pipe.run.executor as schedule_module
    from lightning_gpipe.pipe import GPipeStage
    from lightning_gpipe.pipe.state.rematerialize import discarded_graph

    torch.manual_seed(0)
    size, schedule = job["size"], job["schedule"]
    layers = [
        nn.TransformerEncoderLayer(size["d"], size["heads"], size["ffn"], dropout=0.1, batch_first=True)
        for _ in range(size["layers"])
    ]
    half = size["layers"] // 2
    stage = GPipeStage(nn.Sequential(*layers), chunks=size["M"], balance=[half, size["layers"] - half])
    x, y = torch.randn(size["batch"], size["seq"], size["d"]), torch.randn(size["batch"], size["seq"], size["d"])
    sizes = stage.micro_batch_sizes(x)
    starts = [sum(sizes[:m]) for m in range(len(sizes))]

    def loss(out: torch.Tensor, m: int) -> torch.Tensor:
        target = y[starts[m] : starts[m] + sizes[m]]
        return nn.functional.mse_loss(out, target, reduction="sum") / y.numel()

    forwards: dict[str, Any] = dict(zip(FORWARDS, (lambda device: torch.no_grad(), lambda device: discarded_graph())))
    times: dict[str, list[float]] = {name: [] for name in forwards}
    for step in range(size["steps"]):
        for name, forward in forwards.items():
            schedule_module.first_forward = forward  # type: ignore[assignment]
            start = time.perf_counter()
            stage.forward_backward(x, loss, schedule=schedule)  # type: ignore[arg-type]
            if step >= size["warmup"]:
                times[name].append(time.perf_counter() - start)
    return times


COLUMNS: list[report.Column] = [
    ("schedule", "schedule", ""),
    ("no_grad_ms", "median step ms, no_grad", ".0f"),
    ("grad_mode_ms", "median step ms, grad mode (nothing saved)", ".0f"),
    ("paired_ratio", "median of the paired step ratios (grad mode / no_grad)", ".3f"),
    ("steps", "timed steps each", ""),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="2 small layers, M=4, 3 steps")
    args = parser.parse_args()
    size = SMOKE if args.smoke else FULL
    env = report.environment(threads_per_process=1, processes="2, one per stage, fresh per schedule (gloo)")
    print(env)
    rows, raw = [], {}
    for schedule in ("gpipe", "1f1b"):
        # rank 0: stage 0, the one that recomputes
        times = raw[schedule] = launch(run_job, 2, {"size": size, "schedule": schedule})
        before, now = (times[name] for name in FORWARDS)
        paired = statistics.median(n / b for b, n in zip(before, now))
        row = {"schedule": schedule, "no_grad_ms": statistics.median(before) * 1e3}
        rows.append(row | {"grad_mode_ms": statistics.median(now) * 1e3, "paired_ratio": paired, "steps": len(now)})
        print(
            f"{schedule}: median step {row['no_grad_ms']:.0f} ms (no_grad), {rows[-1]['grad_mode_ms']:.0f} ms "
            f"(grad mode, nothing saved); median of the {len(now)} paired step ratios {paired:.3f}"
        )
    command = report.command_line("studies.remat_forward_ab")
    md = ["# A checkpointed forward, no_grad vs grad mode with nothing saved: forward_backward at K = 2", ""]
    md += [*report.environment_lines(env), f"- Command: `{command}`"]
    shape = ", ".join(f"{k} {v}" for k, v in size.items())
    md += [f"- {shape}; the two forwards alternate step by step in the same processes (stage 0's times)", ""]
    md += [report.markdown_table(rows, COLUMNS)]
    data = {"command": command, "environment": env, "size": size, "rows": rows, "raw": raw}
    paths = report.write("remat_forward_ab", data, "\n".join(md), out_dir=args.out_dir)
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
