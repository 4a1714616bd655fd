"""The registry of training methods: what the framework knows of each method, found by name.

The methods live in hvd_lowcomm.methods, one module or package each; this module sits below
everything that asks for a method by name (config, the cost model, the harness) and imports no
method: the modules of hvd_lowcomm.methods are imported on the first lookup, so adding a method
is adding one module or package there.

A method module registers what the framework needs to know of the method, in one place
(the shape of torchtitan's TrainSpec):

    @register("powersgd", options=PowerSGDOptions, cost=MethodCost(predict_powersgd, ...), drop_in=True)
    class PowerSGD(DataParallel): ...

- the `Method` subclass the training loop drives (hvd_lowcomm.methods.base);
- its options dataclass, which becomes the `--powersgd.key` command-line section and the
  `powersgd:` YAML section, with its defaults and validation;
- presets: options the name implies where the user set none (`{"train.optimizer": "adamw"}`);
- its cost: the collectives and bytes of one step and the step's predicted time
  (a `hvd_lowcomm.costmodel.MethodCost`), which the cost model, `python -m hvd_lowcomm.plan` and
  `--method auto` ask for instead of knowing any method themselves;
- whether `--method auto` may choose it (drop_in: same model and training, only the exchange
  differs).

A *variant* is another name for a registered method with options preset
(`register_variant("ddp-fp16", "ddp", {"comm.compression": "fp16"})`): it is accepted
everywhere a method name is (CLI, YAML, benchmarks, cost model) and shares its method's
options section.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class MethodSpec:
    """Everything registered about one method name."""

    name: str
    method: type  # the hvd_lowcomm.methods.base.Method subclass
    options: type | None = None  # its options dataclass (a CLI/YAML section), if any
    section: str = ""  # that section's name: the method's own, or its base's for a variant
    presets: dict[str, Any] = field(default_factory=dict)  # "section.key" -> value, where the user set none
    cost: Any = None  # hvd_lowcomm.costmodel.MethodCost: bytes and predicted step time
    drop_in: bool = False  # --method auto may choose it


_registry: dict[str, MethodSpec] = {}
_discovered = False


def register(
    name: str,
    *,
    options: type | None = None,
    presets: dict[str, Any] | None = None,
    cost: Any = None,
    drop_in: bool = False,
) -> Callable[[type], type]:
    """Class decorator: register a Method subclass under `name` (see the module docstring)."""

    def decorate(cls: type) -> type:
        _add(MethodSpec(name, cls, options, name if options is not None else "", dict(presets or {}), cost, drop_in))
        cls.name = name
        return cls

    return decorate


def register_variant(
    name: str, of: str, presets: dict[str, Any], drop_in: bool | None = None, cost: Any = None
) -> None:
    """Register `name` as method `of` with `presets` applied (its options and class; its cost
    too unless `cost` replaces it)."""
    base = _registry[of]
    _add(
        MethodSpec(
            name,
            base.method,
            base.options,
            base.section,
            {**base.presets, **presets},
            cost or base.cost,
            base.drop_in if drop_in is None else drop_in,
        )
    )


def _add(spec: MethodSpec) -> None:
    known = _registry.get(spec.name)
    if known is not None and known.method is not spec.method:
        raise ValueError(f"method {spec.name!r} registered twice ({known.method.__module__}, {spec.method.__module__})")
    _registry[spec.name] = spec


def unregister(name: str) -> None:
    """Remove a registration (tests that register a method of their own)."""
    _registry.pop(name, None)


METHODS_PACKAGE = "hvd_lowcomm.methods"


def _discover() -> None:
    global _discovered
    if not _discovered:
        _discovered = True
        package = importlib.import_module(METHODS_PACKAGE)  # by name: the methods sit above this module
        for module in pkgutil.iter_modules(package.__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{METHODS_PACKAGE}.{module.name}")


def specs() -> dict[str, MethodSpec]:
    """Every registered method name and its spec."""
    _discover()
    return dict(_registry)


def method_names() -> list[str]:
    """Every registered method name, variants included, in registration order."""
    return list(specs())


def spec(name: str) -> MethodSpec:
    return specs()[name]


def option_sections() -> dict[str, type]:
    """Options dataclass per section name, for the methods that declare one."""
    return {s.section: s.options for s in specs().values() if s.options is not None}
