"""Long skips declared (Stash/Pop, sent straight between their stages) vs threaded through every layer in a tuple."""

# What it runs: the guide's U-Net ("Long skip connections", docs/guide.md) at K = 3 on three processes (gloo, one
# thread each: on a 2-core machine the processes share the cores, so the step times are labelled oversubscribed),
# split [6, 2, 6]: the encoder and both stashes on stage 0, the bottleneck on stage 1, both pops and the decoder on
# stage 2. "declared": the module as the guide writes it. "threaded": the same layers and weights, each wrapped to
# take and return (x, *skips), so a skip rides through stage 1 with x and its gradient back -- what a user writes
# without declarations. Both alternate step by step in the same processes (forward + loss + backward, 1F1B, loss per
# micro-batch); each link's tensor bytes are counted by the transport. Run it from the repo root:
#   python -m benchmarks.skips            (--smoke: smaller images, a few steps)

from __future__ import annotations

import argparse
import copy
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._lib import report
from benchmarks._lib.machine import Timing, add_timing_args, launch, max_over_ranks, measure, stats, wait_quiet, zeroed
from lightning_gpipe.pipe import GPipeStage, Pop, Stash

BALANCE = [6, 2, 6]
SYSTEMS = ("declared", "threaded")
COLS = (
    "system|system|; median_ms|median ms (oversubscribed)|.1f; min_ms|min|.1f; clean|clean/timed|; "
    "stage1_mb|stage 1 MB in + out per step|.2f; skip_mb|stage 0 ↔ 2 MB per step|.2f; grad_diff|max abs. grad diff "
    "vs plain|.1e"
)


def guide_unet(c: int) -> nn.Sequential:
    """The guide's ``unet(classes=3, c)``, run from the guide's own code block."""
    text = (Path(__file__).parents[1] / "docs" / "guide.md").read_text()
    section = text[text.index("### Long skip connections") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    scope: dict[str, Any] = {}
    exec(compile(code.group(1), "docs/guide.md", "exec"), scope)
    return scope["unet"](3, c)


class Threaded(nn.Module):
    """A layer of the U-Net on (x, *skips): a Stash appends x, a Pop merges the last skip, other layers map x."""

    def __init__(self, layer: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        # Not the Stash and Pop layers themselves: their declarations would route the skips.
        self.kind = "stash" if isinstance(layer, Stash) else "pop" if isinstance(layer, Pop) else "map"
        self.layer = layer if self.kind == "map" else nn.Identity()
        self.first, self.last = first, last

    def forward(self, t: Any) -> Any:
        x, *skips = (t,) if self.first else t
        if self.kind == "stash":
            out = (x, *skips, x)
        elif self.kind == "pop":
            *skips, skip = skips
            out = (torch.cat([x, skip], 1), *skips)
        else:
            out = (self.layer(x), *skips)
        return out[0] if self.last else out


def threaded(model: nn.Sequential) -> nn.Sequential:
    n = len(model)
    return nn.Sequential(*(Threaded(layer, i == 0, i == n - 1) for i, layer in enumerate(model)))


def run_job(rank: int, world: int, job: dict) -> dict:
    torch.manual_seed(0)
    model = guide_unet(job["c"])
    g = torch.Generator().manual_seed(1)
    N, H = job["batch"], job["size"]
    x, y = torch.randn(N, 3, H, H, generator=g), torch.randn(N, 3, H, H, generator=g)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(x), y).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    sizes = [len(c) for c in torch.arange(N).tensor_split(job["M"])]
    offsets = [sum(sizes[:m]) for m in range(len(sizes))]

    def loss_fn(out: torch.Tensor, m: int) -> torch.Tensor:
        return F.mse_loss(out, y[offsets[m] : offsets[m] + sizes[m]]) * (sizes[m] / N)

    stages = {
        "declared": GPipeStage(copy.deepcopy(model), chunks=job["M"], balance=BALANCE),
        "threaded": GPipeStage(threaded(copy.deepcopy(model)), chunks=job["M"], balance=BALANCE),
    }
    runners = {
        name: zeroed(s, lambda s=s: s.forward_backward(x, loss_fn, schedule="1f1b")) for name, s in stages.items()
    }
    m = measure(runners, job["timing"])
    grad_diff = {}
    for name, s in stages.items():
        prefix = "layer." if name == "threaded" else ""
        d = 0.0
        for n, p in s.named_parameters():
            key = n.replace(prefix, "", 1) if prefix else n
            d = max(d, (p.grad - ref_grads[key]).abs().max().item()) if p.grad is not None else d
        grad_diff[name] = max_over_ranks(d)
    steps = {name: len(m.records[name]) + job["timing"].warmup for name in stages}
    traffic = {
        name: {
            "sent": sum(s._executor.peers().transport.bytes_sent.values()),
            "received": sum(s._executor.peers().transport.bytes_received.values()),
            "to_2": s._executor.peers().transport.bytes_sent.get(2, 0),
            "from_2": s._executor.peers().transport.bytes_received.get(2, 0),
            "steps": steps[name],
        }
        for name, s in stages.items()
    }
    every: list[Any] = [None] * world
    torch.distributed.all_gather_object(every, traffic)
    return {"records": m.records, "grad_diff": grad_diff, "traffic": every}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_timing_args(parser)
    parser.add_argument("--size", type=int, default=64, help="image height and width")
    parser.add_argument("--channels", type=int, default=16, help="the U-Net's first width c")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4, metavar="M")
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="16 × 16 images, 5 steps, no quiet waits")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.steps, args.max_steps, args.warmup, args.wait_quiet = 16, 5, 5, 1, 0.0
    timing = Timing.from_args(parser, args)
    t0 = time.perf_counter()
    env = report.environment(threads_per_process=1, processes="3 workers spawned by the script (gloo, 127.0.0.1)")
    job = dict(size=args.size, c=args.channels, batch=args.batch, M=args.micro_batches, timing=timing)
    waited = wait_quiet(args.wait_quiet, args.clean_threshold)
    raw = launch(run_job, 3, job)  # rank 0's records (all-reduced times) and every rank's traffic
    rows = []
    for name in SYSTEMS:
        st = stats(raw["records"][name], args.batch)
        per_rank = [t[name] for t in raw["traffic"]]
        n_steps = per_rank[1]["steps"]
        stage1 = per_rank[1]["sent"] + per_rank[1]["received"]
        skip = per_rank[0]["to_2"] + per_rank[0]["from_2"]
        rows.append(
            {
                "system": name,
                **st,
                "clean": f"{st['clean_steps']}/{st['timed_steps']}",
                "stage1_mb": stage1 / n_steps / 1e6,
                "skip_mb": skip / n_steps / 1e6,
                "grad_diff": raw["grad_diff"][name],
            }
        )
    ratio = rows[1]["stage1_mb"] / rows[0]["stage1_mb"]
    speed = rows[1]["median_ms"] / rows[0]["median_ms"]
    total = time.perf_counter() - t0
    md = "\n\n".join(
        [
            "# Long skips: declared (sent straight between stages) vs threaded through every layer",
            "\n".join(
                [*report.environment_lines(env), f"- waited {waited:.0f} s for a quiet machine; total {total:.0f} s"]
            ),
            f"The guide's U-Net (c = {args.channels}), images 3 × {args.size} × {args.size}, batch {args.batch}, "
            f"M = {args.micro_batches}, K = 3 split {BALANCE} (stage 1: the bottleneck), 1F1B with the loss per "
            "micro-batch, float32. Bytes: every tensor each link carried (activations, skips, their gradients), per "
            "training step.",
            report.markdown_table(rows, report.columns(COLS)),
            f"Stage 1's traffic, threaded ÷ declared: **{ratio:.2f}×**; step time threaded ÷ declared: {speed:.2f} "
            "(three processes on two cores).",
            f"Command: `{report.command_line('skips')}`",
        ]
    )
    print(md)
    data = dict(command=report.command_line("skips"), environment=env, job={**job, "timing": vars(timing)})
    data.update(rows=rows, stage1_ratio=ratio, step_ratio=speed, total_s=total)
    paths = report.write("skips", data, md, out_dir=args.out_dir)
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
