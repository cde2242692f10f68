"""Every benchmark script still runs end to end (``--smoke``: tiny models, few steps) and writes its three files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", ["throughput", "overhead", "peers", "memory", "consistency"])
def test_benchmark_smoke_run_writes_json_markdown_and_plot(script: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / f"{script}.json").read_text())
    assert data["environment"]["torch"]
    assert (tmp_path / f"{script}.md").read_text().startswith("#")
    assert (tmp_path / f"{script}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
