"""HDF5 layout, loader errors, and per-rank sharding."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from data_prep import write_dataset
from data_prep.__main__ import main as data_prep_main
from hvd_lowcomm import data
from hvd_lowcomm.data import DataError


def _write_numbered(path, n_train=103, n_test=17):
    """x[i] = i in every feature, so any row read back tells which sample it is."""
    x = np.repeat(np.arange(n_train, dtype=np.float32)[:, None], 3, axis=1)
    xt = np.repeat(np.arange(n_test, dtype=np.float32)[:, None], 3, axis=1)
    return write_dataset(path, (x, np.arange(n_train) % 4), (xt, np.arange(n_test) % 4), 4, "test")


def test_digits_are_written_in_the_documented_layout(tmp_path):
    assert data_prep_main(["digits", "--out", str(tmp_path / "d.h5")]) == 0
    info = data.inspect(tmp_path / "d.h5")
    assert (info.num_train, info.num_test, info.num_classes, info.input_shape) == (1438, 359, 10, (1, 8, 8))  # stratified 80/20 of 1,797
    with h5py.File(tmp_path / "d.h5") as f:
        assert f.attrs["format"] == data.FORMAT
        assert f["train/x"].chunks is not None and f["train/x"].dtype == np.float32
        assert f["train/y"].dtype == np.int64
        assert 0.0 <= f["train/x"][:].min() and f["train/x"][:].max() <= 1.0
        assert f.attrs["checksum"] == data.checksum(f)
    assert data_prep_main(["verify", str(tmp_path / "d.h5")]) == 0


def test_mnist5k_holds_real_mnist_images(tmp_path):
    assert data_prep_main(["mnist5k", "--out", str(tmp_path / "m.h5")]) == 0
    info = data.inspect(tmp_path / "m.h5")
    assert (info.num_train + info.num_test, info.input_shape, info.num_classes) == (5000, (1, 28, 28), 10)
    with h5py.File(tmp_path / "m.h5") as f:
        assert np.bincount(f["test/y"][:]).tolist() == [100] * 10  # stratified: 500 per class, 20 % held out


def test_npz_import_and_synthetic(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.normal(size=(50, 6)), y=rng.integers(0, 3, 50))
    assert data_prep_main(["npz", str(tmp_path / "a.npz"), "--out", str(tmp_path / "a.h5")]) == 0
    info = data.inspect(tmp_path / "a.h5")
    assert info.num_train + info.num_test == 50 and info.num_classes == 3
    assert data_prep_main(["synthetic", "--out", str(tmp_path / "s.h5"), "--samples", "200",
                           "--features", "5", "--classes", "4"]) == 0
    assert data.inspect(tmp_path / "s.h5").input_shape == (5,)
    np.savez(tmp_path / "bad.npz", inputs=np.zeros(3))
    assert data_prep_main(["npz", str(tmp_path / "bad.npz"), "--out", str(tmp_path / "b.h5")]) == 1
    assert not (tmp_path / "b.h5").exists()


def test_missing_file_names_the_path_and_the_command_that_makes_it(tmp_path):
    with pytest.raises(DataError, match=r"missing\.h5 does not exist; create it with `python -m data_prep digits --out .*missing\.h5`"):
        data.inspect(tmp_path / "missing.h5")


def test_file_without_expected_datasets_is_rejected(tmp_path):
    with h5py.File(tmp_path / "odd.h5", "w") as f:
        f["train/x"] = np.zeros((4, 2), dtype=np.float32)
    with pytest.raises(DataError, match=r"not an hvd_lowcomm dataset: missing /train/y, /test/x, /test/y, attribute num_classes"):
        data.inspect(tmp_path / "odd.h5")


def test_truncated_file_is_reported_as_corrupt(tmp_path):
    path = _write_numbered(tmp_path / "n.h5")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 3])
    with pytest.raises(DataError, match="truncated or corrupt"):
        data.inspect(path)


def test_checksum_detects_changed_data(tmp_path):
    path = _write_numbered(tmp_path / "n.h5")
    with h5py.File(path, "r+") as f:
        f["train/x"][5] = -1.0
    assert data_prep_main(["verify", str(path)]) == 1


def test_reads_return_the_requested_rows_in_the_requested_order(tmp_path):
    split = data.H5Split(_write_numbered(tmp_path / "n.h5"), "train")
    idx = np.array([40, 3, 99, 7])
    x, y = split.read(idx)
    assert x[:, 0].tolist() == [40.0, 3.0, 99.0, 7.0]
    assert y.tolist() == (idx % 4).tolist()
    assert x.dtype == torch.float32 and y.dtype == torch.int64


def test_shards_cover_every_sample_exactly_once_and_steps_agree(world, shared_tmp):
    comm, rank, p = world.comm, world.comm.Get_rank(), world.size
    path = shared_tmp / "n.h5"
    if rank == 0:
        _write_numbered(path)
    comm.Barrier()
    split = data.H5Split(path, "train")
    for batch_size in (1, 5, 32, 1000):
        batches = data.ShardedBatches(split, batch_size, rank, p, seed=7)
        for epoch in (1, 2):
            batches.set_epoch(epoch)
            seen = [int(v) for x, _ in batches for v in x[:, 0].tolist()]
            assert len(set(comm.allgather(len(batches)))) == 1  # same number of steps on every rank
            everything = sorted(s for part in comm.allgather(seen) for s in part)
            assert everything == list(range(len(split))), f"batch size {batch_size}, epoch {epoch}"
            assert len(seen) in (len(split) // p, len(split) // p + 1)
        order1, order2 = batches.shard_indices(1), batches.shard_indices(2)
        assert not np.array_equal(order1, order2)  # reshuffled every epoch
    # The same permutation on every rank: shards of epoch 1 interleave into one permutation.
    full = data.ShardedBatches(split, 8, 0, 1, seed=7).shard_indices(1)
    assert np.array_equal(data.ShardedBatches(split, 8, rank, p, seed=7).shard_indices(1), full[rank::p])


def test_too_few_samples_for_the_ranks_is_an_error(tmp_path):
    split = data.H5Split(_write_numbered(tmp_path / "n.h5", n_train=3), "train")
    with pytest.raises(DataError, match="has 3 samples, fewer than the 8 ranks"):
        data.ShardedBatches(split, 4, 0, 8)
