"""lora-core: LoRA config, deterministic init, ``LoRALinear``, injection and shared contracts.

The FSDP sync layer is the separate submodule ``lora_core.fsdp`` (import it explicitly).
"""

from lora_core._version import __version__
from lora_core.config import DEFAULT_TARGET_MODULES, LoraConfig, LoraConfigError
from lora_core.contracts import (
    ADAPTATION_RESULT_SCHEMA_VERSION,
    AdaptationResult,
    ComponentVersion,
    ContractError,
    ParameterOwnership,
    PeftExport,
    PeftTensorLayout,
    peft_lora_key,
)
from lora_core.initialization import init_lora_tensor
from lora_core.injection import (
    LoraTargetError,
    enable_lora_training,
    matches_module,
    rebind_parameters,
    remap_checkpoint_keys,
)
from lora_core.layers import AdapterStateError, LoRALinear, LoRAParameter, adapters_disabled

__all__ = [
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
    "__version__",
    "adapters_disabled",
    "enable_lora_training",
    "init_lora_tensor",
    "matches_module",
    "peft_lora_key",
    "rebind_parameters",
    "remap_checkpoint_keys",
]
