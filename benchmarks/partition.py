"""Default partitions against measured time: split by parameters, by FLOPs, or by time itself, worst stage vs mean."""

# The measure: on AmoebaNet-D (18, 256) at 224 px and K = 4, how far the costliest stage is above the mean,
# in forward FLOPs (counted on the meta device) and in forward + backward time measured layer by layer on this
# machine (costs_by_time; a stage's time is the sum of its layers'). Time is measured twice: the "time" partition
# solves on the first measurement, as balance="time" would at setup, and every partition is rated on the second, so
# that no split is rated on the very noise it was fitted to. Also the Transformer T(6, 8192, 16).
# Run from the repo root: python -m benchmarks.partition [--smoke] [--out-dir DIR] [--no-time]

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks._lib import report
from benchmarks._lib.machine import steady_heap
from lightning_gpipe.models.amoebanet import amoebanet_d
from lightning_gpipe.models.transformer import transformer_nmt
from lightning_gpipe.pipe.split.balance import costs_by_flops, costs_by_parameters, costs_by_time, solve

PARTITIONS = ("parameters", "flops", "time")


@dataclass(frozen=True)
class Workload:
    """A backbone, one micro-batch of its input (built on any device) and the stage counts to split it into."""

    name: str
    build: Callable[[], nn.Sequential]
    sample: Callable[[torch.device], Any]
    ks: tuple[int, ...]
    micro_batch: str


def amoebanet(layers: int, filters: int, image: int, images: int, ks: tuple[int, ...]) -> Workload:
    def sample(device: torch.device) -> torch.Tensor:
        return torch.randn(images, 3, image, image, generator=torch.Generator().manual_seed(0)).to(device)

    return Workload(
        f"AmoebaNet-D ({layers}, {filters})",
        lambda: amoebanet_d(1000, layers, filters),
        sample,
        ks,
        f"{images} × 3 × {image} × {image} images",
    )


def transformer(layers: int, ffn: int, heads: int, d: int, vocab: int, shape: tuple[int, int], ks: tuple[int, ...]):
    def sample(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return tuple(torch.randint(3, vocab, shape, generator=g).to(device) for _ in range(2))  # type: ignore[return-value]

    return Workload(
        f"Transformer T({layers}, {ffn}, {heads})",
        lambda: transformer_nmt(layers, ffn, heads, d_model=d, vocab_size=vocab, tie_embeddings=True, max_len=256),
        sample,
        ks,
        f"{shape[0]} × {shape[1]} source and target tokens, d_model {d}, vocabulary {vocab} (tied)",
    )


def workloads(smoke: bool) -> list[Workload]:
    if smoke:
        return [amoebanet(6, 32, 64, 1, (2, 4)), transformer(2, 256, 4, 64, 1000, (4, 16), (2, 4))]
    # As the shipped configs train them: d_18_256.yaml (224 px) and t6_8192_16.yaml (d 1024, 64k vocabulary). The
    # micro-batches are smaller than theirs to keep the CPU timings short; FLOPs grow with them alike on every layer.
    return [amoebanet(18, 256, 224, 1, (2, 4, 8)), transformer(6, 8192, 16, 1024, 64000, (4, 32), (2, 4))]


def stage_sums(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    bounds = list(itertools.accumulate(counts, initial=0))
    return [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]


def worst_over_mean(costs: Sequence[float], counts: Sequence[int]) -> float:
    sums = stage_sums(costs, counts)
    return max(sums) / (sum(sums) / len(sums))


def measure(w: Workload, timed: bool, repeat: int) -> dict:
    """Per-layer parameters and FLOPs (meta device) and, if ``timed``, two measurements of forward + backward
    seconds on the CPU: ``time`` (to split by) and ``time_rated`` (to rate every split by)."""
    with torch.device("meta"):
        model = w.build()
    per_layer: dict[str, Any] = {"names": list(model._modules), "parameters": costs_by_parameters(model)}
    per_layer["flops"] = costs_by_flops(model, w.sample(torch.device("meta")))
    if timed:
        torch.manual_seed(0)
        model = w.build()
        started = time.perf_counter()
        for key in ("time", "time_rated"):
            per_layer[key] = costs_by_time(model, w.sample(torch.device("cpu")), repeat=repeat, warmup=1)
        per_layer["time_measured_s"] = time.perf_counter() - started
        del model
    return per_layer


def rows_of(w: Workload, per_layer: dict) -> list[dict]:
    rows = []
    for K in w.ks:
        for partition in PARTITIONS:
            if partition not in per_layer:
                continue
            counts = solve(per_layer[partition], K)
            rows.append(
                {
                    "model": w.name,
                    "K": K,
                    "partition": partition,
                    "layers": "/".join(map(str, counts)),
                    "flops_ratio": worst_over_mean(per_layer["flops"], counts),
                    "time_ratio": worst_over_mean(per_layer["time_rated"], counts) if "time" in per_layer else None,
                    "stage_flops": stage_sums(per_layer["flops"], counts),
                    "stage_time_s": stage_sums(per_layer["time_rated"], counts) if "time" in per_layer else None,
                }
            )
    return rows


TARGET = 1.15  # the bound on the costliest stage over the mean, drawn on the figure


def plot(data: dict) -> Any:
    """The figure of a results file (its JSON, loaded), for its first model: each layer's share of the model's
    parameters, FLOPs and time; the costliest stage over the mean for each split."""
    per_model, rows = data["per_layer"], data["rows"]
    fig, axes = report.subplots(1, 2, figsize=(14, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    a, b = axes[0]
    name, layers = next(iter(per_model.items()))
    for key, style in (("parameters", ":"), ("flops", "-"), ("time_rated", "--")):
        if key in layers:
            total = sum(layers[key])
            label = {"flops": "forward FLOPs", "time_rated": "measured time"}.get(key, key)
            a.plot([100 * c / total for c in layers[key]], style, marker=".", label=label)
    a.set_xticks(range(len(layers["names"])), layers["names"], rotation=90, fontsize=7)
    a.set(xlabel="layer", ylabel="share of the model's total (%)")
    a.set_title(f"per-layer cost, one micro-batch of {layers['micro_batch']}", fontsize=10)
    report.legend_right(a, title="cost")
    picked = [r for r in rows if r["model"] == name]
    labels = [f"K={r['K']}\n{r['partition'].replace('parameters', 'params')}" for r in picked]
    x = range(len(picked))
    b.bar([i - 0.2 for i in x], [r["flops_ratio"] for r in picked], width=0.4, label="in FLOPs")
    if all(r["time_ratio"] is not None for r in picked):
        b.bar([i + 0.2 for i in x], [r["time_ratio"] for r in picked], width=0.4, label="in measured time")
    b.axhline(TARGET, color="gray", linestyle=":", linewidth=1, label=f"target {TARGET:g}")
    b.set_xticks(list(x), labels, fontsize=7)
    b.set(xlabel="K (stages), split by", ylabel="costliest stage / mean stage (×)")
    b.set_title("each split rated in FLOPs and in measured time", fontsize=10)
    report.legend_right(b, title="cost rated")
    what = f"Default partitions of {name}: split by parameters, forward FLOPs or measured time"
    return report.title(fig, what, data["environment"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny models, one timing run per layer")
    parser.add_argument("--no-time", action="store_true", help="FLOPs and parameters only (no CPU timing)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per layer (the median is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the timing")
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    args = parser.parse_args()
    steady_heap()  # before the layers are profiled here, as the report says
    repeat = 1 if args.smoke else args.repeat
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    per_model: dict[str, dict] = {}
    rows: list[dict] = []
    for w in workloads(args.smoke):
        t0 = time.perf_counter()
        per_model[w.name] = measure(w, not args.no_time, repeat) | {"micro_batch": w.micro_batch}
        rows += rows_of(w, per_model[w.name])
        print(f"{w.name}: measured in {time.perf_counter() - t0:.0f} s", flush=True)
    total = time.perf_counter() - started
    env = report.environment(threads_per_process=args.threads, processes="1 (layer by layer, no pipeline)")
    command = report.command_line("partition")
    columns = [
        ("model", "model", ""),
        ("K", "K", ""),
        ("partition", "split by", ""),
        ("layers", "layers per stage", ""),
        ("flops_ratio", "costliest / mean, FLOPs", ".2f"),
        ("time_ratio", "costliest / mean, measured time", ".2f"),
    ]
    micro = "; ".join(f"{name}: {m['micro_batch']}" for name, m in per_model.items())
    markdown = "\n".join(
        [
            "# Partitions: by parameters, by FLOPs, by measured time",
            "",
            *report.environment_lines(env),
            "",
            f"Command: `{command}` ({total:.0f} s). Per layer: parameters; forward FLOPs counted by torch's "
            "FlopCounterMode on the meta device (`costs_by_flops`, plus the elements each layer outputs); forward "
            f"+ backward seconds on this CPU (`costs_by_time`, median of {repeat}, {args.threads} thread(s)), "
            "measured twice. A stage's cost is the sum of its layers'; each partition is the exact min-max split of "
            'its own costs ("time": the first timing), rated in FLOPs and in the second timing. One micro-batch: '
            f"{micro}.",
            "",
            report.markdown_table(rows, columns),
        ]
    )
    data = {"command": command, "seconds": total, "repeat": repeat, "per_layer": per_model, "rows": rows}
    data["environment"] = env
    paths = report.write("partition", data, markdown, out_dir=args.out_dir, plot=plot)
    print(markdown)
    print(f"wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
