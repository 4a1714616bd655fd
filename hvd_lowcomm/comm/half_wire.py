"""Compressed factors in float16 on the wire, scaled so that they stay in its range.

float16 halves the bytes, but its range is narrow: normal numbers run from 6e-5 to
65504, so a gradient factor of 1e-7 keeps a few of its bits and one of 1e5 overflows (Horovod's
`Compression.fp16` and PyTorch's fp16 hooks simply cast, and lean on AMP's loss scaling). Here
every rank multiplies a tensor by the same power of two before the cast: the one that puts the
largest value of that tensor's previous sum at 2**7, leaving a factor of 2**8 of headroom for growth and
more than 20 binades of full precision below it. The previous sum is an allreduce's result, the
same on every rank, so every rank picks the same scale without a message; a tensor summed for the
first time (or after a non-finite sum) is scaled from its ranks' largest values, summed in one
small allreduce. A sum that overflows all the same (a sudden spike, or ranks' values cancelling)
is redone in float32: every rank sees the same inf, so every rank redoes it. Scaling by a power of
two is exact, so the only error is float16's rounding (a relative 2**-11 per number), which the
callers' error feedback adds back at the next step.

Rows that are gathered rather than summed (rank-dAD's factor rows) need no agreement: each row
travels with its own power of two (`to_half_rows`, `from_half_rows`).
"""

from __future__ import annotations

import math

import torch

from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import meter

# The previous sum's largest value is placed at 2**HEADROOM_EXPONENT (float16 reaches 2**16).
HEADROOM_EXPONENT = 7
# A gathered row's largest value is placed at 2**ROW_EXPONENT: nothing is added to it on the way.
ROW_EXPONENT = 14


def to_half_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` as float16, each multiplied by the power of two that puts its largest |value| at
    2**ROW_EXPONENT, and those multipliers (one float32 column)."""
    largest = rows.abs().amax(dim=1, keepdim=True)
    exponents = torch.where(largest > 0, ROW_EXPONENT - torch.ceil(torch.log2(largest)), torch.zeros_like(largest))
    scales = torch.exp2(exponents)
    return (rows * scales).half(), scales


def from_half_rows(half: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 rows `to_half_rows` encoded (exactly what every receiver decodes)."""
    return half.float() / scales


class HalfSums:
    """Float16 sums over a group, with each named tensor's scale carried from sum to sum
    (`state_dict` for checkpoints: an exact resume must pick the same scales)."""

    def __init__(self, label: str) -> None:
        self.label = label  # names the one-off agreement in Horovod and the meter
        self.largest: dict[str, float] = {}  # each tensor's largest |value| in its last sum

    def allreduce(
        self, halves: list[tuple[str, torch.Tensor]], exact: list[tuple[str, torch.Tensor]], group: Group | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Sums over `group` of `halves` (float16 on the wire, float32 back) and of `exact` (as
        they are), submitted together: one Horovod cycle unless a scale must first be agreed or
        a float16 sum overflows."""
        self._agree_missing(halves, group)
        scales = {name: self._scale(name) for name, _ in halves}
        outs = meter.allreduce_many([(name, (t * scales[name]).half()) for name, t in halves] + exact, group, op="sum")
        sums = [out.float() / scales[name] for (name, _), out in zip(halves, outs)]
        if not all(bool(torch.isfinite(s).all()) for s in sums):
            sums = meter.allreduce_many(halves, group, op="sum")  # the same on every rank, so all redo it
        for (name, _), total in zip(halves, sums):
            self.largest[name] = float(total.abs().max()) if total.numel() else 0.0
        return sums, outs[len(halves) :]

    def _scale(self, name: str) -> float:
        largest = self.largest[name]
        if not math.isfinite(largest) or largest <= 0:
            return 1.0
        return 2.0 ** (HEADROOM_EXPONENT - math.ceil(math.log2(largest)))

    def _agree_missing(self, halves: list[tuple[str, torch.Tensor]], group: Group | None) -> None:
        """Scales for tensors without a usable previous sum: the ranks' largest values, summed
        (a bound on the largest value of their sum)."""
        missing = [(name, t) for name, t in halves if not math.isfinite(self.largest.get(name, math.nan))]
        if not missing:
            return
        local = torch.tensor([float(t.abs().max()) if t.numel() else 0.0 for _, t in missing])
        (bounds,) = meter.allreduce_many([(f"{self.label}.scales", local)], group, op="sum")
        self.largest.update({name: float(bound) for (name, _), bound in zip(missing, bounds)})

    def state_dict(self) -> dict[str, float]:
        return dict(self.largest)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.largest = dict(state)
