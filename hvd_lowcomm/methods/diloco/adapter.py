"""`--method diloco`: the built-in loop's adapter to DiLoCo, registered with its options and cost."""
from __future__ import annotations

import torch
import torch.nn as nn

from hvd_lowcomm.costmodel import MethodCost
from hvd_lowcomm.methods.diloco.algorithm import DiLoCo
from hvd_lowcomm.methods.diloco.cost import diloco_facts, predict_diloco
from hvd_lowcomm.methods.diloco.options import DiLoCoOptions, fragment_bounds
from hvd_lowcomm.methods.grouped import GroupTrainerMethod
from hvd_lowcomm.registry import register


@register("diloco", options=DiLoCoOptions, cost=MethodCost(predict_diloco, model_facts=diloco_facts))
class DiLoCoMethod(GroupTrainerMethod):
    """`--method diloco`: DiLoCo driven by the built-in loop."""

    trainer_class = DiLoCo

    def check_model(self, model: nn.Module) -> None:
        fragment_bounds([p.numel() for p in model.parameters() if p.requires_grad], self.options.fragments)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = self.forward_backward(x, y)
        self.trainer.step()
        return loss
