"""`powersgd`: low-rank gradient compression (Vogels et al. 2019), by concern: options, the
algorithm (`PowerSGDOptimizer`, `PowerSGDState`), its cost, and the built-in loop's adapter
(registered on import)."""

from __future__ import annotations

from hvd_lowcomm.methods.powersgd.adapter import PowerSGD
from hvd_lowcomm.methods.powersgd.algorithm import PowerSGDOptimizer, PowerSGDState, all_finite, orthogonalise
from hvd_lowcomm.methods.powersgd.cost import (
    powersgd_facts,
    powersgd_kernels,
    powersgd_quality,
    predict_powersgd,
    predict_sharded_powersgd,
)
from hvd_lowcomm.methods.powersgd.options import PowerSGDOptions, compresses, highest_rank, planned_rank

__all__ = [
    "PowerSGD",
    "PowerSGDOptimizer",
    "PowerSGDOptions",
    "PowerSGDState",
    "all_finite",
    "compresses",
    "highest_rank",
    "orthogonalise",
    "planned_rank",
    "powersgd_facts",
    "powersgd_kernels",
    "powersgd_quality",
    "predict_powersgd",
    "predict_sharded_powersgd",
]
