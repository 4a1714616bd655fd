"""Transformers (gpt, vit): shapes, refusals and options checked without ranks."""

from __future__ import annotations

import math

import pytest
import torch

from hvd_lowcomm import task
from hvd_lowcomm.config import ConfigError, ModelConfig
from hvd_lowcomm.models import build_model
from hvd_lowcomm.models.transformer import gpt, vit


def test_gpt_is_causal_and_predicts_every_position():
    torch.manual_seed(0)
    model = gpt(vocab_size=50, context=12, layers=2, width=32, heads=4).eval()
    ids = torch.randint(0, 50, (3, 12))
    logits = model(ids)
    assert logits.shape == (3, 12, 50)
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 50  # the future of position 6
    after = model(changed)
    torch.testing.assert_close(after[:, :7], logits[:, :7])
    assert (after[:, 7:] - logits[:, 7:]).abs().max() > 1e-3


def test_gpt_initialisation_follows_nanogpt_and_ties_on_request():
    torch.manual_seed(0)
    model = gpt(vocab_size=256, context=16, layers=4, width=128, heads=4)
    assert model[1].attn.q.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model[1].attn.out.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)  # residual
    assert model[1].mlp[2].weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)
    assert model[1].attn.q.bias.abs().max() == 0
    tied = gpt(vocab_size=256, context=16, layers=1, width=32, heads=4, tie_weights=True)
    assert tied[-1].logits.weight is tied[0].tokens.weight


def test_vit_classifies_images_by_class_token_or_mean():
    for pool in ("cls", "mean"):
        model = vit((1, 28, 28), 10, layers=2, width=32, heads=4, patch=7, pool=pool)
        assert model(torch.randn(5, 1, 28, 28)).shape == (5, 10)
        assert model[0].positions.shape[1] == 16 + (pool == "cls")
    with pytest.raises(ConfigError, match="patch size 5 does not divide"):
        vit((1, 28, 28), 10, patch=5)
    with pytest.raises(ConfigError, match="not a multiple of model.heads"):
        vit((1, 28, 28), 10, width=30, heads=4)


def test_the_zoo_pairs_gpt_with_text_and_classifiers_with_samples():
    assert isinstance(
        build_model(ModelConfig(name="gpt", layers=1, width=16, heads=2), (8,), 256, task.LANGUAGE_MODEL)[0],
        torch.nn.Module,
    )
    with pytest.raises(ConfigError, match="use --model.name gpt"):
        build_model(ModelConfig(name="mlp"), (8,), 256, task.LANGUAGE_MODEL)
    with pytest.raises(ConfigError, match="trains on a text dataset"):
        build_model(ModelConfig(name="gpt"), (1, 28, 28), 10, task.CLASSIFY)


def test_loss_and_accuracy_count_every_position_and_lm_figures_follow_from_the_loss():
    logits = torch.randn(4, 6, 11)
    y = torch.randint(0, 11, (4, 6))
    flat = torch.nn.functional.cross_entropy(logits.reshape(24, 11), y.reshape(24))
    torch.testing.assert_close(task.loss(logits, y), flat)
    torch.testing.assert_close(task.loss(logits, y, reduction="sum"), 24 * flat)
    assert task.positions(y) == 24
    assert task.correct(logits, y) == int((logits.argmax(-1) == y).sum())
    figures = task.language_model_figures(2.0, bytes_per_token=2.0)
    assert figures["perplexity"] == pytest.approx(math.exp(2.0))
    assert figures["bits_per_byte"] == pytest.approx(2.0 / math.log(2) / 2.0)
