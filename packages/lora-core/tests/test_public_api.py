"""The curated public surface of lora_core and the absence of import-time side effects."""

from __future__ import annotations

import importlib.metadata
import inspect
import subprocess
import sys

import pytest

import lora_core

EXPECTED = {
    "ADAPTATION_RESULT_SCHEMA_VERSION",
    "DEFAULT_TARGET_MODULES",
    "AdaptationResult",
    "AdapterStateError",
    "ComponentVersion",
    "ContractError",
    "LoRALinear",
    "LoRAParameter",
    "LoraConfig",
    "LoraConfigError",
    "LoraTargetError",
    "ParameterOwnership",
    "PeftExport",
    "PeftTensorLayout",
    "peft_lora_key",
    "__version__",
    "adapters_disabled",
    "enable_lora_training",
    "init_lora_tensor",
    "matches_module",
    "rebind_parameters",
    "remap_checkpoint_keys",
}


def test_all_is_curated() -> None:
    assert set(lora_core.__all__) == EXPECTED
    assert len(lora_core.__all__) == len(EXPECTED)
    for name in lora_core.__all__:
        assert hasattr(lora_core, name), name
        assert name == "__version__" or not name.startswith("_")


def test_version_is_the_installed_one() -> None:
    assert lora_core.__version__ == importlib.metadata.version("lora-core")
    from lora_core._version import __version__

    assert lora_core.__version__ == __version__


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_public_callables_have_docstrings_and_hints(name: str) -> None:
    obj = getattr(lora_core, name)
    if not callable(obj) or (isinstance(obj, type) and issubclass(obj, BaseException)):
        return
    assert inspect.getdoc(obj), name
    if inspect.isfunction(obj):
        hints = inspect.signature(obj)
        assert hints.return_annotation is not inspect.Signature.empty, name
        for p in hints.parameters.values():
            assert p.annotation is not inspect.Parameter.empty, (name, p.name)


def test_errors_subclass_builtins() -> None:
    assert issubclass(lora_core.LoraConfigError, ValueError)
    assert issubclass(lora_core.LoraTargetError, ValueError)
    assert issubclass(lora_core.ContractError, ValueError)


@pytest.mark.timeout(120)
def test_import_has_no_side_effects_and_does_not_import_fsdp() -> None:
    code = (
        "import os, sys, torch\n"
        "env = dict(os.environ)\n"
        "state = torch.random.get_rng_state().clone()\n"
        "dtype, threads = torch.get_default_dtype(), torch.get_num_threads()\n"
        "import lora_core\n"
        "assert dict(os.environ) == env, 'environment changed'\n"
        "assert torch.equal(torch.random.get_rng_state(), state), 'global RNG consumed'\n"
        "assert torch.get_default_dtype() == dtype and torch.get_num_threads() == threads\n"
        "assert 'lora_core.fsdp' not in sys.modules, 'lora_core.fsdp imported eagerly'\n"
        "assert 'peft' not in sys.modules and 'transformers' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
