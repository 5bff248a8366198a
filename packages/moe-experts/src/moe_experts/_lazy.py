"""PEP 562 lazy attributes for a package ``__init__``: names imported on first access.

Keeps ``import moe_experts`` and the ``moe-experts --help`` path free of torch and
transformers; both ``moe_experts`` and ``moe_experts.finetune`` use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_module_attributes"]


def lazy_module_attributes(
    package: str,
    namespace: dict[str, Any],
    where: Mapping[str, str],
    public: list[str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Build a package's module-level ``__getattr__`` and ``__dir__``.

    Args:
        package: the package's ``__name__`` (e.g. ``"moe_experts.finetune"``).
        namespace: the package's ``globals()``; a loaded name is cached there, so it is
            imported once.
        where: public name -> the submodule (relative to ``package``) that defines it.
        public: the package's ``__all__``.

    Returns:
        ``(__getattr__, __dir__)`` to assign at the package's top level.
    """

    def __getattr__(name: str) -> Any:
        """Import a public name's module on first access."""
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        """The public names, for tab completion."""
        return sorted(set(namespace) | set(public))

    return __getattr__, __dir__
