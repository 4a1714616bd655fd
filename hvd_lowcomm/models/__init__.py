"""A small model zoo for CPU-size experiments, plus torchvision models with the [vision] extra.

`build_model(cfg.model, input_shape, num_classes, task)`; every model is an `nn.Sequential` (so
partitioning methods can cut it between layers) except torchvision ones. An empty
`cfg.hidden` means the model's own default widths (DEFAULT_HIDDEN). Classifiers: mlp, cnn,
sil6, vit; the language model gpt (hvd_lowcomm.models.transformer) trains on text datasets,
where `input_shape` is (tokens per window,) and `num_classes` the vocabulary.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch.nn as nn

from hvd_lowcomm import task as tasks
from hvd_lowcomm.config import ConfigError, ModelConfig, import_object
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
        raise ConfigError(f"model cnn needs image input (C, H, W); this dataset's input shape is "
                          f"{tuple(input_shape)}: use --model.name mlp")
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
        raise ConfigError(f"model sil6 has six fully connected layers, so --model.hidden takes five widths "
                          f"(e.g. 256,256,256,256,256); got {len(hidden)}: {list(hidden)}")
    return mlp(input_shape, num_classes, hidden, dropout)


ZOO = {"mlp": mlp, "cnn": cnn, "sil6": sil6}
DEFAULT_HIDDEN = {"mlp": [256, 128], "cnn": [32, 64], "sil6": [256] * 5}


def build_model(cfg: ModelConfig, input_shape: Sequence[int], num_classes: int,
                task: str = tasks.CLASSIFY) -> nn.Module:
    """The model `cfg` names for data of `input_shape` and `num_classes` (for a language model,
    `task` "lm": the window length and the vocabulary)."""
    if ":" in cfg.name and not cfg.name.startswith("tv:"):
        return _factory_model(cfg.name, tuple(input_shape), num_classes, cfg.kwargs)
    if cfg.kwargs:
        raise ConfigError(f"model.kwargs is for a 'module:factory' model; {cfg.name} takes --model.hidden and "
                          f"--model.dropout")
    if (cfg.name == "gpt") != (task == tasks.LANGUAGE_MODEL):
        raise ConfigError("gpt is a language model: it trains on a text dataset (python -m data_prep text ...)"
                          if cfg.name == "gpt" else
                          f"this is a text dataset, which trains a language model: use --model.name gpt "
                          f"(model {cfg.name} classifies images or feature vectors)")
    if cfg.name == "gpt":
        return gpt(num_classes, int(input_shape[0]), cfg.layers, cfg.width, cfg.heads, cfg.dropout, cfg.tie_weights)
    if cfg.name == "vit":
        return vit(tuple(input_shape), num_classes, cfg.layers, cfg.width, cfg.heads, cfg.patch_size, cfg.pool,
                   cfg.dropout)
    if cfg.name.startswith("tv:"):
        return _torchvision_model(cfg.name[3:], num_classes)
    if cfg.name not in ZOO:
        raise ConfigError(f"unknown model {cfg.name!r}; available: {', '.join([*ZOO, 'gpt', 'vit'])}, "
                          f"tv:<torchvision name>")
    return ZOO[cfg.name](input_shape, num_classes, cfg.hidden or DEFAULT_HIDDEN[cfg.name], cfg.dropout)


def _factory_model(name: str, input_shape: tuple[int, ...], num_classes: int, kwargs: dict) -> nn.Module:
    """The user's own model: factory(input_shape, num_classes, **kwargs) from an importable module."""
    factory = import_object(name, "model.name")
    factory_name = name.partition(":")[2]
    try:
        model = factory(input_shape, num_classes, **kwargs)
    except TypeError as err:
        raise ConfigError(f"model {name}: calling {factory_name}(input_shape={input_shape}, num_classes={num_classes}"
                          f"{''.join(f', {k}={v!r}' for k, v in kwargs.items())}) failed: {err}") from None
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
