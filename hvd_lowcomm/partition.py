"""A sequential model cut into K partitions held by K groups of ranks (SIL and model parallelism).

The world is split into K equal groups of contiguous ranks; group k holds only partition k.
Rank i of group k has a *partner* at the same position in groups k-1 and k+1 (global rank
± group size): partners read the same samples (data is sharded by position in the group, with
one seed), so activations and gradients pass between partners point to point, through the
traffic meter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvd_lowcomm import runtime
from hvd_lowcomm.config import ConfigError, option
from hvd_lowcomm.data import ShardedBatches
from hvd_lowcomm.traffic import meter

FORWARD, BACKWARD, EVALUATE = 11, 12, 13  # message tags


@dataclass
class PartitionOptions:
    """How a sequential model is cut across groups of ranks."""

    partitions: int = option(2, "partitions, each held by its own group of ranks")
    cuts: list[int] = option([], "module indices where partitions 2..K start (empty: balanced by parameters)")

    def validate(self) -> None:
        if self.partitions < 2:
            raise ConfigError(f"partitions must be at least 2, got {self.partitions}")


def _sequential(model: nn.Module) -> nn.Sequential:
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"partitioning needs an nn.Sequential model (the zoo's mlp and cnn are); got "
                          f"{type(model).__name__}")
    return model


def cut_points(model: nn.Module, partitions: int, cuts: list[int]) -> list[int]:
    """Boundaries [0, c_1, ..., c_{K-1}, len(model)]: partition k is model[b_k:b_{k+1}].

    Without explicit cuts, each c_j is the position closest to j/K of the parameters, preferring
    positions right after an activation (so a left partition ends in a non-linearity), and
    every partition holds at least one layer with parameters."""
    modules = list(_sequential(model))
    sizes = [sum(p.numel() for p in m.parameters()) for m in modules]
    parametric = sum(1 for size in sizes if size)
    if partitions > parametric:
        raise ConfigError(f"{partitions} partitions but the model has only {parametric} layers with parameters: "
                          f"use at most {parametric} partitions")
    if cuts:
        if len(cuts) != partitions - 1 or sorted(set(cuts)) != list(cuts) or cuts[0] < 1 or cuts[-1] >= len(modules):
            raise ConfigError(f"cuts {cuts} must be {partitions - 1} increasing module indices in 1..{len(modules) - 1}")
        return [0, *cuts, len(modules)]
    cumulative = [sum(sizes[:i]) for i in range(len(modules) + 1)]
    layers_before = [sum(1 for size in sizes[:i] if size) for i in range(len(modules) + 1)]
    after_activation = {i for i in range(1, len(modules)) if sizes[i - 1] == 0 and layers_before[i]}
    chosen: list[int] = []
    for j in range(1, partitions):
        # Leave at least one parametric layer for this partition and each one still to come.
        allowed = [c for c in range(1, len(modules))
                   if layers_before[c] > layers_before[chosen[-1] if chosen else 0]
                   and parametric - layers_before[c] >= partitions - j]
        preferred = [c for c in allowed if c in after_activation] or allowed
        chosen.append(min(preferred, key=lambda c: (abs(cumulative[c] - cumulative[-1] * j / partitions), c)))
    return [0, *chosen, len(modules)]


def activation_shapes(model: nn.Module, boundaries: list[int], input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Per-sample shape of the activation entering each partition (the input's for the first)."""
    shapes = [tuple(input_shape)]
    x = torch.zeros(1, *input_shape)
    with torch.no_grad():
        for start, end in zip(boundaries[:-1], boundaries[1:]):
            x = model[start:end](x)
            shapes.append(tuple(x.shape[1:]))
    return shapes[:-1]


class Layout:
    """This rank's place: its partition index, group, partners and the partition module."""

    def __init__(self, model: nn.Module, options: PartitionOptions, input_shape: tuple[int, ...]) -> None:
        self.boundaries = cut_points(model, options.partitions, options.cuts)
        self.shapes = activation_shapes(model, self.boundaries, input_shape)
        self.count = options.partitions
        self.group, _ = runtime.split_world(num_groups=options.partitions, label="partition")
        self.index = self.group.index
        start, end = self.boundaries[self.index], self.boundaries[self.index + 1]
        self.whole_model_parameters = sum(p.numel() for p in model.parameters())
        self.module = nn.Sequential(*list(model)[start:end])
        # Other partitions' tensors are released on this rank (the caller may still hold the
        # whole model object): each rank keeps only its own partition in memory.
        for index, other in enumerate(model):
            if not start <= index < end:
                for tensor in [*other.parameters(), *other.buffers()]:
                    tensor.data = tensor.data.new_empty(0)
        self.previous = runtime.rank() - self.group.size if self.index > 0 else None
        self.next = runtime.rank() + self.group.size if self.index < self.count - 1 else None

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def batches(self, split: Any, batch_size: int, shuffle: bool, seed: int, device: torch.device) -> ShardedBatches:
        """Sharded over this group by position, so partners see the same samples."""
        return ShardedBatches(split, batch_size, self.group.rank_of(runtime.rank()), self.group.size,
                              seed=seed, shuffle=shuffle, device=device)

    def receive(self, source: int, rows: int, shape: tuple[int, ...], tag: int, name: str) -> torch.Tensor:
        return meter.recv(torch.empty(rows, *shape), source, name, tag)

    def average_gradients(self) -> None:
        params = [(f"partition.grad.{n}", p) for n, p in self.module.named_parameters() if p.requires_grad]
        averaged = meter.allreduce_many([(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in params],
                                        self.group, op="average")
        for (_, p), g in zip(params, averaged):
            p.grad = g


def pipeline_train_step(layout: Layout, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One model-parallel step: activations forward to the partner in the next group, gradients
    back; every group averages its own gradients. Returns the loss on the last partition, 0.0
    elsewhere (the loss exists only there)."""
    optimizer.zero_grad()
    rows = len(y)
    inputs = x if layout.first else layout.receive(layout.previous, rows, layout.shapes[layout.index], FORWARD,
                                                   "mp.activations").requires_grad_()
    out = layout.module(inputs)
    loss_value = 0.0
    if layout.last:
        loss = F.cross_entropy(out, y)
        loss.backward()
        loss_value = loss.item()
    else:
        meter.send(out.detach(), layout.next, "mp.activations", FORWARD)
        out.backward(layout.receive(layout.next, rows, tuple(out.shape[1:]), BACKWARD, "mp.gradients"))
    if not layout.first:
        meter.send(inputs.grad, layout.previous, "mp.gradients", BACKWARD)
    layout.average_gradients()
    optimizer.step()
    return loss_value


def pipeline_evaluate(layout: Layout, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, float]:
    """The joined network on this group's test shard: each batch flows through the partitions
    in order. Counts are returned by the last partition only (zeros elsewhere)."""
    layout.module.eval()
    correct, count, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for x, y in batches:
            inputs = x if layout.first else layout.receive(layout.previous, len(y), layout.shapes[layout.index],
                                                           EVALUATE, "eval.activations")
            out = layout.module(inputs)
            if layout.last:
                loss_sum += F.cross_entropy(out, y, reduction="sum").item()
                correct += (out.argmax(dim=1) == y).sum().item()
                count += len(y)
            else:
                meter.send(out, layout.next, "eval.activations", EVALUATE)
    layout.module.train()
    return correct, count, loss_sum


def joined_state_dict(layout: Layout) -> dict[str, torch.Tensor] | None:
    """The whole model's ordinary state dict (keys as in the unpartitioned nn.Sequential) on
    global rank 0, gathered from each group's first rank; None on other ranks."""
    offset = layout.boundaries[layout.index]
    mine = {f"{int(key.split('.', 1)[0]) + offset}.{key.split('.', 1)[1]}": value.detach().cpu()
            for key, value in layout.module.state_dict().items()}
    leader = layout.group.rank_of(runtime.rank()) == 0
    with meter.in_phase("control"):
        parts = meter.gather_object(mine if leader else None, "partition.state_dict")
    if runtime.rank() != 0:
        return None
    joined: dict[str, torch.Tensor] = {}
    for part in parts:
        joined.update(part or {})
    return joined


def describe(layout: Layout) -> str:
    spans = [f"{k}: modules {a}..{b - 1}" for k, (a, b) in enumerate(zip(layout.boundaries[:-1], layout.boundaries[1:]))]
    return f"{layout.count} partitions ({'; '.join(spans)}), {layout.group.size} rank(s) per partition"

