"""Run a test module's ``mismatches()`` in a child process whose native loops are capped by
``KT_KERNEL_ISA`` (or otherwise set by its environment): the shared body of the forced-ISA tests."""

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
    probe = f"torch.ops.kt_kernel.{isa_op}()"
    got_isa, bad = child_mismatches(module, {"KT_KERNEL_ISA": isa}, probe)
    assert got_isa == isa, f"KT_KERNEL_ISA={isa} ran the {got_isa} loops"
    return bad


def child_mismatches(module: str, env: dict[str, str], probe: str) -> tuple[Any, Any]:
    """``(<probe>, <module>.mismatches())`` evaluated in a child process with ``env`` set."""
    code = (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        f"import {module}\n"
        f"print(json.dumps([{probe}, {module}.mismatches()]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    probed, bad = json.loads(out.stdout.strip().splitlines()[-1])
    return probed, bad
