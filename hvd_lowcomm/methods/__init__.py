"""Training methods, one module each, found by name.

A method module defines a `Method` subclass decorated with `@register("name")`; if the method
has options, it sets `options = SomeDataclass` and they appear as `--name.key` on the command
line and as a `name:` section in YAML. Every module in this package is imported on first
lookup, so adding a method is adding one module.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

_registry: dict[str, type] = {}
_discovered = False


def register(name: str):
    def decorate(cls: type) -> type:
        if name in _registry and _registry[name] is not cls:
            raise ValueError(f"method {name!r} registered twice ({_registry[name].__module__}, {cls.__module__})")
        cls.name = name
        _registry[name] = cls
        return cls
    return decorate


def _discover() -> None:
    global _discovered
    if not _discovered:
        for module in pkgutil.iter_modules(__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{__name__}.{module.name}")
        _discovered = True


def available_methods() -> dict[str, type]:
    _discover()
    return dict(_registry)


def method_option_types() -> dict[str, Any]:
    """Options dataclass per method name, for methods that declare one."""
    return {name: cls.options for name, cls in available_methods().items() if cls.options is not None}


def get_method(name: str) -> type:
    return available_methods()[name]
