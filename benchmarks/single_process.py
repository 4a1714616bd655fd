"""What the one-process gradient diagnostics share (benchmarks.pseudo_gradient_energy,
benchmarks.gradient_signal): a model on an HDF5 dataset, trained by Adam on random batches."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hvd_lowcomm import data, models, task
from hvd_lowcomm.config import ModelConfig
from hvd_lowcomm.metrics import write_csv


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="an HDF5 dataset from data_prep")
    p.add_argument("--model", default="gpt", help="model.name")
    p.add_argument("--hidden", default="", help="model.hidden, comma-separated")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (the trainer's default)")
    p.add_argument("--seed", type=int, default=0)


@dataclass
class Trainee:
    """The model, its Adam and the training split, sampled without replacement per batch."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    split: object
    generator: np.random.Generator

    def gradients(self, batch_size: int) -> None:
        """The loss's gradients on a fresh random batch, in the parameters' .grad."""
        x, y = self.split.read(np.sort(self.generator.choice(len(self.split), batch_size, replace=False)))
        self.optimizer.zero_grad()
        task.loss(task.logits(self.model(x)), y).backward()

    def step(self, batch_size: int) -> None:
        self.gradients(batch_size)
        self.optimizer.step()


def trainee(args: argparse.Namespace) -> Trainee:
    torch.manual_seed(args.seed)
    info = data.inspect(args.data)
    hidden = [int(h) for h in args.hidden.split(",") if h]
    model = models.build_model(
        ModelConfig(name=args.model, hidden=hidden), info.input_shape, info.num_classes, info.task
    )
    return Trainee(
        model,
        torch.optim.Adam(model.parameters(), lr=args.lr),
        data.open_split(info, "train"),
        np.random.default_rng(args.seed),
    )


def write_table(
    out: str, stem: str, heading: list[str], rows: list[dict[str, Any]], cell: Callable[[Any], str]
) -> None:
    """`rows` as out/stem.csv and as a markdown table under `heading` in out/stem.md (also printed)."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(directory / f"{stem}.csv", rows)
    columns = list(rows[0])
    lines = [*heading, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row.values()) + " |" for row in rows]
    (directory / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
