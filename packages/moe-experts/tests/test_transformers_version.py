"""Each family's minimum transformers: an older release is refused with one clear error.

The check reads ``transformers.__version__`` through ``moe_experts.spec._installed_transformers``;
the tests make that report an older release (only the version string changes, the installed
modeling code stays the current one), so what is tested is that the refusal happens first, in
every entry point, naming family, versions and the fix.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from moe_experts import (
    ARCHITECTURES,
    TransformersVersionError,
    UnsupportedModelError,
    find_architecture,
    load_pretrained,
    wrap,
)
from moe_experts import spec as spec_module
from moe_experts.architectures import TRANSFORMERS_FLOOR
from moe_experts.finetune.cli import finetune_main
from moe_experts.finetune.data import ByteTokenizer
from moe_experts.finetune.tokenizer import save_byte_tokenizer
from moe_experts.testing import tiny_model

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def _pretend(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(spec_module, "_installed_transformers", lambda: version)


def _expect(message: str, family: str, installed: str, needed: str) -> None:
    assert f"architecture {family!r}" in message, message
    assert f"transformers {installed} is installed" in message, message
    assert f"needs transformers>={needed}" in message, message
    assert f"pip install -U 'transformers>={needed}'" in message, message


def test_floor_matches_the_declared_dependency_and_every_minimum_parses() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    declared = next(d for d in deps if d.startswith("transformers"))
    assert declared == f"transformers>={TRANSFORMERS_FLOOR}"
    for spec in ARCHITECTURES.values():
        assert Version(spec.min_transformers) >= Version(TRANSFORMERS_FLOOR), spec.family
        # The running (pinned) transformers satisfies every family the suite tests.
        installed = Version(spec_module._installed_transformers())
        assert installed >= Version(spec.min_transformers), spec.family
    assert ARCHITECTURES["qwen3_moe"].min_transformers == TRANSFORMERS_FLOOR
    assert ARCHITECTURES["granitemoe"].min_transformers == "5.17"
    assert ARCHITECTURES["aria"].min_transformers == "5.18"


def test_wrap_refuses_an_older_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("granitemoe")
    _pretend(monkeypatch, "5.1.0")
    with pytest.raises(TransformersVersionError) as info:
        wrap(model)
    _expect(str(info.value), "granitemoe", "5.1.0", "5.17")
    assert isinstance(info.value, UnsupportedModelError)  # callers' existing handlers hold
    # A family at the floor still wraps on the floor release.
    report = wrap(tiny_model("qwen3_moe"))
    assert report.family == "qwen3_moe"
    assert report.wrapped_blocks


@pytest.mark.parametrize("installed", ["5.17.0", "5.17.0.dev0", "5.18.1"])
def test_the_minimum_release_and_its_builds_pass(
    monkeypatch: pytest.MonkeyPatch, installed: str
) -> None:
    model = tiny_model("granitemoe")
    _pretend(monkeypatch, installed)
    assert find_architecture(model).family == "granitemoe"


def test_load_pretrained_refuses_before_transformers_reads_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An old transformers does not know gemma4 at all: the refusal must come before
    # AutoConfig, so config.json alone (no weights) is enough to reach it.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    _pretend(monkeypatch, "5.1.0")
    with pytest.raises(TransformersVersionError) as info:
        load_pretrained(tmp_path)
    _expect(str(info.value), "gemma4", "5.1.0", "5.17")


@pytest.mark.timeout(120)
def test_finetune_cli_refuses_with_one_error_line(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "aria"
    tiny_model("aria", vocab_size=ByteTokenizer.vocab_size).save_pretrained(model_dir)
    save_byte_tokenizer(model_dir)
    _pretend(monkeypatch, "5.17.0")
    args = [
        "--model",
        str(model_dir),
        "--steps",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--output",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    assert finetune_main(args) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert re.search(rf"--model {re.escape(str(model_dir))}: ", lines[0]), lines[0]
    _expect(lines[0], "aria", "5.17.0", "5.18")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.safetensors"))
