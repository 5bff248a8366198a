"""``torchrun --nproc-per-node 2`` with gloo and FSDP2 follows the single-process loss curve."""

from __future__ import annotations

from pathlib import Path

import pytest

STEPS = 8
# Two ranks each average half of the same global batch; FSDP reduce-scatters the dense LoRA
# gradients and lora_core.fsdp averages the expert LoRA. Only the order of float additions
# differs from one process, so the curves agree to float32 round-off, amplified a little by
# AdamW over 8 steps: 1e-4 absolute on losses near 5 leaves room for that and nothing more.
LOSS_ATOL = 1e-4


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_ranks_match_one_process(tmp_path: Path, cli) -> None:
    common = ["--steps", str(STEPS), "--batch-size", "4", "--seq-len", "32", "--no-progress"]
    single = cli.run([*common, "--output", str(tmp_path / "one")])
    assert single.returncode == 0, single.stderr
    double = cli.run([*common, "--output", str(tmp_path / "two"), "--save-every", "4",
                      "--keep-last", "3"], nproc=2, timeout=300)
    assert double.returncode == 0, double.stdout[-3000:] + double.stderr[-3000:]
    one = [r["loss"] for r in cli.log(tmp_path / "one")]
    two = [r["loss"] for r in cli.log(tmp_path / "two")]
    assert len(one) == len(two) == STEPS
    for step, (a, b) in enumerate(zip(one, two, strict=True), 1):
        assert abs(a - b) <= LOSS_ATOL, f"step {step}: 1 process {a}, 2 ranks {b}"
    assert one[-1] < one[0]

    # Resume under torchrun from the step-4 checkpoint (FSDP-sharded AdamW state per rank):
    # steps 5-8 repeat the uninterrupted 2-rank run bitwise.
    ckpt = tmp_path / "two" / "checkpoints" / "step-00000004"
    resumed = cli.run([*common, "--output", str(tmp_path / "resumed"), "--resume", str(ckpt)],
                      nproc=2, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    again = [r["loss"] for r in cli.log(tmp_path / "resumed")]
    assert again == two[4:]
