"""Every data_prep source, fed small files written here in the real on-disk formats: converted,
read back equal, and trained on."""

from __future__ import annotations

import gzip
import pickle
import struct
import sys
import tarfile
import zipfile

import h5py
import numpy as np
import pytest

from conftest import RANK
from data_prep.__main__ import main as data_prep_main
from hvd_lowcomm import data
from hvd_lowcomm.train import main as train_main

RNG = np.random.default_rng(11)


def _images(n, shape):
    return RNG.integers(0, 256, size=(n, *shape), dtype=np.uint8)


def write_cifar(folder, classes=10, per_batch=12):
    """CIFAR python batches: pickled dicts with bytes keys, data (N, 3072) uint8 rows."""
    folder.mkdir(parents=True)
    names = ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]) if classes == 10 else (["train"], ["test"])
    out = {}
    for split, files in zip(("train", "test"), names):
        xs, ys = [], []
        for name in files:
            x = _images(per_batch, (3, 32, 32))
            y = RNG.integers(0, classes, per_batch)
            batch = {b"batch_label": name.encode(), b"data": x.reshape(per_batch, -1)}
            if classes == 10:
                batch[b"labels"] = y.tolist()
            else:
                batch[b"fine_labels"], batch[b"coarse_labels"] = y.tolist(), (y // 5).tolist()
            (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
            xs.append(x)
            ys.append(y)
        out[split] = (np.concatenate(xs), np.concatenate(ys))
    return out


def idx_bytes(array):
    code = {np.dtype(np.uint8): 0x08}[array.dtype]
    return bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape) + array.tobytes()


def write_idx_set(folder, prefix="", n=(30, 10), classes=10, label_offset=0, compress=True, shape=(28, 28)):
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, count, stem in (("train", n[0], "train"), ("test", n[1], "t10k" if not prefix else "test")):
        x = _images(count, shape)
        y = (RNG.integers(0, classes, count) + label_offset).astype(np.uint8)
        for kind, array in (("images-idx3", x), ("labels-idx1", y)):
            name = f"{prefix}{stem}-{kind}-ubyte"
            raw = idx_bytes(array)
            if compress:
                (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
            else:
                (folder / name).write_bytes(raw)
        out[split] = (x, y.astype(np.int64) - label_offset)
    return out


def _read_back(path):
    with h5py.File(path) as f:
        return {s: (f[f"{s}/x"][:], f[f"{s}/y"][:]) for s in ("train", "test")}, f.attrs["num_classes"]


def _assert_same(written, expected):
    for split in ("train", "test"):
        np.testing.assert_array_equal(written[split][0], expected[split][0])
        np.testing.assert_array_equal(written[split][1], expected[split][1])


def _trains(shared_tmp, path, *extra):
    """A few training steps on `path` on every rank."""
    argv = [
        "--data.path",
        str(path),
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.progress",
        "false",
        "--train.max_steps",
        "3",
        "--data.batch_size",
        "4",
        *extra,
    ]
    assert train_main(argv) == 0


def _convert(shared_tmp, world, *argv):
    """Run data_prep on rank 0; every rank waits for the file."""
    code = data_prep_main(list(argv)) if RANK == 0 else 0
    assert world.comm.bcast(code, root=0) == 0


@pytest.mark.parametrize("archive", [False, True], ids=["folder", "tar.gz"])
def test_cifar10_pickles_convert_equal_and_train(world, shared_tmp, archive):
    expected = write_cifar(shared_tmp / "raw" / "cifar-10-batches-py") if RANK == 0 else None
    root = shared_tmp / "raw"
    if archive and RANK == 0:
        with tarfile.open(shared_tmp / "cifar-10-python.tar.gz", "w:gz") as tar:
            tar.add(root / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    if archive:
        root = shared_tmp / "cifar-10-python.tar.gz"
    _convert(shared_tmp, world, "cifar10", "--root", str(root), "--out", str(shared_tmp / "c10.h5"))
    if RANK == 0:
        written, classes = _read_back(shared_tmp / "c10.h5")
        _assert_same(written, expected)
        assert classes == 10 and written["train"][0].shape == (60, 3, 32, 32)
        info = data.inspect(shared_tmp / "c10.h5")
        x = expected["train"][0] / 255.0
        np.testing.assert_allclose(info.mean, x.mean(axis=(0, 2, 3)), rtol=1e-5)
        np.testing.assert_allclose(info.std, x.std(axis=(0, 2, 3)), rtol=1e-4)
    _trains(shared_tmp, shared_tmp / "c10.h5", "--model.name", "cnn", "--model.hidden", "4,4")


def test_cifar100_fine_and_coarse_labels(world, shared_tmp):
    expected = write_cifar(shared_tmp / "raw" / "cifar-100-python", classes=100) if RANK == 0 else None
    for labels in ("fine", "coarse"):
        _convert(
            shared_tmp,
            world,
            "cifar100",
            "--root",
            str(shared_tmp / "raw"),
            "--labels",
            labels,
            "--out",
            str(shared_tmp / f"c100{labels}.h5"),
        )
    if RANK == 0:
        fine, classes = _read_back(shared_tmp / "c100fine.h5")
        _assert_same(fine, expected)
        assert classes == 100
        coarse, classes = _read_back(shared_tmp / "c100coarse.h5")
        assert classes == 20 and np.array_equal(coarse["train"][1], expected["train"][1] // 5)
    _trains(shared_tmp, shared_tmp / "c100fine.h5")


def test_mnist_and_fashion_idx_in_torchvision_layout(world, shared_tmp):
    """torchvision puts both under the same file names in sibling folders; each source picks its own,
    gzipped (MNIST here) or not (Fashion-MNIST here)."""
    if RANK == 0:
        mnist = write_idx_set(shared_tmp / "tv" / "MNIST" / "raw")
        fashion = write_idx_set(shared_tmp / "tv" / "FashionMNIST" / "raw", compress=False)
    _convert(shared_tmp, world, "mnist", "--root", str(shared_tmp / "tv"), "--out", str(shared_tmp / "mnist.h5"))
    _convert(
        shared_tmp,
        world,
        "fashion-mnist",
        "--root",
        str(shared_tmp / "tv"),
        "--out",
        str(shared_tmp / "fashion"),
        "--shards",
        "2",
    )
    if RANK == 0:
        written, _ = _read_back(shared_tmp / "mnist.h5")
        _assert_same(written, {s: (x[:, None], y) for s, (x, y) in mnist.items()})
        info = data.inspect(shared_tmp / "fashion")
        split = data.H5Split(info, "train", normalize=False)
        x, y = split.read(np.arange(len(split)))
        # Sharded: the rows are spread over two files; together they are the originals.
        back = (x.numpy() * 255).round().astype(np.uint8)
        pairs = sorted(row.tobytes() + bytes([label]) for row, label in zip(back, y.tolist()))
        originals = sorted(
            row.tobytes() + bytes([label])
            for row, label in zip(fashion["train"][0][:, None], fashion["train"][1].tolist())
        )
        assert pairs == originals
    _trains(shared_tmp, shared_tmp / "mnist.h5")
    _trains(shared_tmp, shared_tmp / "fashion")


def test_emnist_letters_from_the_zip_are_transposed_and_zero_based(world, shared_tmp):
    if RANK == 0:
        letters = write_idx_set(shared_tmp / "gz" / "gzip", prefix="emnist-letters-", classes=26, label_offset=1)
        with zipfile.ZipFile(shared_tmp / "gzip.zip", "w") as archive:
            for f in sorted((shared_tmp / "gz" / "gzip").iterdir()):
                archive.write(f, f"gzip/{f.name}")
    _convert(
        shared_tmp,
        world,
        "emnist",
        "--split",
        "letters",
        "--root",
        str(shared_tmp / "gzip.zip"),
        "--out",
        str(shared_tmp / "letters.h5"),
    )
    if RANK == 0:
        written, classes = _read_back(shared_tmp / "letters.h5")
        assert classes == 26
        _assert_same(written, {s: (x.transpose(0, 2, 1)[:, None], y) for s, (x, y) in letters.items()})
        assert written["train"][1].min() >= 0 and written["train"][1].max() <= 25
    _trains(shared_tmp, shared_tmp / "letters.h5")


def test_imagefolder_with_split_folders_and_resize(world, shared_tmp):
    from PIL import Image

    if RANK == 0:
        for split, count in (("train", 6), ("val", 2)):
            for cls in ("cat", "dog", "emu"):
                folder = shared_tmp / "imgs" / split / cls
                folder.mkdir(parents=True)
                for i in range(count):
                    Image.fromarray(_images(1, (10, 12, 3))[0]).save(folder / f"{i}.png")
        Image.fromarray(_images(1, (9, 9, 3))[0]).save(shared_tmp / "imgs" / "train" / "cat" / "odd.png")
        # Different sizes without --size: refused, naming the odd image.
        assert data_prep_main(["imagefolder", str(shared_tmp / "imgs"), "--out", str(shared_tmp / "no.h5")]) == 1
        assert not (shared_tmp / "no.h5").exists()
    _convert(
        shared_tmp,
        world,
        "imagefolder",
        str(shared_tmp / "imgs"),
        "--size",
        "8,6",
        "--out",
        str(shared_tmp / "imgs.h5"),
    )
    if RANK == 0:
        written, classes = _read_back(shared_tmp / "imgs.h5")
        assert classes == 3 and written["train"][0].shape == (19, 3, 8, 6) and len(written["test"][1]) == 6
        assert written["train"][1].tolist() == [0] * 7 + [1] * 6 + [2] * 6  # sorted class folders
        with Image.open(shared_tmp / "imgs" / "val" / "dog" / "1.png") as image:
            resized = np.asarray(image.convert("RGB").resize((6, 8), Image.Resampling.BILINEAR)).transpose(2, 0, 1)
        np.testing.assert_array_equal(written["test"][0][3], resized)
    _trains(shared_tmp, shared_tmp / "imgs.h5", "--model.name", "cnn", "--model.hidden", "4")


def test_npz_uint8_channels_last_images_and_synthetic_shape(world, shared_tmp):
    if RANK == 0:
        x = _images(40, (5, 5, 3))
        np.savez(shared_tmp / "a.npz", x=x, y=np.arange(40) % 2)
    _convert(shared_tmp, world, "npz", str(shared_tmp / "a.npz"), "--out", str(shared_tmp / "a.h5"))
    _convert(
        shared_tmp,
        world,
        "synthetic",
        "--out",
        str(shared_tmp / "s.h5"),
        "--samples",
        "64",
        "--shape",
        "2,4,4",
        "--classes",
        "3",
        "--compression",
        "gzip",
    )
    if RANK == 0:
        info = data.inspect(shared_tmp / "a.h5")
        assert info.input_shape == (3, 5, 5) and info.dtype == "uint8" and len(info.mean) == 3
        s = data.inspect(shared_tmp / "s.h5")
        assert s.input_shape == (2, 4, 4) and s.dtype == "float32" and s.mean is None
        with h5py.File(shared_tmp / "s.h5") as f:
            assert f["train/x"].compression == "gzip"
    _trains(shared_tmp, shared_tmp / "a.h5")
    _trains(shared_tmp, shared_tmp / "s.h5")


@pytest.mark.skipif(RANK != 0, reason="no MPI involved")
def test_download_without_torchvision_says_how_to_get_the_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision` fail
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    code = data_prep_main(["cifar10", "--root", str(tmp_path / "c"), "--download", "--out", str(tmp_path / "c.h5")])
    err = capsys.readouterr().err
    assert code == 1 and "--download needs torchvision" in err and "pass their folder with --root" in err
    assert not (tmp_path / "c.h5").exists()


@pytest.mark.skipif(RANK != 0, reason="no MPI involved")
def test_broken_sources_are_reported(tmp_path, capsys):
    assert data_prep_main(["mnist", "--root", str(tmp_path / "none"), "--out", str(tmp_path / "m.h5")]) == 1
    assert "does not exist" in capsys.readouterr().err
    folder = tmp_path / "raw"
    write_idx_set(folder)
    raw = (folder / "train-images-idx3-ubyte.gz").read_bytes()
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(gzip.decompress(raw)[:-100]))
    assert data_prep_main(["mnist", "--root", str(folder), "--out", str(tmp_path / "m.h5")]) == 1
    assert "truncated download?" in capsys.readouterr().err
    assert not (tmp_path / "m.h5").exists()


def test_tampered_dataset_stops_training_before_it_starts(world, shared_tmp, capsys):
    if RANK == 0:
        assert data_prep_main(["synthetic", "--out", str(shared_tmp / "t.h5"), "--samples", "64", "--shape", "4"]) == 0
        with h5py.File(shared_tmp / "t.h5", "r+") as f:
            f["test/y"][0] = (f["test/y"][0] + 1) % 10
    world.comm.Barrier()
    argv = ["--data.path", str(shared_tmp / "t.h5"), "--run.dir", str(shared_tmp / "runs")]
    assert train_main(argv) == 2
    if RANK == 0:
        assert "t.h5: checksum mismatch" in capsys.readouterr().err
    assert not (shared_tmp / "runs").exists()
