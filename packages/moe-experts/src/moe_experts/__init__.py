"""moe-experts: LoRA on the experts of Hugging Face MoE models, run on kt-kernel.

``wrap(model)`` moves every MoE block's expert weights into kt-kernel (zero-storage
placeholders keep their names), ``adapt(model, config)`` adds expert LoRA in the kernel's
buffers and returns a ``lora_core.contracts.AdaptationResult``; ``adapt_model`` does both plus
dense LoRA through ``lora_core.enable_lora_training``.

Names are imported from their modules on first use (PEP 562), so ``import moe_experts`` (and
the ``moe-experts`` command's ``--help``) does not load torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_experts._lazy import lazy_module_attributes
from moe_experts._version import __version__

if TYPE_CHECKING:
    from moe_experts.adaptation import adapt, adapt_model, peft_key_prefix, router_targets
    from moe_experts.architectures import (
        ARCHITECTURES,
        UNSUPPORTED_FAMILIES,
        MoEArchitecture,
        MoEBlockSite,
        find_architecture,
        iter_moe_blocks,
    )
    from moe_experts.attention import (
        KERNEL_ATTENTION,
        kernel_attention_forward,
        register_kernel_attention,
        use_kernel_attention,
    )
    from moe_experts.checkpointing import enable_gradient_checkpointing
    from moe_experts.coverage import (
        BlockCoverage,
        MoECoverage,
        check_gradients,
        coverage_report,
        coverage_summary,
    )
    from moe_experts.errors import (
        AdaptError,
        GradientCheckError,
        LoadError,
        PackingError,
        PlaceholderAccessError,
        SelfCheckError,
        TransformersVersionError,
        UnsupportedModelError,
        WrapError,
    )
    from moe_experts.hot_experts import GpuExperts, GpuExpertsError, enable_gpu_experts
    from moe_experts.hybrid import GpuIdleMeter, enable_overlap, idle_meter
    from moe_experts.isolation import Packing, packed_model_inputs
    from moe_experts.kernel_experts import KernelExperts
    from moe_experts.loading import load_pretrained
    from moe_experts.losses import ChunkedLossError, chunked_lm_cross_entropy
    from moe_experts.norms import use_kernel_norms
    from moe_experts.placeholders import (
        ExpertPlaceholder,
        is_placeholder,
        make_placeholder,
        named_placeholders,
    )
    from moe_experts.reference import adapters_disabled
    from moe_experts.self_check import BlockCheck
    from moe_experts.wrapping import WrapReport, experts_sites, wrap

# public name -> the module that defines it
_WHERE = {
    "GpuExperts": "hot_experts",
    "GpuExpertsError": "hot_experts",
    "enable_gpu_experts": "hot_experts",
    "GpuIdleMeter": "hybrid",
    "enable_overlap": "hybrid",
    "idle_meter": "hybrid",
    "enable_gradient_checkpointing": "checkpointing",
    "ARCHITECTURES": "architectures",
    "KERNEL_ATTENTION": "attention",
    "AdaptError": "errors",
    "BlockCheck": "self_check",
    "BlockCoverage": "coverage",
    "ChunkedLossError": "losses",
    "ExpertPlaceholder": "placeholders",
    "GradientCheckError": "errors",
    "KernelExperts": "kernel_experts",
    "LoadError": "errors",
    "MoEArchitecture": "architectures",
    "MoEBlockSite": "architectures",
    "MoECoverage": "coverage",
    "Packing": "isolation",
    "PackingError": "errors",
    "PlaceholderAccessError": "errors",
    "SelfCheckError": "errors",
    "TransformersVersionError": "errors",
    "UNSUPPORTED_FAMILIES": "architectures",
    "UnsupportedModelError": "errors",
    "WrapError": "errors",
    "WrapReport": "wrapping",
    "adapt": "adaptation",
    "adapt_model": "adaptation",
    "adapters_disabled": "reference",
    "check_gradients": "coverage",
    "chunked_lm_cross_entropy": "losses",
    "coverage_report": "coverage",
    "coverage_summary": "coverage",
    "experts_sites": "wrapping",
    "find_architecture": "architectures",
    "is_placeholder": "placeholders",
    "kernel_attention_forward": "attention",
    "iter_moe_blocks": "architectures",
    "load_pretrained": "loading",
    "make_placeholder": "placeholders",
    "named_placeholders": "placeholders",
    "packed_model_inputs": "isolation",
    "peft_key_prefix": "adaptation",
    "register_kernel_attention": "attention",
    "router_targets": "adaptation",
    "use_kernel_attention": "attention",
    "use_kernel_norms": "norms",
    "wrap": "wrapping",
}

__all__ = [
    "ARCHITECTURES",
    "KERNEL_ATTENTION",
    "UNSUPPORTED_FAMILIES",
    "AdaptError",
    "BlockCheck",
    "BlockCoverage",
    "ChunkedLossError",
    "ExpertPlaceholder",
    "GpuExperts",
    "GpuExpertsError",
    "GpuIdleMeter",
    "GradientCheckError",
    "KernelExperts",
    "LoadError",
    "MoEArchitecture",
    "MoEBlockSite",
    "MoECoverage",
    "Packing",
    "PackingError",
    "PlaceholderAccessError",
    "SelfCheckError",
    "TransformersVersionError",
    "UnsupportedModelError",
    "WrapError",
    "WrapReport",
    "__version__",
    "adapt",
    "adapt_model",
    "adapters_disabled",
    "check_gradients",
    "chunked_lm_cross_entropy",
    "coverage_report",
    "coverage_summary",
    "enable_gpu_experts",
    "enable_gradient_checkpointing",
    "enable_overlap",
    "experts_sites",
    "find_architecture",
    "idle_meter",
    "is_placeholder",
    "iter_moe_blocks",
    "kernel_attention_forward",
    "load_pretrained",
    "make_placeholder",
    "named_placeholders",
    "packed_model_inputs",
    "peft_key_prefix",
    "register_kernel_attention",
    "router_targets",
    "use_kernel_attention",
    "use_kernel_norms",
    "wrap",
]


__getattr__, __dir__ = lazy_module_attributes(__name__, globals(), _WHERE, __all__)
