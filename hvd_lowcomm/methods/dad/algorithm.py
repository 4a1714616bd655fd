"""`dad`, `rank-dad`, `edad`: ranks share layer activations and deltas instead of gradients.

Baker, Calhoun, Pearlmutter, Plis, "Efficient Distributed Auto-Differentiation" (arXiv 2102.09631).
For a layer y = x Wᵀ + b the local gradient is Δᵀ A (A: input rows, Δ: output deltas). Instead
of allreducing d_out·d_in numbers, every rank allgathers its rows [A | Δ], rows·(d_in + d_out)
numbers, and every rank forms the pooled gradient [Δ_1; ...; Δ_p]ᵀ [A_1; ...; A_p] itself.

- Linear layers use their input rows directly (leading dimensions become rows); Conv2d layers
  (groups = 1, zero padding) use im2col: rows are (sample, output position) pairs, activations
  the unfolded input patches. Both are exact.
- A per-layer plan, fixed at the first step from shapes, rows and world size, shares
  activations only where that puts fewer bytes on the wire than allreducing the gradient
  (plan "auto"), or for every supported layer (plan "all"). Everything else is allreduced.
- Scaling: with the loss a mean over each rank's batch of N_s samples, rank s multiplies its
  deltas (and its allreduced gradients) by N_s, and the pooled sums are divided by N = sum of
  N_s, which is allreduced in the same exchange: the result is exactly the gradient of the mean
  loss over the pooled batch, also for unequal batch sizes. The exchange is one Horovod cycle
  (allgathers and allreduces submitted together).
- rank-dAD replaces each rank's rows by k <= r factor rows: the top singular triplets of the
  local gradient, computed the cheapest way for the layer's shapes (hvd_lowcomm.methods.dad.lowrank: exactly
  from few rows, by power iteration on the gradient autograd formed for a conv layer's many
  rows, or by structured power iteration); each rank sends its own k rows (Horovod's allgather
  takes a different count from each rank). Bias gradients, which factors do not carry, are
  allreduced. The k each layer keeps is its "effective rank".
- Every rank runs the same collectives whatever its batch did: the plan covers every layer
  used on any rank at the first step, and a rank on which a planned layer did not run (a branch
  taken on some ranks only) shares one zero row for it. A forward whose output never received
  a gradient (non-reentrant activation checkpointing's recomputation, an output the loss did
  not use) adds no rows, as it adds nothing to the gradient.
- Accumulation: an exchange adds the pooled gradient of the passes since the last one to what
  `.grad` held, as autograd does; the local gradient of a weight formed from rows never enters
  `.grad` (it does not require one, or a hook diverts it), so that `.grad` only ever holds
  pooled numbers and micro-batches exchanged one by one add up to the pooled batch's gradient.
- Rows, factors and sums are float32 whatever the parameters' dtype (bfloat16 weights
  included); the gradients are written back in the parameter's dtype.
- edAD shares every layer's activations but only the output layer's deltas; each rank
  recomputes the hidden deltas from the known weights and activation derivatives. It is exact,
  and therefore allowed, only for nn.Sequential MLPs of Linear layers and element-wise
  activations whose derivative is a function of their output (ReLU, LeakyReLU, Tanh, Sigmoid).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.config import ConfigError, make_options
from hvd_lowcomm.methods.dad.options import DAD_MODES, DadOptions, RankDadOptions
from hvd_lowcomm.methods.dad.plan import supports
from hvd_lowcomm.methods.drop_in import (
    NamedParameters,
    horovod_arguments,
    wrap_optimizer,
)
from hvd_lowcomm.methods.dad.exchange import DadExchange
from hvd_lowcomm.methods.dad.exact_rows import ExactRows
from hvd_lowcomm.methods.dad.factor_rows import FactorRows
from hvd_lowcomm.methods.dad.recomputed_deltas import RecomputedDeltas, edad_chain


def check_dad_model(model: nn.Module, edad: bool) -> None:
    if not any(supports(m) for m in model.modules()):
        raise ConfigError(
            "dAD needs at least one layer it can form from rows (Linear, Hugging Face Conv1D, "
            "Conv2d with groups=1); this model has none: use --method ddp"
        )
    if edad:
        edad_chain(model)


def DadOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: NamedParameters | nn.Module | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    model: nn.Module | None = None,
    mode: str = "exact",
    plan: str = DadOptions.plan,
    group: Group | None = None,
    seed: int = 0,
    options: "RankDadOptions | None" = None,
    **rank_options: Any,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so step() uses the pooled batch's gradient, built by (rank-/e)dAD.

    `model` is the module whose layers' activations and deltas are shared (it may also come
    second, in place of named_parameters: `DadOptimizer(opt, model)`). Horovod's arguments are
    taken as by every wrapper (hvd_lowcomm.methods.drop_in); compression: none for exact dAD
    and edAD (their rows are exact, in float32), none or fp16 for rank-dAD (its factor rows
    are float16 by default).

    mode "exact": dAD; "rank": rank-dAD, by default with each layer's rank adaptive; its
    options are RankDadOptions' (`options=`, or keywords: rank=r for a fixed rank, error_target,
    max_rank, error_feedback, iterations, tol; any of them given with the default mode means
    "rank"); "edad": edAD. plan "auto" shares rows only where that is cheaper than allreduce,
    "all" wherever supported. The loss must be a mean over the local batch (dim 0 of each
    layer's input). From the second step on, weights whose gradient comes from shared rows have
    requires_grad False (autograd's local gradient of them would go unused); their .grad is
    still set at every step.
    """
    if isinstance(named_parameters, nn.Module):
        if model is not None and model is not named_parameters:
            raise ConfigError("DadOptimizer: the module given second is not the model= given too")
        model, named_parameters = named_parameters, None
    if model is None:
        raise ConfigError(
            "DadOptimizer needs the model, whose layers' activations and deltas it shares: "
            "DadOptimizer(opt, named_parameters=model.named_parameters(), model=model)"
        )
    if mode == "exact" and (rank_options or options is not None):
        mode = "rank"
    if mode not in DAD_MODES:
        raise ConfigError(f"DadOptimizer mode must be one of {', '.join(DAD_MODES)}, got {mode!r}")
    if mode != "rank" and (rank_options or options is not None):
        raise ConfigError(
            f"DadOptimizer mode {mode!r} is exact and takes no rank options; use mode='rank' for rank-dAD"
        )
    rank_dad = make_options(RankDadOptions, "rank-dad", options, plan=plan, **rank_options)
    arguments = horovod_arguments(
        "DadOptimizer",
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        sparse_as_dense,
        process_set,
        group,
        model=model,
        compressors=("none", "fp16") if mode == "rank" else ("none",),
        why_not_compressed="its rows are exact (float32); use mode='rank', whose factor rows travel in float16, "
        "or DistributedOptimizer with compression=fp16"
        if mode != "rank"
        else "its own factor rows are its compression",
    )
    if arguments.compression == "fp16" and rank_dad.factor_dtype != "float16":
        raise ConfigError(
            "DadOptimizer: compression=fp16 asks for float16 on the wire, but factor_dtype is "
            "float32; drop one of the two"
        )
    check_dad_model(model, mode == "edad")
    sharing = {"exact": ExactRows, "rank": lambda: FactorRows(rank_dad), "edad": lambda: RecomputedDeltas(model)}[
        mode
    ]()
    return wrap_optimizer(
        optimizer,
        DadExchange,
        named_parameters or model.named_parameters(),
        model,
        sharing,
        rank_dad.plan,
        arguments,
        seed,
    )
