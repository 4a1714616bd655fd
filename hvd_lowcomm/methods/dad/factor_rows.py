"""rank-dAD's sharing: k factor rows of each rank's local gradient per layer (its top singular
triplets), adaptive in k, with error feedback and an exact fallback."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.half_wire import from_half_rows, to_half_rows
from hvd_lowcomm.methods.adaptive_rank import smallest_rank_within
from hvd_lowcomm.methods.dad.options import PLANNED_ADAPTIVE_RANK, RankDadOptions, planned_rank
from hvd_lowcomm.methods.dad.plan import fan_in_out
from hvd_lowcomm.methods.dad.sharing import Exchange, Rows, Sharing
from hvd_lowcomm.methods.dad.lowrank import cheapest_way, factors_from_rows, gradient_power_iteration, missed_energy
from hvd_lowcomm.models.layer_kinds import kind_of


# A layer goes to the exact allreduce only after this many steps in a row over the target at
# max_rank: one step's spike (a loss jump) does not show a gradient the factors cannot follow.
FALLBACK_STEPS = 10


class FactorRows(Sharing):
    """rank-dAD: every rank shares k factor rows of its local gradient (its top singular
    triplets, hvd_lowcomm.methods.dad.lowrank); biases are allreduced.

    Adaptive (rank 0, the default): k is each layer's own, the fewest components that leave out
    at most `error_target` of the local gradient's energy (hvd_lowcomm.methods.adaptive_rank), at
    most `max_rank`. Components are iterated for twice the layer's last k (the spectrum moves
    slowly from step to step), so a layer that needs more grows by doubling. A fixed rank
    keeps that many (as far as the gradient has them). With `error_feedback` what a rank's
    factors leave out of its gradient is added to its next one (the factors then come from the
    gradient itself, G + e)."""

    carries_bias = False

    def __init__(self, options: "RankDadOptions") -> None:
        self.options = options
        self.iterations, self.tol = options.iterations, options.tol
        self.adaptive, self.error_feedback = options.rank == 0, options.error_feedback
        self.label = (
            f"rank-dAD (r={options.rank})"
            if not self.adaptive
            else f"rank-dAD (adaptive: at most {options.error_target:g} of each gradient's energy left out, "
            f"r <= {options.max_rank})"
        )
        self.last_rank: dict[str, int] = {}  # k each layer kept at its last step
        self.errors: dict[str, torch.Tensor] = {}  # error feedback: what the factors left out
        self.errors_before: dict[str, torch.Tensor] = {}  # the errors before this step's exchange
        # per layer and step, as 0-d tensors (no host sync on the step): the share of (G + e)'s
        # energy the sent factors left out, and the fed-back error against the step's gradient, ‖e‖ / ‖G‖
        self.missed_shares: dict[str, list[float]] = {}
        self.feedback_norms: dict[str, list[float]] = {}
        self.fallback = self.adaptive and options.exact_fallback
        self.over_target: dict[str, torch.Tensor] = {}  # this step: 1 where max_rank missed more than the target
        self.steps_over_target: dict[str, int] = {}  # agreed by every rank: consecutive steps over it
        self.exact: list[str] = []  # layers handed to an exact allreduce
        self.steps_done = 0  # exchanges so far: the first start_iter allreduce every exact gradient

    def planned_rows(self, module: nn.Module, rows: int, world_size: int) -> tuple[int, int]:
        return world_size * planned_rank(self.options), module.bias.numel() if module.bias is not None else 0

    def iterated_rank(self, name: str) -> int:
        """Components to compute for layer `name` this step."""
        if not self.adaptive:
            return self.options.rank
        return min(
            self.options.max_rank, max(self.options.min_rank, 2 * self.last_rank.get(name, PLANNED_ADAPTIVE_RANK // 2))
        )

    def from_gradient(self, exchange: Exchange, name: str) -> bool:
        """Whether the factors come from the local weight gradient autograd formed (iterating on
        it is cheapest: a conv layer's many rows; or error feedback needs G itself) rather than
        from the rows."""
        module = exchange.layer(name)
        d_in, d_out = fan_in_out(module)
        way = cheapest_way(exchange.local_row_count(name), d_in, d_out, self.iterated_rank(name), self.iterations)
        return (way == "gradient" or self.error_feedback) and module.weight.requires_grad

    def needs_rows(self, exchange: Exchange, name: str) -> bool:
        return not self.from_gradient(exchange, name)

    def half_rows(self, world_size: int) -> bool:
        return self.options.factor_dtype == "float16" and world_size > 1

    def keeps_weight_gradient(self, exchange: Exchange, name: str) -> bool:
        return self.error_feedback or self.from_gradient(exchange, name)

    def factors_of(
        self, exchange: Exchange, name: str, rows: Rows, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's k factor rows [σ_i b_i | c_i] of layer `name`'s local gradient as they go on
        the wire: float16 with a float32 (k × 2) of their scales, else float32 and None."""
        local = rows[name] if name in rows else (exchange.local_weight_gradient(exchange.layer(name)),)
        if not all(bool(torch.isfinite(t).all()) for t in local):  # (a GradScaler's overflow)
            return self.non_finite_row(exchange, name)
        iterate = (self.iterated_rank(name), self.iterations, self.tol, exchange.generator)
        if name in rows:
            b_rows, c_rows = factors_from_rows(*rows[name], *iterate)
            if self.adaptive:
                energy = float(b_rows.pow(2).sum()) + missed_energy(*rows[name], (b_rows, c_rows), exchange.generator)
        else:
            module = exchange.layer(name)  # its weight's gradient is Σ Δᵀ A over this rank's rows: Gᵀ
            gradient = kind_of(module).matrix(module, exchange.local_weight_gradient(module).float()).T * scale
            if self.error_feedback and name in self.errors:
                fed_back = self.errors[name] * scale
                self.feedback_norms.setdefault(name, []).append(fed_back.norm() / gradient.norm().clamp_min(1e-30))
                gradient += fed_back
            b_rows, c_rows = gradient_power_iteration(gradient, *iterate)
            energy = float(gradient.pow(2).sum())
        if self.adaptive:
            k = max(
                self.options.min_rank, smallest_rank_within(b_rows.pow(2).sum(1), energy, self.options.error_target)
            )
            b_rows, c_rows = b_rows[:k], c_rows[:k]
        packed: tuple[torch.Tensor, torch.Tensor | None] = (torch.cat([b_rows, c_rows], dim=1), None)
        if self.half_rows(exchange.group_size()):
            # b (σ b: the gradient's scale) and c (unit length) each with their own power of two;
            # decoded here as every rank will, so that the error below includes the rounding
            (b_half, b_scales), (c_half, c_scales) = to_half_rows(b_rows), to_half_rows(c_rows)
            packed = torch.cat([b_half, c_half], dim=1), torch.cat([b_scales, c_scales], dim=1)
            b_rows, c_rows = from_half_rows(b_half, b_scales), from_half_rows(c_half, c_scales)
        if name not in rows:
            missed = gradient - b_rows.T @ c_rows
            self.missed_shares.setdefault(name, []).append(missed.pow(2).sum() / max(energy, 1e-30))
            if self.error_feedback and bool(torch.isfinite(gradient).all()):
                self.errors[name] = missed / scale
        elif self.adaptive:
            self.missed_shares.setdefault(name, []).append((1 - b_rows.pow(2).sum() / max(energy, 1e-30)).clamp_min(0))
        if self.fallback:  # the target missed with every component allowed: the factors cannot follow
            at_ceiling = self.iterated_rank(name) == self.options.max_rank
            self.over_target[name] = (self.missed_shares[name][-1] > self.options.error_target).float() * at_ceiling
        self.last_rank[name] = max(1, b_rows.shape[0])
        return packed

    def non_finite_row(self, exchange: Exchange, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One NaN row in place of a non-finite local gradient's factors (which an SVD refuses):
        every rank's pooled gradient is then NaN, so a GradScaler skips the step on all."""
        d_in, d_out = fan_in_out(exchange.layer(name))
        row = exchange.layer(name).weight.new_full((1, d_in + d_out), math.nan)
        return (row.half(), row.new_ones(1, 2)) if self.half_rows(exchange.group_size()) else (row, None)

    def factor_errors(self) -> dict[str, dict[str, list[torch.Tensor]]]:
        return {"missed_energy": self.missed_shares, "feedback_norm": self.feedback_norms}

    def warming_up(self) -> bool:
        """Whether this step is one of the first start_iter, which allreduce every exact gradient."""
        return self.steps_done < self.options.start_iter

    def exact_layers(self, shared_layers: list[str]) -> list[str]:
        return list(shared_layers) if self.warming_up() else self.exact

    def fallen_back(self) -> list[str]:
        return self.exact

    def exact_name(self, name: str) -> str:
        # the first start_iter steps are named as PowerSGD's plain ones: the traffic says which it was
        return f"rank-dad.warmup.{name}.weight" if self.warming_up() else super().exact_name(name)

    def votes(self, layers: list[str]) -> list[tuple[str, torch.Tensor]]:
        if not self.fallback or not layers:
            return []
        flags = [self.over_target.pop(n, None) for n in layers]
        device = next((f.device for f in flags if f is not None), torch.device("cpu"))  # the model's
        return [
            ("rank-dad.over_target", torch.stack([torch.zeros((), device=device) if f is None else f for f in flags]))
        ]

    def count_votes(self, layers: list[str], summed: list[torch.Tensor]) -> None:
        """A layer over the target on any rank for FALLBACK_STEPS steps in a row allreduces its
        exact gradient from the next step on (every rank counts the same summed votes)."""
        if not summed:
            return
        for name, votes in zip(layers, summed[0].tolist()):
            self.steps_over_target[name] = self.steps_over_target.get(name, 0) + 1 if votes > 0 else 0
            if self.steps_over_target[name] >= FALLBACK_STEPS:
                self.exact.append(name)
                runtime.announce(
                    f"rank-dAD: {name}'s {self.options.max_rank} components left out more than "
                    f"{self.options.error_target:g} of its gradient's energy for {FALLBACK_STEPS} steps "
                    f"in a row: it allreduces its exact gradient from the next step on"
                )

    def exact_gradient(self, exchange: Exchange, name: str, scale: float) -> torch.Tensor:
        """The local gradient (from the rows where autograd no longer forms it), with what the
        factors still owed it added once."""
        module = exchange.layer(name)
        kind = kind_of(module)
        if module.weight.requires_grad:
            gradient = exchange.local_weight_gradient(module).float() * scale
        else:
            acts, deltas = exchange.local_rows(name, scale)
            gradient = kind.from_matrix(module, deltas.T @ acts)
        owed = self.errors.pop(name, None)  # (d_in × d_out, unscaled: factors_of's orientation)
        return gradient if owed is None else gradient + kind.from_matrix(module, owed.T * scale).reshape(gradient.shape)

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_rank": dict(self.last_rank),
            "errors": dict(self.errors),
            "exact": list(self.exact),
            "steps_over_target": dict(self.steps_over_target),
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_rank, self.errors = dict(state.get("last_rank", {})), dict(state.get("errors", {}))
        self.exact, self.steps_over_target = list(state.get("exact", [])), dict(state.get("steps_over_target", {}))
        self.steps_done = int(state.get("steps_done", 0))

    def payload(
        self, exchange: Exchange, rows: Rows, layers: list[str], scale: float
    ) -> list[tuple[str, torch.Tensor]]:
        # Each rank sends its own k rows (Horovod's allgather takes a different count from every
        # rank), so the ranks need not agree on k first; a rank with none sends one zero row.
        self.errors_before = dict(self.errors)  # (given back if a GradScaler skips the step)
        shared = []
        for n in layers:
            payload, scales = self.factors_of(exchange, n, rows, scale)
            exchange.effective_ranks[n].append(payload.shape[0])
            if not len(payload):
                payload, scales = (
                    payload.new_zeros(1, payload.shape[1]),
                    None if scales is None else scales.new_ones(1, 2),
                )
            shared.append((f"rank-dad.{n}", payload))
            if scales is not None:  # two float32 per row, gathered in the same cycle
                shared.append((f"rank-dad.{n}.scales", scales))
        return shared

    def apply(
        self, exchange: Exchange, results: dict[str, torch.Tensor], layers: list[str], total_batch: float
    ) -> None:
        self.steps_done += 1
        if not all(bool(torch.isfinite(t).all()) for t in results.values()):
            self.errors = self.errors_before  # an inf or NaN on some rank: the step will be skipped
        for n in layers:
            pooled, scales = results[f"rank-dad.{n}"], results.get(f"rank-dad.{n}.scales")
            if scales is not None:  # [σ b | c] rows, each part with its power of two
                d_in = fan_in_out(exchange.layer(n))[0]
                pooled = torch.cat(
                    [from_half_rows(pooled[:, :d_in], scales[:, :1]), from_half_rows(pooled[:, d_in:], scales[:, 1:])],
                    dim=1,
                )
            exchange.apply_rows(n, pooled, total_batch, with_bias=False)
