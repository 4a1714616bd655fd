"""`ab`: AB-training, low-rank factors trained by groups, by concern: options and schedule, the
algorithm (`ABTraining`), its cost, and the built-in loop's adapter (registered on import)."""

from __future__ import annotations

from hvd_lowcomm.methods.ab.adapter import AB
from hvd_lowcomm.methods.ab.algorithm import (
    ABTraining,
    ModelInput,
    _resize,
    check_factorizable,
    check_outputs_fit_labels,
)
from hvd_lowcomm.methods.ab.cost import ab_kernels, assumed_rank, predict_ab
from hvd_lowcomm.methods.ab.options import ABOptions, Schedule, check_groups

__all__ = [
    "AB",
    "ABOptions",
    "ABTraining",
    "ModelInput",
    "Schedule",
    "_resize",
    "ab_kernels",
    "assumed_rank",
    "check_factorizable",
    "check_groups",
    "check_outputs_fit_labels",
    "predict_ab",
]
