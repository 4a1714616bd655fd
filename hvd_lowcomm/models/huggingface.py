"""Hugging Face `transformers` models from local files: `--model.name hf:PATH`.

PATH is one of
  * a JSON config file (`config.json` as `save_pretrained` writes it, or one of your own with
    a `model_type`): the architecture with random weights, nothing downloaded;
  * a directory holding `config.json`: the same, or, when it also holds weights
    (`model.safetensors`, `pytorch_model.bin`, sharded indexes), the pretrained model loaded
    from them (`from_pretrained(..., local_files_only=True)`).

A text dataset trains a causal language model (AutoModelForCausalLM), an image dataset an image
classifier (AutoModelForImageClassification, its head sized to the dataset's classes). What
the model cannot take is refused before training: a vocabulary smaller than the dataset's
token ids, a context shorter than data.seq_len, an image size or channel count it was not
configured for. Needs the `[hf]` extra (pip install 'hvd_lowcomm[hf]').
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch.nn as nn

from hvd_lowcomm import task as tasks
from hvd_lowcomm.config import ConfigError

PREFIX = "hf:"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Where configs keep the context length, by family.
CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length")


def build(path_text: str, input_shape: Sequence[int], num_classes: int, task: str) -> nn.Module:
    """The model PATH describes, for a dataset of `input_shape` samples and `num_classes`
    classes (a text dataset: windows of input_shape[0] tokens and its vocabulary)."""
    transformers = _import_transformers()
    path = Path(path_text).expanduser()
    config, pretrained = _config(transformers, path)
    if task == tasks.LANGUAGE_MODEL:
        _check_language_model(config, path, int(input_shape[0]), num_classes)
        auto = transformers.AutoModelForCausalLM
    else:
        _check_image_classifier(config, path, tuple(input_shape))
        config.num_labels = num_classes
        auto = transformers.AutoModelForImageClassification
    try:
        if pretrained:
            return auto.from_pretrained(
                path, config=config, local_files_only=True, ignore_mismatched_sizes=task != tasks.LANGUAGE_MODEL
            )
        return auto.from_config(config)
    except ValueError as err:  # a config this auto class has no model for
        kind = "causal language model" if task == tasks.LANGUAGE_MODEL else "image classifier"
        raise ConfigError(
            f"model hf:{path}: transformers has no {kind} for model_type {config.model_type!r} "
            f"({err}); a text dataset needs a causal LM config, an image dataset an image "
            f"classification config"
        ) from None


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ConfigError(
            f"model hf:... needs Hugging Face transformers: pip install 'hvd_lowcomm[hf]' ({err})"
        ) from None
    transformers.logging.set_verbosity_error()  # per-rank warnings would repeat np times
    return transformers


def _config(transformers: Any, path: Path) -> tuple[Any, bool]:
    """(the model's config, whether pretrained weights sit beside it)."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model hf:{path}: the directory has no config.json (save_pretrained writes one)")
        pretrained = any((path / name).is_file() for name in WEIGHT_FILES)
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True), pretrained
    if not path.is_file():
        raise ConfigError(
            f"model hf:{path} does not exist: give a config.json file or a directory holding one "
            f"(models are never downloaded here)"
        )
    try:
        values = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"model hf:{path} is not a JSON config: {err}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ConfigError(
            f"model hf:{path}: a config needs a model_type (gpt2, llama, vit, ...), as save_pretrained writes it"
        )
    values = dict(values)
    try:
        return transformers.AutoConfig.for_model(values.pop("model_type"), **values), False
    except ValueError as err:
        raise ConfigError(f"model hf:{path}: {err}") from None


def _check_language_model(config: Any, path: Path, seq_len: int, vocabulary: int) -> None:
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab < vocabulary:
        raise ConfigError(
            f"model hf:{path} embeds {vocab} token ids, but the dataset's vocabulary has {vocabulary}: "
            f"prepare the data with the model's own tokenizer (python -m data_prep text --tokenizer "
            f"PATH/tokenizer.json) or raise vocab_size in the config"
        )
    context = next((getattr(config, key) for key in CONTEXT_KEYS if getattr(config, key, None)), None)
    if context is not None and context < seq_len:
        raise ConfigError(
            f"model hf:{path} takes at most {context} positions, shorter than data.seq_len {seq_len}: "
            f"use --data.seq_len {context} or less"
        )


def _check_image_classifier(config: Any, path: Path, input_shape: tuple[int, ...]) -> None:
    if len(input_shape) != 3:
        raise ConfigError(
            f"model hf:{path} is an image classifier here, but the dataset's samples have shape "
            f"{input_shape}, not (channels, height, width)"
        )
    channels, height, width = input_shape
    size = getattr(config, "image_size", None)
    sizes = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
    if size is not None and sizes != (height, width):
        raise ConfigError(
            f"model hf:{path} is configured for {sizes[0]}x{sizes[1]} images, the dataset's are "
            f"{height}x{width}: set image_size {height} in the config"
        )
    if getattr(config, "num_channels", channels) != channels:
        raise ConfigError(
            f"model hf:{path} takes {config.num_channels}-channel images, the dataset's have "
            f"{channels}: set num_channels {channels} in the config"
        )
