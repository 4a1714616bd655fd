"""PowerSGD's predicted step: its bytes (plain or across sharded groups), kernels and quality note."""

from __future__ import annotations

import math
from typing import Any

import torch

from hvd_lowcomm.comm.traffic import FLOAT_BYTES
from hvd_lowcomm.config import Config, ConfigError
from hvd_lowcomm.costmodel import Link, LayerSample, Memory, Prediction, Profile, RunAssumptions, sent_bytes
from hvd_lowcomm.methods.adaptive_rank import PROBES
from hvd_lowcomm.methods.fsdp import fsdp_facts, sharded_memory, sharded_step_bytes
from hvd_lowcomm.methods.powersgd.algorithm import orthogonalise
from hvd_lowcomm.methods.powersgd.options import PowerSGDOptions, compresses, planned_rank


def powersgd_kernels(sample: LayerSample, options: PowerSGDOptions, cfg: Config) -> dict[str, Any]:
    """One compression cycle of the layer's gradient as the exchange runs it: error feedback, P =
    M Q, orthogonalisation, the new error (M and the error in the error buffer)."""
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(sample.fan_out, sample.fan_in, generator=generator)
    error = torch.randn(sample.fan_out, sample.fan_in, generator=generator)
    q = torch.randn(sample.fan_in, planned_rank(sample.fan_out, sample.fan_in, options), generator=generator)

    def cycle() -> None:
        m = error.add_(grad)
        p = orthogonalise(m @ q)
        m.sub_(p @ (p.T @ m))

    return {"powersgd": cycle}


def predict_powersgd(
    profile: Profile, world_size: int, link: Link, options: PowerSGDOptions, cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    """A compressed step (after start_iter): P with the uncompressed gradients in one allreduce,
    then Q; each compressed layer's cycle as the method's own work; nothing overlaps backward.
    An adaptive rank is assumed to settle at planned_rank; the probes that measure each matrix
    every adapt_every steps count as their average per step."""
    if options.shard_group_size:
        return predict_sharded_powersgd(profile, world_size, link, options, cfg, assumptions)
    compressed_p = compressed_q = plain = matrices = 0
    own = 0.0
    for layer in profile.layers:
        n, m = layer.fan_out, layer.fan_in
        compress, r = compresses(n, m, options)[0], planned_rank(n, m, options)
        if compress:  # (on average: PROBES columns ride with P every adapt_every steps)
            compressed_p += n * (r + PROBES / options.adapt_every)
            compressed_q += m * r
            plain += layer.params - n * m
            own += layer.kernels["powersgd"]
            matrices += 1
        else:
            plain += layer.params
    plain += profile.other_params - profile.tied_params  # a tied weight travels once
    half = options.factor_dtype == "float16" and world_size > 1
    factor_bytes = 2 if half else FLOAT_BYTES
    p_round, q_round = factor_bytes * (compressed_p + plain), factor_bytes * compressed_q
    comm = sum(link.allreduce(nbytes, world_size, world_size) for nbytes in (p_round, q_round) if nbytes)
    # float16: each round's scales are agreed once, at the first step (a number per matrix, and
    # one for the uncompressed gradients)
    scales = 2 * matrices + (1 if plain else 0)
    agreement = FLOAT_BYTES * scales / assumptions.run_steps if half else 0.0
    sent = sum(sent_bytes("allreduce", nbytes, world_size) for nbytes in (p_round, q_round, agreement))
    return Prediction(
        "powersgd", world_size, profile.step_seconds, own, comm, 0.0, sent, sent * link.node_share(world_size)
    )


def predict_sharded_powersgd(
    profile: Profile, world_size: int, link: Link, options: PowerSGDOptions, cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    """FSDP's gathers and reduce-scatter inside each group of shard_group_size ranks, then
    PowerSGD across the groups on each rank's rows of every gradient (the first position's,
    which holds the most), as predict_powersgd's rounds; the factors' work a share of the
    whole layers'."""
    shard = options.shard_group_size
    if world_size % shard:
        raise ConfigError(f"powersgd: groups of {shard} ranks do not divide {world_size} ranks")
    groups, facts = world_size // shard, profile.facts["powersgd"]
    compressed_p = compressed_q = plain = matrices = 0
    for shape in facts["units"] + facts["root"]:
        n = math.ceil(shape[0] / shard)
        m = math.prod(shape[1:])
        compress, r = compresses(n, m, options)[0], planned_rank(n, m, options)
        if compress:
            compressed_p += n * (r + PROBES / options.adapt_every)
            compressed_q += m * r
            matrices += 1
        else:
            plain += n * m
    factor_bytes = 2 if options.factor_dtype == "float16" and groups > 1 else FLOAT_BYTES
    rounds = [factor_bytes * (compressed_p + plain), factor_bytes * compressed_q]
    scales = FLOAT_BYTES * (2 * matrices + (1 if plain else 0)) / assumptions.run_steps if factor_bytes == 2 else 0.0
    spans = shard >= link.ranks_per_node  # a column's ranks sit on different nodes once groups fill nodes
    across = sum(sent_bytes("allreduce", nbytes, groups) for nbytes in (*rounds, scales))
    step = sharded_step_bytes(facts, shard, cfg.train.accumulate)
    inside = sent_bytes("allgather", step["allgather"] / shard, shard) + sent_bytes(
        "reduce_scatter", step["reduce_scatter"], shard
    )
    comm = (
        sum(link.allreduce(nbytes, groups, world_size, spans_nodes=spans) for nbytes in rounds if nbytes)
        + link.allgather(step["allgather"] / shard, shard, world_size)
        + link.reduce_scatter(step["reduce_scatter"], shard, world_size)
    )
    own = sum(layer.kernels["powersgd"] for layer in profile.layers) / shard
    return Prediction(
        "powersgd",
        world_size,
        profile.step_seconds,
        own,
        comm,
        0.0,
        inside + across,
        inside * link.node_share(shard) + across * link.node_share(groups, spans),
    )


def powersgd_facts(model: torch.nn.Module, input_shape: tuple[int, ...], options: PowerSGDOptions, cfg: Config) -> Any:
    """Sharded: the parameters' shapes as FSDP shards them (fsdp_facts); else nothing."""
    return fsdp_facts(model, input_shape, None, cfg) if options.shard_group_size else None


def powersgd_quality(options: PowerSGDOptions, cfg: Config) -> str | None:
    """Held to its error target when adaptive with error feedback; a fixed rank has no target,
    and without error feedback what the target lets go is lost for good."""
    if not options.adaptive or not options.error_feedback:
        return None
    return (
        f"low-rank gradients, each matrix's rank adapted so that it leaves out at most {options.error_target:.0%} "
        f"of its energy, which error feedback adds back later"
    )


def powersgd_memory(profile: Profile, ranks: int, ranks_per_node: int, options: PowerSGDOptions, cfg: Config) -> Memory:
    """The model (sharded over shard_group_size ranks), and the error feedback of this rank's gradient."""
    held = sharded_memory(profile, options.shard_group_size or 1)
    state = {"error feedback": profile.params * held.model_share} if options.error_feedback else {}
    return Memory(held.model_share, held.gathered, state)
