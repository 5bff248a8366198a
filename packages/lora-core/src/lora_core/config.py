"""``LoraConfig``: the validated ``models.<role>.lora`` block of a training config.

The rules exist so that a typo can never silently train the wrong thing: unknown keys are
errors that list the valid keys, an enabled config must say which rank to train, and every
field is checked for range and type before any module is touched.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = ["DEFAULT_TARGET_MODULES", "LoraConfig", "LoraConfigError"]

logger = logging.getLogger(__name__)

# Attention projections of the common decoder (q/k/v/o_proj) and diffusers (to_*) families.
DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "to_q",
    "to_k",
    "to_v",
    "to_out",
    "to_qkv",
)

# A target is a module name or a dotted suffix of one; regex/glob syntax is refused so that
# nobody writes ``.*q_proj`` expecting PEFT's regex semantics and silently matches nothing.
_COMPONENT = re.compile(r"^[^\s.*?\[\]()|^$+\\{}]+$")


class LoraConfigError(ValueError):
    """A LoRA config (YAML text, file or mapping) is malformed; names the file and key path."""


def _check_names(value: Any, field_name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ValueError(
            f"lora.{field_name} must be a list of names, got the string {value!r}; "
            f"write it as a list, e.g. [{value}]"
        )
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"lora.{field_name} must be a list of names, got {type(value).__name__} {value!r}"
        )
    names: list[str] = []
    for item in value:
        if not isinstance(item, str) or not all(_COMPONENT.match(c) for c in item.split(".")):
            raise ValueError(
                f"lora.{field_name} entry {item!r} is not a name or dotted suffix "
                "(e.g. 'q_proj', 'self_attn.q_proj' or 'mlp.gate.weight'); patterns and empty "
                "components are not supported"
            )
        names.append(item)
    return tuple(dict.fromkeys(names))


class LoraConfig(BaseModel):
    """Dense LoRA settings for one model role (the YAML block ``models.<role>.lora``).

    Frozen, hashable and comparable with ``==``; ``model_dump(mode="json")`` is JSON-able.
    ``LoraConfig.model_validate(mapping)`` and :meth:`from_yaml` apply the same rules.

    Attributes:
        enable: apply LoRA at all. A config with ``enable: false`` is valid (and logged) even
            when a rank is set; nothing is adapted.
        rank: LoRA rank ``r``; required (positive) when ``enable`` is true.
        alpha: LoRA alpha; the update is scaled by ``alpha / rank``. Defaults to ``rank``
            (scaling 1.0).
        target_modules: module names or dotted suffixes to adapt. A target matches a module
            when it equals the trailing whole dotted components of the module's name:
            ``o_proj`` matches ``layers.0.self_attn.o_proj`` but never ``foo_proj``.
        exclude_modules: same matching rule, applied after ``target_modules`` and
            ``target_parameters`` (a parameter is excluded when its module is).
        target_parameters: fully-qualified parameter names or dotted suffixes of them
            (``mlp.gate.weight``) whose 2-D weight gets a LoRA update although its module is
            not an ``nn.Linear``: the MoE routers. Same matching rule; PEFT's
            ``target_parameters`` twin. Needs ``dropout == 0``.
        dropout: dropout probability on the LoRA input, in ``[0, 1)``.
        init_seed: seed for the deterministic adapter initialisation
            (see :func:`lora_core.init_lora_tensor`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enable: StrictBool = False
    rank: StrictInt | None = None
    alpha: float | None = Field(default=None, gt=0)
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    exclude_modules: tuple[str, ...] = ()
    # Empty by default: adapting a router changes which experts run, so it is opt-in.
    target_parameters: tuple[str, ...] = ()
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    # Not a global torch seed: only the adapter values derive from it, per tensor name.
    init_seed: StrictInt = 0

    @model_validator(mode="before")
    @classmethod
    def _known_keys_and_alpha_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        valid = list(cls.model_fields)
        unknown = [k for k in data if k not in cls.model_fields]
        if unknown:
            hints = {str(k): difflib.get_close_matches(str(k), valid, n=1) for k in unknown}
            hint = "".join(f"; did you mean {h[0]!r} for {k!r}?" for k, h in hints.items() if h)
            raise PydanticCustomError(
                "lora_unknown_key",
                "unknown lora key(s) {unknown}; valid keys are {valid}{hint}",
                {"unknown": [str(k) for k in unknown], "valid": valid, "hint": hint},
            )
        rank = data.get("rank")
        # Only a usable rank supplies the alpha default; rank 0 must fail as a *rank* error.
        if data.get("alpha") is None and isinstance(rank, int) and rank > 0:
            data = {**data, "alpha": data["rank"]}
        return data

    @field_validator("rank")
    @classmethod
    def _rank_nonnegative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(
                f"lora.rank must be a positive integer (or 0 when disabled), got {value}"
            )
        return value

    @field_validator("target_modules", "exclude_modules", "target_parameters", mode="before")
    @classmethod
    def _module_names(cls, value: Any, info: Any) -> tuple[str, ...]:
        return _check_names(value, info.field_name)

    @model_validator(mode="after")
    def _rank_when_enabled(self) -> LoraConfig:
        if not self.target_modules and not self.target_parameters:
            raise ValueError(
                "lora.target_modules is empty and so is lora.target_parameters; list at least "
                "one module name such as 'q_proj' (or a parameter such as 'mlp.gate.weight')"
            )
        if self.target_parameters and self.dropout > 0:
            raise ValueError(
                f"lora.dropout is {self.dropout} but lora.target_parameters "
                f"{list(self.target_parameters)} is set; a LoRA update on a parameter cannot "
                "apply dropout to its input (PEFT refuses it too): set lora.dropout: 0 or "
                "drop lora.target_parameters"
            )
        if self.enable and (self.rank is None or self.rank <= 0):
            raise ValueError(
                f"lora.rank must be a positive integer when lora.enable is true, got "
                f"rank={self.rank!r}; set lora.rank (e.g. 8) or set lora.enable: false"
            )
        if not self.enable and self.rank is not None:
            logger.info(
                "lora.rank=%s is set but lora.enable is false: no LoRA is applied", self.rank
            )
        return self

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor on the LoRA update (0.0 when no rank is set)."""
        if not self.rank or self.alpha is None:
            return 0.0
        return self.alpha / self.rank

    @classmethod
    def from_yaml(cls, path_or_text: str | os.PathLike[str], role: str) -> LoraConfig | None:
        """Read the block ``models.<role>.lora`` from a YAML file or YAML text.

        Args:
            path_or_text: a path (``os.PathLike``, or a ``str`` naming an existing file) or
                YAML text.
            role: the model role, e.g. ``"policy"``.

        Returns:
            The validated config, or ``None`` when the block is absent (LoRA not configured).

        Raises:
            LoraConfigError: on YAML syntax errors, duplicate keys, a block that is not a
                mapping, or any validation error; the message names the source and the key
                path (e.g. ``models.policy.lora.rnak``).
        """
        source, text = _read_source(path_or_text)
        try:
            doc = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
        except yaml.YAMLError as exc:
            raise LoraConfigError(f"{source}: invalid YAML: {exc}") from exc
        node: Any = doc
        prefix: list[str] = []
        for key in ("models", role, "lora"):
            if node is None:
                return None
            if not isinstance(node, dict):
                where = ".".join(prefix) or "the document"
                hint = ""
                if not prefix and isinstance(path_or_text, str) and "\n" not in path_or_text:
                    hint = " (if this was meant to be a file path, that file does not exist)"
                raise LoraConfigError(
                    f"{source}: {where} must be a mapping, got {type(node).__name__} {node!r}{hint}"
                )
            if key not in node:
                return None
            node = node[key]
            prefix.append(key)
        if node is None:
            return None
        block = ".".join(prefix)
        if not isinstance(node, dict):
            raise LoraConfigError(
                f"{source}: {block} must be a mapping of lora settings, got "
                f"{type(node).__name__} {node!r}"
            )
        try:
            return cls.model_validate(node)
        except ValidationError as exc:
            raise LoraConfigError(f"{source}: {_describe_errors(exc, block)}") from exc


def _describe_errors(exc: ValidationError, block: str) -> str:
    lines = []
    for err in exc.errors():
        ctx = err.get("ctx") or {}
        if err["type"] == "lora_unknown_key":
            paths = ", ".join(f"{block}.{k}" for k in ctx["unknown"])
            lines.append(f"{paths}: {err['msg']}")
            continue
        loc = ".".join(str(p) for p in err["loc"])
        path = f"{block}.{loc}" if loc else block
        lines.append(f"{path}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)


def _read_source(path_or_text: str | os.PathLike[str]) -> tuple[str, str]:
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str) and "\n" not in path_or_text and _is_file(path_or_text)
    ):
        path = Path(path_or_text)
        try:
            return str(path), path.read_text(encoding="utf-8")
        except OSError as exc:
            raise LoraConfigError(f"cannot read LoRA config file {str(path)!r}: {exc}") from exc
    if not isinstance(path_or_text, str):
        raise LoraConfigError(
            f"from_yaml expects a path or YAML text, got {type(path_or_text).__name__}"
        )
    return "<yaml text>", path_or_text


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
