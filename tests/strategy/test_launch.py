"""Launching: torchrun, and Lightning's own launcher (which re-runs the script for each process)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import root_on_path

SCRIPT = ["-m", "tests.helpers.scripts.fit_pipeline"]


def _run(command: list[str], out: Path, threads: str | None = "1") -> list[dict]:
    env = {key: v for key, v in root_on_path().items() if key != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The strategy destroyed the process groups before the interpreter's teardown (gloo aborts otherwise).
    assert [Path(f"{out}.{rank}.exit").read_text() for rank in range(2)] == ["False", "False"]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check(results: list[dict]) -> None:
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        assert r["err"] <= 1e-6, r


@pytest.mark.timeout(260)
def test_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "result"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
    ]
    _check(_run([*torchrun, "--module", SCRIPT[1], str(out)], out))


@pytest.mark.timeout(260)
def test_lightning_launcher(tmp_path: Path) -> None:
    """OMP_NUM_THREADS unset: the launcher's process and the one it starts get the same share of the cores."""
    out = tmp_path / "result"
    results = _run([sys.executable, *SCRIPT, str(out)], out, threads=None)
    _check(results)
    assert len({r["threads"] for r in results}) == 1, results


def _two_node_launch(out: Path, per_node: int, script_args: list[str]) -> None:
    port = _free_port()
    env = {**root_on_path(), "OMP_NUM_THREADS": "1"}
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(per_node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--module",
                SCRIPT[1],
                str(out),
                *script_args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    try:
        logs = [p.communicate(timeout=200)[0] for p in launches]
    finally:
        for p in launches:
            p.kill()
    assert all(p.returncode == 0 for p in launches), "\n".join(log[-3000:] for log in logs)


@pytest.mark.timeout(260)
def test_two_nodes(tmp_path: Path) -> None:
    """num_nodes=2, shown on one machine: two torchrun launches, one process each, meeting on 127.0.0.1."""
    out = tmp_path / "result"
    _two_node_launch(out, 1, ["2", "1"])
    _check([json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)])


@pytest.mark.timeout(260)
def test_two_nodes_reduce_hierarchically(tmp_path: Path) -> None:
    """2 nodes × 2 processes, K = 1: four replicas, two on each node, so dp_reduction="auto" reduces in Jizhi's
    steps; every replica ends where the plain model does, trained on the four replicas' batches."""
    out = tmp_path / "result"
    _two_node_launch(out, 2, ["2", "2", "1", "auto"])
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(4)]
    assert [r["hierarchical"] for r in results] == [True] * 4, results
    assert all(r["err"] <= 1e-6 for r in results), results


@pytest.mark.timeout(260)
def test_slurm_environment(tmp_path: Path) -> None:
    """As `srun --ntasks=2` starts them: two processes with SLURM's variables, wired by SLURMEnvironment."""
    out, port = tmp_path / "result", _free_port()
    procs = []
    for rank in range(2):
        slurm = {
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "gpipe-test",
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_NNODES": "1",
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "MASTER_PORT": str(port),
        }
        env = {k: v for k, v in root_on_path().items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC"))}
        procs.append(
            subprocess.Popen(
                [sys.executable, *SCRIPT, str(out), "1", "2"],
                env={**env, "OMP_NUM_THREADS": "1", **slurm},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=200)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    _check(results)
    assert all(r["environment"] == "SLURMEnvironment" for r in results), results
