"""The weight layers the framework understands, one registry entry per class of layer.

dAD, rank-dAD and AB-training need the same few facts of a weight layer: its weight as a
d_out × d_in matrix (and back), its input and its output's gradient as rows, and its forward
pass with another weight. A layer class whose weight is a matrix in disguise is one entry here:

    Linear       y = x Wᵀ + b, W stored d_out × d_in
    Conv1D       Hugging Face transformers' GPT-2 projection, y = x W + b with W stored
                 d_in × d_out (a Linear with a transposed weight)
    ConvNd       a kernel C_out × C_in/groups × k… viewed as C_out × (C_in/groups·k…); rows
                 (im2col) only for Conv2d with groups 1 and numeric zero padding

Entries name their class by import path and are matched only once that module is imported, so
the registry never imports `transformers` (a model holding a Conv1D has imported it already).
The next library's layer is one more `register_kind(...)` call.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerKind:
    """How one class of weight layer looks as y = x Wᵀ + b with W a d_out × d_in matrix."""

    name = "?"
    class_path = ""  # "module:ClassName"; matched once the module is imported
    linear = True  # the output is the input's rows times Wᵀ (factors can run without forming W)

    def matches(self, module: nn.Module) -> bool:
        module_name, _, class_name = self.class_path.partition(":")
        loaded = sys.modules.get(module_name)
        cls = getattr(loaded, class_name, None) if loaded is not None else None
        return cls is not None and isinstance(module, cls)

    def matrix(self, module: nn.Module, tensor: torch.Tensor | None = None) -> torch.Tensor:
        """`tensor` (default: the weight; a gradient works too) as the d_out × d_in matrix."""
        tensor = module.weight if tensor is None else tensor
        return tensor.reshape(tensor.shape[0], -1)

    def from_matrix(self, module: nn.Module, matrix: torch.Tensor) -> torch.Tensor:
        """Inverse of `matrix`: a d_out × d_in matrix in the layout of the module's weight."""
        return matrix.reshape(module.weight.shape)

    def shape(self, module: nn.Module) -> tuple[int, int]:
        """(d_out, d_in) of the weight matrix."""
        rows, cols = self.matrix(module, module.weight.detach()).shape
        return rows, cols

    def has_rows(self, module: nn.Module) -> bool:
        """Whether its gradient is exactly Δᵀ A over the rows below (dAD can share them)."""
        return True

    def input_rows(self, module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """The layer's input as rows × d_in."""
        return inputs.reshape(-1, inputs.shape[-1])

    def output_rows(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        """The output (or its gradient) as rows × d_out, rows ordered as in `input_rows`."""
        return output.reshape(-1, output.shape[-1])

    def forward(self, module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The layer's output with `weight` (in the module's own layout) in place of its own."""
        raise NotImplementedError


class LinearKind(LayerKind):
    name, class_path = "Linear", "torch.nn:Linear"

    def forward(self, module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, module.bias)


class TransposedLinearKind(LayerKind):
    """Hugging Face's Conv1D (GPT-2, GPT-J's ancestors): weight nx × nf = d_in × d_out."""

    name, class_path = "Conv1D", "transformers.pytorch_utils:Conv1D"

    def matrix(self, module: nn.Module, tensor: torch.Tensor | None = None) -> torch.Tensor:
        return (module.weight if tensor is None else tensor).T

    def from_matrix(self, module: nn.Module, matrix: torch.Tensor) -> torch.Tensor:
        return matrix.T

    def forward(self, module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight.T, module.bias)


class ConvKind(LayerKind):
    name, linear = "ConvNd", False

    def matches(self, module: nn.Module) -> bool:  # not ConvTransposeNd, whose weight is C_in × C_out/groups × k…
        return isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))

    def has_rows(self, module: nn.Module) -> bool:
        return (
            isinstance(module, nn.Conv2d)
            and module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )

    def input_rows(self, module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """im2col: (sample, output position) rows of unfolded input patches."""
        patches = F.unfold(
            inputs, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride
        )  # N × C_in·kh·kw × L
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])

    def output_rows(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        return output.flatten(2).transpose(1, 2).reshape(-1, output.shape[1])  # N × C × H × W -> (N·H·W) × C

    def forward(self, module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return module._conv_forward(x, weight, module.bias)  # stride, padding (any mode), dilation, groups


KINDS: list[LayerKind] = [LinearKind(), TransposedLinearKind(), ConvKind()]


def register_kind(kind: LayerKind) -> None:
    """Teach every method another class of weight layer (first match wins; later ones are
    tried first, so an entry may refine an earlier one)."""
    KINDS.insert(0, kind)


def kind_of(module: nn.Module) -> LayerKind | None:
    """The registered kind of `module`, or None for anything else (norms, embeddings...)."""
    return next((kind for kind in KINDS if kind.matches(module)), None)


def weight_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every layer of a registered kind, by name, in module order."""
    return {name: m for name, m in model.named_modules() if kind_of(m) is not None}


def shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (tied weights: GPT-2's head and token
    embedding); a method that forms or factorises one module's weight alone cannot own them."""
    uses = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    return {pid for pid, count in uses.items() if count > 1}


def is_tied(module: nn.Module, shared: set[int]) -> bool:
    return id(module.weight) in shared
