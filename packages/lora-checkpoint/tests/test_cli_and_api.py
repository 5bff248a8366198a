"""The public surface: ``__all__`` and the ``lora-checkpoint`` console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import lora_checkpoint as lc
from lora_checkpoint import cli

EXPECTED_ALL = {
    "ADAPTER_CONFIG",
    "ADAPTER_MODEL",
    "FORMAT_VERSION",
    "FUSED_EXPERT_LORA",
    "MANIFEST",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "CheckpointLockedError",
    "CheckpointReport",
    "DigestAlgorithm",
    "DigestMismatchError",
    "DtypeMismatchError",
    "FileEntry",
    "LoadedCheckpoint",
    "Manifest",
    "ManifestError",
    "MissingFileError",
    "MissingTensorError",
    "NonFiniteTensor",
    "NonFiniteTensorError",
    "OptimizerState",
    "ParameterEntry",
    "RankShard",
    "RngState",
    "ShapeMismatchError",
    "TensorEntry",
    "TensorKind",
    "TrainingState",
    "TrainingStateInfo",
    "TruncatedFileError",
    "UnexpectedTensorError",
    "UnknownFormatVersionError",
    "UnsafeFileError",
    "__version__",
    "inspect",
    "list_checkpoints",
    "load",
    "parse_manifest",
    "rank_local_file",
    "register_migration",
    "registered_migrations",
    "resolve_checkpoint",
    "restore",
    "save",
    "to_peft_layout",
    "training_state_files",
    "unregister_migration",
    "verify",
}


def test_all_is_curated():
    assert set(lc.__all__) == EXPECTED_ALL
    assert len(lc.__all__) == len(set(lc.__all__))
    for name in lc.__all__:
        assert hasattr(lc, name), name
    assert not [n for n in lc.__all__ if n.startswith("_") and n != "__version__"]


def test_errors_are_value_errors():
    for name in lc.__all__:
        obj = getattr(lc, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, lc.CheckpointError), name
            assert issubclass(obj, ValueError), name


def test_verify_and_inspect_exit_codes(tmp_path, result, capsys):
    m = lc.save(tmp_path, result, step=3)
    assert cli.main(["verify", str(tmp_path)]) == cli.EXIT_OK
    assert "OK step-00000003" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "digest_algorithm blake3" in out
    assert "lora-checkpoint" in out
    assert lc.__version__ in out
    assert "moe.experts.gate_up_proj.lora_A" in out
    assert "3x4x8" in out
    assert "adapter_model.safetensors" in out
    assert cli.main(["inspect", "--json", str(tmp_path / m.name)]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["name"] == "step-00000003"
    assert cli.main(["verify", str(tmp_path / "missing")]) == cli.EXIT_USAGE
    assert cli.main(["frobnicate"]) == cli.EXIT_USAGE
    assert cli.main([]) == cli.EXIT_USAGE
    data = bytearray((tmp_path / m.name / "adapter_model.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / m.name / "adapter_model.safetensors").write_bytes(bytes(data))
    assert cli.main(["verify", str(tmp_path)]) == cli.EXIT_FAILED
    assert "DigestMismatchError" in capsys.readouterr().err


def test_console_script_installed(tmp_path, result):
    lc.save(tmp_path, result, step=1)
    exe = shutil.which("lora-checkpoint") or str(
        __import__("pathlib").Path(sys.executable).with_name("lora-checkpoint")
    )
    proc = subprocess.run(
        [exe, "verify", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout
