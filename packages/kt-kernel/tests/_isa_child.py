"""Run a test module's ``mismatches()`` in a child process whose native loops are capped by
``KT_KERNEL_ISA``, and return the ISA the op reports there with what the child found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def mismatches_on_isa(module: str, isa_op: str, isa: str) -> tuple[str, Any]:
    """``(torch.ops.kt_kernel.<isa_op>(), <module>.mismatches())`` computed under ``isa``."""
    code = (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        f"import {module}\n"
        f"print(json.dumps([torch.ops.kt_kernel.{isa_op}(), {module}.mismatches()]))\n"
    )
    env = dict(os.environ, KT_KERNEL_ISA=isa)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got_isa, bad = json.loads(out.stdout.strip().splitlines()[-1])
    return got_isa, bad
