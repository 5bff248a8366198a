"""Run a test module's ``mismatches()`` in a child process whose native loops are capped by
``KT_KERNEL_ISA``: the shared body of the forced-ISA tests of the per-ISA row ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

import kt_kernel as kk


def mismatches_on_isa(module: str, isa_op: str, isa: str) -> Any:
    """``<module>.mismatches()`` computed under ``isa``, after checking the op ran there.

    Skips where the native extension is absent or the CPU lacks ``isa``.
    """
    info = kk.backend_info()
    if info.active != "native":
        pytest.skip("needs the native extension")
    # What isa_level() asks of the CPU before it picks the avx2 loops.
    needs = {"avx2": ("avx2", "fma"), "scalar": ()}[isa]
    if lacking := [f for f in needs if f not in info.cpu_features]:
        pytest.skip(f"this CPU has no {'/'.join(lacking).upper()}")
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
    assert got_isa == isa, f"KT_KERNEL_ISA={isa} ran the {got_isa} loops"
    return bad
