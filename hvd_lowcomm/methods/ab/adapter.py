"""`--method ab`: the built-in loop's adapter to ABTraining, registered with its options and cost."""

from __future__ import annotations

import torch
import torch.nn as nn

from hvd_lowcomm import task
from hvd_lowcomm.config import Config
from hvd_lowcomm.costmodel import MethodCost, replicated
from hvd_lowcomm.methods.ab.algorithm import ABTraining, check_factorizable
from hvd_lowcomm.methods.ab.cost import ab_kernels, predict_ab
from hvd_lowcomm.methods.ab.options import ABOptions, check_groups
from hvd_lowcomm.methods.grouped import GroupTrainerMethod
from hvd_lowcomm.registry import register


# The paper trains with AdamW and weight decay 0.1: decay shrinks the directions the gradient
# does not sustain, which is what a cut removes.
@register(
    "ab",
    options=ABOptions,
    presets={"train.optimizer": "adamw", "train.weight_decay": 0.1},
    cost=MethodCost(predict_ab, ab_kernels, memory=replicated),  # its peak: the dense model's full-rank phases
)
class AB(GroupTrainerMethod):
    """`--method ab`: ABTraining driven by the built-in loop."""

    trainer_class = ABTraining
    # The built-in loop's loss fails on the first step if the model's output does not fit the
    # task's labels: no probe forward pass of its own
    trainer_arguments = {"check_outputs": False}

    @classmethod
    def check_groups(cls, cfg: Config, groups: int, world_size: int) -> None:
        check_groups(cfg.options, groups, world_size)

    def check_model(self, model: nn.Module) -> None:
        example = task.example_input(
            2, tuple(self.data.input_shape), self.data.vocabulary, torch.Generator().manual_seed(0)
        )
        check_factorizable(model, self.options.full_rank, example)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with self.trainer.step(x, y):
            self.optimizer.zero_grad()
            loss = self.forward_backward(x, y)
        return loss
