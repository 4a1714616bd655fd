"""Layers whose weight is either dense (W) or a product of low-rank factors (A B), for AB-training.

A weight layer of a registered kind (hvd_lowcomm.models.layer_kinds: Linear, Hugging Face's
Conv1D, ConvNd) is viewed as its d_out × d_in matrix (a conv kernel C_out × C_in/groups × k… as
C_out × C_in/groups·k…, the reference implementation's reshape; a Conv1D's stored d_in × d_out
weight transposed), transposed if needed so that it is tall (rows >= columns), and split by SVD: W
= U Σ Vᵀ, A = U √Σ (rows × r), B = √Σ Vᵀ
(r × columns), so W = A B.

How many singular values to keep (`choose_rank`):
  * rule "noise" (default): those above the edge of the random bulk. A layer trained from a
    random initialisation is a few learned directions on top of a bulk of singular values that
    the initialisation left (Marchenko–Pastur shaped); the bulk is what a cut should drop.
    Its edge is estimated from the median singular value by Gavish & Donoho's optimal hard
    threshold ω(β)·median(σ) (β = columns/rows), which needs no noise level and does not move
    when one direction grows large. The edge is measured while the bulk is there (the first
    factorisation) and kept: after a cut the median falls into the dropped, near-zero part of
    the spectrum, and the few full-rank steps since add small, structured updates (Adam's),
    not a new bulk; later cuts use the larger of the kept edge and the current estimate;
  * rule "tau": σ_i > τ·σ_1, the reference's rule. One outlier σ_1 (a large learning rate
    makes them) moves the cut into the learned directions and breaks the model;
and in both cases no fewer than the floor: the cut may drop at most `max_output_error` of the
layer's output on real inputs (relative Frobenius norm of X Wᵀ, X a batch of the layer's
inputs), or of the weight itself where no inputs were recorded.

The full SVD of an n×n weight costs O(n³) (a 1024² weight 0.27 s, a 2048² one 1.5 s on two
cores), at every re-factorisation on every rank. After a cut, though, W is the kept rank-r
product plus a few full-rank steps' updates, and the next cut lands near r: `spectrum(leading=r)`
then finds the leading ~2r triplets by a randomized range finder with power iterations
(Halko, Martinsson & Tropp 2011; tens of milliseconds) and keeps the rest R = W - U Σ Vᵀ, so
that what a cut drops is still computed exactly: ‖R‖ is part of every tail. The answer matches
the full SVD's wherever it is used: a cut needing more than the trusted leading triplets
computes more (`Spectrum.trusted`), and the noise rule's median, which lies in the uncomputed
part, is bounded by ‖R‖_F/√(i - q) (at least i - q singular values of R are not below the
i-th of W); when that bound could move the threshold above the kept edge, the full SVD is taken.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.models.layer_kinds import is_tied, kind_of, shared_weights

RANK_RULES = ("noise", "tau")
# A randomized spectrum is taken only while it is this small a share of the full one: beyond
# it the power iterations cost about what the SVD does and the leading triplets blur.
MAX_LEADING_SHARE = 0.25
POWER_ITERATIONS = 2


@dataclass
class Spectrum:
    """Leading singular triplets of a tall weight W = U diag(s) Vh + R: all of them (R = 0), or
    the first len(s) from a randomized range finder, with R the part of W outside their span."""

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor
    residual: torch.Tensor | None = None  # None: the whole spectrum
    trusted: int = 0  # leading triplets accurate enough to cut at (all of them when complete)

    @property
    def complete(self) -> bool:
        return self.residual is None

    def weight_energy(self) -> torch.Tensor:
        """σ_i² per triplet and, last, the energy of R: what each part of W holds (sums to ‖W‖²)."""
        rest = self.s.new_zeros(1) if self.complete else self.residual.square().sum().reshape(1)
        return torch.cat([self.s.square(), rest])

    def median_bound(self, shape: tuple[int, int]) -> float:
        """The median singular value of W: exact when complete, else an upper bound from ‖R‖."""
        if self.complete:
            return float(self.s.median())
        k = min(shape)
        median_index = k - (k - 1) // 2  # torch.median's (lower) median, counted from the largest
        return float(self.residual.norm()) / max(1, median_index - len(self.s)) ** 0.5


class FactorizedLayer(nn.Module):
    """Wraps a weight layer of a registered kind. In dense mode it is the original layer; after
    `factorize` its forward uses W = A B until `densify` writes A B back into the dense weight."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.kind = kind_of(layer)
        if self.kind is None:
            raise ConfigError(
                f"AB-training factorises Linear, Hugging Face Conv1D and Conv1d/2d/3d layers, not "
                f"{type(layer).__name__}"
            )
        self.layer = layer
        rows, cols = self.kind.shape(layer)
        self.transposed = rows < cols  # factorise the tall orientation
        self.tall_shape = (cols, rows) if self.transposed else (rows, cols)
        self.A = nn.Parameter(layer.weight.new_zeros(0, 0))
        self.B = nn.Parameter(layer.weight.new_zeros(0, 0))
        self.factorized = False
        self.inputs: torch.Tensor | None = None  # rows of this layer's input, when recorded
        self.noise_edge: float | None = None  # the random bulk's edge, from the first factorisation

    @property
    def rank(self) -> int:
        """Rank of the latest factorisation (kept through dense phases), or full before the first."""
        return self.A.shape[1] if self.A.numel() else min(self.tall_shape)

    @property
    def full_size(self) -> int:
        return self.layer.weight.numel()

    def factor_size(self, rank: int | None = None) -> int:
        """Parameters in A and B at `rank` (default: the current one)."""
        return (self.rank if rank is None else rank) * sum(self.tall_shape)

    def tall_matrix(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as the tall 2-D matrix that is factorised, in float32 (SVD and QR take no
        bfloat16; the factors go back in the weight's dtype)."""
        w = self.kind.matrix(self.layer, (self.layer.weight if weight is None else weight).detach()).float()
        return w.T if self.transposed else w

    def weight_from_tall(self, tall: torch.Tensor) -> torch.Tensor:
        """Inverse of tall_matrix: back to the layer's own weight layout."""
        return self.kind.from_matrix(self.layer, tall.T if self.transposed else tall)

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full SVD of the tall matrix with a canonical sign (each left singular vector's largest
        entry positive): ranks holding the same W get the same A and B, which averaging
        factors across ranks needs."""
        return _canonical_signs(*torch.linalg.svd(self.tall_matrix(), full_matrices=False))

    def spectrum(self, leading: int | None = None) -> Spectrum:
        """The SVD a cut needs: complete, or (`leading`: the rank the cut is expected near) the
        leading triplets only, when they are a small share of the spectrum and the noise rule's
        threshold cannot depend on the rest (see the module docstring)."""
        k = min(self.tall_shape)
        width = None if leading is None else 2 * leading + 16  # half of it oversampling
        if width is None or self.noise_edge is None or width > MAX_LEADING_SHARE * k:
            return Spectrum(*self.svd(), trusted=k)
        w = self.tall_matrix()
        u, s, vh = leading_svd(w, width)
        partial = Spectrum(u, s, vh, residual=w - (u * s) @ vh, trusted=leading + 8)
        if gavish_donoho_omega(k / max(self.tall_shape)) * partial.median_bound(self.tall_shape) > self.noise_edge:
            return Spectrum(*self.svd(), trusted=k)  # the median could move the noise threshold
        return partial

    def component_energy(self, spectrum: Spectrum) -> torch.Tensor:
        """Each component's share of the layer's output energy and, last, the residual's, so that
        the sum of any tail is exactly what a cut there drops (σ_i² and ‖R‖² without inputs).
        The output is O = X W (or X Wᵀ) = Σ_i a_i b_iᵀ + E with a_i = σ_i X (input-side vector i),
        b_i orthonormal and E = X R: ‖Σ_{i>r} a_i b_iᵀ + E‖² = Σ_{i>r} (|a_i|² + 2 a_iᵀ E b_i) + ‖E‖²."""
        if self.inputs is None:
            return spectrum.weight_energy().double()
        input_side, output_side = (spectrum.u, spectrum.vh.T) if self.transposed else (spectrum.vh.T, spectrum.u)
        a = ((self.inputs @ input_side) * spectrum.s).double()  # tails are differences of sums: float64
        energy = a.square().sum(dim=0)
        if spectrum.complete:
            return torch.cat([energy, energy.new_zeros(1)])
        e = (self.inputs @ (spectrum.residual if self.transposed else spectrum.residual.T)).double()
        cross = ((a.T @ e) * output_side.T.double()).sum(dim=1)
        return torch.cat([energy + 2 * cross, e.square().sum().reshape(1)])

    def factorize(
        self, rank: int, svd: Spectrum | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ) -> int:
        """Split the dense weight into A, B keeping `rank` singular values (`svd`: a Spectrum
        or (u, s, vh) already computed). Returns the rank kept."""
        u, s, vh = (svd.u, svd.s, svd.vh) if isinstance(svd, Spectrum) else svd if svd is not None else self.svd()
        r = max(1, min(rank, len(s)))
        root = s[:r].sqrt()
        self._set_factor("A", (u[:, :r] * root).contiguous())
        self._set_factor("B", (root[:, None] * vh[:r]).contiguous())
        self.factorized = True
        return r

    def _set_factor(self, name: str, value: torch.Tensor) -> None:
        """The factor's new value; at a new rank, a new Parameter. (Changing a parameter's shape
        in place breaks the next backward pass whenever a graph of the old shape is still alive,
        as a training loop's last `loss` keeps it: autograd caches a leaf's shape in its
        gradient accumulator. The owner swaps the new Parameter into its optimiser.)"""
        old = getattr(self, name)
        value = value.to(self.layer.weight.dtype)
        if old.shape == value.shape:
            old.data = value
        else:
            setattr(self, name, nn.Parameter(value, requires_grad=old.requires_grad))

    def densify(self) -> None:
        """W = A B into the dense weight; forward uses W again."""
        with torch.no_grad():
            self.layer.weight.copy_(self.weight_from_tall(self.A @ self.B))
        self.factorized = False

    def weight(self) -> torch.Tensor:
        return self.weight_from_tall(self.A @ self.B) if self.factorized else self.layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if self.kind.linear and self.factorized:
            # Through the factors, never forming W: batch·r·(rows + cols) operations instead of
            # rows·cols·r (y = x Wᵀ, with W = A B, or Wᵀ = A B when transposed).
            hidden = x @ self.A if self.transposed else F.linear(x, self.B)
            out = hidden @ self.B if self.transposed else F.linear(hidden, self.A)
            return out if layer.bias is None else out + layer.bias
        return self.kind.forward(layer, x, self.weight())

    # -- recording inputs for the output-space floor ---------------------------------------------
    def record_inputs(self, x: torch.Tensor, max_rows: int = 4096) -> None:
        """Keep rows of this layer's input as the matrix its tall weight multiplies: features
        of a Linear or Conv1D, unfolded patches of a Conv2d with groups=1. Other convolutions
        record nothing, and their floor falls back to the weight's own energy."""
        if not self.kind.has_rows(self.layer):
            return
        rows = self.kind.input_rows(self.layer, x.detach().float())  # float32, as the tall matrix
        if len(rows) > max_rows:  # an even sample keeps the cost of the floor small
            rows = rows[torch.linspace(0, len(rows) - 1, max_rows).long()]
        self.inputs = rows


def gavish_donoho_omega(beta: float) -> float:
    """ω(β) of the optimal hard threshold for an unknown noise level (Gavish & Donoho 2014,
    eq. 5): singular values above ω(β)·median(σ) stand out of a random bulk of aspect ratio β."""
    return 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43


def noise_edge(s: torch.Tensor, shape: tuple[int, int]) -> float:
    """The edge of the random bulk in spectrum `s` of a matrix of `shape`: ω(β)·median(σ)."""
    return gavish_donoho_omega(min(shape) / max(shape)) * float(s.median())


def choose_rank(
    s: torch.Tensor,
    shape: tuple[int, int],
    rule: str,
    tau: float,
    energy: torch.Tensor,
    max_output_error: float,
    kept_edge: float | None = None,
    median: float | None = None,
) -> int:
    """Singular values to keep: the rule's cut (see the module docstring; `kept_edge`: the
    bulk's edge measured at the first factorisation; `median`: the spectrum's median singular
    value when `s` holds only its leading part), raised until the dropped share of `energy`
    (per component, summing to the total; an entry past the last of `s` is the part no
    component holds) is at most `max_output_error` (relative Frobenius norm)."""
    if rule == "tau":
        threshold = tau * float(s[0])
    else:
        bulk_edge = noise_edge(s, shape) if median is None else gavish_donoho_omega(min(shape) / max(shape)) * median
        threshold = max(bulk_edge, kept_edge or 0.0)
    by_rule = int((s > threshold).sum().item())
    # tail[r]: the relative norm dropped when r components are kept.
    tail = (energy.flip(0).cumsum(0).flip(0).clamp_min(0) / energy.sum().clamp_min(1e-30)).sqrt()
    by_floor = int((tail > max_output_error).sum().item())
    return max(1, by_rule, by_floor)


def dropped_fraction(energy: torch.Tensor, rank: int) -> float:
    """Relative Frobenius norm dropped by keeping the first `rank` components."""
    return float((energy[rank:].sum().clamp_min(0) / energy.sum().clamp_min(1e-30)).sqrt())


def factorize_model(
    model: nn.Module, full_rank: list[str], frozen: list[str] = ()
) -> tuple[dict[str, FactorizedLayer], dict[str, str]]:
    """Replace every weight layer of a registered kind except those named in `full_rank` by a
    FactorizedLayer (still dense until factorised). "first" and "last" name the first and last
    such layer in module order (the reference keeps the first conv and the classifier head
    dense). Also kept dense: layers inside a module that reads its children's weights itself
    (nn.MultiheadAttention uses out_proj.weight without calling out_proj), and layers whose
    weight is tied to another module's (GPT-2's head shares the token embedding: factors of one
    use would untie them). Returns the factorised layers, and the layers kept dense for those
    reasons, those in `full_rank` and the `frozen` ones, each with its reason."""
    candidates, kept = [], {}
    inside_attention: set[str] = set()
    shared = shared_weights(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            inside_attention.update(
                f"{name}.{child}" if name else child for child, _ in module.named_modules() if child
            )
        elif kind_of(module) is not None and name not in inside_attention:
            candidates.append(name)
    if not candidates:
        raise ConfigError(
            "AB-training needs Linear, Hugging Face Conv1D or Conv1d/2d/3d layers to factorise; this "
            "model has none" + (" outside nn.MultiheadAttention" if inside_attention else "")
        )
    for name in sorted(inside_attention):
        if isinstance(model.get_submodule(name), nn.Linear):
            kept[name] = "inside nn.MultiheadAttention, which reads its weight itself"
    keep = set()
    for name in full_rank:
        if name in ("first", "last"):
            keep.add(candidates[0] if name == "first" else candidates[-1])
        elif name in candidates:
            keep.add(name)
        else:
            raise ConfigError(
                f"ab.full_rank names layer {name!r}, which is not a weight layer of this model "
                f"(its layers: {', '.join(candidates)}; or use first, last)"
            )
    factorized = {}
    for name in candidates:
        module = model.get_submodule(name)
        if name in keep or name in frozen:
            kept[name] = "ab.full_rank" if name in keep else "frozen by the user"
            continue
        if is_tied(module, shared):
            kept[name] = "weight tied to another module's"
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        factorized[name] = FactorizedLayer(module)
        setattr(parent, child, factorized[name])
    if not factorized:
        raise ConfigError(
            "nothing is left to train as A and B: "
            + "; ".join(f"{n} is kept dense ({kept[n]})" for n in candidates)
            + ": use a deeper model or a shorter ab.full_rank"
        )
    return factorized, kept


def _canonical_signs(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each left singular vector's largest entry positive (the SVD fixes them only up to sign)."""
    signs = torch.sign(u.gather(0, u.abs().argmax(dim=0, keepdim=True)))
    signs[signs == 0] = 1
    return u * signs, s, vh * signs.T


def leading_svd(w: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `width` leading singular triplets of w, by a randomized range finder with power
    iterations (Halko et al. 2011, algorithms 4.4 and 5.1). The test matrix has a fixed seed
    (drawn on the host, then moved to w's device): ranks holding the same w compute the same
    factors, whatever their device."""
    omega = torch.randn(w.shape[1], width, generator=torch.Generator().manual_seed(0), dtype=w.dtype).to(w.device)
    basis = torch.linalg.qr(w @ omega).Q
    for _ in range(POWER_ITERATIONS):  # re-orthonormalised each time: the spectrum's decay is steep
        basis = torch.linalg.qr(w @ torch.linalg.qr(w.T @ basis).Q).Q
    small_u, s, vh = torch.linalg.svd(basis.T @ w, full_matrices=False)
    return _canonical_signs(basis @ small_u, s, vh)


def unfactorized_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with every FactorizedLayer replaced by its dense layer holding the
    current W (A B when factorised): the ordinary model, loadable without hvd_lowcomm."""
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if isinstance(module, FactorizedLayer):
            with torch.no_grad():
                module.layer.weight.copy_(module.weight())
            parent_name, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent_name) if parent_name else out, child, module.layer)
    return out
