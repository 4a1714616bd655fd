"""dAD's sharing: every rank's [activations | deltas] rows, exact."""

from __future__ import annotations


import torch

from hvd_lowcomm.methods.dad.sharing import Exchange, Rows, Sharing


class ExactRows(Sharing):
    """dAD: every rank shares its [activations | deltas] rows; ∇W = Δᵀ A over the pooled rows."""

    def payload(
        self, exchange: Exchange, rows: Rows, layers: list[str], scale: float
    ) -> list[tuple[str, torch.Tensor]]:
        return [(f"dad.{n}", torch.cat(rows[n], dim=1)) for n in layers]

    def apply(
        self, exchange: Exchange, results: dict[str, torch.Tensor], layers: list[str], total_batch: float
    ) -> None:
        for n in layers:
            exchange.apply_rows(n, results[f"dad.{n}"], total_batch, with_bias=True)
