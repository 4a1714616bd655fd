"""Layers whose weight is either dense (W) or a product of low-rank factors (A B), for AB-training.

A Linear or Conv2d weight is viewed as a 2-D matrix (a conv kernel C_out × C_in × kh × kw as
C_out × C_in·kh·kw), transposed if needed so that it is tall (rows >= columns), and split by
SVD: W = U Σ Vᵀ, A = U √Σ (rows × r), B = √Σ Vᵀ (r × columns), so W = A B. The rank r keeps
the singular values σ_i > τ·σ_1; the first factorisation of a run may keep them all.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvd_lowcomm.config import ConfigError


class FactorizedLayer(nn.Module):
    """Wraps a Linear or Conv2d. In dense mode it is the original layer; after `factorize` its
    forward uses W = A B until `densify` writes A B back into the dense weight."""

    def __init__(self, layer: nn.Linear | nn.Conv2d) -> None:
        super().__init__()
        if isinstance(layer, nn.Conv2d) and (layer.groups != 1 or layer.padding_mode != "zeros"):
            raise ConfigError("AB-training factorises Conv2d layers with groups=1 and zero padding only")
        self.layer = layer
        rows, cols = layer.weight.shape[0], layer.weight[0].numel()
        self.transposed = rows < cols  # factorise the tall orientation
        self.tall_shape = (cols, rows) if self.transposed else (rows, cols)
        self.A = nn.Parameter(layer.weight.new_zeros(0, 0))
        self.B = nn.Parameter(layer.weight.new_zeros(0, 0))
        self.factorized = False

    @property
    def rank(self) -> int:
        """Rank of the latest factorisation (kept through dense phases), or full before the first."""
        return self.A.shape[1] if self.A.numel() else min(self.tall_shape)

    def tall_matrix(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as the tall 2-D matrix that is factorised."""
        w = (self.layer.weight if weight is None else weight).detach().reshape(self.layer.weight.shape[0], -1)
        return w.T if self.transposed else w

    def weight_from_tall(self, tall: torch.Tensor) -> torch.Tensor:
        """Inverse of tall_matrix: back to the layer's own weight shape."""
        return (tall.T if self.transposed else tall).reshape(self.layer.weight.shape)

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.linalg.svd(self.tall_matrix(), full_matrices=False)

    def factorize(self, tau: float, truncate: bool, rank: int | None = None,
                  svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> int:
        """Split the dense weight into A, B by SVD (`svd`: one already computed). Returns the
        rank kept: `rank` if given (all ranks agreeing on one), else every σ_i > τ σ_1 when
        truncating, else all of them."""
        u, s, vh = svd if svd is not None else self.svd()
        r = rank if rank is not None else (rank_for(s, tau) if truncate else len(s))
        r = max(1, min(r, len(s)))
        root = s[:r].sqrt()
        self.A.data = (u[:, :r] * root).contiguous()
        self.B.data = (root[:, None] * vh[:r]).contiguous()
        self.factorized = True
        return r

    def densify(self) -> None:
        """W = A B into the dense weight; forward uses W again."""
        with torch.no_grad():
            self.layer.weight.copy_(self.weight_from_tall(self.A @ self.B))
        self.factorized = False

    def weight(self) -> torch.Tensor:
        return self.weight_from_tall(self.A @ self.B) if self.factorized else self.layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, weight = self.layer, self.weight()
        if isinstance(layer, nn.Linear):
            return F.linear(x, weight, layer.bias)
        return F.conv2d(x, weight, layer.bias, layer.stride, layer.padding, layer.dilation, layer.groups)


def rank_for(singular_values: torch.Tensor, tau: float) -> int:
    """How many σ_i > τ·σ_1 (at least 1)."""
    return max(1, int((singular_values > tau * singular_values[0]).sum().item()))


def factorize_model(model: nn.Module, full_rank: list[str]) -> dict[str, FactorizedLayer]:
    """Replace every Linear/Conv2d except those named in `full_rank` by a FactorizedLayer (still
    dense until factorised). "first" and "last" name the first and last such layer in module
    order (the reference keeps the first conv and the classifier head dense)."""
    candidates = [name for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    if not candidates:
        raise ConfigError("AB-training needs Linear or Conv2d layers to factorise; this model has none")
    keep = set()
    for name in full_rank:
        if name in ("first", "last"):
            keep.add(candidates[0] if name == "first" else candidates[-1])
        elif name in candidates:
            keep.add(name)
        else:
            raise ConfigError(f"ab.full_rank names layer {name!r}, which is not a Linear/Conv2d of this model "
                              f"(its layers: {', '.join(candidates)}; or use first, last)")
    factorized = {}
    for name in candidates:
        if name in keep:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        factorized[name] = FactorizedLayer(getattr(parent, child))
        setattr(parent, child, factorized[name])
    if not factorized:
        raise ConfigError(f"every factorisable layer ({', '.join(candidates)}) is in ab.full_rank; "
                          "nothing is left to train as A and B: use a deeper model or a shorter ab.full_rank")
    return factorized
