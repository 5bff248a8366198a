"""Typed specs for the expert op: :class:`ExpertSpec` and the frozen base :class:`ExpertWeights`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kt_kernel.activations import ACTIVATIONS, Activation, SwiGLU
from kt_kernel.errors import KernelDTypeError, KernelInputError

__all__ = ["SUPPORTED_WEIGHT_DTYPES", "ExpertSpec"]

# torch's names of the dtypes the ``dtype`` argument takes (a torch dtype, not a weight format:
# the format names are kt_kernel.FORMATS, whose dense "fp32"/"bf16" are accepted as well).
# float64 exists so torch.autograd.gradcheck can run through both implementations.
SUPPORTED_WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class ExpertSpec:
    """Shape and activation of a routed gated expert bank.

    Attributes:
        num_experts: E, number of routed experts.
        hidden_size: H, model width (expert input and output size).
        intermediate_size: I, per-expert width of gate/up (the input of down).
        activation: the gated activation ``h = act(gate, up)``, an instance of a class in
            :data:`kt_kernel.ACTIVATIONS`: :class:`SwiGLU` (default), :class:`ClampedSwiGLU`
            (GPT-OSS), :class:`SwiGLULimit` (DeepSeek-V4) or :class:`GeluTanhGated` (Gemma).
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: Activation = field(default_factory=SwiGLU)

    def __post_init__(self) -> None:
        """Reject non-positive sizes and anything but an activation object."""
        for name in ("num_experts", "hidden_size", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise KernelInputError(f"ExpertSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.activation, tuple(ACTIVATIONS.values())):
            known = ", ".join(
                f"{c.__name__}({', '.join(c.param_names)})" for c in ACTIVATIONS.values()
            )
            raise KernelInputError(
                f"ExpertSpec.activation must be one of {known} (kt_kernel.ACTIVATIONS), got "
                f"{self.activation!r}"
            )


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        from kt_kernel.formats import FORMATS, DenseStorage

        dense = {n: f.dtype for n, f in FORMATS.items() if isinstance(f, DenseStorage)}
        if dtype in dense:
            return dense[dtype]
        if dtype not in SUPPORTED_WEIGHT_DTYPES:
            raise KernelDTypeError(
                f"dtype must be one of {sorted(SUPPORTED_WEIGHT_DTYPES)} or {sorted(dense)}, "
                f"got {dtype!r} (for int8 storage pass weight_dtype='int8', or another "
                "quantised format of kt_kernel.FORMATS, and a float32/bfloat16 dtype)"
            )
        return SUPPORTED_WEIGHT_DTYPES[dtype]
    if dtype not in SUPPORTED_WEIGHT_DTYPES.values():
        raise KernelDTypeError(
            f"dtype must be one of torch.float32, torch.bfloat16, torch.float64, got {dtype}"
        )
    return dtype


def check_shape(name: str, tensor: object, expected: tuple[int, ...]) -> torch.Tensor:
    """Raise :class:`KernelInputError` naming ``name`` unless ``tensor`` has shape ``expected``."""
    if not isinstance(tensor, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(expected):
        raise KernelInputError(f"{name} must have shape {list(expected)}, got {list(tensor.shape)}")
    if not tensor.dtype.is_floating_point:
        raise KernelDTypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    return tensor
