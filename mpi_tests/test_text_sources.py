"""Text users bring: a pretrained tokenizer, .jsonl / .parquet exports, nanoGPT token files, and
token windows from a user's own dataset; converted streaming, in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from conftest import RANK, clean_env
from data_prep.__main__ import main as data_prep_main
from hvd_lowcomm.data import inspect, open_split, verify
from hvd_lowcomm.train import main

DOCS = [f"Document {i}: " + "the cat sat on the mat and looked at the hat. " * (20 + i) for i in range(12)]

one_rank = pytest.mark.skipif(RANK != 0, reason="file conversions run on one rank")


def stored(path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        return f["train/tokens"][:], f["test/tokens"][:]


@one_rank
def test_jsonl_and_parquet_columns_hold_the_same_documents_as_text_files(tmp_path):
    for i, doc in enumerate(DOCS):
        (tmp_path / f"doc{i:02d}.txt").write_text(doc)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "body": DOCS}), tmp_path / "docs.parquet", row_group_size=5)
    files = [str(tmp_path / f"doc{i:02d}.txt") for i in range(len(DOCS))]
    assert data_prep_main(["text", *files, "--out", str(tmp_path / "txt.h5")]) == 0
    for source in ("docs.jsonl", "docs.parquet"):
        out = tmp_path / f"{source}.h5"
        assert data_prep_main(["text", str(tmp_path / source), "--column", "body", "--out", str(out)]) == 0
        for mine, reference in zip(stored(out), stored(tmp_path / "txt.h5")):
            assert np.array_equal(mine, reference), source
        verify(inspect(out).files)


@one_rank
def test_a_missing_column_is_named_with_the_fix(tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    assert data_prep_main(["text", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "x.h5")]) == 1
    assert "has no 'text' field (choose the text's field with --column)" in capsys.readouterr().err
    assert not (tmp_path / "x.h5").exists()


@one_rank
def test_a_pretrained_tokenizer_file_encodes_the_text_with_its_own_vocabulary(tmp_path):
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    out = tmp_path / "words.h5"
    assert data_prep_main(["text", str(tmp_path / "docs.jsonl"), "--tokenizer", str(model_dir), "--out", str(out)]) == 0
    info = inspect(out)
    assert info.num_classes == tokenizer.get_vocab_size()
    train, held_out = stored(out)
    first_part = DOCS[0][: len(DOCS[0]) - round(0.1 * len(DOCS[0]))]
    expected = tokenizer.encode(first_part, add_special_tokens=False).ids
    assert train[: len(expected)].tolist() == expected
    held_bytes = sum(round(0.1 * len(d)) for d in DOCS)
    assert info.bytes_per_token == pytest.approx(held_bytes / len(held_out))
    with h5py.File(out, "r") as f:
        assert f.attrs["tokenizer"].endswith("tokenizer.json")


@one_rank
def test_nanogpt_token_files_are_imported_memory_mapped_with_their_vocabulary(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 50257, 30_000).astype(np.uint16), rng.integers(0, 50257, 3_000).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    out = tmp_path / "owt"
    assert (
        data_prep_main(
            [
                "tokens",
                str(tmp_path / "train.bin"),
                str(tmp_path / "val.bin"),
                "--vocab-size",
                "50257",
                "--bytes-per-token",
                "4",
                "--shards",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    info = inspect(out, seq_len=64)
    assert info.num_classes == 50257 and info.bytes_per_token == 4.0 and len(info.files) == 2
    x, y = open_split(info, "test").read(np.array([0, 1]))
    assert x[0].tolist() == val[:64].tolist() and y[0].tolist() == val[1:65].tolist()
    # without --vocab-size: the largest id + 1; an id the vocabulary cannot hold is refused
    assert (
        data_prep_main(
            ["tokens", str(tmp_path / "train.bin"), str(tmp_path / "val.bin"), "--out", str(tmp_path / "auto.h5")]
        )
        == 0
    )
    assert inspect(tmp_path / "auto.h5").num_classes == max(train.max(), val.max()) + 1
    assert (
        data_prep_main(
            [
                "tokens",
                str(tmp_path / "train.bin"),
                str(tmp_path / "val.bin"),
                "--vocab-size",
                "1000",
                "--out",
                str(tmp_path / "bad.h5"),
            ]
        )
        == 1
    )


@one_rank
def test_a_corpus_converts_in_memory_that_does_not_grow_with_its_size(tmp_path):
    """Peak resident memory (VmHWM) of the conversion in a child process, for a corpus and one
    four times larger (40 vs 160 MB of jsonl): streaming keeps the difference far below the
    growth. (Not ru_maxrss: Linux carries the parent's peak over into a child.)"""
    peaks = []
    line = json.dumps({"text": "lorem ipsum dolor sit amet " * 400}) + "\n"
    for megabytes in (40, 160):
        corpus = tmp_path / f"c{megabytes}.jsonl"
        with open(corpus, "w") as fh:
            for _ in range(megabytes * 2**20 // len(line)):
                fh.write(line)
        script = (
            "import re, sys; from data_prep.__main__ import main; "
            f"code = main(['text', {str(corpus)!r}, '--out', {str(tmp_path / f'c{megabytes}.h5')!r}]); "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)); "
            "sys.exit(code)"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=clean_env(), check=True
        )
        peaks.append(int(done.stdout.split()[-1]) * 1024)
        corpus.unlink()
    assert peaks[1] - peaks[0] < 30 * 2**20, peaks  # the corpus grew by 120 MB


def token_windows():
    """A user's data.source returning token windows (x, y = x shifted) and the vocabulary."""
    tokens = torch.arange(2000) % 50
    windows = [(tokens[i : i + 16], tokens[i + 1 : i + 17]) for i in range(0, 1900, 8)]
    return windows[:200], windows[200:], 50


def test_token_windows_from_a_user_data_source_train_a_language_model(shared_tmp):
    argv = [
        "--data.source",
        "test_text_sources:token_windows",
        "--model.name",
        "gpt",
        "--model.layers",
        "1",
        "--model.width",
        "32",
        "--model.heads",
        "2",
        "--data.seq_len",
        "16",
        "--data.batch_size",
        "8",
        "--train.epochs",
        "8",
        "--train.lr",
        "0.01",
        "--run.dir",
        str(shared_tmp),
        "--run.name",
        "windows",
        "--run.progress",
        "false",
    ]
    assert main(argv) == 0
    if RANK != 0:
        return
    summary = json.loads((shared_tmp / "windows" / "summary.json").read_text())
    assert summary["final_perplexity"] < 5, summary  # counting up mod 50 is learnable; chance is 50
    assert summary["tokens_per_step_per_rank"] == 8 * 16
