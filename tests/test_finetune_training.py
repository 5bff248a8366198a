"""Evaluation, schedules, accumulation, one YAML per run, loss.png and TensorBoard, and exact
resume with all of them."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from lora_checkpoint import load

TINY = ["--seq-len", "16", "--no-progress"]


def _final_tensors(out: Path) -> dict[str, torch.Tensor]:
    return dict(load(out / "checkpoints").tensors)


@pytest.mark.timeout(400)
def test_grad_accum_equals_the_whole_batch(tmp_path: Path, cli) -> None:
    """4 micro-batches of 2 rows give the loss and gradients of one batch of 8.

    Both runs use the default chunked loss; a third run with ``--loss full`` (the model's
    logits) gives the same losses, gradient norms and adapters as the chunked one.
    """
    common = [*TINY, "--steps", "3", "--batch-size", "8"]
    one = cli.run([*common, "--output", str(tmp_path / "one")])
    four = cli.run([*common, "--grad-accum", "4", "--output", str(tmp_path / "four")])
    full = cli.run([*common, "--loss", "full", "--output", str(tmp_path / "full")])
    for proc in (one, four, full):
        assert proc.returncode == 0, proc.stderr
    a, b = cli.log(tmp_path / "one"), cli.log(tmp_path / "four")
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        # Only the order of float32 additions differs (token sums per micro-batch).
        assert math.isclose(ra["loss"], rb["loss"], rel_tol=1e-6), (ra, rb)
        assert math.isclose(ra["grad_norm"], rb["grad_norm"], rel_tol=1e-5), (ra, rb)
    for ra, rf in zip(a, cli.log(tmp_path / "full"), strict=True):
        # Chunked vs full logits: the same sums in another order and blocking.
        assert math.isclose(ra["loss"], rf["loss"], rel_tol=1e-5), (ra, rf)
        assert math.isclose(ra["grad_norm"], rf["grad_norm"], rel_tol=1e-4), (ra, rf)
    ta, tb = _final_tensors(tmp_path / "one"), _final_tensors(tmp_path / "four")
    tf = _final_tensors(tmp_path / "full")
    assert ta.keys() == tb.keys() == tf.keys()
    for key in ta:
        # Three AdamW steps from gradients equal to float32 round-off. Where a gradient is
        # near zero next to eps=1e-8, AdamW turns a 1e-11 round-off into lr/eps * 1e-11 =
        # 3e-6 (measured: up to 8e-7 with full logits, 3.2e-6 chunked, 4.6e-6 chunked vs
        # full), so the bound is 1e-5 = lr/300; a real accumulation or loss bug moves the
        # losses and gradient norms above, and the adapters by ~lr per step.
        torch.testing.assert_close(ta[key], tb[key], rtol=1e-5, atol=1e-5, msg=key)
        torch.testing.assert_close(ta[key], tf[key], rtol=1e-5, atol=1e-5, msg=key)
    changed = [k for k in ta if "lora_B" in k and ta[k].abs().max() > 0]
    assert changed, "the run did not train"
    assert any(k.startswith("lm_head") or ".lm_head." in k for k in changed), sorted(changed)


def _expected_lr(step: int, peak: float, warmup: int, total: int, kind: str) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / (total - warmup)
    return (
        peak
        * {"constant": 1.0, "linear": 1.0 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p))}[kind]
    )


@pytest.mark.timeout(400)
def test_schedule_eval_and_accumulation_resume_exactly(tmp_path: Path, cli) -> None:
    common = [
        *TINY,
        "--steps",
        "6",
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--lr",
        "4e-3",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--eval-split",
        "0.1",
        "--eval-every",
        "2",
        "--keep-last",
        "5",
    ]
    full = cli.run([*common, "--save-every", "3", "--output", str(tmp_path / "a")])
    assert full.returncode == 0, full.stderr
    log_a = cli.log(tmp_path / "a")
    for r in log_a:
        assert math.isclose(
            r["lr"], _expected_lr(r["step"] - 1, 4e-3, 2, 6, "cosine"), rel_tol=1e-12
        ), r
    assert [r["step"] for r in log_a if "eval_loss" in r] == [2, 4, 6]
    assert log_a[-1]["eval_loss"] < log_a[1]["eval_loss"]  # it learns what it is tested on
    assert "eval loss" in full.stdout
    # The step-3 checkpoint carries the eval state (the step-2 evaluation) and position.
    position = load(tmp_path / "a" / "checkpoints" / "step-00000003").training_state
    assert position.data_position["eval_loss"] == log_a[1]["eval_loss"]
    assert position.data_position["micro_step"] == 0

    resumed = cli.run(
        [
            *common,
            "--output",
            str(tmp_path / "b"),
            "--resume",
            str(tmp_path / "a" / "checkpoints" / "step-00000003"),
        ]
    )
    assert resumed.returncode == 0, resumed.stderr
    log_b = cli.log(tmp_path / "b")
    keys = ("step", "loss", "grad_norm", "lr", "eval_loss")
    assert [[r.get(k) for k in keys] for r in log_b] == [
        [r.get(k) for k in keys] for r in log_a[3:]
    ]
    ta, tb = _final_tensors(tmp_path / "a"), _final_tensors(tmp_path / "b")
    for key in ta:
        assert ta[key].equal(tb[key]), key


@pytest.mark.timeout(200)
def test_linear_schedule_and_eval_data_file(tmp_path: Path, cli) -> None:
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text("the router sends each token to two experts\n" * 20)
    out = tmp_path / "run"
    proc = cli.run(
        [
            *TINY,
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--lr-schedule",
            "linear",
            "--eval-data",
            str(eval_file),
            "--output",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    log = cli.log(out)
    assert [r["lr"] for r in log] == pytest.approx(
        [_expected_lr(s, 3e-3, 0, 4, "linear") for s in range(4)], rel=1e-12
    )
    # No --eval-every: evaluated once, at the end.
    assert [r["step"] for r in log if "eval_loss" in r] == [4]


@pytest.mark.timeout(300)
def test_one_yaml_holds_the_run_and_flags_override_it(tmp_path: Path, cli) -> None:
    out = tmp_path / "from-yaml"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "tiny-qwen3-moe", "weight_dtype": "fp32"},
                "data": {"seq_len": 16, "eval_split": 0.1},
                "training": {
                    "steps": 5,
                    "lr": "2e-3",
                    "batch_size": 4,
                    "grad_accum": 2,
                    "lr_schedule": "linear",
                    "warmup_steps": 1,
                },
                "lora": {"rank": 4, "alpha": 8},
                "output": {"dir": str(out), "keep_last": 1},
            }
        )
    )
    shown = cli.run(["--config", str(cfg), "--steps", "3", "--print-config"])
    assert shown.returncode == 0, shown.stderr
    resolved = yaml.safe_load(shown.stdout)
    assert resolved["training"]["steps"] == 3  # the flag wins
    assert resolved["training"]["lr"] == 2e-3
    assert resolved["lora"]["rank"] == 4
    assert resolved["lora"]["target_modules"][-1] == "lm_head"  # defaults kept under it
    assert resolved["output"]["dir"] == str(out)
    assert not out.exists()  # --print-config runs nothing
    # The printed config is itself a complete --config file.
    again_cfg = tmp_path / "printed.yaml"
    again_cfg.write_text(shown.stdout)
    again = cli.run(["--config", str(again_cfg), "--print-config"])
    assert again.returncode == 0, again.stderr
    assert again.stdout == shown.stdout

    run = cli.run(["--config", str(cfg), "--steps", "3", "--no-progress"])
    assert run.returncode == 0, run.stderr
    log = cli.log(out)
    assert [r["step"] for r in log] == [1, 2, 3]
    assert log[0]["lr"] == pytest.approx(2e-3)  # warm-up of 1 step reaches the peak at once
    adapter = json.loads(
        (out / "checkpoints" / "step-00000003" / "adapter_config.json").read_text()
    )
    assert adapter["r"] == 4
    assert adapter["lora_alpha"] == 8


@pytest.mark.timeout(300)
def test_loss_png_and_tensorboard_scalars(tmp_path: Path, cli) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = cli.run(
        [
            *TINY,
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--eval-split",
            "0.1",
            "--eval-every",
            "2",
            "--report-to",
            "tensorboard",
            "--output",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    log = cli.log(out)
    image = imread(out / "loss.png")
    assert image.shape[0] > 100
    assert image.shape[1] > 100

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    train = acc.Scalars("train/loss")
    assert [e.step for e in train] == [1, 2, 3, 4]
    assert [e.value for e in train] == pytest.approx([r["loss"] for r in log], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([r["lr"] for r in log])
    evals = acc.Scalars("eval/loss")
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in evals] == [
        (r["step"], r["eval_loss"]) for r in log if "eval_loss" in r
    ]


def _wandb_history(run_file: Path) -> list[dict]:
    """The ``history`` records of an offline wandb run file, read with wandb's own protobufs.

    The file is ``:W&B`` plus magic and version (7 bytes), then LevelDB-log records in 32 KiB
    blocks (crc32c, length, type, payload; FIRST/MIDDLE/LAST pieces joined); wandb 0.31 ships
    no Python reader for it, so the framing is read here and the payload by wandb's Record.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if length == 0 and kind == 0:
            break
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = payload if kind in (1, 2) else pending + payload  # FULL/FIRST start anew
        if kind not in (1, 4):  # FULL or LAST completes a record
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            out.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return out


@pytest.mark.timeout(300)
def test_wandb_offline_run_holds_the_logged_scalars(tmp_path: Path, cli) -> None:
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    env = {k: v for k, v in cli.env.items() if not k.startswith("WANDB_")}
    cli.env = {**env, "WANDB_SILENT": "true"}  # offline is the Reporter's default mode
    proc = cli.run(
        [
            *TINY,
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--eval-split",
            "0.1",
            "--eval-every",
            "2",
            "--report-to",
            "wandb",
            "--output",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    runs = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, sorted(p.name for p in (out / "wandb").iterdir())
    history = _wandb_history(runs[0])
    log = cli.log(out)
    assert [h["_step"] for h in history] == [r["step"] for r in log] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == pytest.approx([r["loss"] for r in log], rel=1e-6)
    assert [h["train/lr"] for h in history] == pytest.approx([r["lr"] for r in log])
    evals = [(h["_step"], h["eval/loss"]) for h in history if "eval/loss" in h]
    assert evals == [
        (r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in log if "eval_loss" in r
    ]
    assert [s for s, _ in evals] == [2, 3]


@pytest.mark.timeout(120)
def test_wandb_missing_is_one_clear_error(tmp_path: Path, cli) -> None:
    # A wandb package that fails to import, first on the path: wandb as if not installed.
    fake = tmp_path / "no-wandb" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    cli.env = {
        **cli.env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(fake.parent), cli.env.get("PYTHONPATH")])),
    }
    proc = cli.run(["--report-to", "wandb", "--output", str(tmp_path / "run")])
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --report-to wandb needs")
    assert "pip install wandb" in proc.stderr
