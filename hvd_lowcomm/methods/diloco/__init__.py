"""`diloco`: DiLoCo-style local SGD in groups with an outer optimiser, by concern: options,
the algorithm (`DiLoCo`), its cost, and the built-in loop's adapter (registered on import)."""

from __future__ import annotations

from hvd_lowcomm.methods.diloco.adapter import DiLoCoMethod
from hvd_lowcomm.methods.diloco.algorithm import DiLoCo, Fragment, InFlight
from hvd_lowcomm.methods.diloco.cost import diloco_facts, predict_diloco
from hvd_lowcomm.methods.diloco.options import (
    DiLoCoOptions,
    LowRankOptions,
    SparseOptions,
    fragment_bounds,
    shard_length,
    sync_due,
)

__all__ = [
    "DiLoCo",
    "DiLoCoMethod",
    "DiLoCoOptions",
    "Fragment",
    "InFlight",
    "LowRankOptions",
    "SparseOptions",
    "diloco_facts",
    "fragment_bounds",
    "predict_diloco",
    "shard_length",
    "sync_due",
]
