"""Data loading per pipeline: every stage decodes the batch (K×) vs stage 0 decodes it once and broadcasts it."""

# What it runs: K = 2 processes (gloo on 127.0.0.1, one compute thread each) train a small conv backbone pipelined
# by GPipeStage on images that each step decodes from JPEG, crops at random (seeded by the sample's index, so every
# stage gets the same batch), resizes and flips: ImageNet's input pipeline in small. Two ways to get the batch, in
# blocks taken by turns (the first step of a block is left out of the step times):
#   every_stage -- each stage iterates its own DataLoader, as GPipeStrategy(data_loading="every_stage") does;
#   first_stage -- stage 0 iterates it in BatchFeed's loader thread, up to two batches ahead, and broadcasts each
#                  batch to stage 1 (GPipeStrategy(data_loading="first_stage")); one stream for the whole run, its
#                  thread idle between its blocks once two batches wait.
# Per batch a step took, summed over the pipeline's stages and over whole blocks (the two batches the thread loads
# ahead at the end of a block count in that block): the CPU time spent loading (the dataset's decode and transforms,
# the thread CPU of whichever thread ran them) and the processes' whole CPU time (so the broadcast's cost shows);
# and the step's wall time (median). Writes results/input_pipeline.{json,md,png}. From the repo root:
#   python -m benchmarks.input_pipeline

from __future__ import annotations

import argparse
import itertools
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks._lib import report
from benchmarks._lib.machine import launch
from lightning_gpipe.pipe import GPipeStage
from lightning_gpipe.pipe.comm.batch_feed import BatchFeed

MODES = ("every_stage", "first_stage")
COLUMNS = [
    ("mode", "data_loading", ""),
    ("loading_ms", "loading CPU / step (ms, all stages)", ".1f"),
    ("loading_ratio", "÷ every_stage", ".2f"),
    ("cpu_ms", "process CPU / step (ms, all stages)", ".0f"),
    ("step_ms", "step (ms, median)", ".0f"),
    ("step_ratio", "÷ every_stage", ".2f"),
]


class JpegImages(Dataset):
    """Pre-encoded JPEGs; each sample is decoded, cropped at random (seeded by its index; side ½–1 of the image),
    resized to ``crop`` and flipped, as ImageNet's RandomResizedCrop pipeline does."""

    def __init__(self, n: int, size: int, crop: int) -> None:
        from torchvision.io import encode_jpeg

        g = torch.Generator().manual_seed(0)
        smooth = nn.functional.interpolate(torch.rand(n, 3, size // 8, size // 8, generator=g), size=size)
        self.jpegs = [encode_jpeg((img * 255).to(torch.uint8), quality=90) for img in smooth]
        self.crop, self.loaded_ns = crop, 0

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from torchvision.io import decode_jpeg

        start = time.thread_time_ns()
        g = torch.Generator().manual_seed(i)
        img = decode_jpeg(self.jpegs[i])
        side = int(torch.randint(img.shape[-1] // 2, img.shape[-1] + 1, (1,), generator=g))
        top, left = (int(v) for v in torch.randint(0, img.shape[-1] - side + 1, (2,), generator=g))
        img = img[:, top : top + side, left : left + side].float().unsqueeze(0)
        x = nn.functional.interpolate(img, size=self.crop, mode="bilinear", antialias=True)[0]
        if torch.rand(1, generator=g) < 0.5:
            x = x.flip(-1)
        x = (x / 255 - 0.45) / 0.225
        self.loaded_ns += time.thread_time_ns() - start
        return x, i % 10


def backbone() -> nn.Sequential:
    torch.manual_seed(0)
    c = [3, 32, 64, 96, 128]
    convs = [nn.Sequential(nn.Conv2d(a, b, 3, stride=2, padding=1), nn.ReLU()) for a, b in itertools.pairwise(c)]
    return nn.Sequential(*convs, nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c[-1], 10)))


def run_job(rank: int, world: int, job: dict) -> dict:
    group = dist.new_group(list(range(world)), backend="gloo")
    feed_group = dist.new_group(list(range(world)), backend="gloo")
    data = JpegImages(job["samples"], job["size"], job["crop"])
    stage = GPipeStage(backbone(), chunks=job["chunks"], balance=job["balance"], group=group)
    opt = torch.optim.SGD(stage.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=job["batch"], shuffle=False)
    per_mode: dict[str, dict[str, list[float]]] = {
        m: {"step": [], "loading": [], "cpu": [], "batches": []} for m in MODES
    }
    feed = BatchFeed(feed_group, rank == 0, timeout_s=300)
    fed = iter(feed.stream(loader))  # one stream for every first_stage block: its thread waits between them
    for block in range(job["blocks"] * len(MODES)):
        mode = MODES[block % len(MODES)]
        record = per_mode[mode]
        batches = fed if mode == "first_stage" else iter(loader)
        dist.barrier(group=group)
        cpu, loaded = _cpu_s(), data.loaded_ns
        for step in range(job["steps"] + 1):
            dist.barrier(group=group)
            wall = time.perf_counter()
            x, y = next(batches)
            out = stage(x)
            if stage.is_last:
                nn.functional.cross_entropy(out, y).backward()
            stage.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier(group=group)
            if step > 0:  # the first of a block may wait for a DataLoader to start
                record["step"].append(time.perf_counter() - wall)
        record["cpu"].append(_cpu_s() - cpu)
        record["loading"].append((data.loaded_ns - loaded) / 1e9)
        record["batches"].append(job["steps"] + 1)
    feed.close()
    mine = {m: {k: sum(v) for k, v in r.items()} for m, r in per_mode.items()}
    mine = {m: v | {"step_median": statistics.median(per_mode[m]["step"])} for m, v in mine.items()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return {"per_rank": gathered}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def plot(data: dict) -> Any:
    """Loading CPU and step time per mode, from a results file's JSON."""
    rows, job = data["rows"], data["job"]
    fig, axes = report.subplots(1, 2, figsize=(10, 4))
    modes = [r["mode"] for r in rows]
    for ax, key, label in (
        (axes[0][0], "loading_ms", "loading CPU per step, all stages (ms)"),
        (axes[0][1], "step_ms", "step time, median (ms)"),
    ):
        ax.bar(modes, [r[key] for r in rows], color=["tab:gray", "tab:blue"][: len(rows)])
        ax.set(ylabel=label)
    what = (
        "One input pipeline per pipeline: every stage decodes vs stage 0 decodes and broadcasts\n"
        f"K = 2 CPU processes, {job['batch']} JPEGs of {job['size']}² decoded, cropped, resized to {job['crop']}² "
        f"per step, "
        f"M = {job['chunks']}"
    )
    return report.title(fig, what, data["environment"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=448, help="side of the stored JPEGs")
    parser.add_argument("--crop", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="measured per block")
    parser.add_argument("--blocks", type=int, default=4, help="per mode, taken by turns")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--smoke", action="store_true", help="small images, two short blocks per mode")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.size, args.crop, args.steps, args.blocks = 8, 64, 32, 2, 1
    job = {k: getattr(args, k) for k in ("batch", "size", "crop", "chunks", "steps", "blocks")}
    job |= {"samples": args.batch * ((args.steps + 1) * args.blocks + 3), "balance": [3, 2]}
    result = launch(run_job, 2, job)
    per_rank = result["per_rank"]
    rows = []
    for mode in MODES:
        steps = per_rank[0][mode]["batches"]
        rows.append(
            {
                "mode": mode,
                "loading_ms": sum(r[mode]["loading"] for r in per_rank) / steps * 1e3,
                "cpu_ms": sum(r[mode]["cpu"] for r in per_rank) / steps * 1e3,
                "step_ms": max(r[mode]["step_median"] for r in per_rank) * 1e3,
                "per_stage_loading_ms": [r[mode]["loading"] / steps * 1e3 for r in per_rank],
            }
        )
    for row in rows:
        row["loading_ratio"] = row["loading_ms"] / rows[0]["loading_ms"]
        row["step_ratio"] = row["step_ms"] / rows[0]["step_ms"]
    env = report.environment(threads_per_process=1, processes="2 (K = 2)")
    md = "\n".join(
        [
            "# Data loading per pipeline: every stage vs stage 0 once (data_loading)",
            "",
            *report.environment_lines(env),
            f"- Command: `{report.command_line('input_pipeline')}`",
            f"- {args.batch} JPEGs of {args.size}² per step, decoded, cropped at random, resized to {args.crop}² and "
            f"flipped; a 5-layer conv backbone, K = 2, M = {args.chunks}; {args.blocks} blocks of {args.steps} steps "
            "per mode, by turns; loading and process CPU summed over both stages per step; step: median, slowest stage",
            "",
            report.markdown_table(rows, COLUMNS),
        ]
    )
    data = {"command": report.command_line("input_pipeline"), "environment": env, "job": job, "rows": rows}
    paths = report.write("input_pipeline", data, md, out_dir=args.out_dir, plot=plot)
    print(md)
    print(paths)


if __name__ == "__main__":
    main()
