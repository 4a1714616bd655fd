"""What dAD's exchange asks of a sharing strategy, one per mode: exact_rows.py (dAD),
factor_rows.py (rank-dAD), recomputed_deltas.py (edAD). The exchange (captures, plan, scaling,
the one collective) is common to them (hvd_lowcomm.methods.dad.exchange)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn as nn


Rows = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Exchange(Protocol):
    """What a sharing may read and call of the exchange that drives it (DadExchange)."""

    frozen: set[str]  # layers whose weight the user froze
    effective_ranks: dict[str, list[int]]  # per layer, the rank each step's factors kept
    generator: torch.Generator  # random starts, the same sequence on every rank

    def layer(self, name: str) -> nn.Module: ...

    def group_size(self) -> int: ...

    def local_rows(self, name: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def local_row_count(self, name: str) -> int: ...

    def local_weight_gradient(self, module: nn.Module) -> torch.Tensor: ...

    def set_pooled_gradient(self, param: nn.Parameter, pooled: torch.Tensor) -> None: ...

    def apply_rows(self, name: str, pooled: torch.Tensor, total_batch: float, with_bias: bool) -> None: ...


class Sharing:
    """How one mode of dAD turns layers' rows into what ranks share, and what they share back
    into gradients. The exchange (captures, plan, scaling, the one collective) is common."""

    label = "dAD"
    shares_every_layer = False  # share every supported layer whatever the plan's cost rule says
    carries_bias = True  # the shared rows give the bias gradient too

    def planned_rows(self, module: nn.Module, rows: int, world_size: int) -> tuple[int, int]:
        """Rows all ranks share per step for this layer (`rows`: its rows over all ranks at the
        first step), and numbers still allreduced beside them."""
        return rows, 0

    def needs_rows(self, exchange: Exchange, name: str) -> bool:
        return True

    def half_rows(self, world_size: int) -> bool:
        """Whether the shared rows travel as float16 among `p` ranks."""
        return False

    def keeps_weight_gradient(self, exchange: Exchange, name: str) -> bool:
        """Whether autograd's local weight gradient is still needed (not skipped after the plan)."""
        return False

    def payload(
        self, exchange: Exchange, rows: Rows, layers: list[str], scale: float
    ) -> list[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def factor_errors(self) -> dict[str, dict[str, list[torch.Tensor]]]:
        """Per-step factor errors by series and layer, for the epoch record (exact modes: none)."""
        return {}

    def exact_layers(self, shared_layers: list[str]) -> list[str]:
        """Planned layers (of `shared_layers`) whose exact gradient is allreduced this step."""
        return []

    def fallen_back(self) -> list[str]:
        """Planned layers handed back to an exact allreduce for the rest of the run."""
        return []

    def votes(self, layers: list[str]) -> list[tuple[str, torch.Tensor]]:
        """Numbers summed over the ranks in the step's own allreduce (no round of their own)."""
        return []

    def count_votes(self, layers: list[str], summed: list[torch.Tensor]) -> None:
        pass

    def exact_gradient(self, exchange: Exchange, name: str, scale: float) -> torch.Tensor:
        """This rank's exact weight gradient of an exact layer, × `scale`, to be allreduced."""
        raise NotImplementedError

    def exact_name(self, name: str) -> str:
        """The name the exact gradient of layer `name` travels under."""
        return f"allreduce.{name}.weight"

    def state_dict(self) -> dict[str, Any]:
        """What the sharing carries from step to step (a checkpoint's, per rank)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def apply(
        self, exchange: Exchange, results: dict[str, torch.Tensor], layers: list[str], total_batch: float
    ) -> None:
        raise NotImplementedError
