"""``--resume`` continues exactly: a resumed run equals the uninterrupted one, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_checkpoint import load


@pytest.mark.timeout(400)
def test_resume_equals_uninterrupted(tmp_path: Path, cli) -> None:
    common = ["--batch-size", "4", "--seq-len", "32", "--no-progress", "--keep-last", "5"]
    full = cli.run([*common, "--steps", "6", "--save-every", "3", "--output", str(tmp_path / "a")])
    assert full.returncode == 0, full.stderr
    # Stop after 3 steps, then continue in a new process from that checkpoint.
    part = cli.run([*common, "--steps", "3", "--output", str(tmp_path / "b")])
    assert part.returncode == 0, part.stderr
    ckpt_b = Path(part.stdout.split("checkpoint:")[1].split()[0])
    resumed = cli.run(
        [*common, "--steps", "6", "--output", str(tmp_path / "b"), "--resume", str(ckpt_b)]
    )
    assert resumed.returncode == 0, resumed.stderr

    losses_a = [r["loss"] for r in cli.log(tmp_path / "a")]
    losses_b = [r["loss"] for r in cli.log(tmp_path / "b")]
    assert losses_b == losses_a  # bitwise: same floats, same order
    final_a = Path(full.stdout.split("checkpoint:")[1].split()[0])
    final_b = Path(resumed.stdout.split("checkpoint:")[1].split()[0])
    a, b = load(final_a), load(final_b)
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype, k
        assert a.tensors[k].equal(b.tensors[k]), k
    # The optimizer state (AdamW moments, step counts) continues exactly too.
    opt_a, opt_b = a.training_state.optimizer, b.training_state.optimizer
    assert opt_a.state.keys() == opt_b.state.keys()
    for name, state in opt_a.state.items():
        for key, value in state.items():
            other = opt_b.state[name][key]
            if isinstance(value, torch.Tensor):
                assert value.equal(other), (name, key)
            else:
                assert value == other, (name, key)
    assert a.training_state.step == b.training_state.step == 6
    # And the files themselves: every tensor file is byte-identical (only the manifest's
    # creation time differs).
    files = sorted(p.name for p in final_a.glob("*.safetensors"))
    assert files == sorted(p.name for p in final_b.glob("*.safetensors"))
    for name in files:
        assert (final_a / name).read_bytes() == (final_b / name).read_bytes(), name
