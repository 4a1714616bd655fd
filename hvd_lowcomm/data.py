"""HDF5 datasets, shard files and per-rank sharding.

File layout (written by `python -m data_prep`, format "hvd_lowcomm-h5/2"):

    /                 attrs: format, num_classes, input_shape, source, checksum (sha256 hex),
                             shard_index, num_shards, and for uint8 images mean, std
    /train/x          uint8 images [N, C, H, W] (or float32 features [N, ...]), chunked along N
    /train/y          int64 [N], class indices in [0, num_classes)
    /test/x, /test/y  the same for the held-out set

Images are stored as uint8; the loader returns float32 (x / 255 - mean[c]) / std[c] with the
per-channel mean and std of the whole training split (attributes, in [0, 1] units). Float
features are returned as stored.

A text dataset (written by `python -m data_prep text`, attribute kind "text") holds a token
stream per split instead:

    /                 attrs: format, kind = "text", num_classes (= the vocabulary size), vocab_size,
                             tokenizer, bytes_per_token (text bytes per token, 1 for bytes),
                             source, checksum, shard_index, num_shards
    /train/tokens     uint8 (a vocabulary of at most 256) or uint16/int32 token ids [N]
    /test/tokens      the held-out (validation) stream

Its samples are windows of `seq_len` + 1 tokens: x the first seq_len, y the same shifted by
one (the next token at every position). Evaluation reads the stream in consecutive windows;
training reads one window fewer per shard, shifted every epoch by a random offset below
seq_len (from seed and epoch, the same on every rank), so each epoch cuts the text elsewhere.

A dataset is one such file, or a directory of S shard files `shard-00000-of-000S.h5` (data_prep
--shards S), each a complete file holding a slice of both splits. The samples of all shards
form one index space, shard after shard.

Which samples a rank reads (`ShardedBatches`):
  * no more shards than ranks (one file included): the ranks are dealt round-robin onto the
    shards; every epoch, the ranks on a shard take interleaved positions of a permutation of
    that shard drawn from (seed, epoch, shard), so together they see each sample once;
  * more shards than ranks: each rank owns whole shards (dealt largest first to the
    least-loaded rank) and permutes its own samples every epoch.
A rank opens only the files it reads, lazily in its own process, and reads only the rows of
the current batch. All ranks take the same number of steps, ceil(m / batch_size) with m the
smallest rank's sample count, which collective methods need. In training a rank with more
samples uses at most max(steps * batch_size, m + 1) of them per epoch (a fresh random choice
each epoch); evaluation reads every sample.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np
import torch

from hvd_lowcomm.config import ConfigError, DataConfig, import_object
from hvd_lowcomm.task import CLASSIFY, LANGUAGE_MODEL

FORMAT = "hvd_lowcomm-h5/2"
SPLITS = ("train", "test")
SHARD_NAME = "shard-{index:05d}-of-{count:05d}.h5"
_SHARD_PATTERN = re.compile(r"shard-(\d{5})-of-(\d{5})\.h5")


class DataError(ConfigError):
    """The dataset is missing, not in the expected layout, or corrupt."""


def checksum(f: h5py.File) -> str:
    """sha256 over every split's x and y bytes, in layout order, read chunk by chunk."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for key in f[split]:  # x and y, or tokens (in name order)
            ds = f[split][key]
            rows = max(1, (1 << 24) // max(1, ds.dtype.itemsize * math.prod(ds.shape[1:])))
            for start in range(0, ds.shape[0], rows):
                digest.update(np.ascontiguousarray(ds[start : start + rows]).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class DatasetInfo:
    path: str  # what the user gave: a file or a shard directory
    files: tuple[str, ...]  # the HDF5 files, in shard order
    num_classes: int
    input_shape: tuple[int, ...]
    train_sizes: tuple[int, ...]  # samples per file
    test_sizes: tuple[int, ...]
    source: str
    dtype: str  # "uint8" (images, normalised when read) or "float32"
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    datasets: Any = field(default=None, compare=False, repr=False)  # data.source: {"train": ..., "test": ...}
    task: str = CLASSIFY  # or LANGUAGE_MODEL: a text dataset (num_classes is its vocabulary)
    bytes_per_token: float = 1.0  # text: bytes of text per token of the held-out split (bits per byte)

    @property
    def num_train(self) -> int:
        return sum(self.train_sizes)

    @property
    def num_test(self) -> int:
        return sum(self.test_sizes)

    def sizes(self, split: str) -> tuple[int, ...]:
        return self.train_sizes if split == "train" else self.test_sizes

    @property
    def vocabulary(self) -> int | None:
        """Token ids a language model must embed (None for classification data)."""
        return self.num_classes if self.task == LANGUAGE_MODEL else None


def _remake(path: Path) -> str:
    return f"recreate it with `python -m data_prep <source> --out {path}` (see `python -m data_prep --help`)"


def shard_files(path: Path) -> list[Path]:
    """The shard files of a shard directory, checked to be complete."""
    found = sorted(p for p in path.iterdir() if _SHARD_PATTERN.fullmatch(p.name))
    if not found:
        raise DataError(
            f"{path} is a directory without shard files (shard-NNNNN-of-NNNNN.h5); {_remake(path)} --shards S"
        )
    counts = {int(_SHARD_PATTERN.fullmatch(p.name).group(2)) for p in found}
    count = counts.pop()
    expected = [path / SHARD_NAME.format(index=i, count=count) for i in range(count)]
    missing = [p.name for p in expected if p not in found]
    if counts or missing:
        raise DataError(
            f"{path}: shard set incomplete or mixed (missing {', '.join(missing[:4]) or '-'}; "
            f"counts {sorted(counts | {count})}); {_remake(path)} --shards S"
        )
    return expected


def _describe(path: Path, seq_len: int) -> dict:
    """One file's layout, checked; everything `inspect` needs from it."""
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("kind") == "text":
                return _describe_text(path, f, seq_len)
            missing = [f"/{s}/{k}" for s in SPLITS for k in ("x", "y") if f"{s}/{k}" not in f]
            missing += [f"attribute {a}" for a in ("format", "num_classes", "checksum") if a not in f.attrs]
            if missing:
                raise DataError(
                    f"{path} is not a complete hvd_lowcomm dataset: missing {', '.join(missing)}; {_remake(path)}"
                )
            if str(f.attrs["format"]) != FORMAT:
                raise DataError(
                    f"{path} has format {f.attrs['format']!r}, this version reads {FORMAT!r}; {_remake(path)}"
                )
            if not re.fullmatch(r"[0-9a-f]{64}", str(f.attrs["checksum"])):
                raise DataError(
                    f"{path}: checksum attribute {str(f.attrs['checksum'])[:20]!r} is not a sha256 "
                    f"digest; the file was not written by data_prep: {_remake(path)}"
                )
            x = f["train/x"]
            for split in SPLITS:
                xs, ys = f[f"{split}/x"], f[f"{split}/y"]
                if xs.shape[0] != ys.shape[0] or ys.ndim != 1:
                    raise DataError(f"{path}: /{split}/x has {xs.shape[0]} rows but /{split}/y has shape {ys.shape}")
                if xs.shape[1:] != x.shape[1:] or xs.dtype != x.dtype:
                    raise DataError(f"{path}: /{split}/x ({xs.dtype}, {xs.shape[1:]}) differs from /train/x")
            if x.dtype not in (np.uint8, np.float32):
                raise DataError(f"{path}: /train/x is {x.dtype}, expected uint8 images or float32 features")
            stats = None
            if x.dtype == np.uint8:
                if "mean" not in f.attrs or "std" not in f.attrs:
                    raise DataError(f"{path}: uint8 images without mean/std attributes; {_remake(path)}")
                stats = (tuple(float(v) for v in f.attrs["mean"]), tuple(float(v) for v in f.attrs["std"]))
            return {
                "num_classes": int(f.attrs["num_classes"]),
                "input_shape": tuple(int(d) for d in x.shape[1:]),
                "train": int(x.shape[0]),
                "test": int(f["test/x"].shape[0]),
                "dtype": str(x.dtype),
                "source": str(f.attrs.get("source", "?")),
                "stats": stats,
                "task": CLASSIFY,
                "bytes_per_token": 1.0,
                "shard": (int(f.attrs.get("shard_index", 0)), int(f.attrs.get("num_shards", 1))),
            }
    except OSError as err:
        raise DataError(
            f"cannot read {path} as HDF5 ({err}); the file may be truncated or corrupt: delete it and {_remake(path)}"
        ) from None


def _describe_text(path: Path, f: h5py.File, seq_len: int) -> dict:
    missing = [f"/{s}/tokens" for s in SPLITS if f"{s}/tokens" not in f]
    missing += [f"attribute {a}" for a in ("format", "vocab_size", "checksum") if a not in f.attrs]
    if missing:
        raise DataError(
            f"{path} is not a complete hvd_lowcomm text dataset: missing {', '.join(missing)}; "
            f"recreate it with `python -m data_prep text <files> --out {path}`"
        )
    if str(f.attrs["format"]) != FORMAT:
        raise DataError(
            f"{path} has format {f.attrs['format']!r}, this version reads {FORMAT!r}; "
            f"recreate it with `python -m data_prep text <files> --out {path}`"
        )
    counts = {split: int(f[f"{split}/tokens"].shape[0]) for split in SPLITS}
    for split, count in counts.items():
        if count < seq_len + 1:
            raise DataError(
                f"{path}: the {split} split has {count} tokens, fewer than one window of data.seq_len "
                f"{seq_len} + 1: use a shorter --data.seq_len, more text, or fewer --shards"
            )
    return {
        "num_classes": int(f.attrs["vocab_size"]),
        "input_shape": (seq_len,),
        "train": TokenSplit.windows(counts["train"], seq_len, training=True),
        "test": TokenSplit.windows(counts["test"], seq_len, training=False),
        "dtype": str(f["train/tokens"].dtype),
        "source": str(f.attrs.get("source", "?")),
        "stats": None,
        "task": LANGUAGE_MODEL,
        "bytes_per_token": float(f.attrs.get("bytes_per_token", 1.0)),
        "shard": (int(f.attrs.get("shard_index", 0)), int(f.attrs.get("num_shards", 1))),
    }


def inspect(path: str | Path, seq_len: int = DataConfig.seq_len) -> DatasetInfo:
    """Check the layout of a dataset file or shard directory (not the checksums: that reads
    everything, see `verify`) and describe it; a text dataset as windows of `seq_len` tokens."""
    path = Path(path)
    if path.is_dir():
        files = shard_files(path)
    elif path.is_file():
        files = [path]
    else:
        raise DataError(
            f"dataset {path} does not exist; create it with `python -m data_prep SOURCE --out {path}` "
            f"(SOURCE: a bundled set such as digits, mnist5k or shakespeare, or your own data; see "
            f"`python -m data_prep --help`)"
        )
    described = [_describe(f, seq_len) for f in files]
    first = described[0]
    for index, (file, d) in enumerate(zip(files, described)):
        for key in ("num_classes", "input_shape", "dtype", "stats", "task"):
            if d[key] != first[key]:
                raise DataError(
                    f"{file}: {key} {d[key]} differs from {files[0].name}'s {first[key]}; "
                    f"the shards come from different data_prep runs: {_remake(path)}"
                )
        if len(files) > 1 and d["shard"] != (index, len(files)):
            raise DataError(f"{file} says it is shard {d['shard'][0]} of {d['shard'][1]}; {_remake(path)}")
    if first["num_classes"] < 2:
        raise DataError(f"{path}: num_classes is {first['num_classes']}, need at least 2")
    stats = first["stats"]
    return DatasetInfo(
        path=str(path),
        files=tuple(str(f) for f in files),
        num_classes=first["num_classes"],
        input_shape=first["input_shape"],
        train_sizes=tuple(d["train"] for d in described),
        test_sizes=tuple(d["test"] for d in described),
        source=first["source"],
        dtype=first["dtype"],
        mean=stats[0] if stats else None,
        std=stats[1] if stats else None,
        task=first["task"],
        bytes_per_token=first["bytes_per_token"],
    )


def verify(files: list[str] | tuple[str, ...]) -> None:
    """Recompute the checksum of each file; raise DataError naming the first that differs."""
    for file in files:
        try:
            with h5py.File(file, "r") as f:
                stored, actual = str(f.attrs.get("checksum", "")), checksum(f)
        except OSError as err:
            raise DataError(f"cannot read {file} ({err}): delete it and {_remake(Path(file))}") from None
        if stored != actual:
            raise DataError(
                f"{file}: checksum mismatch (stored {stored[:12]}..., data {actual[:12]}...): the "
                f"file was changed or damaged after it was written; {_remake(Path(file))}"
            )


class H5Split:
    """One split (train or test) of a dataset, over all its shard files; a file is opened on
    its first read in this process, so a rank only opens the files it reads."""

    def __init__(
        self, info: DatasetInfo | str | Path, split: str, normalize: bool = True, driver: str = "default"
    ) -> None:
        self.info = info if isinstance(info, DatasetInfo) else inspect(info)
        self.split, self.driver = split, driver
        self.path = self.info.path
        self.sizes = self.info.sizes(split)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._files: dict[int, tuple] = {}  # shard -> (x, y) as h5py datasets or memory maps
        self._scale = None
        if self.info.dtype == "uint8" and normalize:
            shape = (-1,) + (1,) * (len(self.info.input_shape) - 1)
            mean = torch.tensor(self.info.mean, dtype=torch.float32)
            std = torch.tensor(self.info.std, dtype=torch.float32)
            self._scale = (mean.reshape(shape) if len(mean) > 1 else mean, std.reshape(shape) if len(std) > 1 else std)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def shard_range(self, shard: int) -> np.ndarray:
        return np.arange(self.offsets[shard], self.offsets[shard + 1])

    def _open(self, shard: int) -> tuple[h5py.Dataset, h5py.Dataset]:
        if shard not in self._files:
            kwargs = {}
            if self.driver == "mpio":
                from mpi4py import MPI

                # MPI-IO with independent reads: each rank its own communicator, since ranks
                # read different rows at different times and a collective open could hang.
                kwargs = {"driver": "mpio", "comm": MPI.COMM_SELF}
            group = h5py.File(self.info.files[shard], "r", **kwargs)[self.split]
            # h5py lookups by name are slow: keep handles (or maps) for every later batch.
            self._files[shard] = tuple(
                _mapped(group[key], self.info.files[shard]) if self.driver == "default" else group[key]
                for key in ("x", "y")
            )
        return self._files[shard]

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `indices` (global, any order) as (x float32, y int64) tensors."""
        indices = np.asarray(indices, dtype=np.int64)
        order = np.argsort(indices, kind="stable")
        sorted_idx = indices[order]
        if len(self.sizes) == 1:
            parts = [(0, sorted_idx)]
        else:
            shard_of = np.searchsorted(self.offsets, sorted_idx, side="right") - 1
            parts = [(int(s), sorted_idx[shard_of == s] - self.offsets[s]) for s in np.unique(shard_of)]
        xs, ys = [], []
        for shard, rows in parts:
            x_ds, y_ds = self._open(shard)
            xs.append(_read_rows(x_ds, rows))
            ys.append(_read_rows(y_ds, rows))
        restore = np.empty_like(order)
        restore[order] = np.arange(len(order))
        x = torch.from_numpy(np.concatenate(xs)[restore] if len(xs) > 1 else xs[0][restore])
        y = torch.from_numpy((np.concatenate(ys) if len(ys) > 1 else ys[0])[restore].astype(np.int64))
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
            if self._scale is not None:
                x = x.sub_(self._scale[0]).div_(self._scale[1])
        return x, y


class TokenSplit:
    """One split of a text dataset as windows of `seq_len` + 1 tokens (see the module
    docstring), over all its shard files; read like H5Split: `read(indices)` gives x [B, seq_len]
    and y [B, seq_len], both int64 token ids, y the next token at every position of x."""

    def __init__(self, info: DatasetInfo, split: str, seq_len: int) -> None:
        self.info, self.split, self.seq_len, self.path = info, split, seq_len, info.path
        self.training = split == "train"
        self.sizes = info.sizes(split)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._tokens: dict[int, np.ndarray | h5py.Dataset] = {}
        self._shift = np.zeros(len(self.sizes), dtype=np.int64)

    @staticmethod
    def windows(tokens: int, seq_len: int, training: bool) -> int:
        """Windows in a stream of `tokens`: consecutive ones, and in training one fewer (when
        there are two) to leave room for the epoch's random shift."""
        whole = (tokens - 1) // seq_len
        return whole - 1 if training and whole >= 2 else whole

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def shard_range(self, shard: int) -> np.ndarray:
        return np.arange(self.offsets[shard], self.offsets[shard + 1])

    def start_epoch(self, seed: int, epoch: int) -> None:
        """Training: shift every shard's windows by a random offset for this epoch (the same on
        every rank); evaluation reads fixed windows."""
        if not self.training:
            return
        for shard, count in enumerate(self.sizes):
            slack = min(self._stream(shard).shape[0] - 1 - count * self.seq_len, self.seq_len - 1)
            self._shift[shard] = np.random.default_rng([seed, epoch, shard, 7]).integers(0, slack + 1)

    def _stream(self, shard: int) -> np.ndarray | h5py.Dataset:
        if shard not in self._tokens:
            tokens = h5py.File(self.info.files[shard], "r")[self.split]["tokens"]
            self._tokens[shard] = _mapped(tokens, self.info.files[shard])
        return self._tokens[shard]

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64)
        shards = np.searchsorted(self.offsets, indices, side="right") - 1
        length = self.seq_len + 1
        rows = np.empty((len(indices), length), dtype=np.int64)
        for i, (index, shard) in enumerate(zip(indices, shards)):
            start = (index - self.offsets[shard]) * self.seq_len + self._shift[shard]
            rows[i] = self._stream(int(shard))[start : start + length]
        window = torch.from_numpy(rows)
        return window[:, :-1], window[:, 1:]


SLAB_BYTES = 1 << 20


def _mapped(ds: h5py.Dataset, file: str) -> h5py.Dataset | np.ndarray:
    """An uncompressed contiguous dataset as a read-only memory map of its bytes in the file:
    random rows then cost what the page cache costs, not an HDF5 selection each (~40 us/row).
    Chunked or compressed datasets are returned as they are."""
    offset = ds.id.get_offset() if ds.chunks is None and ds.compression is None and ds.size else None
    if offset is None:
        return ds
    return np.memmap(file, dtype=ds.dtype, mode="r", offset=offset, shape=ds.shape)


def _read_rows(ds: h5py.Dataset | np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (increasing) of `ds`. From a memory map: gather directly. From a chunked
    dataset: one contiguous read and an in-memory gather when the rows lie within ~1 MiB,
    else one read per row, which is faster than HDF5's multi-row point selection."""
    if isinstance(ds, np.ndarray):
        return ds[rows]
    first, last = int(rows[0]), int(rows[-1])
    row_bytes = ds.dtype.itemsize * math.prod(ds.shape[1:])
    if (last - first + 1) * row_bytes <= SLAB_BYTES:
        return ds[first : last + 1][rows - first]
    out = np.empty((len(rows), *ds.shape[1:]), dtype=ds.dtype)
    for i, row in enumerate(rows):
        out[i] = ds[row]
    return out


def assign_shards(sizes: tuple[int, ...] | list[int], world_size: int) -> list[list[int]]:
    """For each rank, the shards it reads (see the module docstring)."""
    if len(sizes) <= world_size:
        return [[rank % len(sizes)] for rank in range(world_size)]
    owned: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for shard in sorted(range(len(sizes)), key=lambda s: (-sizes[s], s)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owned[rank].append(shard)
        load[rank] += sizes[shard]
    return [sorted(s) for s in owned]


class ShardedBatches:
    """This rank's batches of one split for a given epoch (see the module docstring)."""

    def __init__(
        self,
        split: H5Split,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        device: torch.device | None = None,
    ) -> None:
        if len(split) < world_size:
            raise DataError(
                f"{split.path}: the {split.split} split has {len(split)} samples, "
                f"fewer than the {world_size} ranks; use fewer ranks or more data"
            )
        self.split, self.batch_size = split, batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.device = device or torch.device("cpu")
        self.epoch, self.start = 0, 0
        self.assignment = assign_shards(split.sizes, world_size)
        self.rank_sizes = [len(self._pool(r, 0, permute=False)) for r in range(world_size)]
        if min(self.rank_sizes) == 0:
            raise DataError(
                f"{split.path}: with {len(split.sizes)} shards over {world_size} ranks some rank "
                f"gets no {split.split} samples; write more (or fewer) shards"
            )

    def _pool(self, rank: int, epoch: int, permute: bool = True) -> np.ndarray:
        """Rank `rank`'s global sample indices for `epoch`, in the order it visits them."""
        shards = self.assignment[rank]
        if len(self.split.sizes) <= self.world_size:  # one shard per rank, or shared
            shard = shards[0]
            sharing = [r for r in range(self.world_size) if self.assignment[r] == shards]
            rows = self.split.shard_range(shard)
            if permute:
                rows = rows[np.random.default_rng([self.seed, epoch, shard]).permutation(len(rows))]
            return rows[sharing.index(rank) :: len(sharing)]
        rows = np.concatenate([self.split.shard_range(s) for s in shards])
        if permute:
            rows = rows[np.random.default_rng([self.seed, epoch, 1 << 20, rank]).permutation(len(rows))]
        return rows

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch `epoch` from its batch `start` on (a resumed run skips those done)."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return math.ceil(min(self.rank_sizes) / self.batch_size)

    def unused_fraction(self) -> float:
        """Share of the split's samples that training skips each epoch because shards split
        unevenly over the ranks (0 when the shard count fits the rank count)."""
        used = sum(min(n, self._cap()) for n in self.rank_sizes)
        return 1.0 - used / len(self.split)

    def _cap(self) -> int:
        return max(len(self) * self.batch_size, min(self.rank_sizes) + 1)

    def shard_indices(self, epoch: int | None = None) -> np.ndarray:
        pool = self._pool(self.rank, self.epoch if epoch is None else epoch, permute=self.shuffle)
        return pool[: self._cap()] if self.shuffle else pool

    def batch_indices(self, epoch: int | None = None) -> list[np.ndarray]:
        return np.array_split(self.shard_indices(epoch), len(self))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.shuffle and hasattr(self.split, "start_epoch"):  # a text split's windows move each epoch
            self.split.start_epoch(self.seed, self.epoch)
        gpu = self.device.type == "cuda"  # page-locked batches copy to a GPU while it still computes
        for indices in self.batch_indices()[self.start :]:
            x, y = self.split.read(indices)
            if gpu:
                x, y = x.pin_memory(), y.pin_memory()
            yield x.to(self.device, non_blocking=gpu), y.to(self.device, non_blocking=gpu)


# ---------------------------------------------------------------------------------------------
# a user's own datasets (--data.source mypkg.data:load)


class DatasetSplit:
    """A torch Dataset (items (x, y)) behind the interface ShardedBatches reads: one "shard"
    holding every sample, read by index. Features become float32 and labels int64; token
    windows (a language model's, `tokens`) stay int64 ids."""

    def __init__(self, dataset: Any, name: str, split: str, tokens: bool = False) -> None:
        self.dataset, self.path, self.split = dataset, name, split
        self.sizes = (len(dataset),)
        self.input_dtype = torch.int64 if tokens else torch.float32

    def __len__(self) -> int:
        return self.sizes[0]

    def shard_range(self, shard: int) -> np.ndarray:
        return np.arange(self.sizes[0])

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.dataset[int(i)] for i in indices]
        x = torch.stack([torch.as_tensor(item[0], dtype=self.input_dtype) for item in items])
        y = torch.stack([torch.as_tensor(item[1], dtype=torch.int64) for item in items])
        return x, y


def from_source(source: str) -> DatasetInfo:
    """Call a user's `module:function` returning (train, test) torch Datasets of (x, y) items,
    or (train, test, num_classes); describe them like an HDF5 dataset. Items whose x is a
    window of integer token ids and y the same shape (the next token at every position) are a
    language model's: the third element, the vocabulary, is then required. The datasets travel
    in `info.datasets`; `open_split` reads them."""
    load = import_object(source, "data.source")
    result = load()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise DataError(
            f"data.source {source}() must return (train, test) or (train, test, num_classes) datasets, "
            f"got {type(result).__name__}"
        )
    train, test = result[:2]
    for name, dataset in (("train", train), ("test", test)):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__") or len(dataset) == 0:
            raise DataError(f"data.source {source}(): the {name} set must be a non-empty map-style Dataset")
    x, y = (torch.as_tensor(v) for v in train[0])
    if not x.is_floating_point() and x.dim() >= 1 and y.shape == x.shape:  # token windows
        if len(result) != 3:
            raise DataError(
                f"data.source {source}() returns token windows (integer x, y of the same shape): "
                f"return (train, test, vocabulary_size) so the model's embedding can be checked"
            )
        return DatasetInfo(
            path=f"source {source}",
            files=(),
            num_classes=int(result[2]),
            input_shape=tuple(x.shape),
            train_sizes=(len(train),),
            test_sizes=(len(test),),
            source=source,
            dtype="int64",
            mean=None,
            std=None,
            datasets={"train": train, "test": test},
            task=LANGUAGE_MODEL,
        )
    if len(result) == 3:
        num_classes = int(result[2])
    else:  # from the labels: .targets where the dataset has them (torchvision's do), else every item
        labels = getattr(train, "targets", None)
        labels = labels if labels is not None else [train[i][1] for i in range(len(train))]
        num_classes = int(max(int(v) for v in labels)) + 1
    return DatasetInfo(
        path=f"source {source}",
        files=(),
        num_classes=num_classes,
        input_shape=tuple(torch.as_tensor(x).shape),
        train_sizes=(len(train),),
        test_sizes=(len(test),),
        source=source,
        dtype="float32",
        mean=None,
        std=None,
        datasets={"train": train, "test": test},
    )


def open_split(info: DatasetInfo, split: str, normalize: bool = True, driver: str = "default") -> Any:
    """The reader of one split: the user's dataset (data.source), a text dataset's windows, or
    the HDF5 files."""
    if info.datasets is not None:
        return DatasetSplit(info.datasets[split], info.path, split, tokens=info.task == LANGUAGE_MODEL)
    if info.task == LANGUAGE_MODEL:
        return TokenSplit(info, split, info.input_shape[0])
    return H5Split(info, split, normalize, driver)
