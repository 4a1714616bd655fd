"""edAD's sharing: every layer's activations and the output layer's deltas; each rank recomputes
the hidden deltas (exact for the MLPs `edad_chain` accepts)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.dad.sharing import Exchange, Rows, Sharing


class RecomputedDeltas(Sharing):
    """edAD: every layer's activations and the output layer's deltas are shared; each rank
    recomputes the hidden deltas from them and the known weights (exact for the MLPs
    `edad_chain` accepts)."""

    label = "edAD"
    shares_every_layer = True

    def __init__(self, model: nn.Module) -> None:
        self.chain = edad_chain(model)

    def payload(
        self, exchange: Exchange, rows: Rows, layers: list[str], scale: float
    ) -> list[tuple[str, torch.Tensor]]:
        names = [n for n, _ in self.chain]
        shared = [(f"edad.acts.{n}", rows[n][0]) for n in names]
        shared.append((f"edad.delta.{names[-1]}", rows[names[-1]][1]))
        return shared

    def apply(
        self, exchange: Exchange, results: dict[str, torch.Tensor], layers: list[str], total_batch: float
    ) -> None:
        names = [n for n, _ in self.chain]
        delta = results[f"edad.delta.{names[-1]}"] / total_batch  # the chain below is linear in it
        for index in range(len(names) - 1, -1, -1):
            name, module = names[index], exchange.layer(names[index])
            acts = results[f"edad.acts.{name}"]
            if name not in exchange.frozen:
                exchange.set_pooled_gradient(module.weight, delta.T @ acts)
            if module.bias is not None and module.bias.requires_grad:
                exchange.set_pooled_gradient(module.bias, delta.sum(dim=0))
            if index:
                derivative = self.chain[index - 1][1]
                delta = (delta @ module.weight.detach().float()) * derivative(acts)


def edad_chain(model: nn.Module) -> list[tuple[str, Any]]:
    """[(linear name, derivative of the activation that follows it as a function of its output)],
    or ConfigError when recomputing hidden deltas would not be exact for this model."""
    derivatives = {
        nn.ReLU: lambda m: lambda out: (out > 0).to(out.dtype),
        nn.LeakyReLU: lambda m: lambda out: torch.where(out > 0, 1.0, m.negative_slope).to(out.dtype),
        nn.Tanh: lambda m: lambda out: 1 - out * out,
        nn.Sigmoid: lambda m: lambda out: out * (1 - out),
    }
    if not isinstance(model, nn.Sequential):
        raise ConfigError("edAD is exact only for nn.Sequential MLPs; use --method dad")
    chain: list[list[Any]] = []
    for name, module in model.named_children():
        if isinstance(module, nn.Flatten) and not chain:
            continue
        if isinstance(module, nn.Linear):
            if chain and chain[-1][1] is None:
                chain[-1][1] = lambda out: torch.ones_like(out)  # Linear followed directly by Linear
            chain.append([name, None])
        elif type(module) in derivatives and chain and chain[-1][1] is None:
            chain[-1][1] = derivatives[type(module)](module)
        elif isinstance(module, nn.Dropout) and module.p == 0:
            continue
        else:
            raise ConfigError(
                f"edAD is exact only for Linear layers and element-wise ReLU/LeakyReLU/Tanh/"
                f"Sigmoid activations; layer {name} ({type(module).__name__}) breaks that: use --method dad"
            )
    if not chain or chain[-1][1] is not None:
        raise ConfigError("edAD needs a model that ends with a Linear layer; use --method dad")
    return [(name, derivative) for name, derivative in chain]
