"""What zb-h1's split costs a micro-batch on the last stage: F + B against F, I and W (W: the deferred weights')."""

# At K = 2 only the last rank splits its backwards ("zb-h1" fuses I and W where nobody waits for the input gradient),
# so its step is that rank's F + I + W per micro-batch where 1F1B's is F + B. One process, one thread: the last
# stage's layers of overhead.py's K = 2 balance, one micro-batch (batch / M samples), three passes alternating round
# by round, in each of their six orders by turns: plain; split as the engine splits at K = 2 and M (only the ops
# whose W pays for the split, ``weight_grad.split_pays``); and every op split. Gradients accumulate as in
# micro-batches 1 … M−1 of a step.
# Profiled rounds of each, alternating, give the matrix products' time (aten::mm, the convolutions' backward): the
# same products, in I and W or in B. `python -m benchmarks.studies.zb_split` (about 2 min on 2 cores; `--smoke`: small
# models, seconds; `--out-dir DIR`; `--device cuda`: the passes on a GPU, each part timed between synchronizations,
# the products not profiled; `--set d_model=1024 ...`: the models' sizes changed); results in
# benchmarks/results/zb_split/README.md.

from __future__ import annotations

import argparse
import itertools
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks._lib import report, workloads
from lightning_gpipe.pipe.run.weight_grad import WeightGrads
from lightning_gpipe.pipe.state.batchnorm import convert_deferred_batch_norm, deferred_statistics

PRODUCTS = ("aten::mm", "aten::addmm", "aten::convolution_backward")
Pass = Callable[[], dict[str, float]]


def _on(t: Any, device: torch.device) -> Any:
    return tuple(_on(u, device) for u in t) if isinstance(t, tuple) else t.to(device)


def _clock(device: torch.device) -> float:
    """Now, once the device has run what was queued (a GPU's part ends when its kernels do)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _passes(
    name: str, s: dict[str, Any], M: int, device: torch.device
) -> tuple[list[int], Pass, Callable[..., tuple[Pass, WeightGrads]]]:
    """The last stage's layers at K = 2 and passes of one micro-batch through them: plain, and split with the ops
    that split at ``shape`` = (K, M) (None: every op)."""
    balance = workloads.balances(name, s, [2], "time", M)["balance"][2]  # profiled on the CPU
    model = convert_deferred_batch_norm(workloads.build(name, s)).to(device)
    x, target = _on(workloads.make_batch(name, s, s["batch"] // M), device)
    first, last = model[: balance[0]], model[balance[0] :]
    with torch.no_grad(), deferred_statistics():
        h = first(x)
    leaves = h if isinstance(h, tuple) else (h,)
    h = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in leaves)
    inputs = h if len(h) > 1 else h[0]

    def forward() -> torch.Tensor:
        with deferred_statistics():
            return workloads.loss_fn(last(inputs), target)

    def plain() -> dict[str, float]:
        t0 = _clock(device)
        loss = forward()
        t1 = _clock(device)
        loss.backward()
        return {"F": t1 - t0, "B": _clock(device) - t1}

    def split(shape: tuple[int, int] | None) -> tuple[Pass, WeightGrads]:
        weights = WeightGrads(last, shape)  # once per step in the engine: its first pass decides which ops split

        def halves() -> dict[str, float]:
            t0 = _clock(device)
            with weights.deferring(0):
                loss = forward()
            t1 = _clock(device)
            loss.backward()
            t2 = _clock(device)
            weights.run(0)
            return {"F": t1 - t0, "I": t2 - t1, "W": _clock(device) - t2}

        return halves, weights

    return balance, plain, split


def _products_ms(run: Pass) -> float:
    """The matrix products' self time in one pass, from torch's profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in PRODUCTS) / 1e3


def measure(name: str, s: dict[str, Any], M: int, rounds: int, warmup: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(workloads.SEED)
    balance, plain, split = _passes(name, s, M, device)
    (pays, weights), (every, _) = split((2, M)), split(None)
    passes = {"plain": plain, "split": pays, "every": every}
    times: dict[str, list[dict[str, float]]] = {key: [] for key in passes}
    faults: dict[str, list[int]] = {key: [] for key in passes}  # minor page faults a pass: the heap's fresh pages
    # The VM's speed drifts: the passes alternate, in each of their six orders by turns, so that each follows each
    # other as often (a pass runs slower after one that held more memory: two orders alone favoured one pass).
    orders = list(itertools.permutations(passes))
    for r in range(warmup + rounds):
        for key in orders[r % len(orders)]:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = passes[key]()
            if r >= warmup:
                times[key].append(t)
                faults[key].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

    def median(key: str, part: str) -> float:
        return statistics.median(t[part] for t in times[key]) * 1e3

    def paired(key: str) -> float:
        return statistics.median(sum(b.values()) / sum(a.values()) for a, b in zip(times["plain"], times[key]))

    products: dict[str, list[float]] = {key: [] for key in passes}
    for _ in range(max(rounds // 3, 2) if device.type == "cpu" else 0):  # CPU self time: a GPU's is its launches
        for key, run in passes.items():
            products[key].append(_products_ms(run))
    split_weights, met = weights.decided
    row: dict[str, Any] = {"model": name, "layers": f"{balance[0]}–{sum(balance) - 1} of {sum(balance)}"}
    row |= {"plain_F": median("plain", "F"), "plain_B": median("plain", "B")}
    row["faults"] = " / ".join(f"{statistics.median(faults[key]):.0f}" for key in passes)
    for key in ("split", "every"):
        row |= {f"{key}_{part}": median(key, part) for part in "FIW"}
        row[f"{key}_paired"] = paired(key)
        ratios = [b / a for a, b in zip(products["plain"], products[key])]
        row[f"{key}_products"] = statistics.median(ratios) if ratios else None
    return row | {"weights": f"{split_weights} of {met}", "rounds": rounds, "raw": times, "raw_products_ms": products}


COLUMNS = report.columns(
    "model|model|; layers|last stage's layers (K = 2)|; weights|weights split (K = 2, M = 8)|;"
    " plain_F|plain F ms|.1f; plain_B|plain B ms|.1f; split_F|split F ms|.1f; split_I|I ms|.1f; split_W|W ms|.1f;"
    " split_paired|(F + I + W) ÷ (F + B), paired|.3f; split_products|matrix products, split ÷ plain|.2f;"
    " every_F|every op split: F ms|.1f; every_I|I ms|.1f; every_W|W ms|.1f;"
    " every_paired|(F + I + W) ÷ (F + B), paired|.3f; every_products|matrix products, ÷ plain|.2f;"
    " faults|page faults a pass, plain / split / every|; rounds|rounds|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["transformer", "amoebanet"], choices=list(workloads.SIZES))
    parser.add_argument("--micro-batches", type=int, default=8, metavar="M")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out-dir", default=str(report.RESULTS))
    parser.add_argument("--smoke", action="store_true", help="small models, 3 rounds")
    parser.add_argument("--device", default="cpu", help="where the passes run (cpu, cuda)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=INT", help="size changes, e.g. d_model=1024")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    sizes = workloads.resized(workloads.SMOKE_SIZES if args.smoke else workloads.SIZES, args.set)
    rounds, warmup = (3, 1) if args.smoke else (args.rounds, 3)
    env = report.environment(threads_per_process=torch.get_num_threads(), processes="1") | {"device": str(device)}
    rows = []
    for name in args.models:
        s = sizes[name]
        row = measure(name, s, args.micro_batches, rounds, warmup, device) | {"sizes": workloads.describe(name, s)}
        rows.append(row)
        print(
            f"{name}: F + B {row['plain_F']:.1f} + {row['plain_B']:.1f} ms; weights split {row['weights']}: F + I + W "
            f"{row['split_F']:.1f} + {row['split_I']:.1f} + {row['split_W']:.1f} ms, paired {row['split_paired']:.3f}; "
            f"every op split: {row['every_F']:.1f} + {row['every_I']:.1f} + {row['every_W']:.1f} ms, paired "
            f"{row['every_paired']:.3f}"
        )
    command = report.command_line("studies.zb_split")
    md = ["# zb-h1's split on the last stage: one micro-batch, F + B vs F + I + W", ""]
    md += [*report.environment_lines(env), f"- Device of the passes: {device}; command: `{command}`"]
    md += [f"- Sizes: {'; '.join(row['sizes'] for row in rows)}"]
    md += [
        f"- M = {args.micro_batches}: one micro-batch of batch / M samples; {rounds} rounds, the three passes "
        "alternating in each of their six orders by turns (plain; split where it pays at K = 2, as the engine "
        "splits; every op split); medians; the "
        "matrix products' self time from torch's profiler in a third as many rounds, "
        "alternating too (the paired ratio's median)",
        "",
        report.markdown_table(rows, COLUMNS),
    ]
    data = {"command": command, "environment": env, "sizes": sizes, "rows": rows}
    paths = report.write("zb_split", data, "\n".join(md), out_dir=args.out_dir)
    print(f"# wrote {', '.join(paths.values())}")


if __name__ == "__main__":
    main()
