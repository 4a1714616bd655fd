"""What a model is trained to predict, in one place: a class per sample (image classification)
or a class per position (a language model's next token at every position of a window).

Both are the same loss: cross-entropy over the last dimension of the logits, averaged over
every labelled position (samples, or samples × tokens). Every method and the loop call these
instead of F.cross_entropy, so a method written for classifiers trains a language model
unchanged: logits [B, C] with labels [B], or [B, T, V] with labels [B, T].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CLASSIFY, LANGUAGE_MODEL = "classify", "lm"


def loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of every labelled position (mean or sum over all of them)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction=reduction)


def correct(logits: torch.Tensor, y: torch.Tensor) -> int:
    """Positions whose most likely class is the label."""
    return int((logits.argmax(dim=-1) == y).sum().item())


def positions(y: torch.Tensor) -> int:
    """Labelled positions in a batch: samples, or samples × tokens."""
    return y.numel()


def language_model_figures(loss_per_token: float, bytes_per_token: float) -> dict[str, float]:
    """Perplexity (e^loss) and bits per byte (loss in bits spread over the text bytes a token
    stands for: 1 byte per token for a byte-level vocabulary), the figures language models
    are compared by."""
    return {"perplexity": math.exp(min(loss_per_token, 700.0)),
            "bits_per_byte": loss_per_token / math.log(2) / bytes_per_token}


def example_input(model: torch.nn.Module, batch: int, input_shape: tuple[int, ...],
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A random batch `model` accepts: token ids below its vocabulary for a model that reads
    tokens (its first module has `vocab_size`), else standard normal values."""
    vocab = _vocabulary(model)
    if vocab is not None:
        return torch.randint(0, vocab, (batch, *input_shape), generator=generator)
    return torch.randn(batch, *input_shape, generator=generator)


def _vocabulary(model: torch.nn.Module) -> int | None:
    first = next(iter(model.children()), model)
    return getattr(first, "vocab_size", getattr(model, "vocab_size", None))


def label_dims(model: torch.nn.Module) -> int:
    """Dimensions of one sample's label for `model`: 1 (a class at every position) for a model
    that reads tokens (the zoo's language model), else 0 (a class per sample)."""
    return 0 if _vocabulary(model) is None else 1
