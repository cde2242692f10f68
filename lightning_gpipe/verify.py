"""Is my pipelined run my plain run? Trains a module's first steps pipelined and in one process, and says.

``python -m lightning_gpipe.verify [--steps N] [--tolerance T] [--precision P] <module> fit <its CLI arguments>``
runs ``python -m <module>``'s LightningCLI (its ``main()``) with those arguments, or :func:`verify` does it from Python.
Three runs of the first N steps from the same initial weights, on the same batches in the same order:

* **pipelined**: the user's GPipeStrategy (its K, M and schedule), one process per stage;
* **plain**: the module in one process, no strategy: the run the pipeline promises to be;
* **one stage**: GPipeStrategy with K = 1 and the same M, in one process (only where M > 1): the same micro-batches,
  no pipeline between them.

Arranged so that the runs can be equal: every run starts from the pipelined run's initial weights (whatever
initialization a model built on the meta device gets), the training batches come in one order seeded anew each epoch
(no distributed sampler: every stage of one pipeline takes the same batches), dropout is off (its masks are drawn
per micro-batch), validation is skipped. Per parameter it prints the largest difference relative to the parameter's
largest value, each step's loss in each run, and a verdict: the same run; different by design (BatchNorm normalizes
each micro-batch: pipelined = one stage ≠ plain); a layer that mixes the samples of a batch (pipelined = one stage
≠ plain, no BatchNorm); or different (pipelined ≠ one stage: what the pipeline itself changed). Data-parallel
replicas are not compared (run it with all processes in one pipeline).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn

from lightning_gpipe.strategy import GPipeStrategy

Data = Callable[[], Any]  # a fresh DataLoader (or LightningDataModule) for each run


@dataclass
class Report:
    """What :func:`verify` found: ``verdict`` "same run", "by design", "mixes samples" or "different"."""

    verdict: str
    explanation: str
    tolerance: float
    losses: dict[str, list[float]]  # per run: each step's training loss
    differences: dict[str, float]  # per parameter: max |pipelined − plain| / max |plain|
    by_micro_batching: dict[str, float] = field(default_factory=dict)  # the same against the one-stage run
    # Parameters whose gradient is rounding alone (zero in exact arithmetic: an attention key's bias under softmax):
    # Adam makes each such gradient a whole step, so their values are noise in every run; not in the verdict.
    noise: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        runs = list(self.losses)
        lines = ["step  " + "  ".join(f"{run:>14}" for run in runs) + "  pipelined − plain"]
        for i, values in enumerate(zip(*self.losses.values())):
            diff = values[0] - values[1]
            lines.append(f"{i:>4}  " + "  ".join(f"{v:>14.8g}" for v in values) + f"  {diff:+.3e}")
        worst = sorted(self.differences.items(), key=lambda kv: -kv[1])
        lines.append(f"largest differences of the {len(worst)} parameters (relative to each one's largest value):")
        lines += [
            f"  {d:.3e}  {name}{'  (rounding: no gradient)' if name in self.noise else ''}" for name, d in worst[:10]
        ]
        if self.noise:
            lines.append(
                f"{len(self.noise)} parameter(s) have no gradient but rounding (their values are noise in every run, "
                f"as Adam turns it into steps; not counted): {', '.join(self.noise[:5])}"
            )
        lines.append(f"verdict: {self.verdict} — {self.explanation}")
        return "\n".join(lines)


# What a launcher (Lightning's, torchrun) tells a process about the run it is a rank of: not the one-process runs'.
_LAUNCH = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
)  # fmt: skip


class _Arrange(pl.Callback):
    """Makes a run comparable: no dropout, one batch order per epoch; records the losses. The pipelined run writes
    its initial and final weights (``written``: the files), the others start from the initial ones."""

    def __init__(self, seed: int, initial: Path, written: tuple[Path, Path] | None = None) -> None:
        self.seed, self.initial, self.written = seed, initial, written
        self.losses: list[float] = []
        self.gradients: dict[str, float] = {}  # per parameter: its largest gradient over the steps

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _no_dropout(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.written is not None:
            trainer.save_checkpoint(self.written[0], weights_only=True)
        else:
            state = torch.load(self.initial, map_location="cpu", weights_only=False)["state_dict"]
            pl_module.load_state_dict(state)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.written is not None:  # collective: while the pipeline's processes are still together
            trainer.save_checkpoint(self.written[1], weights_only=True)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A shuffling loader's order comes from the global generator when its iterator is made, right after this.
        torch.manual_seed(self.seed + trainer.current_epoch)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                self.gradients[name] = max(self.gradients.get(name, 0.0), float(p.grad.abs().max()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def _no_dropout(module: nn.Module) -> None:
    """Every dropout off: nn.Dropout's ``p`` and a float ``*dropout*`` attribute (HF's attention modules)."""
    for sub in module.modules():
        rate = "p" if isinstance(sub, nn.modules.dropout._DropoutNd) else None
        for name, value in list(vars(sub).items()):
            if isinstance(value, float) and ("dropout" in name or name == rate):
                setattr(sub, name, 0.0)


def _fit(
    module: Callable[[], pl.LightningModule],
    data: Data,
    strategy: Any,
    devices: int,
    steps: int,
    precision: str,
    arrange: _Arrange,
    folder: Path,
) -> pl.LightningModule:
    model = module()
    trainer = pl.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        precision=precision,  # type: ignore[arg-type]
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=folder,
        callbacks=[arrange],
    )
    source = data()
    if isinstance(source, pl.LightningDataModule):
        trainer.fit(model, datamodule=source)
    else:
        trainer.fit(model, train_dataloaders=source)  # None: the module's own train_dataloader
    return model


def verify(
    module: Callable[[], pl.LightningModule],
    data: Data,
    strategy: GPipeStrategy,
    *,
    steps: int = 20,
    devices: int | None = None,
    precision: str = "64-true",
    tolerance: float = 1e-9,
    seed: int = 0,
) -> Report | None:
    """Train ``module()`` for ``steps`` steps under ``strategy`` (K processes: ``devices``, default its
    ``pipeline_parallel_size``) and in one process, and report (see the module docstring). Returns the report on the
    process that launched the others (global rank 0), None on the others; call it from a script as you would
    ``trainer.fit`` (Lightning re-runs the script in each process). ``data`` makes a fresh DataLoader or
    LightningDataModule for each run. In float64 by default, where rounding stays far below ``tolerance``."""
    K = strategy._pipeline_parallel_size
    devices = devices if devices is not None else (K if isinstance(K, int) else None)
    if devices is None or (isinstance(K, int) and devices != K):
        raise ValueError(
            f"verify compares one pipeline with one process: give GPipeStrategy(pipeline_parallel_size=K) and "
            f"devices=K (got pipeline_parallel_size={K!r}, devices={devices!r}); data-parallel replicas are not "
            "compared"
        )
    strategy.save_distributed_checkpoint = False  # the weights as the plain module's, in one file
    folder = Path(os.environ.get("GPIPE_VERIFY_DIR") or tempfile.mkdtemp(prefix="gpipe_verify_"))
    os.environ["GPIPE_VERIFY_DIR"] = str(folder)  # the processes Lightning launches write to the same place
    initial, final = folder / "initial.ckpt", folder / "pipelined.ckpt"
    arrange = _Arrange(seed, initial, written=(initial, final))
    pipelined = _fit(module, data, strategy, devices, steps, precision, arrange, folder)
    rank = pipelined.trainer.global_rank
    if torch.distributed.is_initialized():  # the pipeline's processes part here: the one-process runs make their own
        torch.distributed.destroy_process_group()
    if rank != 0:
        return None
    want = torch.load(final, map_location="cpu", weights_only=False)["state_dict"]
    losses = {"pipelined": arrange.losses}
    runs: dict[str, Any] = {"plain": "auto"}
    M = strategy.chunks  # as the fit ran it ("auto" resolved at its setup)
    assert isinstance(M, int), "the pipelined fit resolved chunks"
    if M > 1:  # the same micro-batches in one process: what micro-batching alone changes
        runs["one stage"] = GPipeStrategy(
            chunks=M,
            pipeline_parallel_size=1,
            backbone=strategy.backbone,
            batch_dim=strategy.batch_dim,
            deferred_batch_norm=strategy.deferred_batch_norm,
            pipeline_loss=strategy.pipeline_loss,
            schedule=ONE_CHUNK.get(str(strategy.schedule), strategy.schedule),  # type: ignore[arg-type]
        )
    states: dict[str, dict[str, Tensor]] = {}
    gradients: dict[str, float] = {}
    launched = {name: os.environ.pop(name) for name in _LAUNCH if name in os.environ}
    try:  # the one-process runs are not ranks of the launch that ran the pipeline
        for name, run_strategy in runs.items():
            record = _Arrange(seed, initial)
            model = _fit(module, data, run_strategy, 1, steps, precision, record, folder)
            losses[name] = record.losses
            states[name] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            gradients = gradients or record.gradients  # the plain run's
    finally:
        os.environ.update(launched)
    largest = max(gradients.values(), default=0.0)
    noise = sorted(n for n, g in gradients.items() if g <= _ROUNDING * largest)
    differences = _differences(want, states["plain"])
    by_micro_batching = _differences(want, states["one stage"]) if "one stage" in states else {}
    plain, one_stage = ({k: v for k, v in d.items() if k not in noise} for d in (differences, by_micro_batching))
    verdict, explanation = _verdict(pipelined, plain, one_stage, tolerance, M)
    return Report(verdict, explanation, tolerance, losses, differences, by_micro_batching, noise)


# A schedule of several chunks per rank, and its order on one chunk (a pipeline of one rank holds one).
ONE_CHUNK = {"interleaved-1f1b": "1f1b", "interleaved-zb": "zb-h1", "zb-v": "zb-h1"}
# A gradient this small against the largest one is rounding (float64's is 1e-16 of it): no gradient.
_ROUNDING = 1e-10


def _differences(got: dict[str, Tensor], want: dict[str, Tensor]) -> dict[str, float]:
    out = {}
    for name, ref in want.items():
        if not ref.is_floating_point() or name not in got:
            continue
        scale = ref.abs().max().clamp_min(1e-12)
        out[name] = float((got[name].to(ref.dtype) - ref).abs().max() / scale)
    return out


def _verdict(
    model: pl.LightningModule, plain: dict[str, float], one_stage: dict[str, float], tolerance: float, M: int
) -> tuple[str, str]:
    worst = lambda d: max(d.values(), default=0.0)  # noqa: E731
    if worst(plain) <= tolerance:
        return "same run", f"every parameter within {tolerance:g} of the plain run's"
    if M == 1 or worst(one_stage) > tolerance:  # at M = 1 the plain run is the one stage's
        against = one_stage if one_stage else plain
        names = ", ".join(n for n, d in sorted(against.items(), key=lambda kv: -kv[1])[:3] if d > tolerance)
        return "different", (
            f"the pipelined run differs from one process at the same M = {M} ({names} most): the split into stages "
            "changed it; look for state kept between calls of a layer, randomness outside the layers, or a layer "
            "that depends on which process runs it"
        )
    names = ", ".join(n for n, d in sorted(plain.items(), key=lambda kv: -kv[1])[:3] if d > tolerance)
    batch_norm = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if batch_norm:
        return "by design", (
            f"the pipelined run equals one process at the same M = {M} but not the plain run ({names} most): "
            f"BatchNorm ({', '.join(batch_norm[:3])}) normalizes each of the M micro-batches with its own statistics "
            "(GPipe's semantics); at M = 1 the runs agree"
        )
    return "mixes samples", (
        f"the pipelined run equals one process at the same M = {M} but not the plain run ({names} most): a layer "
        "computes across the samples of its batch (a mean or a norm over dim 0, a batch statistic), and each "
        "micro-batch is a smaller batch; keep such a layer out of the backbone, or use M = 1"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_gpipe.verify",
        description="Train the first steps of a LightningCLI run pipelined and in one process, and compare them.",
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps of each run (default 20)")
    parser.add_argument("--tolerance", type=float, default=1e-9, help="largest relative difference of a same run")
    parser.add_argument("--precision", default="64-true", help="of every run (default 64-true: rounding stays small)")
    parser.add_argument("cli", help="the module whose main() runs the LightningCLI, as for python -m (examples.nmt)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments: fit --config ...")
    ns = parser.parse_args(argv)
    if not ns.args or ns.args[0] != "fit":
        parser.error("give the CLI's fit subcommand and its arguments: ... examples.nmt fit --config cpu.yaml")
    cli = _cli(ns.cli, ns.args[1:])
    if not isinstance(cli.trainer.strategy, GPipeStrategy):
        parser.error(f"the configuration's strategy is {type(cli.trainer.strategy).__name__}, not GPipeStrategy")
    strategy = _strategy_of(cli)

    def module() -> pl.LightningModule:
        return _cli(ns.cli, ns.args[1:]).model

    def data() -> Any:
        return _cli(ns.cli, ns.args[1:]).datamodule  # None: the module's own train_dataloader

    report = verify(
        module, data, strategy, steps=ns.steps, precision=ns.precision, tolerance=ns.tolerance,
        devices=cli.trainer.num_devices,
    )  # fmt: skip
    if report is not None:
        print(report)


def _strategy_of(cli: LightningCLI) -> GPipeStrategy:
    """A new GPipeStrategy as the configuration gives it (the CLI's own is its Trainer's), without its trace."""
    spec = cli.config["trainer"]["strategy"]
    kwargs = spec.init_args.as_dict() if hasattr(spec, "init_args") else {}
    kwargs["trace_dir"] = None
    return GPipeStrategy(**kwargs)


def _cli(name: str, args: list[str]) -> LightningCLI:
    """The LightningCLI that ``python -m name fit args`` makes, made but not run."""
    made: list[LightningCLI] = []
    original = LightningCLI.__init__

    def capture(self: LightningCLI, *a: Any, **kw: Any) -> None:
        kw.update(run=False, args=args)
        original(self, *a, **kw)
        made.append(self)

    target = importlib.import_module(name if name.endswith("__main__") else f"{name}.__main__")
    LightningCLI.__init__ = capture  # type: ignore[method-assign]
    try:
        target.main()
    finally:
        LightningCLI.__init__ = original  # type: ignore[method-assign]
    if not made:
        raise ValueError(f"{name}'s main() made no LightningCLI")
    return made[0]


if __name__ == "__main__":
    main(sys.argv[1:])
