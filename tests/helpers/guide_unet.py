"""The U-Net of docs/guide.md's section "Long skip connections", built from the guide's own code block."""

from __future__ import annotations

import re
from typing import Any

from tests.helpers import ROOT

GUIDE = ROOT / "docs" / "guide.md"


def guide_unet() -> Any:
    """The ``unet`` function of the guide's section "Long skip connections", run as the guide shows it."""
    text = GUIDE.read_text()
    section = text[text.index("### Long skip connections") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "the guide's skip section has its code block"
    scope: dict[str, Any] = {}
    exec(compile(code.group(1), str(GUIDE), "exec"), scope)
    return scope["unet"]
