"""`--method diloco`: the built-in loop's adapter to DiLoCo, registered with its options and cost."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.config import Config
from hvd_lowcomm.costmodel import MethodCost
from hvd_lowcomm.data import ShardedBatches
from hvd_lowcomm.elastic.protocol import Launch
from hvd_lowcomm.methods.diloco.algorithm import DiLoCo, check_elastic
from hvd_lowcomm.methods.diloco.cost import diloco_facts, diloco_memory, predict_diloco
from hvd_lowcomm.methods.diloco.options import DiLoCoOptions, fragment_bounds
from hvd_lowcomm.methods.fsdp import check_sharding_world, shard_the_replicas
from hvd_lowcomm.methods.grouped import GroupTrainerMethod
from hvd_lowcomm.registry import register


@register(
    "diloco",
    options=DiLoCoOptions,
    cost=MethodCost(
        predict_diloco,
        model_facts=diloco_facts,
        memory=diloco_memory,
        memory_forms=(("diloco + shard (FSDP in each group)", {"shard": True}),),
    ),
)
class DiLoCoMethod(GroupTrainerMethod):
    """`--method diloco`: DiLoCo driven by the built-in loop."""

    trainer_class = DiLoCo
    trainer_arguments = {"join": False}  # the loop joins after it restored any checkpoint (join_run)

    def check_model(self, model: nn.Module) -> None:
        fragment_bounds([p.numel() for p in model.parameters() if p.requires_grad], self.options.fragments)

    @classmethod
    def engine_needed(cls, cfg: Config) -> str | None:
        return "torch" if cfg.options.shard else None

    @classmethod
    def check_world(cls, cfg: Config, world_size: int) -> None:
        if Launch.from_environment() is None:
            super().check_world(cfg, world_size)
            return
        check_elastic(cfg.options)  # under the elastic launcher this job is one group
        cls.check_groups(cfg, 1, world_size)

    @classmethod
    def check_groups(cls, cfg: Config, groups: int, world_size: int) -> None:
        if cfg.options.shard:
            check_sharding_world(cfg, world_size, world_size // groups, "diloco.groups' group size")

    def setup(self, model: nn.Module) -> None:
        if self.options.shard:  # FSDP2 over each group, the same start in every group
            elastic = Launch.from_environment() is not None  # then this job is one group
            groups = 1 if elastic else runtime.default_group_count(self.options.groups, runtime.size())
            model = shard_the_replicas(model, runtime.size() // groups, replicate=False)
        super().setup(model)

    def batches(self, split: Any, batch_size: int, shuffle: bool, device: torch.device) -> Any:
        """Under the elastic launcher, this group's share of the data is its slot's: its ranks
        read as ranks slot * N + i of groups * N."""
        launch = Launch.from_environment()
        if launch is None:
            return super().batches(split, batch_size, shuffle, device)
        n = runtime.size()
        return ShardedBatches(
            split,
            batch_size,
            launch.slot * n + runtime.rank(),
            launch.groups * n,
            seed=self.cfg.train.seed,
            shuffle=shuffle,
            device=device,
        )

    def join_run(self, resumed_at: int | None, load: Callable[[], None]) -> int:
        return self.trainer.join(resumed_at, load)

    def request_stop(self) -> bool:
        return self.trainer.request_stop()

    def stop_requested(self) -> bool:
        return self.trainer.stop_requested

    def start_micro_batch(self, last: bool) -> None:
        if self.options.shard:
            self.model.set_requires_gradient_sync(last)  # earlier micro-batches accumulate unreduced

    def final_state_dict(self) -> dict[str, Any] | None:
        return self.trainer.full_state_dict()

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = self.forward_backward(x, y)
        self.trainer.step()
        return loss
