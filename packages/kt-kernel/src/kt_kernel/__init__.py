"""kt-kernel: a native CPU kernel for routed MoE experts with LoRA, and its PyTorch oracle.

The public surface is tensors plus small typed specs: :class:`ExpertSpec` (with its
activation), :class:`ExpertWeights` (in a :class:`WeightFormat`), :class:`LoraBuffers`,
:func:`moe_experts_forward`, :func:`causal_attention`, :func:`logit_rows` (the elementwise
half of a chunked LM-head loss), :func:`rms_norm` (a decoder's fused RMSNorm) and
:func:`backend_info`.
``kt_kernel.reference`` holds the plain-PyTorch oracle.
"""

from kt_kernel._native import BackendInfo, backend_info, get_num_threads, set_num_threads
from kt_kernel._version import __version__
from kt_kernel.activations import (
    ACTIVATIONS,
    Activation,
    ActivationClass,
    ClampedSwiGLU,
    GeluTanhGated,
    SwiGLU,
    SwiGLULimit,
    register_activation,
)
from kt_kernel.attention import causal_attention, causal_attention_reference
from kt_kernel.errors import KernelDTypeError, KernelInputError, NativeBackendError
from kt_kernel.finite import FINITE_DTYPES, all_finite
from kt_kernel.formats import (
    FORMAT_ALIASES,
    FORMATS,
    Dense,
    DenseStorage,
    FormatFactory,
    Int8PerChannel,
    WeightFormat,
    auto_format,
    format_name,
    register_format,
)
from kt_kernel.formats_bf16_packed import Bf16Packed
from kt_kernel.formats_fp8 import Fp8Block
from kt_kernel.formats_int4 import Int4Grouped
from kt_kernel.formats_int4_packed import Int4Packed
from kt_kernel.formats_int8_packed import Int8Packed, Int8PackedA8
from kt_kernel.formats_mxfp4 import Mxfp4
from kt_kernel.logit_rows import LOGIT_ROWS_DTYPES, LogitRows, logit_rows
from kt_kernel.lora import FUSED_NAMES, SPLIT_NAMES, LoraBuffers, LoraLayout, lora_shapes
from kt_kernel.ops import activation_memory_bytes, moe_experts_forward
from kt_kernel.quant import (
    ProjectionQuantError,
    QuantizationReport,
    dequantize_per_channel,
    int8_isa,
    quantize_per_channel,
)
from kt_kernel.reference import moe_experts_forward_reference
from kt_kernel.rms_norm import RMS_NORM_DTYPES, rms_norm, rms_norm_reference
from kt_kernel.shared import (
    SharedExperts,
    SharedMemoryError,
    map_shared,
    write_shared,
)
from kt_kernel.spec import ExpertSpec
from kt_kernel.weights import ExpertWeights

__all__ = [
    "ACTIVATIONS",
    "FINITE_DTYPES",
    "FORMATS",
    "FORMAT_ALIASES",
    "FUSED_NAMES",
    "LOGIT_ROWS_DTYPES",
    "RMS_NORM_DTYPES",
    "SPLIT_NAMES",
    "Activation",
    "ActivationClass",
    "BackendInfo",
    "Bf16Packed",
    "ClampedSwiGLU",
    "Dense",
    "DenseStorage",
    "ExpertSpec",
    "ExpertWeights",
    "FormatFactory",
    "Fp8Block",
    "GeluTanhGated",
    "Int4Grouped",
    "Int4Packed",
    "Int8Packed",
    "Int8PackedA8",
    "Int8PerChannel",
    "KernelDTypeError",
    "KernelInputError",
    "LogitRows",
    "LoraBuffers",
    "LoraLayout",
    "Mxfp4",
    "NativeBackendError",
    "ProjectionQuantError",
    "QuantizationReport",
    "SharedExperts",
    "SharedMemoryError",
    "SwiGLU",
    "SwiGLULimit",
    "WeightFormat",
    "__version__",
    "activation_memory_bytes",
    "all_finite",
    "auto_format",
    "backend_info",
    "causal_attention",
    "causal_attention_reference",
    "dequantize_per_channel",
    "format_name",
    "get_num_threads",
    "int8_isa",
    "logit_rows",
    "lora_shapes",
    "map_shared",
    "moe_experts_forward",
    "moe_experts_forward_reference",
    "quantize_per_channel",
    "register_activation",
    "register_format",
    "rms_norm",
    "rms_norm_reference",
    "set_num_threads",
    "write_shared",
]
