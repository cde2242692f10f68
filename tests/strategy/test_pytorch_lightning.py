"""``lightning_gpipe.pytorch_lightning``: the strategy on the standalone ``pytorch_lightning`` package, built from the
unified sources with the imports rewritten, driving the one shared engine."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers.launch import run_distributed
from tests.helpers.tiny_fit import BATCH, STEPS, TOL, dataset, reference

pytorch_lightning = pytest.importorskip("pytorch_lightning")

MIRROR = "lightning_gpipe.pytorch_lightning.strategy"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.detach() - b).abs().max() / b.abs().max()).item()


def fit_worker(rank: int, world_size: int) -> dict[str, dict]:
    import pytorch_lightning as pl

    from lightning_gpipe.pytorch_lightning import GPipeStrategy
    from tests.helpers.standalone import quiet_trainer, tiny

    warnings.simplefilter("ignore")
    runs = {}
    for hooked in (False, True):  # the loss after the pipeline, and inside it (pipeline_loss)
        module = tiny(hooked)
        trainer = quiet_trainer(devices=world_size, strategy=GPipeStrategy(chunks=3), max_steps=STEPS)
        assert isinstance(trainer.strategy, pl.strategies.ParallelStrategy)
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
        runs[f"hooked={hooked}"] = {
            # As lists: a tensor would cross the queue as shared memory, gone once this process exits.
            "weights": {n: p.detach().tolist() for n, p in module.named_parameters()},
            "loss": float(trainer.callback_metrics["train_loss"]),
            "step": trainer.global_step,
        }
    return runs


@pytest.mark.timeout(150)
def test_pytorch_lightning_trainer_fit_equals_a_plain_run() -> None:
    """pp = 2 under ``pytorch_lightning.Trainer``: every rank ends with a plain single-device pytorch_lightning run's
    weights (≤ 1e-6 relative), on both loss paths."""
    from tests.helpers.standalone import single_device_reference

    results = run_distributed(fit_worker, 2, timeout=140, lightning=True)
    torch_reference = reference(1, None)
    for hooked in (False, True):
        expected = single_device_reference(STEPS, hooked)
        for name, want in expected.items():  # the reference itself: the plain Lightning run is the plain torch run
            assert rel_err(want, torch_reference[name]) <= TOL, name
        checked: set[str] = set()
        for rank, runs in enumerate(results):
            run = runs[f"hooked={hooked}"]
            assert run["step"] == STEPS
            checked |= run["weights"].keys()  # each rank: its stage's layers (global names) and the replicated ones
            errors = {n: rel_err(torch.tensor(p), expected[n]) for n, p in run["weights"].items()}
            assert max(errors.values()) <= TOL, (rank, hooked, errors)
        assert checked == expected.keys()  # the two stages hold the whole model between them
        assert results[0][f"hooked={hooked}"]["loss"] == results[1][f"hooked={hooked}"]["loss"]


def _mirrored_modules() -> dict[str, types.ModuleType]:
    import lightning_gpipe.pytorch_lightning  # noqa: F401

    return {name: m for name, m in sys.modules.items() if name == MIRROR or name.startswith(MIRROR + ".")}


@pytest.mark.timeout(60)
def test_mirror_shares_the_one_engine() -> None:
    """The mirrored strategy modules import ``lightning_gpipe.pipe`` itself: one engine, never a second copy."""
    import lightning_gpipe.pipe
    import lightning_gpipe.pipe.stage
    import lightning_gpipe.strategy.gpipe

    mirrored = _mirrored_modules()
    unified = {name.replace(MIRROR, "lightning_gpipe.strategy", 1) for name in mirrored}
    # Every module of the strategy package the strategy imports, mirrored; no engine module is.
    assert {n for n in sys.modules if n.startswith("lightning_gpipe.strategy")} >= unified
    files = {p.stem for p in Path(lightning_gpipe.strategy.gpipe.__file__).parent.glob("*.py")}
    assert {name.removeprefix(MIRROR).removeprefix(".") or "__init__" for name in mirrored} == files
    assert not [n for n in sys.modules if n.startswith("lightning_gpipe.pytorch_lightning.pipe")]
    gpipe = mirrored[MIRROR + ".gpipe"]
    assert gpipe.GPipeStage is lightning_gpipe.pipe.GPipeStage is lightning_gpipe.pipe.stage.GPipeStage
    assert mirrored[MIRROR + "._rank_pipeline"].GPipeStage is lightning_gpipe.pipe.GPipeStage
    assert mirrored[MIRROR + "._step_results"].PipelineError is lightning_gpipe.pipe.PipelineError
    for name, module in mirrored.items():
        for value in vars(module).values():
            owner = getattr(value, "__module__", None) if not isinstance(value, types.ModuleType) else value.__name__
            if isinstance(owner, str):
                # Nothing of the unified Lightning or of the unified strategy is reached from the mirror.
                assert not owner.startswith(("lightning.", "lightning_gpipe.strategy")), (name, value)
    # The same files: tracebacks and inspect show the real source, at the same lines.
    assert gpipe.__file__ == lightning_gpipe.strategy.gpipe.__file__
    mirrored_setup, unified_setup = gpipe.GPipeStrategy.setup, lightning_gpipe.strategy.gpipe.GPipeStrategy.setup
    assert mirrored_setup.__code__.co_filename == unified_setup.__code__.co_filename
    assert mirrored_setup.__code__.co_firstlineno == unified_setup.__code__.co_firstlineno
    assert inspect.getsource(mirrored_setup) == inspect.getsource(unified_setup)


@pytest.mark.timeout(60)
def test_each_strategy_is_its_own_packages_strategy() -> None:
    import lightning.pytorch
    import pytorch_lightning as pl

    import lightning_gpipe
    from lightning_gpipe.pytorch_lightning import GPipeStrategy

    assert GPipeStrategy.__module__ == MIRROR + ".gpipe"
    assert issubclass(GPipeStrategy, pl.strategies.ParallelStrategy)
    assert not issubclass(GPipeStrategy, lightning.pytorch.strategies.Strategy)
    assert issubclass(lightning_gpipe.GPipeStrategy, lightning.pytorch.strategies.ParallelStrategy)
    assert not issubclass(lightning_gpipe.GPipeStrategy, pl.strategies.Strategy)
    # Trainer(strategy="gpipe") in each package's registry, with that package's class.
    assert pl.strategies.StrategyRegistry["gpipe"]["strategy"] is GPipeStrategy
    assert lightning.pytorch.strategies.StrategyRegistry["gpipe"]["strategy"] is lightning_gpipe.GPipeStrategy
    # The same arguments, from the same source.
    assert inspect.signature(GPipeStrategy) == inspect.signature(lightning_gpipe.GPipeStrategy)


@pytest.mark.timeout(60)
def test_missing_or_mismatched_pytorch_lightning_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lightning_gpipe.pytorch_lightning", raising=False)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "pytorch_lightning", None)  # as if not installed
        with pytest.raises(ImportError, match="pip install pytorch-lightning"):
            importlib.import_module("lightning_gpipe.pytorch_lightning")
    assert "lightning_gpipe.pytorch_lightning" not in sys.modules
    major, minor = importlib.metadata.version("lightning").split(".")[:2]
    monkeypatch.setattr(pytorch_lightning, "__version__", f"{major}.{int(minor) - 1}.6")
    wanted = re.escape(
        f"pytorch_lightning is {major}.{int(minor) - 1}.6: pip install 'pytorch-lightning=={major}.{minor}.*'"
    )
    with pytest.raises(ImportError, match=wanted):
        importlib.import_module("lightning_gpipe.pytorch_lightning")


@pytest.mark.timeout(60)
def test_the_rewrite_refuses_what_it_cannot_map() -> None:
    from lightning_gpipe.pytorch_lightning import rewrite

    source = "import lightning.pytorch as pl\nfrom lightning.fabric.utilities import x\n"
    source += "from lightning_gpipe.strategy import y\n"
    assert rewrite(source) == (
        f"import pytorch_lightning as pl\nfrom lightning_fabric.utilities import x\nfrom {MIRROR} import y\n"
    )
    assert rewrite("import lightning_utilities\nfrom lightning_gpipe.pipe import z\n").endswith("pipe import z\n")
    with pytest.raises(ImportError, match=r"f\.py:2: 'from lightning import Trainer' names neither"):
        rewrite("x = 1\n    from lightning import Trainer\n", "f.py")
