"""``moe-experts finetune --method dpo`` under real torchrun (2 ranks, --grad-accum 2) equals TRL.

Step 1 runs first (LoRA B starts at zero, so policy = reference there); step 2 resumes from
its checkpoint under torchrun with 2 ranks, 2 accumulation micro-batches and
``--precompute-reference``, and its loss, rewards, log-probabilities (train_log.jsonl) and
every LoRA gradient (recorded at the optimizer step) must equal one step of TRL's
DPOTrainer on the same adapter values (loaded from the step-1 checkpoint) and the same pairs.
A resumed run reuses the kept reference log-probabilities.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="TRL is the oracle of preference training (moe-experts[test])")

from safetensors.torch import load_file

from moe_experts.finetune.data import load_samples
from moe_experts.finetune.preference_data import (
    PreferenceBatches,
    preference_demo_path,
    tokenize_pairs,
)
from moe_experts.finetune.preference_setup import REFERENCE_FILE

WORKER = Path(__file__).with_name("pref_cli_worker.py")
SEQ_LEN = 127
BATCH = 4
TOL = {"rtol": 1e-5, "atol": 1e-5}
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], env: dict[str, str], *, nproc: int = 1, grads: Path | None = None):
    worker = [str(WORKER), str(grads)] if grads is not None else ["-m", "moe_experts.finetune"]
    launch = [sys.executable]
    if nproc > 1:
        launch += [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
        ]
        if grads is None:
            launch += ["-m", "moe_experts.finetune"]
            worker = []
    proc = subprocess.run(
        [*launch, *worker, *args], env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _log(output: Path) -> dict[int, dict]:
    lines = (output / "train_log.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_torchrun_two_ranks_grad_accum_equals_trl(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "MOE_EXPERTS_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }
    config = tmp_path / "run.yaml"
    # TRL refuses LoRA on lm_head: attention and routers ("auto") and the experts only.
    config.write_text("lora:\n  rank: 4\n  alpha: 8\n  target_modules: [auto]\n")
    data = preference_demo_path()
    common = [
        "--method", "dpo", "--data", str(data), "--config", str(config),
        "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--lr", "0.02",
        "--max-grad-norm", "inf", "--no-progress",
    ]  # fmt: skip
    first = tmp_path / "one"
    held = tmp_path / "held.jsonl"
    held.write_text("".join(data.read_text().splitlines(keepends=True)[:3]))
    # A checkpoint resumes under the world size that wrote it: step 1 runs on 2 ranks too.
    _run(
        [
            *common, "--steps", "1", "--grad-accum", "2", "--output", str(first),
            "--eval-data", str(held), "--report-to", "tensorboard",
        ],
        env,
        nproc=2,
    )  # fmt: skip
    # TensorBoard gets TRL's names too (train/..., eval/...), the values of train_log.jsonl.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = _log(first)[1]
    acc = EventAccumulator(str(first / "tensorboard"))
    acc.Reload()
    for name in METRICS:
        for split, key in (("train", name), ("eval", f"eval_{name}")):
            (event,) = acc.Scalars(f"{split}/{name}")
            assert event.value == pytest.approx(record[key], rel=1e-6, abs=1e-7), name
    ckpt = first / "checkpoints" / "step-00000001"
    second = tmp_path / "two"
    grads_file = tmp_path / "grads.safetensors"
    proc = _run(
        [
            *common,
            "--steps", "2", "--grad-accum", "2", "--precompute-reference",
            "--resume", str(ckpt), "--output", str(second),
        ],
        env,
        nproc=2,
        grads=grads_file,
    )  # fmt: skip
    assert "reference log-probs: 16 pairs" in proc.stderr, proc.stderr[-2000:]
    ours = _log(second)[2]
    grads = load_file(grads_file)

    # TRL on the same adapter values, the same four pairs (step 2's draw), one batch.
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .trl_oracle import peft_name, trl_dpo_from_adapter

    os.environ.setdefault("MOE_EXPERTS_CACHE", str(cache))
    model_dir = cache / "tiny-qwen3-moe"
    tok = AutoTokenizer.from_pretrained(model_dir)
    samples = load_samples(data)
    pairs, _ = tokenize_pairs(data, samples, tok, max_tokens=SEQ_LEN + 1)
    order = PreferenceBatches(tuple(pairs), BATCH, 0, SEQ_LEN).model_batch(1).index
    lines = data.read_text().splitlines()
    records = [json.loads(lines[pairs[i].line - 1]) for i in order]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss, metrics, named = trl_dpo_from_adapter(
        base, peft.PeftConfig.from_pretrained(ckpt), load_file(ckpt / "adapter_model.safetensors"),
        tok, records, tmp_path / "trl",
    )  # fmt: skip
    torch.testing.assert_close(ours["loss"], loss, **TOL)
    for name in METRICS:
        torch.testing.assert_close(ours[name], metrics[name], **TOL, msg=name)
    assert abs(ours["rewards/margins"]) > 1e-4  # step 1 really moved the policy
    assert len(grads) == len(named) > 0
    for key, g in grads.items():
        want = named[peft_name(key)].grad
        assert want is not None, key
        torch.testing.assert_close(g, want, **TOL, msg=lambda m, key=key: f"{key}: {m}")

    # A resumed run reuses the kept reference log-probabilities (same bytes, no new pass).
    kept = (second / REFERENCE_FILE).read_bytes()
    again = _run(
        [
            *common, "--steps", "3", "--grad-accum", "2", "--precompute-reference",
            "--resume", str(second / "checkpoints"), "--output", str(second),
        ],
        env,
        nproc=2,
    )  # fmt: skip
    assert f"reference log-probs: reused {second / REFERENCE_FILE}" in again.stderr
    assert (second / REFERENCE_FILE).read_bytes() == kept
    assert set(_log(second)) == {2, 3}


def test_kept_reference_key_names_the_resolved_storage() -> None:
    # "auto" stands for different formats on different CPUs (bf16-packed where kt-kernel runs
    # its products), so kept reference values are keyed on the storage the experts got.
    from types import SimpleNamespace

    import kt_kernel
    from moe_experts import wrap
    from moe_experts.finetune.preference_setup import _key
    from moe_experts.testing import tiny_model

    pairs = SimpleNamespace(fingerprint=lambda: "pairs")
    args = SimpleNamespace(weight_dtype="auto", loss="full")
    keys = {}
    for name in ("auto", "bf16", "int8"):
        torch.manual_seed(0)
        model = tiny_model("qwen3_moe").to(torch.bfloat16)
        wrap(model, weight_dtype=name)
        keys[name] = _key(args, model, Path("m"), pairs, None)["weight_dtype"]
    assert keys["auto"] == kt_kernel.auto_format(torch.bfloat16)
    assert keys["bf16"] == "bf16"
    assert keys["int8"] == "int8"
    unwrapped = tiny_model("qwen3_moe")
    assert _key(args, unwrapped, Path("m"), pairs, None)["weight_dtype"] == "auto"
