"""Write a dataset in the hvd_lowcomm HDF5 layout (see hvd_lowcomm.data), atomically.

`x` may be a numpy array or any array-like with `shape`, `dtype`, `len()` and `x[rows]` for an
increasing index array (data_prep.sources.ImageFiles decodes image files that way), so a
dataset larger than memory is written block by block.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
from tqdm import tqdm

from hvd_lowcomm.data import FORMAT, SHARD_NAME, SPLITS, checksum

# Uncompressed arrays are stored contiguously: the loader memory-maps them, so random batches
# read at page-cache speed and sequential reads are plain file reads. Compression needs chunks;
# small ones (~64 KiB) keep a random row from costing the decompression of much else.
CHUNK_BYTES = 64 << 10
BLOCK_BYTES = 64 << 20  # rows converted and written at a time


class ChannelStats:
    """Running per-channel sum and sum of squares of uint8 images, in [0, 1] units."""

    def __init__(self) -> None:
        self.sum = self.sq = None
        self.count = 0

    def add(self, x: np.ndarray) -> None:
        # (N, C, H, W) -> per channel; other shapes -> one channel.
        values = x.reshape(x.shape[0], x.shape[1], -1) if x.ndim == 4 else x.reshape(x.shape[0], 1, -1)
        values = values.astype(np.float64) / 255.0
        s, q = values.sum(axis=(0, 2)), (values * values).sum(axis=(0, 2))
        self.sum = s if self.sum is None else self.sum + s
        self.sq = q if self.sq is None else self.sq + q
        self.count += values.shape[0] * values.shape[2]

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        mean = self.sum / self.count
        std = np.sqrt(np.maximum(self.sq / self.count - mean * mean, 0.0))
        return mean.astype(np.float32), np.maximum(std, 1e-6).astype(np.float32)


def _checked(split: str, x: Any, y: np.ndarray, num_classes: int) -> np.ndarray:
    y = np.ascontiguousarray(y, dtype=np.int64)
    if len(x) != len(y):
        raise ValueError(f"{split}: {len(x)} samples but {len(y)} labels")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"{split}: labels must be in [0, {num_classes}), got {y.min()}..{y.max()}")
    if np.dtype(x.dtype) not in (np.uint8, np.float32, np.float64):
        raise ValueError(f"{split}: x is {x.dtype}; give uint8 images or floating-point features")
    return y


def _shard_rows(n: int, shards: int, seed: int) -> list[np.ndarray]:
    """Rows of each shard: a seeded random split into near-equal parts (class-mixed), each
    kept in increasing order so the source is read sequentially."""
    if shards == 1:
        return [np.arange(n)]
    return [np.sort(part) for part in np.array_split(np.random.default_rng([seed, n]).permutation(n), shards)]


def _write_split(
    group: h5py.Group,
    x: Any,
    y: np.ndarray,
    rows: np.ndarray,
    compression: str | None,
    stats: ChannelStats | None,
    bar: tqdm,
) -> None:
    dtype = np.uint8 if np.dtype(x.dtype) == np.uint8 else np.float32
    sample_shape = tuple(x.shape[1:])
    row_bytes = np.dtype(dtype).itemsize * max(1, math.prod(sample_shape))
    chunk_rows = max(1, min(len(rows), CHUNK_BYTES // row_bytes))
    compressed = compression is not None and len(rows) > 0
    opts = {"chunks": (chunk_rows, *sample_shape), "compression": compression} if compressed else {}
    xs = group.create_dataset("x", shape=(len(rows), *sample_shape), dtype=dtype, **opts)
    group.create_dataset(
        "y",
        data=y[rows],
        **({"chunks": (max(1, min(len(rows), CHUNK_BYTES // 8)),), "compression": compression} if compressed else {}),
    )
    block = max(chunk_rows, (BLOCK_BYTES // row_bytes) // chunk_rows * chunk_rows)
    for start in range(0, len(rows), block):
        values = np.asarray(x[rows[start : start + block]])
        if stats is not None:
            stats.add(values)
        xs[start : start + len(values)] = values.astype(dtype, copy=False)
        bar.update(len(values))


def write_dataset(
    path: str | Path,
    train: tuple[Any, np.ndarray],
    test: tuple[Any, np.ndarray],
    num_classes: int,
    source: str,
    shards: int = 1,
    compression: str | None = None,
    seed: int = 0,
    progress: bool = False,
) -> list[Path]:
    """Write train/test arrays to `path` (one file), or with `shards` > 1 to the directory
    `path` holding that many shard files; return the files written.

    Appears complete or not at all: everything is written under temporary names, flushed to
    disk, then renamed into place, so an interrupted run leaves the old data (or nothing)."""
    if shards < 1:
        raise ValueError(f"--shards must be >= 1, got {shards}")
    if shards > len(train[1]):
        raise ValueError(f"{shards} shards for {len(train[1])} training samples: every shard needs at least one")
    path = Path(path)
    splits = {
        "train": (train[0], _checked("train", *train, num_classes)),
        "test": (test[0], _checked("test", *test, num_classes)),
    }
    images = np.dtype(train[0].dtype) == np.uint8
    stats = ChannelStats() if images else None
    rows = {split: _shard_rows(len(y), shards, seed) for split, (_, y) in splits.items()}
    total = sum(len(y) for _, y in splits.values())
    with tqdm(total=total, unit="sample", desc=f"writing {path.name}", disable=not progress) as bar:

        def write_shard(f: h5py.File, index: int) -> None:
            for split in SPLITS:
                x, y = splits[split]
                _write_split(
                    f.create_group(split),
                    x,
                    y,
                    rows[split][index],
                    compression,
                    stats if split == "train" else None,
                    bar,
                )
            f.attrs.update(
                {
                    "format": FORMAT,
                    "num_classes": int(num_classes),
                    "source": source,
                    "input_shape": np.asarray(train[0].shape[1:], dtype=np.int64),
                }
            )

        def finish(f: h5py.File) -> None:  # the statistics cover the whole training split: known only now
            if stats is not None:
                f.attrs["mean"], f.attrs["std"] = stats.mean_std()

        return write_atomically(path, shards, write_shard, finish)


def write_atomically(
    path: Path,
    shards: int,
    write_shard: Callable[[h5py.File, int], None],
    finish: Callable[[h5py.File], None] | None = None,
) -> list[Path]:
    """Write `shards` files (one file at `path`, or a directory of shard files) with
    `write_shard(file, index)`, which fills the file; each gets its shard index, count and
    checksum, then `finish(file)` runs on every file once all are written (for figures
    over all shards). Everything is written under temporary names, flushed to disk, then
    renamed into place, so an interrupted run leaves the old data (or nothing)."""
    sharded = shards > 1
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    target_dir = tmp if sharded else path.parent
    names = [SHARD_NAME.format(index=i, count=shards) for i in range(shards)] if sharded else [tmp.name]
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        for index, name in enumerate(names):
            with h5py.File(target_dir / name, "w") as f:
                write_shard(f, index)
                f.attrs.update({"shard_index": index, "num_shards": shards, "checksum": checksum(f)})
        for name in names:
            if finish is not None:
                with h5py.File(target_dir / name, "r+") as f:
                    finish(f)
            with open(target_dir / name, "rb+") as fh:
                os.fsync(fh.fileno())
        if sharded:
            old = path.with_name(f".{path.name}.old{os.getpid()}")
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            if old.exists():
                shutil.rmtree(old) if old.is_dir() else old.unlink()
            return [path / name for name in names]
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)
        return [path]
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()


def token_dtype(vocab_size: int) -> np.dtype:
    """The type a text dataset stores its ids in: the smallest that holds the vocabulary."""
    return np.dtype(np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.int32)


def write_text_dataset(
    path: str | Path,
    train: np.ndarray,
    test: np.ndarray,
    vocab_size: int,
    source: str,
    tokenizer: str = "bytes",
    bytes_per_token: float = 1.0,
    shards: int = 1,
) -> list[Path]:
    """Write token streams (train and held-out) as a text dataset (hvd_lowcomm.data's layout):
    with `shards` > 1 each stream is cut into that many consecutive pieces, one per file.
    The streams may be files read a slice at a time (data_prep.text.TokenFile): they are
    checked and copied block by block."""
    if shards < 1:
        raise ValueError(f"--shards must be >= 1, got {shards}")
    dtype = token_dtype(vocab_size)
    block = max(1, BLOCK_BYTES // 8)
    pieces = {}
    for split, tokens in (("train", train), ("test", test)):
        if len(tokens) < 2 * shards:
            raise ValueError(f"the {split} split has {len(tokens)} tokens: too little text for {shards} shard(s)")
        bounds = np.linspace(0, len(tokens), shards + 1).round().astype(int)
        pieces[split] = [(tokens, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def write_shard(f: h5py.File, index: int) -> None:
        for split in SPLITS:  # one pass over each stream: checked as it is copied (a bad id leaves no file)
            tokens, begin, end = pieces[split][index]
            ds = f.create_group(split).create_dataset("tokens", shape=(end - begin,), dtype=dtype)
            for start in range(begin, end, block):
                part = np.asarray(tokens[start : min(end, start + block)])
                if part.min() < 0 or part.max() >= vocab_size:
                    raise ValueError(
                        f"{split}: token ids must be in [0, {vocab_size}), found {part.min()}.."
                        f"{part.max()} (is the vocabulary size right?)"
                    )
                ds[start - begin : start - begin + len(part)] = part.astype(dtype)
        f.attrs.update(
            {
                "format": FORMAT,
                "kind": "text",
                "num_classes": int(vocab_size),
                "vocab_size": int(vocab_size),
                "tokenizer": tokenizer,
                "bytes_per_token": float(bytes_per_token),
                "source": source,
            }
        )

    return write_atomically(Path(path), shards, write_shard)
