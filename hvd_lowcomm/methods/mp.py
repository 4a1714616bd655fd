"""`mp`: conventional model parallelism, the baseline for SIL.

The sequential model is cut into partitions held by groups of ranks (hvd_lowcomm.methods.partition);
every step sends each batch's activations forward to the next group and their gradients back,
and each group averages its partition's gradients among its own ranks (data parallel within a
partition when groups have several ranks).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import group_layout
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, meter
from hvd_lowcomm.config import Config, ConfigError
from hvd_lowcomm.registry import register
from hvd_lowcomm.methods.base import Method, make_optimizer
from hvd_lowcomm.methods.partition import (
    Layout,
    PartitionOptions,
    cut_points,
    describe,
    joined_state_dict,
    partitioned_cost,
    pipeline_evaluate,
    pipeline_train_step,
)


class Partitioned(Method):
    """What mp and sil share: the layout, partition-local optimiser, joined evaluation."""

    default_model = "sil6"
    # Whether every partition must be able to learn on its own (two weight layers with a
    # non-linearity between them): SIL's partitions do, mp's learn end to end.
    needs_deep_partitions = False

    @classmethod
    def check_world(cls, cfg: Config, world_size: int) -> None:
        t = cfg.train
        if t.clip_grad_norm:
            raise ConfigError(
                f"{cls.name} does not support train.clip_grad_norm: each partition holds only its "
                f"part of the gradient, so no rank knows its norm; leave it at 0 for {cls.name}"
            )
        if t.accumulate > 1 or t.amp != "none":
            raise ConfigError(
                f"{cls.name} does not support train.accumulate or train.amp yet (its partitions "
                f"train by their own step functions); leave them at 1 and none for {cls.name}"
            )
        group_layout(world_size, num_groups=cfg.options.partitions)

    def check_model(self, model: torch.nn.Module) -> None:
        cut_points(model, self.options.partitions, self.options.cuts, self.needs_deep_partitions, self.data.input_shape)

    def setup(self, model: torch.nn.Module) -> None:
        self.layout = self.make_layout(model)
        self.model = self.layout.module
        self.pass_seconds = self.layout.pass_seconds  # the partition's own passes, as the loop reports them
        self.optimizer = make_optimizer(self.cfg, self.model)  # replicas equal: Layout saw to it
        runtime.announce(f"{self.name}: {describe(self.layout)}")
        for warning in self.partition_warnings():
            runtime.announce(f"warning: {warning}")

    def make_layout(self, model: torch.nn.Module) -> Layout:
        return Layout(model, self.options, self.data.input_shape, self.needs_deep_partitions)

    def partition_warnings(self) -> list[str]:
        return []

    def batches(self, split: Any, batch_size: int, shuffle: bool, device: torch.device) -> Any:
        return self.layout.batches(split, batch_size, shuffle, self.cfg.train.seed, device)

    def state_owner(self) -> int:
        return self.layout.group.ranks[0]  # one rank per partition group holds its partition

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, float]:
        return pipeline_evaluate(self.layout, batches)

    def epoch_metrics(self) -> dict[str, Any]:
        between = sum(
            t.payload_bytes for (phase, op, _), t in meter.by_kind.items() if phase == "train" and op == "send"
        )
        within = meter.total_on(("partition",))
        own = sum(p.numel() for p in self.model.parameters())
        return {
            "partition": self.layout.index,
            "between_partitions_bytes": between,
            "within_partition_wire_bytes": within,
            "parameter_bytes": FLOAT_BYTES * own,
            "parameter_fraction": own / self.layout.whole_model_parameters,
        }

    def summary_metrics(self) -> dict[str, Any]:
        return {**self.epoch_metrics(), "partitions": self.layout.table}

    def joined_state_dict(self) -> dict[str, torch.Tensor] | None:
        return joined_state_dict(self.layout)

    final_state_dict = joined_state_dict


@register("mp", options=PartitionOptions, cost=partitioned_cost("mp", exchanges_activations=True, need_depth=False))
class ModelParallel(Partitioned):
    """Model parallelism: activations forward and gradients back between partition groups every step."""

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return pipeline_train_step(self.layout, self.optimizer, x, y)
