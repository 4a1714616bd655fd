"""The `powersgd` Method the built-in loop drives (registered on import)."""

from __future__ import annotations

from typing import Any

import torch

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.mesh import full_state_dict, load_sharded_state, sharded_state
from hvd_lowcomm.config import Config
from hvd_lowcomm.costmodel import NODE, MethodCost
from hvd_lowcomm.registry import register
from hvd_lowcomm.methods.base import make_optimizer
from hvd_lowcomm.methods.ddp import DataParallel
from hvd_lowcomm.methods.grouped import group_traffic
from hvd_lowcomm.methods.fsdp import check_sharding_world, shard_the_replicas
from hvd_lowcomm.methods.powersgd.algorithm import PowerSGDOptimizer, PowerSGDState
from hvd_lowcomm.methods.powersgd.cost import (
    powersgd_facts,
    powersgd_kernels,
    powersgd_memory,
    powersgd_quality,
    predict_powersgd,
)
from hvd_lowcomm.methods.powersgd.options import PowerSGDOptions


@register(
    "powersgd",
    options=PowerSGDOptions,
    cost=MethodCost(
        predict_powersgd,
        powersgd_kernels,
        powersgd_facts,
        powersgd_quality,
        judged=True,
        memory=powersgd_memory,
        memory_forms=(("powersgd + shard_group_size a node", {"shard_group_size": NODE}),),
    ),
    drop_in=True,
)
class PowerSGD(DataParallel):
    """Gradients compressed to rank-r factors before they are averaged (PowerSGD)."""

    honours_compression = False  # its own compression

    @classmethod
    def engine_needed(cls, cfg: Config) -> str | None:
        return "torch" if cfg.options.shard_group_size else None

    @classmethod
    def check_world(cls, cfg: Config, world_size: int) -> None:
        if cfg.options.shard_group_size:
            check_sharding_world(cfg, world_size, cfg.options.shard_group_size, "powersgd.shard_group_size")

    def setup(self, model: torch.nn.Module) -> None:
        size = self.options.shard_group_size
        if not size:
            super().setup(model)
            return
        self.model = shard_the_replicas(model, size, replicate=False)  # PowerSGD then joins the groups
        self.optimizer = self.distribute(make_optimizer(self.cfg, self.model), self.model)

    def distribute(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
        state = PowerSGDState(self.options, seed=self.cfg.train.seed)
        return PowerSGDOptimizer(
            optimizer, model.named_parameters(), state=state, backward_passes_per_step=self.cfg.train.accumulate
        )

    def start_micro_batch(self, last: bool) -> None:
        if self.options.shard_group_size:
            self.model.set_requires_gradient_sync(last)  # earlier micro-batches accumulate unreduced

    def final_state_dict(self) -> dict[str, Any] | None:
        return full_state_dict(self.model) if self.options.shard_group_size else super().final_state_dict()

    def epoch_metrics(self) -> dict[str, Any]:
        """The compression rate so far, and each compressed matrix's current rank and kept
        energy at its last measurement (effective_rank/<parameter>, kept_energy/<parameter>)."""
        state = self.optimizer.powersgd
        return {
            "powersgd_compression_rate": state.compression_rate(),
            **{f"effective_rank/{name}": rank for name, rank in state.ranks.items()},
            **{f"kept_energy/{name}": kept for name, kept in state.kept_energy.items()},
            **(group_traffic(("column",)) if self.options.shard_group_size else {}),
        }

    summary_metrics = epoch_metrics

    def state_dict(self) -> dict[str, Any]:
        own = {} if self.options.shard_group_size else super().state_dict()  # sharded: in sharded_state_dict
        return {**own, "powersgd": self.optimizer.powersgd.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.options.shard_group_size:
            super().load_state_dict(state)
        self.optimizer.powersgd.load_state_dict(state["powersgd"])

    def sharded_state_dict(self) -> dict[str, Any] | None:
        return sharded_state(self.model, self.optimizer) if self.options.shard_group_size else None

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        load_sharded_state(self.model, self.optimizer, state)

    def state_owner(self) -> int:
        return runtime.rank()  # error-feedback buffers are each rank's own
