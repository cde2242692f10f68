"""Launching: torchrun, and Lightning's own launcher (which re-runs the script for each process)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "fit_pipeline.py"


def _run(command: list[str], out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def _check(results: list[dict]) -> None:
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        assert r["err"] <= 1e-6, r


@pytest.mark.timeout(260)
def test_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "result"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    _check(_run([*torchrun, str(SCRIPT), str(out)], out))


@pytest.mark.timeout(260)
def test_lightning_launcher(tmp_path: Path) -> None:
    out = tmp_path / "result"
    _check(_run([sys.executable, str(SCRIPT), str(out)], out))
