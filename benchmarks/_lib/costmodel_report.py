"""schedules.py's tables: predicted against measured steps, where they part per rank, Table 2 (predicted)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks._lib import report
from benchmarks._lib.costmodel import LayerCosts, Prediction, predict
from benchmarks._lib.costmodel_ranks import PARTS, engines_of, replayed
from benchmarks._lib.gloo_link import Link
from benchmarks._lib.machine import paired_interval, paired_ratio
from benchmarks._lib.workloads import PAPER_TABLE2
from lightning_gpipe.pipe.schedule.registry import SCHEDULES
from lightning_gpipe.pipe.state.rematerialize import Checkpoint

V = {"interleaved-1f1b": 2, "interleaved-zb": 2, "zb-v": 2}  # virtual stages per rank where a schedule needs several
TOLERANCE = 0.10

VALIDATION: list[report.Column] = [
    ("model", "model", ""),
    ("K", "K", ""),
    ("M", "M", ""),
    ("schedule", "schedule", ""),
    ("balance", "balance", ""),
    ("predicted_ms", "predicted ms", ".1f"),
    ("measured_ms", "measured ms (median)", ".1f"),
    ("ratio", "predicted / measured", ".3f"),
    ("within", "within 10 %", ""),
    ("vs_gpipe_predicted", "÷ GPipe's, predicted", ".3f"),
    ("vs_gpipe_measured", "÷ GPipe's, measured (paired by round)", ".3f"),
    ("vs_gpipe_ci", "its 95 % interval", ""),
    ("relative_within", "÷ GPipe's within 10 %", ""),
    ("replayed_ms", "replayed ms (traced action times)", ".1f"),
    ("traced_ms", "traced step ms", ".1f"),
    ("replayed_ratio", "replayed / traced (median of steps)", ".3f"),
    ("replayed_within", "replay within 10 %", ""),
    ("predicted_on_cores_ms", "predicted, cores shared", ".1f"),
    ("ratio_on_cores", "cores shared / measured", ".3f"),
    ("one_process_ms", "one-process prediction ms", ".1f"),
    ("ratio_one_process", "one-process / measured", ".3f"),
    ("clean_steps", "clean steps", ""),
    ("note", "note", ""),
]
PARTS_COLUMNS: list[report.Column] = [
    ("model", "model", ""),
    ("K", "K", ""),
    ("schedule", "schedule", ""),
    ("rank", "rank", ""),
    *[(kind, kind, "") for kind in PARTS],
    ("step", "step", ""),
    ("foreign_cores", "other processes (cores)", ".2f"),
]
TABLE2: list[report.Column] = [
    ("model", "model", ""),
    ("M", "M", ""),
    ("K", "K", ""),
    ("schedule", "schedule", ""),
    ("step_ms", "predicted step ms", ".1f"),
    ("samples_per_s", "samples/s", ".1f"),
    ("speedup", "speed-up vs K=1", ".2f"),
    ("ideal", "ideal K·M/(M+K−1)", ".2f"),
    ("normalized", "normalized to GPipe K=2, M=1", ".2f"),
    ("paper", "paper Table 2", ".2f"),
    ("bubble", "bubble %", ".1f"),
    ("peak", "peak live per rank", ""),
    ("note", "note", ""),
]


def markdown(data: dict, models: dict[str, Any], link: Link, args: argparse.Namespace, load_line: str) -> list[str]:
    """The results' Markdown lines: the setup, the validation, the traced parts, each model's Table 2 (none yet
    while ``data["table2"]`` is empty: written so after the validation, then again at the end)."""
    cores, M = data["usable_cores"], args.micro_batches
    md = [
        "# Schedules by the simulator as a cost model (predicted vs measured; GPipe Table 2, predicted)",
        "",
        *report.environment_lines(data["environment"]),
        f"- Command: `{data['command']}`; "
        + (f"total {data['total_s']:.0f} s" if "total_s" in data else "Table 2 not done yet"),
        f"- {load_line.removeprefix('# ')}; per measurement: `models.<name>.foreign_cores` in the JSON",
        f"- Costs per layer, measured in one process (1 thread), medians of {args.repeat}: forward (no grad, kept "
        "under grad, recomputed), backward, zb-h1's split forward, recompute, I and W, RMSprop update; the loss; gloo "
        f"latency {link.latency * 1e6:.0f} µs + bytes / {link.bandwidth / 1e9:.2f} GB/s (ping-pong fit, 2 processes);"
        f" a message's host time, the ranks' own, fixed + per tensor: sending {link.send_host[0] * 1e6:.0f} + "
        f"{link.send_host[1] * 1e6:.0f} µs, receiving an output gradient (posted early, read) "
        f"{link.recv_host[0] * 1e6:.0f} + {link.recv_host[1] * 1e6:.0f} µs (the transport, 2 processes)."
        " Step predicted = the last rank's finish in `simulate` (gloo: buffered sends) + the status all-reduce + the "
        "longest update of a rank (`benchmarks/_lib/costmodel.py`).",
        "- Engine factors (a one-stage pipeline's forward_backward over its layers' costs; they scale every compute "
        "cost of a stage): per stage, each rank timing its stages in its process while the others time theirs "
        "(co-run; `models.<name>.stages` in the JSON), which the prediction uses; one process, the whole model "
        "(checkpoint always): "
        + ", ".join(f"{n} {m['costs'].engine:.3f}" for n, m in models.items())
        + ", times the co-run factor (co-run ÷ alone of the launch's stages, K = "
        + f"{min(args.ks)}): "
        + ", ".join(f"{n} {m['costs'].corun:.3f}" for n, m in models.items())
        + ", which the one-process prediction and Table 2 use.",
        f"- Measured step: `stage.forward_backward(x, loss per micro-batch, schedule=...)` + RMSprop, median of clean "
        f"steps (barriers around), checkpoint={args.checkpoint}, the schedules by turns in the same processes.",
        f"- Rows with K > {cores} usable cores are oversubscribed (stages share cores); 'cores shared' bounds the "
        f"step by the work spread over {cores} cores: max(predicted, work / {cores}).",
        "",
        *[f"- {n}: {m['describe']}" for n, m in models.items()],
        "",
        f"## Predicted vs measured, M = {M}",
        "",
        report.markdown_table(data["validation"], VALIDATION),
        "",
        "## Where they part: traced steps per schedule, measured / predicted ms per rank",
        "",
        "forward: F (dropped and kept); recompute: R before a backward; backward: B, or I and W, with the last "
        "stage's loss; update: RMSprop; other: the rest of the step (waits for a peer, transfers, sends, the status "
        "check, the engine between actions). Steps with the timeline on, after the timed ones: each kind's median "
        "over them (`traced_steps` in the JSON; files without it traced one step).",
        "",
        report.markdown_table(data["parts"], PARTS_COLUMNS),
        "",
        "Engine factor per stage (co-run; alone) and layers:",
        "",
        *[
            f"- {n}, K = {K}, v = {v}: "
            + ", ".join(
                f"stage {row['stage']} {row['layers']} {engines_of(m['costs'], [row], M)[tuple(row['layers'])]:.3f}"
                f" ({row['corun_s'] / row['alone_s']:.3f} × alone)"
                for row in rows
            )
            for n, m in models.items()
            for K, by_v in m["stages"].items()
            for v, rows in by_v.items()
        ],
        "",
    ]
    if data["table2"]:
        md += [
            f"## GPipe Table 2 at K ≤ {args.table_k}: predicted from {data['predicted_from']}",
            "",
            "Not measured: the simulator's step for K processes with a core each, from per-layer costs measured on "
            "this machine for each micro-batch size (global batch as above, M micro-batches). paper Table 2: the "
            "paper's GPipe throughput on TPUs, normalized to K=2, M=1, beside ours normalized the same way.",
            "",
        ]
    for name, rows in data["table2"].items():
        md += [f"### {name}: {models[name]['table_model']}", "", report.markdown_table(rows, TABLE2), ""]
    return md


def relative(predicted: float, records: dict[str, list[dict]], schedule: str) -> dict[str, Any]:
    """A schedule's step ÷ GPipe's, predicted and measured (the median over rounds of the two steps' ratio, each
    round's two back to back in the same processes: the launch's speed and the VM's drift cancel, which move the
    steps themselves by 10–25 % between launches here), with its 95 % interval; GPipe's own row is the reference."""
    if schedule == "gpipe" or "gpipe" not in records:
        return {"vs_gpipe_predicted": 1.0, "relative_within": "reference"} if schedule == "gpipe" else {}
    measured = paired_ratio(records[schedule], records["gpipe"])
    interval = paired_interval(records[schedule], records["gpipe"])
    row: dict[str, Any] = {"vs_gpipe_predicted": predicted, "vs_gpipe_measured": measured}
    row["vs_gpipe_ci"] = f"{interval[0]:.3f}–{interval[1]:.3f}" if interval else ""
    if measured is not None:
        row["relative_ratio"] = predicted / measured
        row["relative_within"] = "yes" if abs(row["relative_ratio"] - 1) <= TOLERANCE else "no"
    return row


def table2(name: str, costs: dict[int, LayerCosts], link: Link, ks: list[int], batch: int) -> list[dict]:
    """Predicted rows of Table 2 for one model: every schedule at every K and M (K=1: one stage, gpipe's order)."""
    rows: list[dict] = []
    for M, lc in costs.items():
        base = predict(lc, link, "gpipe", 1, M).step
        for K in ks:
            for schedule in SCHEDULES:
                v = V.get(schedule, 1)
                row: dict[str, Any] = {
                    "model": name,
                    "M": M,
                    "K": K,
                    "schedule": schedule + (f" v={v}" if v > 1 else ""),
                }
                if v * K > len(lc.forward):
                    rows.append({**row, "note": f"n/a: {len(lc.forward)} layers < {v * K} stages"})
                    continue
                try:
                    p = predict(lc, link, schedule, K, M, v)
                except ValueError as e:
                    rows.append({**row, "note": f"n/a: {e}"})
                    continue
                rows.append(
                    {
                        **row,
                        "step_ms": p.step * 1e3,
                        "samples_per_s": batch / p.step,
                        "speedup": base / p.step,
                        "ideal": K * M / (M + K - 1),
                        "paper": PAPER_TABLE2.get(name, {}).get(M, {}).get(K) if schedule == "gpipe" else None,
                        "bubble": 100 * p.bubble,
                        "peak": p.peak,
                        "balance": p.balance,
                        "note": "",
                    }
                )
    ref = next((r for r in rows if (r["K"], r["M"], r["schedule"]) == (2, 1, "gpipe") and "step_ms" in r), None)
    for r in rows:
        if ref is not None and "step_ms" in r:
            r["normalized"] = ref["step_ms"] / r["step_ms"]
    return rows


def replay_row(p: Prediction, traced: list[dict[str, Any]], link: Link, checkpoint: Checkpoint) -> dict[str, Any]:
    """The validation row's replay columns: per traced step, ``replayed`` over the step (in the JSON); the medians of
    the steps, of their replays and of the ratios."""
    if not all("units" in rank for rank in traced):  # a file from before the replay
        return {}
    steps = traced[0]["steps"]
    replays = [replayed(p, traced, link, checkpoint, i) for i in range(len(steps))]
    ratios = [a / b for a, b in zip(replays, steps, strict=True)]
    ratio = statistics.median(ratios)
    return {
        "replayed_per_step": ratios,
        "traced_ms": statistics.median(steps) * 1e3,
        "replayed_ms": statistics.median(replays) * 1e3,
        "replayed_ratio": ratio,
        "replayed_within": "yes" if abs(ratio - 1) <= TOLERANCE else "no",
    }
