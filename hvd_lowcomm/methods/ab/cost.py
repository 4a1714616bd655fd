"""AB-training's cost: the kernels it times per layer, and its predicted bytes and step time."""

from __future__ import annotations

import math
from typing import Any

import torch

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import FLOAT_BYTES
from hvd_lowcomm.config import Config, ConfigError
from hvd_lowcomm.costmodel import LayerSample, Link, Prediction, Profile, RunAssumptions, median_seconds, sent_bytes
from hvd_lowcomm.methods.ab.options import ABOptions, Schedule
from hvd_lowcomm.methods.ab.factorized import leading_svd


def assumed_rank(fan_in: int, fan_out: int, assumptions: RunAssumptions, o: ABOptions) -> int:
    """The rank the cost model assumes AB's cuts keep for a fan_in × fan_out layer: the assumed
    share of its smaller side, and never below the cuts' floor (cut.min_rank_share)."""
    side = min(fan_in, fan_out)
    return max(1, round(assumptions.rank_share * side), math.ceil(o.cut.min_rank_share * side))


def ab_kernels(sample: LayerSample, options: ABOptions, cfg: Config) -> dict[str, Any]:
    """A re-factorisation's leading triplets and residual at the assumed rank, and a full SVD
    (the first factorisation's and the first cut's)."""
    tall = torch.randn(
        max(sample.fan_in, sample.fan_out),
        min(sample.fan_in, sample.fan_out),
        generator=torch.Generator().manual_seed(0),
    )
    width = min(2 * assumed_rank(sample.fan_in, sample.fan_out, RunAssumptions(), options) + 16, tall.shape[1])

    def leading() -> None:
        u, s, vh = leading_svd(tall, width)
        _ = tall - (u * s) @ vh

    return {"ab_leading": leading, "ab_svd": _svd_seconds(*tall.shape)}


def _svd_seconds(rows: int, cols: int, largest: int = 1024) -> float:
    """A full SVD of a rows × cols matrix (rows >= cols), O(rows cols²): timed at most
    `largest` columns wide and scaled, so that profiling a wide model stays quick."""
    scale = min(1.0, largest / cols)
    small = (max(1, round(rows * scale)), max(1, round(cols * scale)))
    matrix = torch.randn(*small, generator=torch.Generator().manual_seed(0))
    seconds = median_seconds(lambda: torch.linalg.svd(matrix, full_matrices=False))
    return seconds * (rows * cols * cols) / (small[0] * small[1] * small[1])


def predict_ab(
    profile: Profile, world_size: int, link: Link, o: ABOptions, cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    """AB-training's mean step over a run of assumptions.run_steps steps (its default layers:
    every weight layer but the first and last is factorised). Warm-up and full-rank steps are
    ddp steps; a group step allreduces the trained factor (the larger of A's and B's, which sets
    the pace at the next sync) and the dense parameters inside its group (on the node's own
    links when a group fits in a node); once per cycle a sync allreduces A, B and the rest over
    all ranks, and a re-factorisation computes each layer's leading triplets and checks the cut
    with two forward passes; the first factorisation and every re-factorisation up to the first
    cut (first_cut) take full SVDs, and until then the factors are full-rank. The bytes are an
    A-group rank's (B-group ranks send less)."""
    factorised = profile.layers[1:-1]
    if not factorised:
        raise ConfigError("ab: the model needs a weight layer besides the first and the last to factorise")
    groups = runtime.groups_for(o.groups, world_size, link.ranks_per_node)
    if world_size % groups or groups < 2:
        raise ConfigError(f"ab: {world_size} ranks do not split into {groups} groups")
    runs = max(assumptions.run_steps, 1)
    schedule = Schedule(o, runs)
    # Walk the schedule: per step its phase and whether the factors are cut yet; count the
    # syncs of full-rank and of cut factors, and the factorisations that take full SVDs.
    uncut_group_steps = cut_group_steps = full_steps = 0
    syncs, full_svds, leading_svds, cut = [0, 0], 0, 0, False
    for t in range(runs):
        for action in schedule.transitions(t):
            if action == "sync":
                syncs[cut] += 1
                continue
            truncate = schedule.cuts(t) if action == "refactorize" else not o.first_full_rank
            if truncate and cut:  # a cut after a cut: the leading triplets near the last rank
                leading_svds += 1
            else:
                full_svds += 1
            cut = truncate
        if schedule.phase(t) != "group":
            full_steps += 1
        elif cut:
            cut_group_steps += 1
        else:
            uncut_group_steps += 1
    cycles = sum(syncs)
    dense = profile.params - sum(layer.fan_in * layer.fan_out for layer in factorised)  # biases, dense layers...

    def factors(cut: bool) -> tuple[int, int]:  # numbers in A and in B: at the assumed rank, or all of it
        ranks = [
            assumed_rank(layer.fan_in, layer.fan_out, assumptions, o) if cut else min(layer.fan_in, layer.fan_out)
            for layer in factorised
        ]
        return (
            sum(max(layer.fan_in, layer.fan_out) * r for layer, r in zip(factorised, ranks)),
            sum(min(layer.fan_in, layer.fan_out) * r for layer, r in zip(factorised, ranks)),
        )

    g = world_size // groups
    # A group averages its trained factor (the larger one sets the pace).
    in_group = [FLOAT_BYTES * (max(factors(cut)) + dense) for cut in (False, True)]
    at_sync = [FLOAT_BYTES * (sum(factors(cut)) + dense) for cut in (False, True)]
    ddp_bytes = FLOAT_BYTES * profile.params  # a warm-up or full-rank step: ddp's allreduce
    ddp_comm = link.allreduce(ddp_bytes, world_size, world_size)
    # Re-factorisations after the first cut take the leading triplets; each checks its cut with
    # two forward passes.
    own = (
        leading_svds * sum(layer.kernels["ab_leading"] for layer in factorised)
        + full_svds * sum(layer.kernels["ab_svd"] for layer in factorised)
        + cycles * 2 * profile.forward_seconds
    ) / runs
    group_steps = (uncut_group_steps, cut_group_steps)
    comm = (
        sum(n * link.allreduce(in_group[c], g, world_size) for c, n in enumerate(group_steps))
        + full_steps * ddp_comm
        + sum(n * link.allreduce(at_sync[c], world_size, world_size) for c, n in enumerate(syncs))
    ) / runs
    in_groups = sum(n * sent_bytes("allreduce", in_group[c], g) for c, n in enumerate(group_steps))
    on_world = full_steps * sent_bytes("allreduce", ddp_bytes, world_size) + sum(
        n * sent_bytes("allreduce", at_sync[c], world_size) for c, n in enumerate(syncs)
    )
    sent = (in_groups + on_world) / runs
    between_nodes = (in_groups * link.node_share(g) + on_world * link.node_share(world_size)) / runs
    hidden = full_steps * min(ddp_comm, link.overlap * profile.backward_seconds) / runs  # ddp's overlap in its steps
    return Prediction("ab", world_size, profile.step_seconds, own, comm, hidden, sent, between_nodes)
