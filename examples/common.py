"""What both example scripts share: a ResNet-18-style network and CIFAR-shaped data.

The network is ResNet-18's layout (a 3x3 stem, four stages of two basic blocks, global
pooling, a linear head) at a configurable width (64 is ResNet-18 itself; the examples default
to 16 so that a few steps run in seconds on CPU). It is built as an `nn.Sequential` of blocks
so that SIL can cut it between them; other methods do not care.

The data is CIFAR-shaped (3x32x32, 10 classes): an HDF5 file written by `python -m data_prep`
when --data names one, else a synthetic task that can be learned (each class is a fixed random
image plus noise), so the examples run anywhere without a download.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (1x1 conv when the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18(width: int = 16, num_classes: int = 10) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    channels = width
    for stage, multiple in enumerate((1, 2, 4, 8)):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(channels, width * multiple, stride))
            channels = width * multiple
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def batches(args: argparse.Namespace, rank: int, replicas: int, train: bool = True):
    """This rank's batches (`rank` of `replicas` shards): args.steps of them for training, 4 for test."""
    count = args.steps if train else 4
    if args.data:
        from hvd_lowcomm.data import H5Split, ShardedBatches, inspect

        split = H5Split(inspect(args.data), "train" if train else "test")
        sharded = ShardedBatches(split, args.batch_size, rank, replicas, seed=0, shuffle=train)
        sharded.set_epoch(1)
        yield from itertools.islice(sharded, count)
        return
    prototypes = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1000 * rank + (0 if train else 999))
    for _ in range(count):
        y = torch.randint(0, 10, (args.batch_size,), generator=generator)
        yield prototypes[y] + torch.randn(args.batch_size, 3, 32, 32, generator=generator), y


def arguments(description: str, methods: tuple[str, ...] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    if methods:
        default = "ddp" if "ddp" in methods else methods[0]
        parser.add_argument("--method", choices=methods, default=default, help="how ranks share what they learn")
        parser.add_argument("--list-methods", action="store_true", help="print the methods, one a line, and exit")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage (64: ResNet-18)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam(W) learning rate")
    parser.add_argument(
        "--data",
        default="",
        help="an HDF5 file from data_prep with 3x32x32 images (default: synthetic CIFAR-shaped data)",
    )
    args = parser.parse_args()
    if methods and args.list_methods:
        print("\n".join(methods))
        raise SystemExit(0)
    return args


def accuracy(model: nn.Module, test_batches) -> tuple[int, int]:
    model.eval()
    correct = count = 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for x, y in test_batches:
            correct += (model(x.to(device)).argmax(1).cpu() == y).sum().item()
            count += len(y)
    model.train()
    return correct, count
