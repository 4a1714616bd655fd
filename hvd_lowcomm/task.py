"""What a model is trained to predict, in one place: a class per sample (image classification)
or a class per position (a language model's next token at every position of a window).

Both are the same loss: cross-entropy over the last dimension of the logits, averaged over
every labelled position (samples, or samples × tokens). Every method and the loop call these
instead of F.cross_entropy, so a method written for classifiers trains a language model
unchanged: logits [B, C] with labels [B], or [B, T, V] with labels [B, T].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

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
    return {
        "perplexity": math.exp(min(loss_per_token, 700.0)),
        "bits_per_byte": loss_per_token / math.log(2) / bytes_per_token,
    }


def logits(output: Any) -> torch.Tensor:
    """The logits in what a model returned: a tensor; a Hugging Face `ModelOutput`, a mapping
    or any object with `logits`; or a tuple/list whose first element is a tensor (the logits,
    as models called without labels return them)."""
    if torch.is_tensor(output):
        return output
    found = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if torch.is_tensor(found):
        return found
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    raise TypeError(
        f"the model returned {type(output).__name__}, which holds no logits: hvd_lowcomm reads a "
        f"tensor, an object or mapping with 'logits' (a Hugging Face ModelOutput), or a tuple whose "
        f"first element is the logits"
    )


def example_input(
    batch: int, input_shape: tuple[int, ...], vocabulary: int | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A random batch shaped like the dataset's samples: token ids below `vocabulary` for a text
    dataset (a DatasetInfo's `vocabulary`), else standard normal values."""
    if vocabulary is not None:
        return torch.randint(0, vocabulary, (batch, *input_shape), generator=generator)
    return torch.randn(batch, *input_shape, generator=generator)
