"""``--resume`` continues exactly: a resumed run equals the uninterrupted one, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file


def _tensors(checkpoint: Path) -> dict:
    out = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return out


@pytest.mark.timeout(400)
def test_resume_equals_uninterrupted(tmp_path: Path, cli) -> None:
    common = ["--batch-size", "4", "--seq-len", "32", "--no-progress", "--keep-last", "5"]
    full = cli.run([*common, "--steps", "6", "--save-every", "3", "--output", str(tmp_path / "a")])
    assert full.returncode == 0, full.stderr
    # Stop after 3 steps, then continue in a new process from that checkpoint.
    part = cli.run([*common, "--steps", "3", "--output", str(tmp_path / "b")])
    assert part.returncode == 0, part.stderr
    ckpt_b = Path(part.stdout.split("checkpoint:")[1].split()[0])
    resumed = cli.run([*common, "--steps", "6", "--output", str(tmp_path / "b"),
                       "--resume", str(ckpt_b)])
    assert resumed.returncode == 0, resumed.stderr

    losses_a = [r["loss"] for r in cli.log(tmp_path / "a")]
    losses_b = [r["loss"] for r in cli.log(tmp_path / "b")]
    assert losses_b == losses_a  # bitwise: same floats, same order
    final_a = Path(full.stdout.split("checkpoint:")[1].split()[0])
    final_b = Path(resumed.stdout.split("checkpoint:")[1].split()[0])
    ta, tb = _tensors(final_a), _tensors(final_b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].equal(tb[k]), k
