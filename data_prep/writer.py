"""Write a dataset in the hvd_lowcomm HDF5 layout, atomically."""
from __future__ import annotations

import math
import os
from pathlib import Path

import h5py
import numpy as np

from hvd_lowcomm.data import FORMAT, checksum

CHUNK_BYTES = 1 << 20  # ~1 MiB chunks: a batch read touches a few chunks, not the whole file


def write_dataset(path: str | Path, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                  num_classes: int, source: str) -> Path:
    """Write train/test arrays to `path`. The file appears complete or not at all: it is
    written under a temporary name, flushed to disk, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            for split, (x, y) in (("train", train), ("test", test)):
                x = np.ascontiguousarray(x, dtype=np.float32)
                y = np.ascontiguousarray(y, dtype=np.int64)
                if len(x) != len(y):
                    raise ValueError(f"{split}: {len(x)} samples but {len(y)} labels")
                if len(y) and (y.min() < 0 or y.max() >= num_classes):
                    raise ValueError(f"{split}: labels must be in [0, {num_classes}), got {y.min()}..{y.max()}")
                row_bytes = 4 * math.prod(x.shape[1:])
                rows = max(1, min(len(x), CHUNK_BYTES // max(1, row_bytes)))
                g = f.create_group(split)
                g.create_dataset("x", data=x, chunks=(rows, *x.shape[1:]) if len(x) else None)
                g.create_dataset("y", data=y, chunks=(max(1, min(len(y), CHUNK_BYTES // 8)),) if len(y) else None)
            f.attrs["format"] = FORMAT
            f.attrs["num_classes"] = int(num_classes)
            f.attrs["input_shape"] = np.asarray(train[0].shape[1:], dtype=np.int64)
            f.attrs["source"] = source
            f.attrs["checksum"] = checksum(f)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
