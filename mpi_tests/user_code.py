"""A user's own model factory and dataset, as `--model.name user_code:build` and
`--data.source user_code:load` name them (mpi_tests is on sys.path under pytest)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


class TwoBranch(nn.Module):
    """Not a Sequential, not from the zoo: two branches whose outputs are added."""

    def __init__(self, features: int, classes: int, width: int) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(features, width), nn.ReLU())
        self.right = nn.Sequential(nn.Linear(features, width), nn.Tanh())
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.head(self.left(x) + self.right(x))


def build(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    features = 1
    for d in input_shape:
        features *= d
    return TwoBranch(features, num_classes, width)


def load() -> tuple[TensorDataset, TensorDataset]:
    """A learnable 4-class task on 12 features: the class is the argmax of the first four."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1200, 12, generator=generator)
    y = x[:, :4].argmax(1)
    return TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:], y[1000:])
