"""Muon for the weight matrices, AdamW for the rest, as one optimiser every method takes.

Muon (torch.optim.Muon) orthogonalises each step of a 2-D weight matrix; embeddings, the
output layer, biases, norms and convolutions keep AdamW, as the field runs it (Keller Jordan's
modded-nanogpt, MuLoCo). The methods take one optimiser, so the pair is one
`CombinedOptimizer`: its parameter groups are the two optimisers' own (the same dicts, so a
learning rate set on it reaches both), its state is theirs, and step() steps both.

    opt = hvd_lowcomm.muon_with_adamw(model, lr=1e-3, weight_decay=0.1)
    # or the user's own pair, built their way:
    opt = hvd_lowcomm.CombinedOptimizer.of(torch.optim.Muon(matrices, ...), torch.optim.AdamW(rest, ...))
    diloco = hvd_lowcomm.DiLoCo(model, opt, total_steps=...)
    # the same: every method's constructor takes the pair itself, (muon, adamw)

Muon's learning rate is scaled to match AdamW's update size (adjust_lr_fn "match_rms_adamw",
Moonshot's rule), so one learning rate serves both.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

import torch
import torch.nn as nn

# Where a parameter group says which optimiser class steps it ("module:QualifiedName"): a
# wrapped copy of the combined optimiser (Horovod's idiom: the class rebuilt over the groups)
# and a loaded state dict find their inner optimisers by it.
KIND = "optimizer_class"
MUON_MOMENTUM = 0.95  # torch.optim.Muon's default, the field's


class CombinedOptimizer(torch.optim.Optimizer):
    """Several torch optimisers over disjoint parameters, stepped as one (see the module).

    Built from parameter groups that each name their optimiser class under KIND (what
    `of(...)` and a wrapper's rebuild pass), or from optimisers with `of`."""

    def __init__(self, params: Iterable[dict[str, Any]], defaults: dict[str, Any] | None = None) -> None:
        groups = list(params)
        if not groups or not all(isinstance(g, dict) and KIND in g for g in groups):
            raise TypeError(
                "CombinedOptimizer takes parameter groups that name their optimiser class: build it "
                "with CombinedOptimizer.of(optimizer, ...) or hvd_lowcomm.muon_with_adamw(model)"
            )
        kinds: dict[str, list[dict[str, Any]]] = {}
        for group in groups:
            kinds.setdefault(group[KIND], []).append(group)
        inner = [_optimizer_class(kind)(kind_groups) for kind, kind_groups in kinds.items()]
        super().__init__([g for o in inner for g in o.param_groups], defaults or {})
        self.inner = inner
        self._link()

    @classmethod
    def of(cls, *optimizers: torch.optim.Optimizer) -> "CombinedOptimizer":
        """One optimiser over `optimizers`' parameters, their groups and state kept."""
        if len(optimizers) == 1 and isinstance(optimizers[0], (list, tuple)):
            optimizers = tuple(optimizers[0])
        seen: set[int] = set()
        for optimizer in optimizers:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"CombinedOptimizer.of takes torch optimisers, got {type(optimizer).__name__}")
            ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if ids & seen:
                raise ValueError("CombinedOptimizer.of: a parameter is in two of the optimisers; give each its own")
            seen |= ids
            for group in optimizer.param_groups:
                group[KIND] = f"{type(optimizer).__module__}:{type(optimizer).__qualname__}"
        combined = cls([g for o in optimizers for g in o.param_groups])
        for optimizer in optimizers:
            combined.state.update(optimizer.state)  # moments made before combining carry over
        return combined

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("state", "param_groups") and "inner" in self.__dict__:
            self._link()

    def __setstate__(self, state: dict[str, Any]) -> None:  # load_state_dict's new groups and state
        super().__setstate__(state)
        if "inner" in self.__dict__:
            self._link()

    def _link(self) -> None:
        """Give each inner optimiser this optimiser's groups of its class, and its state."""
        for optimizer in self.inner:
            kind = optimizer.param_groups[0][KIND] if optimizer.param_groups else None
            optimizer.__dict__["param_groups"] = [g for g in self.param_groups if g[KIND] == kind]
            optimizer.__dict__["state"] = self.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "inner" not in self.__dict__:  # during __init__: the inner optimisers' groups
            super().add_param_group(param_group)
            return
        if KIND not in param_group:
            raise ValueError(f"a group added to a CombinedOptimizer names its optimiser class under {KIND!r}")
        owner = next(o for o in self.inner if o.param_groups and o.param_groups[0][KIND] == param_group[KIND])
        owner.add_param_group(param_group)
        self.param_groups.append(param_group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.inner:
            optimizer.step()
        return loss


def as_one_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The user's optimiser, or one CombinedOptimizer over a list or tuple of them (a Muon
    and AdamW pair): what every method's constructor accepts."""
    if isinstance(optimizer, (list, tuple)):
        return CombinedOptimizer.of(*optimizer)
    return optimizer


def describe(optimizer: torch.optim.Optimizer) -> str:
    """What steps which parameters: 'Muon (4 tensors) + AdamW (6 tensors)', or the class's name."""
    parts = getattr(optimizer, "inner", [optimizer])
    if len(parts) == 1:
        return type(parts[0]).__name__
    return " + ".join(f"{type(o).__name__} ({sum(len(g['params']) for g in o.param_groups)} tensors)" for o in parts)


def _optimizer_class(kind: str) -> type:
    module, _, name = kind.partition(":")
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the hidden layers' 2-D weight matrices Muon steps, every other parameter): embeddings,
    the output layer (the model's last Linear), biases, norms and convolutions go to AdamW, and
    so does a weight tied between an embedding and the output layer."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    head = linears[-1] if linears else None
    adamw_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    if head is not None:
        adamw_ids |= {id(p) for p in head.parameters()}
    matrices, rest, seen = [], [], set()
    for module in linears:
        weight = module.weight
        if weight.requires_grad and weight.dim() == 2 and id(weight) not in adamw_ids and id(weight) not in seen:
            matrices.append(weight)
            seen.add(id(weight))
    for param in model.parameters():
        if param.requires_grad and id(param) not in seen:
            rest.append(param)
            seen.add(id(param))
    return matrices, rest


def muon_with_adamw(
    model: nn.Module,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    momentum: float = MUON_MOMENTUM,
    betas: tuple[float, float] = (0.9, 0.999),
) -> CombinedOptimizer:
    """Muon for `model`'s hidden weight matrices and AdamW for the rest (muon_parameters), at
    one learning rate and weight decay (Muon's update scaled to AdamW's size)."""
    matrices, rest = muon_parameters(model)
    optimizers: list[torch.optim.Optimizer] = []
    if matrices:
        optimizers.append(
            torch.optim.Muon(
                matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn="match_rms_adamw"
            )
        )
    if rest:
        optimizers.append(torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, betas=betas))
    return CombinedOptimizer.of(*optimizers)
