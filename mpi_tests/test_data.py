"""HDF5 layout, loader errors, and per-rank sharding."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from data_prep import write_dataset
from data_prep.__main__ import main as data_prep_main
from hvd_lowcomm import data


def _numbered(n_train=103, n_test=17):
    """x[i] = i in every feature, so any row read back tells which sample it is."""
    x = np.repeat(np.arange(n_train, dtype=np.float32)[:, None], 3, axis=1)
    xt = np.repeat(np.arange(n_test, dtype=np.float32)[:, None], 3, axis=1)
    return (x, np.arange(n_train) % 4), (xt, np.arange(n_test) % 4)


def _write_numbered(path, n_train=103, n_test=17):
    return write_dataset(path, *_numbered(n_train, n_test), 4, "test")[0]


def test_mnist5k_holds_real_mnist_images(tmp_path):
    assert data_prep_main(["mnist5k", "--out", str(tmp_path / "m.h5")]) == 0
    info = data.inspect(tmp_path / "m.h5")
    assert (info.num_train + info.num_test, info.input_shape, info.num_classes) == (5000, (1, 28, 28), 10)
    with h5py.File(tmp_path / "m.h5") as f:
        assert np.bincount(f["test/y"][:]).tolist() == [100] * 10  # stratified: 500 per class, 20 % held out


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


@pytest.mark.parametrize("shards", [2, 3, 4, 5, 8, 12])
def test_shard_files_cover_every_sample_once_and_each_rank_opens_only_its_own(world, shared_tmp, shards):
    comm, rank, p = world.comm, world.comm.Get_rank(), world.size
    if rank == 0:
        files = write_dataset(shared_tmp / "sharded", *_numbered(), 4, "test", shards=shards)
        assert len(files) == shards
        assert data_prep_main(["verify", str(shared_tmp / "sharded")]) == 0
    comm.Barrier()
    info = data.inspect(shared_tmp / "sharded")
    assert (info.num_train, info.num_test, len(info.files)) == (103, 17, shards)
    assert max(info.train_sizes) - min(info.train_sizes) <= 1  # balanced shards
    # The shard files hold every sample exactly once.
    with_files = [h5py.File(f)["train/x"][:, 0].astype(int).tolist() for f in info.files]
    assert sorted(v for part in with_files for v in part) == list(range(103))
    for split_name, n in (("train", 103), ("test", 17)):
        if n < p:
            continue
        split = data.H5Split(info, split_name)
        train = split_name == "train"
        batches = data.ShardedBatches(split, 4, rank, p, seed=3, shuffle=train)
        batches.set_epoch(2)
        seen = [int(v) for x, _ in batches for v in x[:, 0].tolist()]
        assert len(set(comm.allgather(len(batches)))) == 1
        everything = sorted(s for part in comm.allgather(seen) for s in part)
        assert len(everything) == len(set(everything))  # no sample twice in an epoch
        if not train or shards % p == 0 or p % shards == 0:
            assert everything == list(range(n)), (split_name, shards)  # evaluation sees everything
        if train and shards >= p:  # a rank reads only its own shards
            mine = sorted(split._files)
            assert mine == data.assign_shards(split.sizes, p)[rank]
            assert sorted(s for part in comm.allgather(mine) for s in part) == list(range(shards))
    comm.Barrier()
