"""Bad values, bad files and a used --output are refused with one line before any model loads;
a diverging run stops with the step and a lower --lr, and saves nothing non-finite."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lora_checkpoint import load


@pytest.fixture
def cold(cli, tmp_path: Path):
    """A runner whose model cache is empty: if the model loaded, the cache would fill."""
    cache = tmp_path / "cold-cache"
    cli.env = {**cli.env, "MOE_EXPERTS_CACHE": str(cache)}
    yield cli
    assert not cache.exists(), "the model was loaded before the bad input was refused"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--lr", "nan"], ["--lr", "finite"]),
        (["--lr", "inf"], ["--lr", "finite"]),
        (["--lr", "0"], ["--lr", "> 0"]),
        (["--lr=-1e-3"], ["--lr", "> 0"]),
        (["--max-grad-norm", "nan"], ["--max-grad-norm"]),
        (["--max-grad-norm", "0"], ["--max-grad-norm", "> 0"]),
        (["--save-every", "0"], ["--save-every", ">= 1"]),
        (["--keep-last", "0"], ["--keep-last", ">= 1"]),
        (["--grad-accum", "3", "--batch-size", "8"], ["--batch-size", "--grad-accum"]),
        (["--lr-schedule", "cosin"], ["--lr-schedule", "cosine"]),
        (["--eval-every", "5"], ["--eval-every", "--eval-data"]),
    ],
    ids=[
        "lr-nan",
        "lr-inf",
        "lr-zero",
        "lr-negative",
        "clip-nan",
        "clip-zero",
        "save-every-0",
        "keep-last-0",
        "accum-split",
        "schedule-typo",
        "eval-without-data",
    ],
)
def test_bad_value_refused_before_the_model_loads(
    cold, tmp_path: Path, flags, needles, assert_clean_error
) -> None:
    assert_clean_error(cold.run([*flags, "--output", str(tmp_path / "out")]), *needles)


@pytest.mark.timeout(120)
def test_output_under_a_file(cold, tmp_path: Path, assert_clean_error) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    assert_clean_error(cold.run(["--output", str(blocker / "run")]), "--output", "file.txt")


@pytest.mark.timeout(120)
def test_output_not_writable(cold, tmp_path: Path, assert_clean_error) -> None:
    if os.geteuid() == 0:
        # root writes through permission bits; sysfs refuses new entries even to root.
        target = Path("/sys/fs/moe-experts-test/run")
        if not Path("/sys/fs").is_dir():
            pytest.skip("no unwritable directory available to root here")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        target = locked / "run"
    assert_clean_error(cold.run(["--output", str(target)]), "--output", "cannot write")


@pytest.mark.timeout(120)
def test_data_not_utf8_names_file_and_line(cold, tmp_path: Path, assert_clean_error) -> None:
    data = tmp_path / "latin1.txt"
    data.write_bytes("first line\nsecond line\ncaf\xe9 au lait\n".encode("latin-1"))
    assert_clean_error(
        cold.run(["--data", str(data), "--output", str(tmp_path / "out")]),
        "latin1.txt",
        "line 3",
        "UTF-8",
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("yaml_text", "needles"),
    [
        ("training:\n  lr: 1e-3\n  lerning_rate: 2\n", ["training.lerning_rate"]),
        ("trainig:\n  lr: 1e-3\n", ["trainig", "training"]),
        ("training:\n  stepz: 3\n", ["training.stepz", "steps"]),
        ("lr: 0.1\n", ["lr", "training.lr"]),
        ("lora:\n  rnak: 4\n", ["lora.rnak", "rank"]),
        ("models:\n  moe:\n    lora:\n      enable: true\n      rnak: 8\n", ["rnak", "rank"]),
        ("models:\n  moe:\n    lora: {rank: 4}\n    loar: {}\n", ["models.moe.loar", "lora"]),
        ("output:\n  keep_last: 0\n", ["output.keep_last", ">= 1"]),
    ],
    ids=[
        "training-key",
        "section",
        "near-key",
        "wrong-section",
        "lora-key",
        "legacy-lora-key",
        "legacy-block",
        "yaml-value",
    ],
)
def test_config_unknown_keys_suggest_the_nearest(
    cold, tmp_path: Path, yaml_text, needles, assert_clean_error
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml_text)
    assert_clean_error(
        cold.run(["--config", str(cfg), "--output", str(tmp_path / "out")]), *needles
    )


@pytest.mark.timeout(300)
def test_existing_output_needs_resume_or_overwrite(tmp_path: Path, cli, assert_clean_error) -> None:
    out = tmp_path / "run"
    common = ["--batch-size", "2", "--seq-len", "16", "--no-progress", "--output", str(out)]
    first = cli.run([*common, "--steps", "3"])
    assert first.returncode == 0, first.stderr
    again = cli.run([*common, "--steps", "2"])
    assert_clean_error(again, "already holds checkpoints", "--resume", "--overwrite")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    fresh = cli.run([*common, "--steps", "2", "--overwrite"])
    assert fresh.returncode == 0, fresh.stderr
    assert [r["step"] for r in cli.log(out)] == [1, 2]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert not (out / "checkpoints" / "step-00000003").exists()


@pytest.mark.timeout(300)
def test_resume_logs_each_step_once(tmp_path: Path, cli, assert_clean_error) -> None:
    out = tmp_path / "run"
    common = [
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--no-progress",
        "--output",
        str(out),
        "--keep-last",
        "5",
    ]
    full = cli.run([*common, "--steps", "6", "--save-every", "3"])
    assert full.returncode == 0, full.stderr
    before = cli.log(out)
    # A crash after step 6 was logged but before its checkpoint was published: latest is
    # step 3, and resuming logs steps 4-6 again.
    shutil.rmtree(out / "checkpoints" / "step-00000006")
    (out / "checkpoints" / "latest").write_text("step-00000003")
    resumed = cli.run([*common, "--steps", "6", "--resume", str(out / "checkpoints")])
    assert resumed.returncode == 0, resumed.stderr
    after = cli.log(out)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in after] == [r["loss"] for r in before]
    # Resuming from an older checkpoint while later ones exist is refused (they would clash).
    older = cli.run(
        [*common, "--steps", "6", "--resume", str(out / "checkpoints" / "step-00000003")]
    )
    assert_clean_error(older, "later checkpoints", "step-00000006")


@pytest.mark.timeout(300)
def test_divergence_stops_with_the_step_and_saves_nothing(
    tmp_path: Path, cli, assert_clean_error
) -> None:
    out = tmp_path / "run"
    # lr 1e6: after one step the adapters are ~1e6, the activations overflow and the
    # gradient vanishes (today: exit 0 with a flat loss and adapters of 5e6 saved as latest).
    proc = cli.run(
        [
            "--lr",
            "1e6",
            "--steps",
            "20",
            "--save-every",
            "1",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--no-progress",
            "--output",
            str(out),
        ]
    )
    line = assert_clean_error(proc, "diverged", "step 2", "--lr")
    assert "1e+06" in line or "1000000" in line
    # Only the step-1 checkpoint exists (finite), and it is what latest names.
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000001"
    ckpt = load(out / "checkpoints")
    for name, tensor in ckpt.tensors.items():
        assert bool(tensor.isfinite().all()), name
    assert [r["step"] for r in cli.log(out)] == [1]


_DEEP = 5000  # far past Python's recursion limit (1000) for a recursive parser
# Six levels of ten aliases each: 10**6 values once expanded, from 6 short lines.
_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcde", "bcdef", strict=True)
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("yaml_text", "needles"),
    [
        ("lora:\n  target_modules: " + "[" * _DEEP + "]" * _DEEP + "\n", ["nested", "16 deep"]),
        ("training:\n  lr: " + "[" * 20 + "]" * 20 + "\n", ["nested", "16 deep"]),
        (
            "training:\n  lr: 1e-3\n  steps: 3\n  lr: 2e-3\n",
            ["line 4", "duplicate key 'lr'", "first at line 2"],
        ),
        ("training:\n  lr: 1e-3\ntraining:\n  steps: 3\n", ["line 3", "'training'", "line 1"]),
        ("training:\n  seed: 18446744073709551616\n", ["training.seed", "64 bits"]),
        ("".join("  " * i + f"k{i}:\n" for i in range(_DEEP)), ["line 17", "16 deep"]),
        (_LAUGHS, ["line 5", "aliases expand to more than 100,000 values"]),
    ],
    ids=[
        "nested-yaml-deep",
        "nested-yaml",
        "duplicate-key",
        "duplicate-section",
        "seed-yaml",
        "nested-yaml-block",
        "alias-bomb",
    ],
)
def test_hostile_config_is_one_error(
    cold, tmp_path: Path, yaml_text, needles, assert_clean_error
) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml_text)
    assert_clean_error(
        cold.run(["--config", str(cfg), "--output", str(tmp_path / "out")]), str(cfg), *needles
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [str(2**63), str(2**64), str(-(2**63) - 1), str(10**40)])
def test_seed_beyond_64_bits_is_one_error(cold, tmp_path: Path, seed, assert_clean_error) -> None:
    assert_clean_error(
        cold.run(["--seed", seed, "--output", str(tmp_path / "out")]), f"--seed {seed}", "64 bits"
    )


_ROLES = "models:\n  experts:\n    lora:\n      enable: true\n      rank: 4\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("config", "flags", "needles"),
    [
        # The block is for role "experts": the default role would silently train without it.
        (_ROLES, [], ["--role (default moe)", "models.moe", "roles there: experts"]),
        (_ROLES, ["--role", "expert"], ["--role expert", "models.expert", "experts"]),
        ("lora:\n  rank: 4\n", ["--role", "experts"], ["--role experts", "no models: section"]),
        (None, ["--role", "experts"], ["--role experts", "no --config"]),
    ],
    ids=["default-role-missing", "role-typo", "no-models-section", "no-config"],
)
def test_a_role_with_no_yaml_block_is_one_error(
    cold, tmp_path: Path, config, flags, needles, assert_clean_error
) -> None:
    args = [*flags, "--output", str(tmp_path / "out")]
    if config is not None:
        cfg = tmp_path / "run.yaml"
        cfg.write_text(config)
        args += ["--config", str(cfg)]
    assert_clean_error(cold.run(args), *needles)


@pytest.mark.timeout(120)
def test_the_role_named_reads_its_block(cli, tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(_ROLES)
    shown = cli.run(["--config", str(cfg), "--role", "experts", "--print-config"])
    assert shown.returncode == 0, shown.stderr
    import yaml

    assert yaml.safe_load(shown.stdout)["lora"]["rank"] == 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.jsonl", '{"text": "fine"}\n{"text": ' + "[" * _DEEP + "]" * _DEEP + "}\n"),
        ("deep.json", '[{"text": "fine"}, {"text": ' + "[" * _DEEP + "]" * _DEEP + "}]\n"),
        ("nested.jsonl", '{"text": "fine"}\n{"text": ' + "[" * 40 + "]" * 40 + "}\n"),
    ],
    ids=["jsonl-deep", "json-deep", "jsonl-nested"],
)
def test_nested_data_is_one_error(cold, tmp_path: Path, name, text, assert_clean_error) -> None:
    data = tmp_path / name
    data.write_text(text)
    assert_clean_error(
        cold.run(["--data", str(data), "--output", str(tmp_path / "out")]),
        f"{data}:",
        "nested more than 16 deep",
    )


@pytest.mark.timeout(120)
def test_share_experts_with_a_faked_local_world_size_is_one_error(
    cold, tmp_path: Path, assert_clean_error
) -> None:
    """LOCAL_WORLD_SIZE=2 without torchrun: no process group, so nobody to share with."""
    cold.env = {**cold.env, "LOCAL_WORLD_SIZE": "2"}
    cold.env.pop("WORLD_SIZE", None)
    assert_clean_error(
        cold.run(["--share-experts", "--output", str(tmp_path / "out")]),
        "--share-experts",
        "LOCAL_WORLD_SIZE=2 and WORLD_SIZE=1",
        "torchrun --nproc-per-node 2",
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--temperature", "nan"], ["--temperature nan", "finite"]),
        (["--temperature", "inf"], ["--temperature inf", "finite"]),
        (["--seed", str(2**64)], [f"--seed {2**64}", "64 bits"]),
    ],
    ids=["temperature-nan", "temperature-inf", "seed"],
)
def test_generate_bad_sampling_is_one_error(
    cli, tmp_path: Path, flags, needles, assert_clean_error
) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from moe_experts.finetune.cli import main; raise SystemExit(main())",
            "generate",
            "--adapter",
            str(tmp_path / "no-checkpoint"),
            "--prompt",
            "hi",
            *flags,
        ],
        env=cli.env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert_clean_error(proc, *needles)
