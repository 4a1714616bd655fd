"""`dad`, `rank-dad`, `edad`: ranks share layer activations and deltas instead of gradients, by
concern: options, the per-layer plan, the algorithm (`DadOptimizer`), its exchange and one
sharing strategy per mode (exact rows, factor rows, recomputed deltas), its cost, and the
built-in loop's adapters (registered on import)."""

from __future__ import annotations

from hvd_lowcomm.methods.dad.adapter import DistributedAutoDiff, EfficientDistributedAutoDiff, RankDistributedAutoDiff
from hvd_lowcomm.methods.dad.algorithm import DadOptimizer, check_dad_model
from hvd_lowcomm.methods.dad.exact_rows import ExactRows
from hvd_lowcomm.methods.dad.factor_rows import FactorRows
from hvd_lowcomm.methods.dad.recomputed_deltas import RecomputedDeltas, edad_chain
from hvd_lowcomm.methods.dad.cost import (
    dad_kernels,
    predict_dad,
    predict_edad,
    predict_rank_dad,
    rank_dad_kernels,
    shared_layers,
)
from hvd_lowcomm.methods.dad.options import DAD_MODES, DadOptions, RankDadOptions, planned_rank
from hvd_lowcomm.methods.dad.plan import (
    LayerPlan,
    format_plan,
    left_to_allreduce,
    plan_layer,
    row_layers,
    shared_row_bytes,
    sharing_is_cheaper,
    supports,
)

__all__ = [
    "DAD_MODES",
    "DadOptimizer",
    "DadOptions",
    "DistributedAutoDiff",
    "EfficientDistributedAutoDiff",
    "ExactRows",
    "FactorRows",
    "LayerPlan",
    "RankDadOptions",
    "RankDistributedAutoDiff",
    "RecomputedDeltas",
    "check_dad_model",
    "dad_kernels",
    "edad_chain",
    "format_plan",
    "left_to_allreduce",
    "plan_layer",
    "planned_rank",
    "predict_dad",
    "predict_edad",
    "predict_rank_dad",
    "rank_dad_kernels",
    "row_layers",
    "shared_layers",
    "shared_row_bytes",
    "sharing_is_cheaper",
    "supports",
]
