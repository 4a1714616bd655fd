"""`fsdp`: the model, its gradients and its optimiser state sharded over ranks (PyTorch's FSDP2).

Each rank keeps 1/group_size of every parameter, gradient and optimiser moment; a layer's
parameters are all-gathered just before its forward (and again before its backward) pass and
its gradients reduce-scattered after it, so a rank needs memory for its shards and for one
layer gathered at a time: a model whose replicas do not fit a rank trains. With one group (the
default) it is plain FSDP over every rank; with several it is HSDP: each group of group_size
contiguous ranks shards one copy and the groups all-reduce their shards' gradients every step.
The optimisation is ddp's: the same gradient, the same steps, to float32 rounding.

Built on hvd_lowcomm.comm.mesh (the mesh from hvd_lowcomm's groups; fully_shard with metered
collectives), so it runs on the torch engine. Checkpoints are DCP's: they resume on any rank count
or group size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.mesh import (
    device_mesh,
    full_state_dict,
    load_sharded_state,
    shard_model,
    shard_units,
    sharded_state,
)
from hvd_lowcomm.comm.traffic import FLOAT_BYTES
from hvd_lowcomm.config import Config, ConfigError, option
from hvd_lowcomm.costmodel import NODE, Link, Memory, MethodCost, Prediction, Profile, RunAssumptions, sent_bytes
from hvd_lowcomm.methods.base import Method, broadcast_parameters, make_optimizer
from hvd_lowcomm.methods.grouped import group_traffic
from hvd_lowcomm.registry import register


@dataclass
class FSDPOptions:
    """FSDP: which ranks shard one copy of the model."""

    section: ClassVar[str] = "fsdp"

    group_size: int = option(
        0,
        "ranks that shard one copy of the model: 0 every rank (plain FSDP); a divisor of "
        "the rank count: groups of that many contiguous ranks (a node's, with the node's "
        "rank count) each shard a copy, and the groups all-reduce their gradient shards "
        "every step (HSDP)",
    )

    def validate(self) -> None:
        if self.group_size < 0:
            raise ConfigError(f"fsdp.group_size must be >= 0 (0: every rank), got {self.group_size}")


def check_sharding_world(cfg: Config, world_size: int, group_size: int, option_name: str) -> None:
    """Refuse, with the fix, a run that cannot shard: Horovod asked for, or a group size that
    does not divide the rank count."""
    if cfg.comm.engine == "horovod":
        raise ConfigError(
            f"--method {cfg.method} shards the model with PyTorch's FSDP2, which runs on "
            f"torch.distributed process groups, not Horovod's: use --comm.engine torch (or auto)"
        )
    if group_size and world_size % group_size:
        raise ConfigError(
            f"{option_name} {group_size} does not divide the {world_size} ranks: choose a divisor of "
            f"the rank count, or 0 for every rank"
        )


def shard_the_replicas(model: torch.nn.Module, group_size: int, replicate: bool = True) -> torch.nn.Module:
    """The built-in trainer's sharding: every rank starts from rank 0's model, then shard_model
    over groups of `group_size` ranks (0: every rank); `replicate` False leaves the groups to the
    method (DiLoCo, PowerSGD). Collective."""
    broadcast_parameters(model.state_dict())  # every group shards the same start
    return shard_model(model, device_mesh(group_size, runtime.device_of(model.parameters()), replicate=replicate))


def gathered_numbers(shapes: list[tuple[int, ...]], shard: int) -> int:
    """Numbers an all-gather of these parameters returns on `shard` ranks: FSDP2 splits each
    along dim 0, padded to a multiple of the rank count."""
    return sum(shard * math.ceil(shape[0] / shard) * math.prod(shape[1:]) for shape in shapes)


def fsdp_facts(
    model: torch.nn.Module, input_shape: tuple[int, ...], options: FSDPOptions | None, cfg: Config
) -> dict[str, list[tuple[int, ...]]]:
    """The parameters' shapes as shard_model groups them: in the repeated blocks (gathered in
    forward and again in backward) and in the root (gathered once)."""
    in_units = [p for unit in shard_units(model) for p in unit.parameters()]
    ids = {id(p) for p in in_units}
    shape = lambda p: tuple(p.shape) or (1,)  # noqa: E731 - a scalar is sharded as one row
    return {"units": [shape(p) for p in in_units], "root": [shape(p) for p in model.parameters() if id(p) not in ids]}


def sharded_step_bytes(facts: dict[str, list[tuple[int, ...]]], shard: int, accumulate: int) -> dict[str, float]:
    """Payload bytes of one step's collectives inside a group: every micro-batch gathers the
    blocks twice and the root once; the last reduce-scatters every gradient."""
    units, root = (FLOAT_BYTES * gathered_numbers(facts[k], shard) for k in ("units", "root"))
    return {
        "allgather": accumulate * (2 * units + root),
        "reduce_scatter": units + root,
        "shard": (units + root) / shard,
    }


def predict_fsdp(
    profile: Profile, world_size: int, link: Link, o: FSDPOptions, cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    """All-gathers and a reduce-scatter inside each group (on a node's links when a group fits
    in one), each gradient shard all-reduced across groups, FSDP2's prefetch hiding what the
    forward and backward passes cover."""
    shard = o.group_size or world_size
    if world_size % shard:
        raise ConfigError(f"fsdp: groups of {shard} ranks do not divide {world_size} ranks")
    groups = world_size // shard
    step = sharded_step_bytes(profile.facts["fsdp"], shard, cfg.train.accumulate)
    inside = sent_bytes("allgather", step["allgather"] / shard, shard) + sent_bytes(
        "reduce_scatter", step["reduce_scatter"], shard
    )
    across = sent_bytes("allreduce", step["shard"], groups)
    spans = shard >= link.ranks_per_node  # a column's ranks sit on different nodes once groups fill nodes
    comm = (
        link.allgather(step["allgather"] / shard, shard, world_size)
        + link.reduce_scatter(step["reduce_scatter"], shard, world_size)
        + link.allreduce(step["shard"], groups, world_size, spans_nodes=spans)
    )
    hidden = min(comm, link.overlap * (profile.forward_seconds + profile.backward_seconds))
    return Prediction(
        "fsdp",
        world_size,
        profile.step_seconds,
        0.0,
        comm,
        hidden,
        inside + across,
        inside * link.node_share(shard) + across * link.node_share(groups, spans),
    )


def sharded_memory(profile: Profile, shard: int) -> Memory:
    """A model sharded over `shard` ranks (shard_model's units): its share, and what it holds
    gathered at once, the root and the largest unit's parameter twice (backward prefetches the next)."""
    if shard <= 1:
        return Memory()
    facts = profile.facts["fsdp"]
    largest = max((math.prod(s) for s in facts["units"]), default=0)
    return Memory(1 / shard, sum(math.prod(s) for s in facts["root"]) + 2 * largest)


def fsdp_memory(profile: Profile, ranks: int, ranks_per_node: int, options: FSDPOptions, cfg: Config) -> Memory:
    return sharded_memory(profile, options.group_size or ranks)


def fsdp_quality(options: FSDPOptions | None, cfg: Config) -> str:
    """Exact: ddp's gradient, reduced in another order."""
    return ""


@register(
    "fsdp",
    options=FSDPOptions,
    cost=MethodCost(
        predict_fsdp,
        model_facts=fsdp_facts,
        quality=fsdp_quality,
        memory=fsdp_memory,
        memory_forms=(("fsdp in each node, all-reduced across (HSDP)", {"group_size": NODE}),),
    ),
)
class FullyShardedDataParallel(Method):
    """ddp's training with the model, gradients and optimiser state sharded (FSDP2)."""

    @classmethod
    def engine_needed(cls, cfg: Config) -> str | None:
        return "torch"

    @classmethod
    def check_world(cls, cfg: Config, world_size: int) -> None:
        check_sharding_world(cfg, world_size, cfg.options.group_size, "fsdp.group_size")

    def setup(self, model: torch.nn.Module) -> None:
        self.model = shard_the_replicas(model, self.options.group_size)
        self.optimizer = make_optimizer(self.cfg, self.model)  # over this rank's shards

    def start_micro_batch(self, last: bool) -> None:
        assert self.model is not None
        self.model.set_requires_gradient_sync(last)  # earlier micro-batches accumulate unreduced

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.model is not None and self.optimizer is not None
        self.optimizer.zero_grad()
        loss = self.forward_backward(x, y)
        if self.cfg.train.clip_grad_norm:  # the norm over every shard: one all-reduce
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad_norm)
        self.optimizer.step()
        return loss

    def final_state_dict(self) -> dict[str, Any] | None:
        return full_state_dict(self.model)

    def state_dict(self) -> dict[str, Any]:
        return {}  # all of it is sharded: sharded_state_dict

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def sharded_state_dict(self) -> dict[str, Any]:
        return sharded_state(self.model, self.optimizer)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        load_sharded_state(self.model, self.optimizer, state)

    @classmethod
    def reshards(cls, cfg: Config) -> bool:
        return True

    def summary_metrics(self) -> dict[str, Any]:
        assert self.model is not None
        shards = sum(p.to_local().numel() for p in self.model.parameters())
        total = sum(p.numel() for p in self.model.parameters())
        hsdp = 0 < self.options.group_size < runtime.size()
        return {"parameter_share_per_rank": shards / max(total, 1), **(group_traffic(("replicate",)) if hsdp else {})}
