"""Transformers (gpt, vit), text datasets and language-model training through every method."""

from __future__ import annotations

import copy
import json
import math
import random

import h5py
import numpy as np
import pytest
import torch

from conftest import RANK, SIZE, skip_where_its_engine_is_not_running
from data_prep.__main__ import main as data_prep_main
from data_prep.text import split_documents
from hvd_lowcomm import task
from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.data import DataError, ShardedBatches, inspect, open_split, verify
from hvd_lowcomm.registry import specs
from hvd_lowcomm.methods.dad import DadOptimizer
from hvd_lowcomm.models.transformer import gpt
from hvd_lowcomm.train import main

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Now is the winter of our discontent.",
    "To be, or not to be, that is the question.",
    "All the world's a stage.",
    "A horse! a horse! my kingdom for a horse!",
    "Brevity is the soul of wit.",
]


def write_text(folder, name: str, sentences: int, seed: int) -> bytes:
    rng = random.Random(seed)
    text = "\n".join(rng.choice(SENTENCES) for _ in range(sentences)).encode()
    (folder / name).write_bytes(text)
    return text


@pytest.fixture
def corpus(shared_tmp):
    """Two text files and the dataset data_prep makes of them (rank 0 writes, all read)."""
    folder, out = shared_tmp / "corpus", shared_tmp / "corpus.h5"
    if RANK == 0:
        folder.mkdir(exist_ok=True)
        texts = [write_text(folder, "a.txt", 400, 1), write_text(folder, "b.txt", 300, 2)]
        assert data_prep_main(["text", str(folder), "--out", str(out)]) == 0
        (shared_tmp / "texts.json").write_text(json.dumps([t.decode() for t in texts]))
    from hvd_lowcomm.comm.traffic import meter

    meter.barrier("test.corpus")
    return out, [t.encode() for t in json.loads((shared_tmp / "texts.json").read_text())]


# ---------------------------------------------------------------------------------------------
# models


# ---------------------------------------------------------------------------------------------
# text data


def test_data_prep_text_holds_out_the_end_of_every_document_byte_for_byte(corpus):
    path, texts = corpus
    train, held_out = split_documents(texts, 0.1)
    with h5py.File(path, "r") as f:
        assert f.attrs["kind"] == "text" and f.attrs["vocab_size"] == 256
        assert bytes(f["train/tokens"][:]) == b"".join(train)
        assert bytes(f["test/tokens"][:]) == b"".join(held_out)
    for doc, tail in zip(texts, held_out):
        assert doc.endswith(tail) and len(tail) == round(0.1 * len(doc))
    verify(inspect(path).files)


def test_windows_predict_the_next_token_and_training_windows_move_each_epoch(corpus):
    path, texts = corpus
    info = inspect(path, seq_len=16)
    assert info.task == task.LANGUAGE_MODEL and info.input_shape == (16,) and info.num_classes == 256
    train_tokens = sum(len(t) for t in split_documents(texts, 0.1)[0])
    assert info.num_train == (train_tokens - 1) // 16 - 1  # one window kept free for the shift
    test = open_split(info, "test")
    x, y = test.read(np.array([0, 1]))
    held_out = b"".join(split_documents(texts, 0.1)[1])
    assert bytes(x[0].numpy().astype(np.uint8)) == held_out[:16]
    assert bytes(x[1].numpy().astype(np.uint8)) == held_out[16:32]  # consecutive, fixed
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    train = ShardedBatches(open_split(info, "train"), 4, 0, 1, seed=3)
    starts = []
    for epoch in (1, 2, 3, 4):
        train.set_epoch(epoch)
        batch_x, batch_y = next(iter(train))
        torch.testing.assert_close(batch_y[:, :-1], batch_x[:, 1:])
        starts.append(train.split._shift[0])
    assert len(set(starts)) > 1 and all(0 <= s < 16 for s in starts)


def test_text_that_is_too_short_or_damaged_is_refused_clearly(corpus, shared_tmp):
    path, _ = corpus
    with pytest.raises(DataError, match="fewer than one window of data.seq_len"):
        inspect(path, seq_len=100_000)
    if RANK == 0:
        broken = shared_tmp / "broken.h5"
        broken.write_bytes(path.read_bytes())
        with h5py.File(broken, "r+") as f:
            f["train/tokens"][5] = (int(f["train/tokens"][5]) + 1) % 256
        with pytest.raises(DataError, match="checksum mismatch"):
            verify([str(broken)])


# ---------------------------------------------------------------------------------------------
# methods on a transformer


@pytest.mark.skipif(SIZE < 2, reason="pools batches of several ranks")
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_dad_on_a_gpt_gives_the_pooled_batch_gradient(world, tie):
    torch.manual_seed(3)
    model = gpt(vocab_size=30, context=8, layers=2, width=16, heads=2, tie_weights=tie)
    generator = torch.Generator().manual_seed(4)
    sizes = [2 + r for r in range(SIZE)]
    x = torch.randint(0, 30, (sum(sizes), 8), generator=generator)
    y = torch.randint(0, 30, (sum(sizes), 8), generator=generator)
    local = slice(sum(sizes[:RANK]), sum(sizes[: RANK + 1]))
    reference = copy.deepcopy(model)
    task.loss(reference(x), y).backward()
    opt = DadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, plan="all")
    task.loss(model(x[local]), y[local]).backward()
    opt.synchronize()
    shared = {name for name, plan in opt.plan.items() if plan.choice == "dad"}
    assert "1.attn.q" in shared and ("3.logits" in shared) != tie  # a tied head is allreduced instead
    scale = max(r.grad.abs().max().item() for r in reference.parameters())
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        # atol: the key bias's true gradient is zero (softmax ignores a shift of every score)
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_sil_refuses_a_language_model_with_the_measured_reason(world):
    from hvd_lowcomm.methods.sil import SIL

    model = gpt(vocab_size=40, context=8, layers=4, width=16, heads=2)
    with pytest.raises(ConfigError, match=r"sil cannot train a language model.*measured: docs: transformers"):
        SIL(model, input_shape=(8,), num_classes=40, partitions=2)  # the library's door, before any cut


@pytest.mark.skipif(SIZE < 2, reason="every method's smoke run on several ranks")
@pytest.mark.parametrize("method", sorted(specs()))
def test_every_method_trains_a_gpt_at_its_defaults_or_refuses_before_training(corpus, shared_tmp, method, capsys):
    skip_where_its_engine_is_not_running(method)
    path, _ = corpus
    argv = [
        "--method",
        method,
        "--data.path",
        str(path),
        "--model.name",
        "gpt",
        "--model.layers",
        "2",
        "--model.width",
        "32",
        "--model.heads",
        "2",
        "--data.seq_len",
        "16",
        "--data.batch_size",
        "8",
        "--train.epochs",
        "1",
        "--train.max_steps",
        "60",
        "--train.lr",
        "0.003",
        "--run.dir",
        str(shared_tmp / "runs"),
        "--run.name",
        f"gpt-{method}",
        "--run.progress",
        "false",
    ]
    code = main(argv)
    refusals = {"edad": "edAD is exact only for", "sil": "sil cannot train a language model"}
    if method in refusals:  # refused with the measured reason, before any training
        assert code == 2
        if RANK == 0:
            assert refusals[method] in capsys.readouterr().err
        return
    assert code == 0
    if RANK == 0:
        summary = json.loads((shared_tmp / "runs" / f"gpt-{method}" / "summary.json").read_text())
        # Uniform guessing over 256 bytes is ln 256 = 5.55 nats; the corpus's bytes alone give ~3.
        assert summary["final_test_loss"] < 4.0, summary
        assert summary["final_perplexity"] == pytest.approx(math.exp(summary["final_test_loss"]))
        assert summary["tokens_per_step_per_rank"] == 8 * 16


def test_the_cost_model_predicts_no_sil_for_a_language_model_and_mp_by_its_tokens():
    from hvd_lowcomm.costmodel import Link, predict, profile_model

    model = gpt(vocab_size=40, context=8, layers=2, width=16, heads=2)
    profile = profile_model(model, (8,), 4, repeats=1, vocabulary=40)
    assert profile.facts["sil"] is None  # refused, as sil refuses to train it
    with pytest.raises(ConfigError, match="sil: cannot train this model"):
        predict(profile, "sil", 4, Link(1e9))
    # mp sends each cut's activations, batch x tokens x width floats, forward and back
    assert profile.facts["mp"].widths == [8 * 16]
