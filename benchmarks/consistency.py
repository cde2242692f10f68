"""GPipe §4.3.1 consistency: the same seed at K = 1, 2, 4 pipeline stages gives the same fp32 training-loss curve."""

# Run from the repo root: python -m benchmarks.consistency [--steps 60] [--ks 1 2 4] [--smoke] [--out-dir DIR]
# Each K is one real Lightning launch: Trainer(strategy=GPipeStrategy(chunks=M, pipeline_parallel_size=K),
# accelerator="cpu", devices=K) re-runs this module for ranks 1..K-1 (Lightning's own launcher, gloo).

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks._lib.machine import quiet_trainer
from benchmarks._lib.report import (
    command_line,
    environment,
    environment_lines,
    legend_right,
    markdown_table,
    subplots,
    title,
    write,
)

REPO = Path(__file__).resolve().parent.parent
SEED = 0
# A gated run's loss may differ from K=1's by float reassociation only: relative TOL_START + TOL_PER_STEP * step.
TOL_START, TOL_PER_STEP = 1e-6, 1e-6


@dataclass(frozen=True)
class Run:
    """One training run, repeated at every K in ``ks`` (all when None) and compared with ``ref`` at K=1."""

    name: str
    model: str  # "translator" or "amoebanet"
    chunks: int = 4  # M
    dropout: float = 0.0
    tie: bool = True  # the Translator's tied embeddings (first and last stage)
    reseed: bool = False  # reseed the RNG after initialization: other dropout masks, same weights
    ks: tuple[int, ...] | None = None
    ref: str = ""  # the run at K=1 it is compared with; its own name when empty
    gated: bool = True  # must stay within tolerance(step) of its reference


RUNS = [
    Run("nmt", "translator"),
    Run("nmt M=3", "translator", chunks=3, ks=(2,), ref="nmt"),
    Run("nmt untied", "translator", tie=False),
    Run("amoebanet", "amoebanet"),
    Run("nmt dropout", "translator", dropout=0.1),
    Run("nmt dropout, reseeded", "translator", dropout=0.1, reseed=True, ks=(1,), ref="nmt dropout", gated=False),
]
SMOKE_RUNS = {"nmt", "nmt M=3"}
NMT_DATA = {"train_size": 4000, "val_size": 8, "batch_size": 32, "max_len": 64, "vocab_size": 600, "num_workers": 0}
NMT_MODEL = {"num_layers": 2, "ffn_dim": 128, "num_heads": 4, "d_model": 64, "lr": 2e-3, "warmup_steps": 20}
IMG_DATA = {"image_size": 32, "num_classes": 10, "batch_size": 16, "num_workers": 0, "val_size": 16}
IMG_MODEL = {"num_layers": 3, "num_filters": 8, "lr": 0.016, "rmsprop_eps": 1e-3, "warmup_epochs": 0.2}


# ------------------------------------------------------------------------------------------------ one launch
def _batch_size(batch: Any) -> int:
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return int(first.shape[0])


def worker(job_path: str) -> None:
    """One K: every run in the job, one Trainer.fit each, in this process and the K-1 that Lightning starts."""
    import lightning.pytorch as pl

    from examples.amoebanet.classifier import ImageClassifier
    from examples.amoebanet.data import ImageClassificationData
    from examples.nmt.data.translation import TranslationData
    from examples.nmt.translator import Translator
    from lightning_gpipe import GPipeStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # every K, every process: the same kernels, so only the pipeline can differ
    job = json.loads(Path(job_path).read_text())
    K, steps = job["k"], job["steps"]

    class Recorder(pl.Callback):
        def __init__(self, reseed: bool) -> None:
            self.reseed = reseed
            self.loss: list[float] = []
            self.batch: list[int] = []

        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            if self.reseed:  # weights are set by now: only the dropout masks change
                torch.manual_seed(SEED + 1000)

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            self.loss.append(float(outputs["loss"]))
            self.batch.append(_batch_size(batch))

    for run in job["runs"]:
        pl.seed_everything(SEED, verbose=False)
        data: pl.LightningDataModule
        module: pl.LightningModule
        if run["model"] == "translator":
            data = TranslationData(**NMT_DATA, cache_dir=job["cache"])
            module = Translator(
                **NMT_MODEL,
                dropout=run["dropout"],
                tie_embeddings=run["tie"],
                vocab_size=data.vocab_size,
                max_len=NMT_DATA["max_len"],
            )
        else:
            data = ImageClassificationData(**IMG_DATA, train_size=IMG_DATA["batch_size"] * steps)
            module = ImageClassifier(**IMG_MODEL, num_classes=IMG_DATA["num_classes"])
        recorder = Recorder(run["reseed"])
        strategy = GPipeStrategy(chunks=run["chunks"], pipeline_parallel_size=K, timeout=timedelta(seconds=120))
        trainer = quiet_trainer(K, strategy, steps, [recorder], job["dir"], precision="32-true")
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        result = {"loss": recorder.loss, "batch": recorder.batch, "seconds": time.perf_counter() - start}
        result["balance"] = strategy.stage.balance
        Path(job["dir"], f"{run['key']}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def launch(k: int, runs: list[dict], steps: int, work: Path, cache: str, timeout: float) -> dict[str, dict]:
    """``python -m benchmarks.consistency --worker job.json`` with devices=K; returns rank 0's curve per run."""
    job = {"k": k, "steps": steps, "runs": runs, "dir": str(work), "cache": cache}
    job_path = work / f"job_K{k}.json"
    job_path.write_text(json.dumps(job))
    env = {key: v for key, v in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK")}
    # The repo root on the path: the worker, and the ranks Lightning starts as `python -m benchmarks.consistency`.
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env |= {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    log_path = work / f"K{k}.log"
    with log_path.open("w") as log:
        # A new session: on a timeout the whole group (this launch and the ranks Lightning started) is killed.
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.consistency", "--worker", str(job_path)],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if rc != 0:
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exit code {rc}"
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"K={k} launch {why}; log tail:\n{tail}")
    curves = {}
    for run in runs:
        ranks = [json.loads((work / f"{run['key']}.rank{r}.json").read_text()) for r in range(k)]
        curve = ranks[0]
        # Every rank computes the loss on the pipeline's output (output="all"): they must agree exactly.
        curve["rank_spread"] = max(abs(a - b) for r in ranks for a, b in zip(r["loss"], curve["loss"], strict=True))
        curves[run["name"]] = curve
    return curves


# ------------------------------------------------------------------------------------------------- analysis
def tolerance(step: int) -> float:
    """Allowed relative loss difference at a step: float reassociation grows as training goes on."""
    return TOL_START + TOL_PER_STEP * step


def compare(loss: list[float], ref: list[float]) -> dict[str, Any]:
    a, b = torch.tensor(loss, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
    diff = (a - b).abs()
    rel = diff / b.abs()
    tenth = max(1, len(loss) // 10)
    return {
        "abs": diff.tolist(),
        "rel": rel.tolist(),
        "max_abs": diff.max().item(),
        "max_rel": rel.max().item(),
        "equal_steps": int((diff == 0).sum()),
        "first_differing_step": next((i for i, d in enumerate(diff.tolist()) if d > 0), None),
        "max_rel_first_tenth": rel[:tenth].max().item(),
        "max_rel_last_tenth": rel[-tenth:].max().item(),
        "used_of_tolerance": max(r / tolerance(t) for t, r in enumerate(rel.tolist())),
        "mean_last_tenth": a[-tenth:].mean().item(),
    }


FLOOR = 1e-9  # where the figure draws a zero difference (log scale)


def plot(data: dict) -> Any:
    """The figure of a results file (its JSON, loaded). One row per reference run: its loss curves at every K (and
    its variants) overlaid, and |loss_K − loss_(K=1)| on a log scale."""
    curves = {n: {int(k): c for k, c in by_k.items()} for n, by_k in data["curves"].items()}
    diffs = {n: {int(k): d for k, d in by_k.items()} for n, by_k in data["diffs"].items()}
    runs = [Run(**{**r, "ks": tuple(r["ks"]) if r["ks"] is not None else None}) for r in data["runs"]]
    groups = [r.name for r in runs if not r.ref and r.name in curves]
    fig, axes = subplots(len(groups), 2, figsize=(15, 3.4 * len(groups) + 0.6))
    widths = {1: (5.0, 0.35), 2: (2.4, 0.9), 4: (1.4, 1.0)}
    for row, group in zip(axes, groups):
        members = [r for r in runs if (r.ref or r.name) == group]
        color = 0  # one colour per curve, the same in both panels
        for r in members:
            for k, curve in sorted(curves.get(r.name, {}).items()):
                label = f"K={k}" + (f" ({r.name.removeprefix(group).strip(' ,')})" if r.ref else "")
                width, alpha = widths.get(k, (1.4, 1.0))
                style = "-" if not r.ref and k == 1 else ("--" if k == 2 else ":")
                lw, alpha = (1.4, 1.0) if r.ref else (width, alpha)
                row[0].plot(curve["loss"], style, color=f"C{color}", lw=lw, alpha=alpha, label=label)
                color += 1
                if r.name == group and k == 1:
                    continue
                d = diffs[r.name][k]
                marker = {1: "o-", 2: "s-", 4: "^-"}.get(k, "x-")
                abs_diff = [max(x, FLOOR) for x in d["abs"]]
                row[1].semilogy(abs_diff, marker, color=f"C{color - 1}", ms=3, lw=1, label=label)
        row[0].set_title(f"{group}: training loss (fp32, seed {data['seed']})", fontsize=10)
        row[0].set(xlabel="training step", ylabel="training loss (rank 0)")
        legend_right(row[0], title="pipeline stages")
        row[1].set_ylim(FLOOR / 3, 1.0)
        row[1].set_title(f"{group}: difference from K = 1 (bitwise equal drawn at {FLOOR:g})", fontsize=10)
        row[1].set(xlabel="training step", ylabel="|loss_K − loss_(K=1)|")
        legend_right(row[1], title="pipeline stages")
    fig.get_layout_engine().set(hspace=0.08)
    what = f"Consistency (GPipe §4.3.1): the same seed at K = {', '.join(map(str, data['ks']))} stages, fp32"
    return title(fig, what, data["environment"])


def explain(diffs: dict[str, dict[int, dict]], curves: dict[str, dict[int, dict]]) -> list[str]:
    """What the table shows, in words, with the measured numbers."""
    reseed = diffs.get("nmt dropout, reseeded", {}).get(1)
    masks = f": changing only the dropout masks moves the loss by {reseed['rel'][0]:.0e} at step 0" if reseed else ""
    lines = [
        "## Reading the table",
        "",
        f"- Gate (gated runs): |loss_K − loss_1| / loss_1 ≤ {TOL_START:g} + {TOL_PER_STEP:g}·t at step t, and every "
        "rank logs the same loss. Runs whose arithmetic does not depend on K (one thread per process; each stage runs "
        "the same kernels on the same micro-batches) should be bitwise equal. With tied embeddings the table's "
        "gradient is summed across the first and the last stage (an all-reduce of partial sums) where K=1 lets "
        "autograd accumulate it in its own order: the sums differ in the last bit, and Adam, dividing each gradient "
        "entry by its running magnitude, carries that into the weights; the curves then drift apart by roundoff, "
        "from 0 over the first steps, growing with t (compare `nmt untied`). The bound leaves room for that drift "
        "and stays far below what a pipeline error (a lost micro-batch, wrong masks or gradients) does within the "
        f"first steps{masks}.",
    ]
    if "nmt M=3" in curves:
        sizes = curves["nmt M=3"][2]["batch"]
        lines.append(
            "- `nmt M=3` is compared with `nmt` at K=1, M=4: the Transformer has no batch statistics, so M only "
            f"changes how each batch (≤ {NMT_DATA['batch_size']} sentences; 32 = 11 + 11 + 10) is split into "
            f"micro-batches; {sum(n % 3 != 0 for n in sizes)} of its {len(sizes)} steps split unevenly."
        )
    if "nmt dropout" not in diffs:
        return lines
    early = ", ".join(f"K={k}: {d['rel'][0]:.1e}" for k, d in sorted(diffs["nmt dropout"].items()))
    lines.append(
        "- Dropout (`nmt dropout`, p = 0.1, gated): every layer draws its masks from a seed of (the step's seed, the "
        "micro-batch, the layer's name) -- `lightning_gpipe.pipe.state.rng` -- not from its process's stream, "
        "so the masks "
        f"do not depend on K and the curves coincide like the others (relative difference at step 0: {early})."
        + (f" `nmt dropout, reseeded` shows what other masks do: {reseed['rel'][0]:.1e} at step 0." if reseed else "")
    )
    return lines


# ------------------------------------------------------------------------------------------------------ main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4], help="pipeline stages K (1 is the reference)")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--smoke", action="store_true", help="K in {1, 2}, 5 steps, the Transformer only")
    parser.add_argument("--runs", nargs="+", choices=[r.name for r in RUNS], help="a subset of the runs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch before it is killed")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    if args.smoke:
        args.steps, args.ks, args.timeout = 5, [1, 2], min(args.timeout, 150.0)
    ks = sorted(set(args.ks) | {1})
    chosen = SMOKE_RUNS if args.smoke else set(args.runs or [r.name for r in RUNS])
    runs = [r for r in RUNS if r.name in chosen or any(c.ref == r.name for c in RUNS if c.name in chosen)]
    started = time.perf_counter()
    curves: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="consistency-") as tmp:
        for k in ks:  # K=1 first: its single process trains the vocabulary that the later launches load
            todo = [asdict(r) | {"key": f"run{i}"} for i, r in enumerate(runs) if r.ks is None or k in r.ks]
            if not todo:
                continue
            t0 = time.perf_counter()
            print(f"K={k}: {', '.join(r['name'] for r in todo)} ({args.steps} steps each)", flush=True)
            for name, curve in launch(k, todo, args.steps, Path(tmp), tmp, args.timeout).items():
                curves.setdefault(name, {})[k] = curve
            print(f"K={k}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    total = time.perf_counter() - started

    diffs: dict[str, dict[int, dict]] = {}
    rows, failed = [], []
    for run in runs:
        ref = run.ref or run.name
        for k, curve in sorted(curves.get(run.name, {}).items()):
            if (run.name, k) == (ref, 1):
                continue
            d = compare(curve["loss"], curves[ref][1]["loss"]) | {"reference": f"{ref} K=1"}
            diffs.setdefault(run.name, {})[k] = d
            ok = curve["rank_spread"] == 0.0 and (not run.gated or d["used_of_tolerance"] <= 1.0)
            if not ok:
                failed.append(f"{run.name} K={k}")
            rows.append(
                {
                    "run": run.name,
                    "K": k,
                    "M": run.chunks,
                    "balance": "/".join(map(str, curve["balance"])),
                    "vs": f"{ref} K=1",
                    "equal": f"{d['equal_steps']}/{len(curve['loss'])}",
                    "first_diff": d["first_differing_step"],
                    "max_abs": d["max_abs"],
                    "max_rel": d["max_rel"],
                    "first": d["max_rel_first_tenth"],
                    "last": d["max_rel_last_tenth"],
                    "used": f"{100 * d['used_of_tolerance']:.0f}%" if run.gated else "–",
                    "check": ("pass" if ok else "FAIL") if run.gated else "reported",
                }
            )
    env = environment(threads_per_process=1, processes="K per launch (Lightning's launcher, gloo), one launch per K")
    command = command_line("consistency")
    data = {
        "command": command,
        "seconds": total,
        "steps": args.steps,
        "ks": ks,
        "seed": SEED,
        "tolerance": {"start": TOL_START, "per_step": TOL_PER_STEP},
        "runs": [asdict(r) for r in runs],
        "configs": {"nmt_data": NMT_DATA, "nmt_model": NMT_MODEL, "img_data": IMG_DATA, "img_model": IMG_MODEL},
        "curves": {n: {str(k): c for k, c in by_k.items()} for n, by_k in curves.items()},
        "diffs": {n: {str(k): d for k, d in by_k.items()} for n, by_k in diffs.items()},
        "rows": rows,
        "failed": failed,
        "environment": env,
    }
    columns = [
        ("run", "run", ""),
        ("K", "K", ""),
        ("M", "M", ""),
        ("balance", "layers per stage", ""),
        ("vs", "compared with", ""),
        ("equal", "bitwise-equal steps", ""),
        ("first_diff", "first differing step", ""),
        ("max_abs", "max abs diff", ".1e"),
        ("max_rel", "max rel diff", ".1e"),
        ("first", "max rel, first 10% of steps", ".1e"),
        ("last", "max rel, last 10%", ".1e"),
        ("used", "of tolerance", ""),
        ("check", "check", ""),
    ]
    nmt = f"Translator T({NMT_MODEL['num_layers']}, {NMT_MODEL['ffn_dim']}, {NMT_MODEL['num_heads']})"
    markdown = "\n".join(
        [
            "# Consistency across pipeline depths (GPipe §4.3.1)",
            "",
            *environment_lines(env),
            "",
            f"Command: `{command}` ({total:.0f} s). {args.steps} steps per run, seed {SEED}, fp32 (`32-true`), "
            f"K = {ks}, each K one `Trainer(strategy=GPipeStrategy(chunks=M, pipeline_parallel_size=K), "
            f'accelerator="cpu", devices=K)` launch. nmt: {nmt} at width {NMT_MODEL["d_model"]}, tied embeddings, '
            f"Adam, on the generated corpus (batches of ≤ {NMT_DATA['batch_size']} sentences bucketed by length); "
            f"amoebanet: AmoebaNet-D ({IMG_MODEL['num_layers']}, {IMG_MODEL['num_filters']}), RMSProp, on generated "
            f"{IMG_DATA['image_size']} px images, batches of {IMG_DATA['batch_size']}. Curves: rank 0's training "
            "loss per step.",
            "",
            markdown_table(rows, columns),
            "",
            *explain(diffs, curves),
        ]
    )
    paths = write("consistency", data, markdown, out_dir=args.out_dir, plot=plot)
    print(markdown)
    print(f"wrote {', '.join(paths.values())}")
    if failed:
        print(f"FAILED: {', '.join(failed)} differ(s) from K=1 beyond the tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
