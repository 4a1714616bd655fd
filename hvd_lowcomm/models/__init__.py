"""Model families, one registry: a small zoo for CPU-size experiments, torchvision models with
the [vision] extra, Hugging Face models from local files with the [hf] extra.

`build_model(cfg.model, input_shape, num_classes, task)` finds the family --model.name names
(`FAMILIES`; `register_family` adds one) and builds it for the dataset. Zoo models are
`nn.Sequential` (so partitioning methods can cut them between layers); an empty `cfg.hidden`
means the model's own default widths (DEFAULT_HIDDEN). Classifiers: mlp, cnn, sil6, vit,
tv:NAME; language models: gpt (hvd_lowcomm.models.transformer) and hf:PATH
(hvd_lowcomm.models.huggingface), trained on text datasets, where `input_shape` is (tokens per
window,) and `num_classes` the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch.nn as nn

from hvd_lowcomm import task as tasks
from hvd_lowcomm.config import ConfigError, ModelConfig, import_object
from hvd_lowcomm.models import huggingface
from hvd_lowcomm.models.transformer import gpt, vit


def mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], dropout: float = 0.0) -> nn.Sequential:
    """Flatten, then Linear-ReLU(-Dropout) per hidden width, then a Linear classifier head."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], dropout: float = 0.0) -> nn.Sequential:
    """Conv3x3-BN-ReLU blocks (one per entry of `hidden`, channels), 2x2 max-pool after each
    while the image is at least 4 pixels wide, global average pool, Linear head."""
    if len(input_shape) != 3:
        raise ConfigError(
            f"model cnn needs image input (C, H, W); this dataset's input shape is "
            f"{tuple(input_shape)}: use --model.name mlp"
        )
    channels, height, _ = input_shape
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Conv2d(channels, h, 3, padding=1, bias=False), nn.BatchNorm2d(h), nn.ReLU()]
        if height >= 4:
            layers.append(nn.MaxPool2d(2))
            height //= 2
        channels = h
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(channels, num_classes))
    return nn.Sequential(*layers)


def sil6(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], dropout: float = 0.0) -> nn.Sequential:
    """The SIL paper's network: six fully connected layers (five hidden widths). Cut in two, each
    side keeps at least two weight layers with a non-linearity between them, which SIL needs."""
    if len(hidden) != 5:
        raise ConfigError(
            f"model sil6 has six fully connected layers, so --model.hidden takes five widths "
            f"(e.g. 256,256,256,256,256); got {len(hidden)}: {list(hidden)}"
        )
    return mlp(input_shape, num_classes, hidden, dropout)


@dataclass(frozen=True)
class ModelFamily:
    """A name (or a `prefix:` with a path or name after it) that --model.name accepts: how to
    build it for a dataset, and which task it trains."""

    name: str
    build: Callable[[ModelConfig, str, tuple[int, ...], int, str], nn.Module]  # (cfg, argument, shape, classes, task)
    tasks: tuple[str, ...]
    help: str
    prefix: bool = False  # "hf:PATH": the rest of the name is the argument


FAMILIES: dict[str, ModelFamily] = {}
DEFAULT_HIDDEN = {"mlp": [256, 128], "cnn": [32, 64], "sil6": [256] * 5}


def register_family(family: ModelFamily) -> None:
    FAMILIES[family.name] = family


def _zoo(factory: Callable[..., nn.Module], name: str) -> Callable[..., nn.Module]:
    def build(cfg: ModelConfig, _: str, shape: tuple[int, ...], classes: int, task: str) -> nn.Module:
        return factory(shape, classes, cfg.hidden or DEFAULT_HIDDEN[name], cfg.dropout)

    return build


CLASSIFIERS, LANGUAGE_MODELS, ANY = (tasks.CLASSIFY,), (tasks.LANGUAGE_MODEL,), (tasks.CLASSIFY, tasks.LANGUAGE_MODEL)
for _family in (
    ModelFamily("mlp", _zoo(mlp, "mlp"), CLASSIFIERS, "an MLP (model.hidden widths)"),
    ModelFamily("cnn", _zoo(cnn, "cnn"), CLASSIFIERS, "a small CNN for images (model.hidden channels)"),
    ModelFamily("sil6", _zoo(sil6, "sil6"), CLASSIFIERS, "the SIL paper's six fully connected layers"),
    ModelFamily(
        "gpt",
        lambda c, _, shape, classes, t: gpt(
            classes, int(shape[0]), c.layers, c.width, c.heads, c.dropout, c.tie_weights
        ),
        LANGUAGE_MODELS,
        "a decoder-only language model for text datasets",
    ),
    ModelFamily(
        "vit",
        lambda c, _, shape, classes, t: vit(
            shape, classes, c.layers, c.width, c.heads, c.patch_size, c.pool, c.dropout
        ),
        CLASSIFIERS,
        "a vision transformer",
    ),
    ModelFamily(
        "tv",
        lambda c, name, shape, classes, t: _torchvision_model(name, classes),
        CLASSIFIERS,
        "tv:NAME, a torchvision model (the [vision] extra)",
        prefix=True,
    ),
    ModelFamily(
        "hf",
        lambda c, path, shape, classes, t: huggingface.build(path, shape, classes, t),
        ANY,
        "hf:PATH, a Hugging Face model from a local config.json or pretrained directory (the [hf] extra)",
        prefix=True,
    ),
):
    register_family(_family)


def family_of(name: str) -> tuple[ModelFamily | None, str]:
    """(the registered family, its argument) of a --model.name; (None, name) for 'module:factory'."""
    head, colon, rest = name.partition(":")
    family = FAMILIES.get(head)
    if family is not None and family.prefix == bool(colon):
        return family, rest
    return None, name


def build_model(
    cfg: ModelConfig, input_shape: Sequence[int], num_classes: int, task: str = tasks.CLASSIFY
) -> nn.Module:
    """The model `cfg` names for data of `input_shape` and `num_classes` (for a language model,
    `task` "lm": the window length and the vocabulary)."""
    family, argument = family_of(cfg.name)
    if family is None and ":" in cfg.name:
        return _factory_model(cfg.name, tuple(input_shape), num_classes, cfg.kwargs)
    if family is None:
        raise ConfigError(
            f"unknown model {cfg.name!r}; available: "
            + "; ".join(f"{f.name + (':...' if f.prefix else '')} ({f.help})" for f in FAMILIES.values())
            + "; or your own 'module:factory'"
        )
    if cfg.kwargs:
        raise ConfigError(f"model.kwargs is for a 'module:factory' model; {cfg.name} does not take it")
    if task not in family.tasks:
        raise ConfigError(
            f"{cfg.name} is a language model: it trains on a text dataset (python -m data_prep text ...)"
            if task == tasks.CLASSIFY
            else f"this is a text dataset, which trains a language model: use --model.name gpt or "
            f"hf:PATH (model {cfg.name} classifies images or feature vectors)"
        )
    return family.build(cfg, argument, tuple(input_shape), num_classes, task)


def _factory_model(name: str, input_shape: tuple[int, ...], num_classes: int, kwargs: dict) -> nn.Module:
    """The user's own model: factory(input_shape, num_classes, **kwargs) from an importable module."""
    factory = import_object(name, "model.name")
    factory_name = name.partition(":")[2]
    try:
        model = factory(input_shape, num_classes, **kwargs)
    except TypeError as err:
        raise ConfigError(
            f"model {name}: calling {factory_name}(input_shape={input_shape}, num_classes={num_classes}"
            f"{''.join(f', {k}={v!r}' for k, v in kwargs.items())}) failed: {err}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {name}: {factory_name}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _torchvision_model(name: str, num_classes: int) -> nn.Module:
    try:
        import torchvision
    except Exception as err:  # ImportError, or a torchvision built for another torch
        raise ConfigError(f"model tv:{name} needs torchvision: pip install 'hvd_lowcomm[vision]' ({err})") from None
    try:
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError as err:
        raise ConfigError(f"torchvision has no model {name!r}: {err}") from None
