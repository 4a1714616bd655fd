"""Transformers for the zoo: `gpt` (a decoder-only language model) and `vit` (a vision
transformer), both an `nn.Sequential` of [embedding, block, ..., block, head].

Every learned matrix is an ordinary `nn.Linear` (the attention's q, k, v and output
projections included; `F.scaled_dot_product_attention` forms the product), so each method sees
the layers it knows: dAD shares their rows (a row is a token), AB factorises them, PowerSGD
compresses their gradients; and partitioned methods (SIL, mp) cut the Sequential between blocks.

The block is pre-LayerNorm (GPT-2, nanoGPT, ViT): x + attn(ln(x)), then x + mlp(ln(x)), with a
GELU MLP four times as wide. Initialisation as nanoGPT's: weights N(0, 0.02), biases zero, the
two projections back into the residual stream N(0, 0.02/√(2·layers)) so the stream's variance
does not grow with depth; ViT's class token and positions N(0, 0.02) as in the ViT paper.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvd_lowcomm.config import ConfigError


class SelfAttention(nn.Module):
    """Multi-head self-attention from four Linear layers (causal for a language model)."""

    def __init__(self, width: int, heads: int, causal: bool, dropout: float) -> None:
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = (
            proj(x).view(b, t, self.heads, width // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).reshape(b, t, width))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention, then a GELU MLP, each added to the stream."""

    def __init__(self, width: int, heads: int, causal: bool, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, causal, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TokenEmbedding(nn.Module):
    """Token ids [B, T] -> token embedding + learned position embedding [B, T, width]."""

    def __init__(self, vocab_size: int, context: int, width: int, dropout: float) -> None:
        super().__init__()
        self.vocab_size, self.context = vocab_size, context
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"a window of {t} tokens is longer than the model's context of {self.context}")
        return self.drop(self.tokens(ids) + self.positions(torch.arange(t, device=ids.device)))


class LanguageModelHead(nn.Module):
    """Final LayerNorm, then the logits of the next token at every position."""

    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.logits = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.ln(x))


class PatchEmbedding(nn.Module):
    """Image [B, C, H, W] -> patch tokens [B, (1 +) patches, width]: each p×p patch flattened and
    projected by a Linear (the ViT paper's linear projection; the same as a stride-p conv), a
    class token prepended when pooling by it, learned positions added."""

    def __init__(self, input_shape: tuple[int, ...], patch: int, width: int, class_token: bool, dropout: float) -> None:
        super().__init__()
        channels, height, width_px = input_shape
        if height % patch or width_px % patch:
            raise ConfigError(
                f"model vit: patch size {patch} does not divide the {height}x{width_px} images; "
                f"give --model.patch_size a divisor of both (e.g. {math.gcd(height, width_px)})"
            )
        self.patch = patch
        self.project = nn.Linear(channels * patch * patch, width)
        self.class_token = nn.Parameter(torch.zeros(1, 1, width)) if class_token else None
        count = (height // patch) * (width_px // patch) + (1 if class_token else 0)
        self.positions = nn.Parameter(torch.zeros(1, count, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch
        patches = F.unfold(images, p, stride=p).transpose(1, 2)  # B × patches × C·p·p
        x = self.project(patches)
        if self.class_token is not None:
            x = torch.cat([self.class_token.expand(len(x), -1, -1), x], dim=1)
        return self.drop(x + self.positions)


class ClassifierHead(nn.Module):
    """Final LayerNorm, then the class token's (or the mean token's) logits."""

    def __init__(self, width: int, num_classes: int, pool: str) -> None:
        super().__init__()
        self.pool = pool
        self.ln = nn.LayerNorm(width)
        self.logits = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln(x)
        return self.logits(x[:, 0] if self.pool == "cls" else x.mean(dim=1))


def _check(width: int, heads: int, layers: int) -> None:
    if width % heads:
        raise ConfigError(
            f"model.width {width} is not a multiple of model.heads {heads}: each head takes width/heads channels"
        )
    if layers < 1:
        raise ConfigError(f"model.layers must be at least 1, got {layers}")


def _initialise(model: nn.Sequential, layers: int) -> nn.Sequential:
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith("attn.out") or name.endswith("mlp.2")
            nn.init.normal_(module.weight, 0.0, 0.02 / math.sqrt(2 * layers) if residual else 0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    for parameter in (getattr(model[0], "class_token", None), getattr(model[0], "positions", None)):
        if isinstance(parameter, nn.Parameter):
            nn.init.normal_(parameter, 0.0, 0.02)
    return model


def gpt(
    vocab_size: int,
    context: int,
    layers: int = 4,
    width: int = 128,
    heads: int = 4,
    dropout: float = 0.0,
    tie_weights: bool = False,
) -> nn.Sequential:
    """A decoder-only language model: token ids [B, T] -> next-token logits [B, T, vocab_size].
    `tie_weights` makes the output layer share the token embedding's matrix (GPT-2)."""
    _check(width, heads, layers)
    model = nn.Sequential(
        TokenEmbedding(vocab_size, context, width, dropout),
        *(Block(width, heads, True, dropout) for _ in range(layers)),
        LanguageModelHead(width, vocab_size),
    )
    _initialise(model, layers)
    if tie_weights:
        model[-1].logits.weight = model[0].tokens.weight
    return model


def vit(
    input_shape: tuple[int, ...],
    num_classes: int,
    layers: int = 4,
    width: int = 128,
    heads: int = 4,
    patch: int = 4,
    pool: str = "cls",
    dropout: float = 0.0,
) -> nn.Sequential:
    """A vision transformer: images [B, C, H, W] -> class logits [B, num_classes]."""
    if len(input_shape) != 3:
        raise ConfigError(f"model vit needs image input (C, H, W); this dataset's input shape is {tuple(input_shape)}")
    _check(width, heads, layers)
    model = nn.Sequential(
        PatchEmbedding(tuple(input_shape), patch, width, pool == "cls", dropout),
        *(Block(width, heads, False, dropout) for _ in range(layers)),
        ClassifierHead(width, num_classes, pool),
    )
    return _initialise(model, layers)
