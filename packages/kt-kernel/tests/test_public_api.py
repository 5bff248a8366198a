"""The curated public surface, the specs' constructors and the loader's fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kt_kernel as kk

EXPECTED_ALL = {
    "ACTIVATIONS",
    "ActivationClass",
    "register_activation",
    "FINITE_DTYPES",
    "FORMATS",
    "FORMAT_ALIASES",
    "DenseStorage",
    "FormatFactory",
    "auto_format",
    "format_name",
    "Activation",
    "BackendInfo",
    "ClampedSwiGLU",
    "Dense",
    "GeluTanhGated",
    "Int8PerChannel",
    "Int4Grouped",
    "Fp8Block",
    "Bf16Packed",
    "Int4Packed",
    "Int8Packed",
    "Int8PackedA8",
    "Mxfp4",
    "SwiGLU",
    "SwiGLULimit",
    "WeightFormat",
    "register_format",
    "ExpertSpec",
    "ExpertWeights",
    "FUSED_NAMES",
    "KernelDTypeError",
    "KernelInputError",
    "LOGIT_ROWS_DTYPES",
    "LogitRows",
    "LoraBuffers",
    "LoraLayout",
    "NativeBackendError",
    "ProjectionQuantError",
    "QuantizationReport",
    "SPLIT_NAMES",
    "__version__",
    "activation_memory_bytes",
    "all_finite",
    "backend_info",
    "causal_attention",
    "causal_attention_reference",
    "dequantize_per_channel",
    "int8_isa",
    "logit_rows",
    "lora_shapes",
    "rms_norm",
    "rms_norm_reference",
    "RMS_NORM_DTYPES",
    "moe_experts_forward",
    "moe_experts_forward_reference",
    "quantize_per_channel",
    "SharedExperts",
    "SharedMemoryError",
    "get_num_threads",
    "map_shared",
    "set_num_threads",
    "write_shared",
}


def test_all_is_curated() -> None:
    assert set(kk.__all__) == EXPECTED_ALL
    assert len(kk.__all__) == len(EXPECTED_ALL)
    for name in kk.__all__:
        assert hasattr(kk, name), name


def test_version_single_source() -> None:
    from importlib.metadata import version

    from kt_kernel._version import __version__

    assert kk.__version__ == __version__ == version("kt-kernel")


def test_backend_info_reports_native() -> None:
    info = kk.backend_info()
    if os.environ.get("KT_KERNEL_REQUIRE_NATIVE") == "1":
        assert info.active == "native"
        assert info.native_error is None
    if info.native_available:
        assert info.isa in ("avx512", "avx2", "scalar")
        assert info.torch_version == torch.__version__.split("+")[0]
        if "avx512f" in info.cpu_features and "avx512bw" in info.cpu_features:
            assert info.isa == "avx512"


def test_from_split_equals_from_fused() -> None:
    spec = kk.ExpertSpec(3, 8, 4)
    gate, up, down = torch.randn(3, 4, 8), torch.randn(3, 4, 8), torch.randn(3, 8, 4)
    a = kk.ExpertWeights.from_split(spec, gate, up, down)
    b = kk.ExpertWeights.from_fused(spec, torch.cat([gate, up], 1), down)
    assert torch.equal(a.gate_up, b.gate_up)
    assert torch.equal(a.down, b.down)
    assert torch.equal(a.gate, gate)
    assert torch.equal(a.up, up)
    assert a.nbytes == (3 * 8 * 8 + 3 * 8 * 4) * 4
    bf = kk.ExpertWeights.from_split(spec, gate, up, down, dtype="bfloat16")
    assert bf.dtype == torch.bfloat16
    assert bf.nbytes == a.nbytes // 2
    assert bf.gate_up.is_contiguous()
    assert not bf.gate_up.requires_grad


def test_weights_do_not_alias_inputs() -> None:
    spec = kk.ExpertSpec(2, 4, 2)
    gu, dn = torch.randn(2, 4, 4), torch.randn(2, 4, 2)
    w = kk.ExpertWeights.from_fused(spec, gu, dn)
    gu.zero_()
    assert w.gate_up.abs().sum() > 0


def test_lora_buffers_layouts_and_names() -> None:
    spec = kk.ExpertSpec(5, 16, 8)
    split = kk.LoraBuffers(spec, 2, 4.0, "split")
    assert [n for n, _ in split.named_parameters()] == list(kk.SPLIT_NAMES)
    assert split.gate_lora_a.shape == (5, 2, 16)
    assert split.gate_lora_b.shape == (5, 8, 2)
    assert split.down_lora_a.shape == (5, 2, 8)
    assert split.down_lora_b.shape == (5, 16, 2)
    assert split.scaling == 2.0
    assert all(float(t.detach().abs().sum()) == 0 for t in split.tensors())
    fused = kk.LoraBuffers(spec, 2, None, "fused", init=lambda n, t: t.fill_(1.0))
    assert [n for n, _ in fused.named_parameters()] == list(kk.FUSED_NAMES)
    assert fused.gate_up_lora_b.shape == (5, 16, 2)
    assert fused.scaling == 1.0
    assert all(bool((t == 1).all()) for t in fused.tensors())


def test_from_tensors_shares_parameters() -> None:
    spec = kk.ExpertSpec(2, 4, 2)
    src = kk.LoraBuffers(spec, 1, 1.0, "fused")
    adopted = kk.LoraBuffers.from_tensors(spec, 1, 1.0, "fused", dict(src.named_parameters()))
    assert adopted.gate_up_lora_a is src.gate_up_lora_a
    with pytest.raises(kk.KernelInputError, match="missing \\['down_lora_b'\\]"):
        kk.LoraBuffers.from_tensors(
            spec, 1, 1.0, "fused", {n: t for n, t in src.named_parameters() if n != "down_lora_b"}
        )


def _run_isolated(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KT_KERNEL_REQUIRE_NATIVE"}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


# Simulates an extension that cannot load (as a missing file or an ABI mismatch would).
_BLOCK = "import sys; sys.modules['kt_kernel._C'] = None\n"


@pytest.mark.timeout(180)
def test_fallback_warns_once_and_reports() -> None:
    code = _BLOCK + (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as rec:\n"
        "    warnings.simplefilter('always')\n"
        "    import kt_kernel, kt_kernel.ops\n"
        "msgs = [str(r.message) for r in rec if 'kt_kernel' in str(r.message)]\n"
        "assert len(msgs) == 1, msgs\n"
        "assert 'reference' in msgs[0] and 'ModuleNotFoundError' in msgs[0], msgs[0]\n"
        "info = kt_kernel.backend_info()\n"
        "assert info.active == 'reference' and not info.native_available, info\n"
        "assert 'kt_kernel._C' in info.native_error, info.native_error\n"
        "print('ok')\n"
    )
    res = _run_isolated(code, {})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


@pytest.mark.timeout(180)
def test_require_native_turns_fallback_into_import_error() -> None:
    code = _BLOCK + (
        "try:\n"
        "    import kt_kernel\n"
        "except ImportError as exc:\n"
        "    assert type(exc).__name__ == 'NativeBackendError', type(exc)\n"
        "    assert 'KT_KERNEL_REQUIRE_NATIVE' in str(exc)\n"
        "    print('raised')\n"
    )
    res = _run_isolated(code, {"KT_KERNEL_REQUIRE_NATIVE": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "raised"


def test_activation_memory_policies() -> None:
    spec = kk.ExpertSpec(4, 16, 8)
    w = kk.ExpertWeights.from_fused(spec, torch.zeros(4, 16, 16), torch.zeros(4, 16, 8))
    lora = kk.LoraBuffers(spec, 2, 2.0, "split")
    save = kk.activation_memory_bytes(10, 2, w, lora, policy="save")
    rec = kk.activation_memory_bytes(10, 2, w, lora, policy="recompute")
    assert rec == (20 + 5) * 8
    assert save - rec == 20 * (2 * 8 + 4 + 2) * 4
