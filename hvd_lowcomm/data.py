"""HDF5 datasets and per-rank sharding.

File layout (written by `python -m data_prep`, format "hvd_lowcomm-h5/1"):

    /                 attrs: format, num_classes, input_shape, source, checksum (sha256 hex)
    /train/x          float32 [N, *input_shape], chunked along N
    /train/y          int64   [N], class indices in [0, num_classes)
    /test/x, /test/y  the same for the held-out set

Each rank opens the file lazily (first read, in its own process) and reads only the rows of
its own shard, batch by batch. Every epoch the sample order is a permutation drawn from
(seed, epoch), the same on every rank; rank r takes positions r, r+p, r+2p, ... of it, so
over an epoch the ranks together see every sample exactly once. All ranks take the same
number of steps, ceil((N // p) / batch_size), which collective methods need; a rank holding
one more sample than others puts it in one of its batches.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np
import torch

from hvd_lowcomm.config import ConfigError

FORMAT = "hvd_lowcomm-h5/1"
SPLITS = ("train", "test")


class DataError(ConfigError):
    """The dataset file is missing or not in the expected layout."""


def checksum(f: h5py.File) -> str:
    """sha256 over every split's x and y bytes, in layout order, read chunk by chunk."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for key in ("x", "y"):
            ds = f[split][key]
            rows = max(1, (1 << 24) // max(1, ds.dtype.itemsize * math.prod(ds.shape[1:])))
            for start in range(0, ds.shape[0], rows):
                digest.update(np.ascontiguousarray(ds[start:start + rows]).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class DatasetInfo:
    path: str
    num_classes: int
    input_shape: tuple[int, ...]
    num_train: int
    num_test: int
    source: str


def inspect(path: str | Path) -> DatasetInfo:
    """Check the file's layout (not its checksum: that reads everything) and describe it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset {path} does not exist; create it with "
                        f"`python -m data_prep digits --out {path}` (or synthetic / npz, see --help)")
    try:
        with h5py.File(path, "r") as f:
            problems = [f"/{s}/{k}" for s in SPLITS for k in ("x", "y") if f"{s}/{k}" not in f]
            if problems or "num_classes" not in f.attrs:
                missing = problems + ([] if "num_classes" in f.attrs else ["attribute num_classes"])
                raise DataError(f"{path} is not an hvd_lowcomm dataset: missing {', '.join(missing)}; "
                                f"rewrite it with `python -m data_prep ... --out {path}`")
            info = DatasetInfo(
                path=str(path), num_classes=int(f.attrs["num_classes"]),
                input_shape=tuple(int(d) for d in f["train/x"].shape[1:]),
                num_train=int(f["train/x"].shape[0]), num_test=int(f["test/x"].shape[0]),
                source=str(f.attrs.get("source", "?")))
            for split in SPLITS:
                x, y = f[f"{split}/x"], f[f"{split}/y"]
                if x.shape[0] != y.shape[0] or y.ndim != 1:
                    raise DataError(f"{path}: /{split}/x has {x.shape[0]} rows but /{split}/y has shape {y.shape}")
                if x.shape[1:] != f["train/x"].shape[1:]:
                    raise DataError(f"{path}: /{split}/x sample shape {x.shape[1:]} differs from /train/x")
    except OSError as err:
        raise DataError(f"cannot read {path} as HDF5 ({err}); the file may be truncated or "
                        f"corrupt: delete it and run data_prep again") from None
    if info.num_classes < 2:
        raise DataError(f"{path}: num_classes is {info.num_classes}, need at least 2")
    return info


class H5Split:
    """One split (train or test) of a dataset file, opened on first read in this process."""

    def __init__(self, path: str | Path, split: str) -> None:
        self.path, self.split = str(path), split
        self._file: h5py.File | None = None
        with h5py.File(self.path, "r") as f:
            self.length = int(f[split]["y"].shape[0])

    def __len__(self) -> int:
        return self.length

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `indices` (any order) as (x float32, y int64) tensors."""
        if self._file is None:
            self._file = h5py.File(self.path, "r")
        group = self._file[self.split]
        # h5py reads fancy selections only in increasing order: read sorted, then restore order.
        order = np.argsort(indices, kind="stable")
        sorted_idx = indices[order]
        restore = np.empty_like(order)
        restore[order] = np.arange(len(order))
        x = group["x"][sorted_idx][restore]
        y = group["y"][sorted_idx][restore]
        return torch.from_numpy(np.asarray(x, dtype=np.float32)), torch.from_numpy(np.asarray(y, dtype=np.int64))


class ShardedBatches:
    """This rank's batches of one split for a given epoch (see the module docstring)."""

    def __init__(self, split: H5Split, batch_size: int, rank: int, world_size: int,
                 seed: int = 0, shuffle: bool = True, device: torch.device | None = None) -> None:
        if len(split) < world_size:
            raise DataError(f"{split.path}: the {split.split} split has {len(split)} samples, "
                            f"fewer than the {world_size} ranks; use fewer ranks or more data")
        self.split, self.batch_size = split, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.device = device or torch.device("cpu")
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil((len(self.split) // self.world_size) / self.batch_size)

    def shard_indices(self, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else epoch
        n = len(self.split)
        order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        return order[self.rank::self.world_size]

    def batch_indices(self, epoch: int | None = None) -> list[np.ndarray]:
        return np.array_split(self.shard_indices(epoch), len(self))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for indices in self.batch_indices():
            x, y = self.split.read(indices)
            yield x.to(self.device), y.to(self.device)
