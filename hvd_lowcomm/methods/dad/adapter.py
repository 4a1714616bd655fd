"""`--method dad`, `rank-dad`, `edad`: the built-in loop's adapters to DadOptimizer, registered
with their options and cost."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import Config, ConfigError
from hvd_lowcomm.costmodel import MethodCost, replicated
from hvd_lowcomm.methods.dad.algorithm import DadOptimizer, check_dad_model
from hvd_lowcomm.methods.dad.cost import (
    dad_kernels,
    edad_layers,
    predict_dad,
    predict_edad,
    predict_rank_dad,
    rank_dad_kernels,
    rank_dad_quality,
    shared_layers,
)
from hvd_lowcomm.methods.dad.options import DadOptions, RankDadOptions
from hvd_lowcomm.methods.ddp import DataParallel
from hvd_lowcomm.registry import register


@register(
    "dad",
    options=DadOptions,
    cost=MethodCost(predict_dad, dad_kernels, shared_layers, quality=lambda *_: "", memory=replicated),
    drop_in=True,
)
class DistributedAutoDiff(DataParallel):
    """Exact dAD: allgather [activations | deltas] per planned layer, allreduce the rest."""

    honours_compression = False  # rows and factors travel in fp32
    edad = False

    def check_model(self, model: nn.Module) -> None:
        check_dad_model(model, self.edad)

    def distribute(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return DadOptimizer(
            optimizer,
            model,
            plan=self.options.plan,
            seed=self.cfg.train.seed,
            backward_passes_per_step=self.cfg.train.accumulate,
        )

    def summary_metrics(self) -> dict[str, Any]:
        return {f"plan/{name}": lp.choice for name, lp in self.optimizer.plan.items()}

    def local_state_dict(self) -> dict[str, Any]:
        # rank-dAD's random starts, and its error feedback and last ranks (each rank's own)
        return {
            "power_iteration_generator": self.optimizer.generator.get_state(),
            **self.optimizer.sharing.state_dict(),
        }

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.generator.set_state(state["power_iteration_generator"])
        self.optimizer.sharing.load_state_dict(state)

    def epoch_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        exact = self.optimizer.sharing.fallen_back()
        for name, lp in self.optimizer.plan.items():
            out[f"plan/{name}"] = "allreduce (fallen back)" if name in exact else lp.choice
        for name, totals in meter.by_name.items():
            if name.split(".", 1)[0] in ("dad", "rank-dad", "edad", "allreduce"):
                out[f"layer_payload_bytes/{name}"] = totals.payload_bytes
        for name, ks in self.optimizer.effective_ranks.items():
            if ks:
                out[f"effective_rank/{name}"] = sum(ks) / len(ks)
                ks.clear()
        for label, per_layer in self.optimizer.sharing.factor_errors().items():
            for name, values in per_layer.items():
                if values:  # averaged over the epoch's steps
                    out[f"{label}/{name}"] = float(torch.stack(values).mean())
                    values.clear()
        return out


@register(
    "rank-dad",
    options=RankDadOptions,
    cost=MethodCost(
        predict_rank_dad,
        lambda *a: {**dad_kernels(*a), **rank_dad_kernels(*a)},
        shared_layers,
        rank_dad_quality,
        judged=True,
        memory=replicated,
    ),
    drop_in=True,
)
class RankDistributedAutoDiff(DistributedAutoDiff):
    """rank-dAD: each rank shares k <= r power-iteration factors per planned layer."""

    def distribute(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return DadOptimizer(
            optimizer,
            model,
            mode="rank",
            options=self.options,
            seed=self.cfg.train.seed,
            backward_passes_per_step=self.cfg.train.accumulate,
        )


@register("edad", cost=MethodCost(predict_edad, dad_kernels, edad_layers, memory=replicated))
class EfficientDistributedAutoDiff(DistributedAutoDiff):
    """edAD: share all activations and only the output delta; recompute hidden deltas (exact MLPs)."""

    edad = True

    def distribute(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return DadOptimizer(optimizer, model, mode="edad", seed=self.cfg.train.seed)

    @classmethod
    def check_world(cls, cfg: Config, world_size: int) -> None:
        # Hidden deltas are recomputed from the output delta and the shared activations of one
        # forward pass: several micro-batches (or bf16 activations) break that recomputation.
        t = cfg.train
        if t.accumulate > 1 or t.amp != "none":
            raise ConfigError(
                "edad does not support train.accumulate or train.amp (it recomputes hidden deltas "
                "from one fp32 forward pass); use dad, which does, or leave them at 1 and none"
            )
