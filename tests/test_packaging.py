"""The package as a user gets it: a wheel with the right metadata that trains from a fresh virtual environment."""

from __future__ import annotations

import email
import json
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

import lightning_gpipe

ROOT = Path(__file__).resolve().parents[1]

FIT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import lightning.pytorch as pl, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning_gpipe
    from lightning_gpipe import GPipeStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.backbone(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    module = Module()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=GPipeStrategy(chunks=2, pipeline_parallel_size=1), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=8))
    changed = any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    print(json.dumps({"file": lightning_gpipe.__file__, "strategy": sys.modules[GPipeStrategy.__module__].__file__,
                      "changed": changed, "finite": all(bool(p.isfinite().all()) for p in module.parameters())}))
    """
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy without this checkout's build/ (setuptools would reuse, and could ship, stale files from it).
    source = tmp_path_factory.mktemp("source") / "lightning-gpipe"
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "runs", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, source, ignore=skip)
    # Built as a user's pip builds it (isolated, setuptools from pip's index or cache), without the dependencies.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True,
        timeout=180,
    )
    (built,) = out.glob("lightning_gpipe-*.whl")
    return built


@pytest.mark.timeout(200)
def test_the_wheel_holds_the_package_its_license_and_one_version(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(z.read(f"{info}/METADATA"))
        license_text = z.read(f"{info}/licenses/LICENSE").decode()
    assert metadata["Version"] == lightning_gpipe.__version__
    assert metadata["License-Expression"] == "Apache-2.0" and "License" not in metadata  # no deprecated table
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert any(c.startswith("Development Status") for c in metadata.get_all("Classifier", []))
    assert metadata.get_all("Project-URL") and metadata["Author"]
    assert "timeline" in metadata.get_all("Provides-Extra", [])
    assert {n.split("/")[0] for n in names} == {"lightning_gpipe", info}  # no tests, examples or benchmarks
    assert "lightning_gpipe/py.typed" in names and "lightning_gpipe/pipe/run/loss_inside.py" in names


@pytest.mark.timeout(300)
def test_a_fresh_environment_trains_with_the_wheel(wheel: Path, tmp_path: Path) -> None:
    """A new venv gets only the wheel; torch and Lightning come from this one (a path, whose .pth files, such as
    this checkout's editable install, Python does not read)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    ours = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (Path(purelib) / "host_packages.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, timeout=120)
    run = subprocess.run([python, "-c", FIT], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(purelib) and result["strategy"].startswith(purelib), (purelib, result)
    assert result["changed"] and result["finite"], result
