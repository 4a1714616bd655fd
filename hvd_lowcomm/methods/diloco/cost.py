"""DiLoCo's cost: the facts it needs of a model, and its predicted bytes and step time."""

from __future__ import annotations

import math
from typing import Any

import torch.nn as nn

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import FLOAT_BYTES
from hvd_lowcomm.config import Config, ConfigError
from hvd_lowcomm.costmodel import Link, Memory, Prediction, Profile, RunAssumptions, sent_bytes
from hvd_lowcomm.methods.diloco.options import DiLoCoOptions, fragment_bounds, shard_length, sync_due
from hvd_lowcomm.methods.fsdp import fsdp_facts, sharded_memory, sharded_step_bytes
from hvd_lowcomm.methods.diloco.exchange import Transfer, make_exchange
from hvd_lowcomm.schedule import run_steps


def diloco_facts(model: nn.Module, input_shape: tuple[int, ...], options: DiLoCoOptions, cfg: Config) -> dict[str, Any]:
    """The shapes of each fragment's tensors, and the numbers in the floating-point buffers."""
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    bounds = fragment_bounds([math.prod(s) for s in shapes], options.fragments)
    return {
        "fragments": [shapes[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
        "buffers": sum(b.numel() for b in model.buffers() if b.is_floating_point()),
        "fsdp": fsdp_facts(model, input_shape, None, cfg) if options.shard else None,
    }


def diloco_memory(profile: Profile, ranks: int, ranks_per_node: int, options: DiLoCoOptions, cfg: Config) -> Memory:
    """A group's model (sharded over the group with `shard`), and this rank's slice of the outer
    state: the global copy, its momentum, and the exchange's error feedback where its form keeps one."""
    groups = runtime.groups_for(options.groups, ranks, ranks_per_node)
    group = ranks // groups
    held = sharded_memory(profile, group if options.shard else 1)
    slice_ = profile.params / group
    state = {"global copy": slice_}
    if options.outer_momentum:
        state["outer momentum"] = slice_
    exchange = make_exchange(None, options, members=groups)
    if exchange.feeds_back:
        state["error feedback"] = slice_
    if (exchange.feeds_back and exchange.name in ("int8", "int2")) or getattr(exchange, "by_owner", False):
        state["error feedback on the mean part it owns"] = slice_ / groups
    return Memory(held.model_share, held.gathered, state)


def predict_diloco(
    profile: Profile, world_size: int, link: Link, o: DiLoCoOptions, cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    """The mean step over a run of assumptions.run_steps steps: every step the gradients are
    allreduced inside the group (on the node's links when a group fits in a node); each
    fragment's syncs average its slice over the column (one rank per group, across the network
    once groups fill nodes) by the exchange's own collectives, then the group allgathers the
    fragment. Bytes are the busiest position's (low-rank slices differ in their matrices)."""
    groups = runtime.groups_for(o.groups, world_size, link.ranks_per_node)
    if world_size % groups:
        raise ConfigError(f"diloco: {world_size} ranks do not split into {groups} groups")
    g, runs = world_size // groups, max(assumptions.run_steps, 1)
    every = max(1, run_steps(o.sync_every, runs, "diloco.sync_every"))
    facts = profile.facts["diloco"]
    if o.shard:  # FSDP inside the group: all-gathers and a reduce-scatter
        step = sharded_step_bytes(facts["fsdp"], g, cfg.train.accumulate)
        inner_seconds = link.allgather(step["allgather"] / g, g, world_size) + link.reduce_scatter(
            step["reduce_scatter"], g, world_size
        )
        inner_sent = sent_bytes("allgather", step["allgather"] / g, g) + sent_bytes(
            "reduce_scatter", step["reduce_scatter"], g
        )
    else:
        inner = FLOAT_BYTES * profile.params
        inner_seconds, inner_sent = link.allreduce(inner, g, world_size), sent_bytes("allreduce", inner, g)
    comm = runs * inner_seconds
    sent = runs * inner_sent
    between_nodes = sent * link.node_share(g)
    across = g >= link.ranks_per_node  # a column's ranks sit on different nodes once groups fill nodes
    exchange = make_exchange(None, o, members=groups)
    for f, shapes in enumerate(facts["fragments"]):
        starts = [s for s in range(1, runs + 1) if sync_due(s, f, every, len(facts["fragments"]))]
        # a delayed exchange may land after the run; an eager step lands at once
        applied = len(starts) if o.eager else sum(s + o.sync_delay <= runs for s in starts)
        if o.shard:  # a rank's shards are its slice; the first position holds the most rows
            local = [(math.ceil((s or (1,))[0] / g), *(s or (1,))[1:]) for s in shapes]
            length = sum(math.prod(s) for s in local)
            transfers = exchange.transfers(length, local, 0)
        else:
            length = shard_length(sum(math.prod(s) for s in shapes), g)
            transfers = max(
                (exchange.transfers(length, shapes, position * length) for position in range(g)),
                key=lambda ts: sum(t.sent_bytes(groups) for t in ts),
            )
        landing = [Transfer("allreduce", FLOAT_BYTES * facts["buffers"])] if f == 0 and facts["buffers"] else []
        column = [sum(t.sent_bytes(groups) for t in ts) for ts in (transfers, landing)]
        # an alltoall's time is an allgather's of its parts
        cost = [
            sum(
                link.allreduce(t.payload, groups, world_size, spans_nodes=across)
                if t.op == "allreduce"
                else link.allgather(
                    t.payload / (groups if t.op == "alltoall" else 1), groups, world_size, spans_nodes=across
                )
                for t in ts
            )
            for ts in (transfers, landing)
        ]
        # the group's gather of the new slices, inside it (none where each rank keeps its shards)
        gather = 0.0 if o.shard else sent_bytes("allgather", FLOAT_BYTES * length, g)
        cost[1] += 0.0 if o.shard else link.allgather(FLOAT_BYTES * length, g, world_size)
        between_nodes += (len(starts) * column[0] + applied * column[1]) * link.node_share(
            groups, across
        ) + applied * gather * link.node_share(g)
        # A delayed exchange waits on the network behind sync_delay inner steps, an eager one
        # behind the whole period (its thread needs no core of its own: it mostly waits); what
        # they do not cover is exposed.
        behind = every if o.eager else o.sync_delay
        exposed = max(0.0, cost[0] - behind * (profile.step_seconds + inner_seconds))
        comm += len(starts) * exposed + applied * cost[1]
        sent += len(starts) * column[0] + applied * (column[1] + gather)
    return Prediction(
        "diloco", world_size, profile.step_seconds, 0.0, comm / runs, 0.0, sent / runs, between_nodes / runs
    )
