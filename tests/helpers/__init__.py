"""What the tests share: launching ranks, tiny models and their plain references, running the repo's programs."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def root_on_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which ``python -m examples.nmt`` (or any of this repo's modules) imports from any cwd."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env
