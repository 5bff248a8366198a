"""moe-experts: LoRA on the experts of Hugging Face MoE models, run on kt-kernel.

``wrap(model)`` moves every MoE block's expert weights into kt-kernel (zero-storage
placeholders keep their names), ``adapt(model, config)`` adds expert LoRA in the kernel's
buffers and returns a ``lora_core.contracts.AdaptationResult``; ``adapt_model`` does both plus
dense LoRA through ``lora_core.enable_lora_training``.
"""

from moe_experts._version import __version__
from moe_experts.adaptation import adapt, adapt_model, peft_key_prefix, router_targets
from moe_experts.architectures import (
    ARCHITECTURES,
    MoEArchitecture,
    MoEBlockSite,
    find_architecture,
    iter_moe_blocks,
)
from moe_experts.errors import (
    AdaptError,
    PlaceholderAccessError,
    UnsupportedModelError,
    WrapError,
)
from moe_experts.kernel_experts import KernelExperts
from moe_experts.losses import ChunkedLossError, chunked_lm_cross_entropy
from moe_experts.placeholders import (
    ExpertPlaceholder,
    is_placeholder,
    make_placeholder,
    named_placeholders,
)
from moe_experts.wrapping import WrapReport, experts_sites, wrap

__all__ = [
    "ARCHITECTURES",
    "AdaptError",
    "ChunkedLossError",
    "ExpertPlaceholder",
    "KernelExperts",
    "MoEArchitecture",
    "MoEBlockSite",
    "PlaceholderAccessError",
    "UnsupportedModelError",
    "WrapError",
    "WrapReport",
    "__version__",
    "adapt",
    "adapt_model",
    "chunked_lm_cross_entropy",
    "experts_sites",
    "find_architecture",
    "is_placeholder",
    "iter_moe_blocks",
    "make_placeholder",
    "named_placeholders",
    "peft_key_prefix",
    "router_targets",
    "wrap",
]
