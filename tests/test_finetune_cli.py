"""The ``moe-experts`` command table, and start-up without torch for help and argument errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Runs a CLI entry in-process, then reports whether torch/transformers were imported.
PROBE = """
import sys
from moe_experts.finetune.cli import main
try:
    code = main({argv!r})
except SystemExit as exc:
    code = exc.code
print("heavy:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
print("code:", code)
"""


def _probe(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["finetune", "--help"], 0),
        (["finetune", "--lr", "nan"], 1),
        (["finetune", "--keep-last", "0"], 1),
        (["finetune", "--bogus-flag"], 2),
        (["finetun"], 2),
    ],
    ids=["help", "finetune-help", "bad-lr", "bad-keep-last", "unknown-flag", "unknown-command"],
)
def test_answers_without_importing_torch(argv, code, cli_env) -> None:
    proc = _probe(argv, cli_env)
    assert f"code: {code}" in proc.stdout, proc.stdout + proc.stderr
    assert "heavy: []" in proc.stdout, proc.stdout


@pytest.mark.timeout(60)
def test_help_lists_the_commands() -> None:
    from moe_experts.finetune.cli import COMMANDS

    script = str(Path(sys.executable).with_name("moe-experts"))
    proc = subprocess.run(
        [script, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    for name, command in COMMANDS.items():
        assert f"  {name}" in proc.stdout
        assert command.summary in proc.stdout
    typo = subprocess.run(
        [script, "finetun"], capture_output=True, text=True, timeout=60, check=False
    )
    assert typo.returncode == 2
    assert "did you mean 'finetune'" in typo.stderr


def test_every_flag_is_a_yaml_key_and_back() -> None:
    """The settings table drives flags, YAML and --print-config: each flag has one key."""
    from moe_experts.finetune.cli import build_parser
    from moe_experts.finetune.config import OPTIONS, SECTIONS, FinetuneArgs

    parser_flags = {s for a in build_parser()._actions for s in a.option_strings}
    places = [(o.section, o.key) for o in OPTIONS]
    assert len(places) == len(set(places))
    from lora_core import LoraConfig

    for opt in OPTIONS:
        assert opt.flag in parser_flags
        assert opt.section in SECTIONS
        if opt.section == "lora":  # overrides one key of FinetuneArgs.lora
            assert opt.key in LoraConfig.model_fields
        else:
            assert hasattr(FinetuneArgs(), opt.dest)
    assert {o.flag for o in OPTIONS if o.section == "lora"} == {
        "--lora-rank",
        "--lora-alpha",
        "--lora-dropout",
    }


def test_resume_command_replaces_resume_and_drops_overwrite() -> None:
    from moe_experts.finetune.cli import resume_command

    cmd = resume_command(
        ["--steps", "9", "--overwrite", "--resume", "old", "--output", "o"],
        "python -m moe_experts.finetune",
        Path("o"),
    )
    assert cmd.endswith("-m moe_experts.finetune --steps 9 --output o --resume o/checkpoints")
