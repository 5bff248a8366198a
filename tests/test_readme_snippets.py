"""Every code block of README.md, the package READMEs and their docs/ pages runs as written.

Python blocks of one README run in order in one fresh interpreter (as a reader pastes them
into one session); bash blocks run with bash unless the line before the fence is
``<!-- not-run: REASON -->``; yaml blocks must parse.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
READMES = [
    ROOT / "README.md",
    *sorted((ROOT / "packages").glob("*/README.md")),
    *sorted((ROOT / "packages").glob("*/docs/*.md")),
]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!-- not-run: (\S.*?) -->\s*$")

RUNNER = """
import sys, traceback
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for line, source in blocks:
    try:
        exec(compile(source, f"{readme}:{{line}}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"block at {readme}:{{line}} failed")
"""


def _blocks(readme: Path) -> list[tuple[str, int, str, str | None]]:
    """``(language, line, source, not-run reason)`` for each fenced block."""
    text = readme.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        out.append((m.group(1), line, m.group(2), reason.group(1) if reason else None))
    return out


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(
        os.environ,
        MOE_EXPERTS_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )


def test_every_readme_has_its_blocks_found() -> None:
    # docs/ pages may be prose only; every README (kt-kernel's too) has a block to run
    assert all(_blocks(r) for r in READMES if r.name == "README.md")
    langs = {lang for r in READMES for lang, *_ in _blocks(r)}
    assert langs <= {"python", "bash", "yaml", "text"}, langs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(readme: Path, tmp_path: Path) -> None:
    blocks = [
        (line, src)
        for lang, line, src, reason in _blocks(readme)
        if lang == "python" and reason is None
    ]
    if not blocks:
        pytest.skip("no python blocks")
    script = RUNNER.format(blocks=blocks, readme=readme.relative_to(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_blocks_run_or_say_why_not(readme: Path, tmp_path: Path) -> None:
    for lang, line, src, reason in _blocks(readme):
        if lang == "yaml":
            assert yaml.safe_load(src) is not None
        if lang != "bash" or reason is not None:
            continue
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", src],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=540,
            check=False,
        )
        assert proc.returncode == 0, (f"{readme}:{line}", proc.stdout[-2000:], proc.stderr[-2000:])
