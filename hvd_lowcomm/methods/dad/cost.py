"""dAD's, rank-dAD's and edAD's cost: the kernels they time per layer, and their predicted
bytes and step time."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from hvd_lowcomm.comm.traffic import FLOAT_BYTES
from hvd_lowcomm.config import Config, ConfigError
from hvd_lowcomm.costmodel import LayerSample, Link, Prediction, Profile, RunAssumptions, sent_bytes
from hvd_lowcomm.methods.dad.factor_rows import FactorRows
from hvd_lowcomm.methods.dad.recomputed_deltas import edad_chain
from hvd_lowcomm.methods.dad.options import DadOptions, RankDadOptions, planned_rank
from hvd_lowcomm.methods.dad.plan import (
    activation_rows,
    delta_rows,
    row_layers,
    shared_row_bytes,
    sharing_is_cheaper,
    supports,
)
from hvd_lowcomm.methods.dad.lowrank import cheapest_way, factors_from_rows, gradient_power_iteration


def shared_layers(model: nn.Module, input_shape: tuple[int, ...], options: Any, cfg: Config) -> set[str]:
    """The layers whose rows dAD can share (model facts for the cost model)."""
    return set(row_layers(model))


def dad_kernels(sample: LayerSample, options: Any, cfg: Config) -> dict[str, Any]:
    """Forming this rank's rows of the layer (im2col for a conv) and the product of one rank's
    rows, ∇W += Δᵀ A (every rank forms it for all p ranks' rows)."""
    if not supports(sample.module):
        return {}
    generator = torch.Generator().manual_seed(0)
    acts = torch.randn(sample.rows, sample.fan_in, generator=generator)
    deltas = torch.randn(sample.rows, sample.fan_out, generator=generator)
    return {
        "rows": lambda: (activation_rows(sample.module, sample.inputs), delta_rows(sample.module, sample.output)),
        "dad_product": lambda: deltas.T @ acts,
    }


def rank_dad_kernels(sample: LayerSample, options: "RankDadOptions", cfg: Config) -> dict[str, Any]:
    """The top triplets of one rank's gradient, the way rank-dAD takes them for these shapes
    (an adaptive rank iterates twice the rank it keeps: FactorRows.iterated_rank; error feedback
    adds the error to the gradient first and forms the new one from the kept factors after), and
    the product of one rank's k factor rows."""
    if not supports(sample.module):
        return {}
    generator = torch.Generator().manual_seed(0)
    acts = torch.randn(sample.rows, sample.fan_in, generator=generator)
    deltas = torch.randn(sample.rows, sample.fan_out, generator=generator)
    grad = torch.randn(sample.fan_in, sample.fan_out, generator=generator)  # Gᵀ, as the method holds it
    error = torch.randn(sample.fan_in, sample.fan_out, generator=generator)
    rank = planned_rank(options)
    k = min(rank, sample.rows, sample.fan_in, sample.fan_out)
    iterated = rank if options.rank else min(options.max_rank, 2 * rank)
    iterate = (iterated, options.iterations, options.tol)
    if not _factors_from_gradient(sample.rows, sample.fan_in, sample.fan_out, options):
        factors: Callable[[], Any] = lambda: factors_from_rows(acts, deltas, *iterate, generator)  # noqa: E731
    elif options.error_feedback:

        def factors() -> None:
            fed = grad + error
            b_rows, c_rows = gradient_power_iteration(fed, *iterate, generator)
            torch.sub(fed, b_rows[:k].T @ c_rows[:k], out=error)
    else:
        factors = lambda: gradient_power_iteration(grad, *iterate, generator)  # noqa: E731
    return {"rank_factors": factors, "rank_product": lambda: deltas[:k].T @ acts[:k]}


def _factors_from_gradient(rows: int, fan_in: int, fan_out: int, options: "RankDadOptions") -> bool:
    return (
        options.error_feedback
        or cheapest_way(rows, fan_in, fan_out, planned_rank(options), options.iterations) == "gradient"
    )


def _predict_sharing(profile: Profile, world_size: int, link: Link, rank: "RankDadOptions | None") -> Prediction:
    """dAD (rank None) or rank-dAD: per layer the same choice as the plan 'auto' (share rows, or
    factors, where that sends fewer numbers than allreducing the gradient), then one allgather
    and one allreduce. Autograd skips the local weight gradient of layers whose gradient is
    formed from rows: the product of one rank's rows, taken off the measured backward pass.
    rank-dAD's float16 rows are 2 bytes a number and 8 a row for its two scales."""
    half = rank is not None and FactorRows(rank).half_rows(world_size)
    gathered = reduced = 0
    own = skipped = 0.0
    shareable = profile.facts.get("dad" if rank is None else "rank-dad", set())
    for layer in profile.layers:
        local_rows = profile.batch * layer.rows
        planned = local_rows if rank is None else planned_rank(rank)  # the plan's rows per rank
        width = local_rows if rank is None else min(planned, local_rows, layer.fan_in, layer.fan_out)
        extra = 0 if rank is None else layer.fan_out  # rank-dAD allreduces the bias
        if layer.name in shareable and sharing_is_cheaper(
            world_size * planned, layer.fan_in, layer.fan_out, layer.params, extra, half
        ):
            gathered += width * shared_row_bytes(layer.fan_in, layer.fan_out, half)
            reduced += extra
            from_gradient = rank is not None and _factors_from_gradient(local_rows, layer.fan_in, layer.fan_out, rank)
            if rank is None:
                own += layer.kernels["rows"] + world_size * layer.kernels["dad_product"]
            else:
                own += (0.0 if from_gradient else layer.kernels["rows"]) + world_size * layer.kernels["rank_product"]
                own += layer.kernels["rank_factors"]
            if not from_gradient:
                skipped += layer.kernels["dad_product"]
        else:
            reduced += layer.params
    reduced += profile.other_params - profile.tied_params + 1  # (a tied weight once) + the pooled batch size
    comm = link.allgather(gathered, world_size, world_size) + link.allreduce(
        FLOAT_BYTES * reduced, world_size, world_size
    )
    sent = sent_bytes("allgather", gathered, world_size) + sent_bytes("allreduce", FLOAT_BYTES * reduced, world_size)
    return Prediction(
        "", world_size, profile.step_seconds, own - skipped, comm, 0.0, sent, sent * link.node_share(world_size)
    )


def predict_dad(
    profile: Profile, world_size: int, link: Link, options: "DadOptions", cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    return _predict_sharing(profile, world_size, link, None)


def predict_rank_dad(
    profile: Profile, world_size: int, link: Link, options: "RankDadOptions", cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    return _predict_sharing(profile, world_size, link, options)


def predict_edad(
    profile: Profile, world_size: int, link: Link, options: None, cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    """edAD: every layer's activation rows and the output layer's delta rows, one allgather (and
    the pooled batch size); each rank forms every layer's product of the pooled rows and
    recomputes the hidden deltas over them (about one more such product per layer), where
    autograd's local weight gradient (one rank's product) is skipped."""
    if set(profile.facts.get("edad", set())) != {layer.name for layer in profile.layers}:
        raise ConfigError("edad: exact only for MLPs of Linear layers")
    gathered = sum(profile.batch * layer.rows * layer.fan_in for layer in profile.layers)
    gathered += profile.batch * profile.layers[-1].rows * profile.layers[-1].fan_out
    own = sum(layer.kernels["rows"] + (2 * world_size - 1) * layer.kernels["dad_product"] for layer in profile.layers)
    comm = link.allgather(FLOAT_BYTES * gathered, world_size, world_size) + link.allreduce(
        FLOAT_BYTES, world_size, world_size
    )
    sent = sent_bytes("allgather", FLOAT_BYTES * gathered, world_size) + sent_bytes(
        "allreduce", FLOAT_BYTES, world_size
    )
    return Prediction("", world_size, profile.step_seconds, own, comm, 0.0, sent, sent * link.node_share(world_size))


def edad_layers(model: nn.Module, input_shape: tuple[int, ...], options: Any, cfg: Config) -> set[str]:
    """The Linear layers of an MLP edAD is exact for (none when it is not)."""
    try:
        return {name for name, _ in edad_chain(model)}
    except ConfigError:
        return set()


def rank_dad_quality(options: RankDadOptions, cfg: Config) -> str | None:
    """Held to its error target when adaptive with error feedback; a fixed rank has no target,
    and without error feedback the target alone keeps too few components (one per layer holds
    half of a transformer's local gradient energy; docs: dad, "Error feedback")."""
    if options.rank or not options.error_feedback:
        return None
    return (
        f"low-rank local gradients, each layer's rank adapted so that it leaves out at most "
        f"{options.error_target:.0%} of its energy, which error feedback adds back later"
    )
