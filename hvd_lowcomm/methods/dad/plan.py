"""dAD's view of a model: which layers form their gradient from rows, and the per-layer plan
(share rows where that sends fewer bytes than allreducing the gradient)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from hvd_lowcomm.comm.traffic import FLOAT_BYTES, wire_bytes
from hvd_lowcomm.metrics import human_bytes
from hvd_lowcomm.models.layer_kinds import is_tied, kind_of, shared_weights


# ---------------------------------------------------------------------------------------------
# layers as rows


def supports(module: nn.Module) -> bool:
    """Whether the layer's gradient is Δᵀ A over rows (hvd_lowcomm.models.layer_kinds)."""
    kind = kind_of(module)
    return kind is not None and kind.has_rows(module)


def row_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers whose gradient dAD forms from rows: supported ones whose weight no other
    module uses (a tied weight's gradient also has the other use's part, which the rows lack;
    such a layer is allreduced)."""
    shared = shared_weights(model)
    return {name: m for name, m in model.named_modules() if supports(m) and not is_tied(m, shared)}


def left_to_allreduce(model: nn.Module) -> dict[str, str]:
    """Layers with a weight matrix that dAD allreduces whatever the plan, and why."""
    shared, why = shared_weights(model), {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or not name:
            continue
        kind = kind_of(module)
        if kind is None:
            why[name] = f"{type(module).__name__}: not a layer kind dAD forms from rows"
        elif not kind.has_rows(module):
            why[name] = (
                f"{type(module).__name__}: no exact rows (not a Conv2d, "
                f"or groups > 1, padding given as a string or not zeros)"
            )
        elif is_tied(module, shared):
            why[name] = "weight tied to another module's"
    return why


def activation_rows(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The layer's input as rows × fan_in (im2col patches for Conv2d)."""
    return kind_of(module).input_rows(module, inputs)


def delta_rows(module: nn.Module, grad_output: torch.Tensor) -> torch.Tensor:
    """∂L/∂(layer output) as rows × fan_out, rows ordered as in activation_rows."""
    return kind_of(module).output_rows(module, grad_output)


def fan_in_out(module: nn.Module) -> tuple[int, int]:
    d_out, d_in = kind_of(module).shape(module)
    return d_in, d_out


# ---------------------------------------------------------------------------------------------
# the plan


@dataclass
class LayerPlan:
    name: str
    weight_shape: tuple[int, ...]
    rows: int  # rows shared per step by all ranks together
    shared_wire_bytes: float  # what sharing activations + deltas (or factors) costs one rank
    allreduce_wire_bytes: float
    choice: str  # "dad" or "allreduce"


def plan_layer(
    name: str,
    module: nn.Module,
    rows: int,
    world_size: int,
    extra_allreduce: int = 0,
    force: bool = False,
    half_rows: bool = False,
) -> LayerPlan:
    """Share rows for this layer when that sends fewer bytes than allreducing its gradient.

    rows·(d_in + d_out) numbers are allgathered ((p-1)/p of them cross the wire per rank)
    against weight + bias numbers allreduced (2 (p-1)/p). The comparison drops the common
    (p-1)/p factor, so it is the same on one rank. `extra_allreduce` counts numbers the
    sharing variant still allreduces (rank-dAD's bias); `half_rows`: the rows travel as float16.
    """
    d_in, d_out = fan_in_out(module)
    params = sum(p.numel() for p in module.parameters(recurse=False))
    p = world_size
    shared_wire = wire_bytes("allgather", rows * shared_row_bytes(d_in, d_out, half_rows), p) + wire_bytes(
        "allreduce", extra_allreduce * FLOAT_BYTES, p
    )
    allreduce_wire = wire_bytes("allreduce", params * FLOAT_BYTES, p)
    share = force or sharing_is_cheaper(rows, d_in, d_out, params, extra_allreduce, half_rows)
    return LayerPlan(
        name, tuple(module.weight.shape), rows, shared_wire, allreduce_wire, "dad" if share else "allreduce"
    )


def shared_row_bytes(d_in: int, d_out: int, half: bool = False) -> int:
    """Bytes of one shared row of d_in + d_out numbers (a float16 row of rank-dAD's factors
    carries a float32 scale for each of its two parts)."""
    return (d_in + d_out) * 2 + 2 * FLOAT_BYTES if half else (d_in + d_out) * FLOAT_BYTES


def sharing_is_cheaper(
    rows: int, d_in: int, d_out: int, params: int, extra_allreduce: int = 0, half_rows: bool = False
) -> bool:
    """The plan's rule: `rows` rows of d_in + d_out numbers shared by all ranks together (plus
    `extra_allreduce` numbers still allreduced, which cost twice) against `params` allreduced."""
    return (
        rows * shared_row_bytes(d_in, d_out, half_rows) + 2 * FLOAT_BYTES * extra_allreduce < 2 * FLOAT_BYTES * params
    )


def format_plan(plans: list[LayerPlan], left: dict[str, str] | None = None) -> str:
    """The plan as a table, and the layers with a weight matrix left to allreduce (`left`:
    name -> why), so that no layer's treatment goes unsaid."""
    width = max([16, *(len(lp.name) for lp in plans)])
    lines = [f"{'layer':<{width}} {'weight':<18} {'rows/step':>9} {'share':>11} {'allreduce':>11}  choice"]
    for lp in plans:
        lines.append(
            f"{lp.name:<{width}} {'x'.join(map(str, lp.weight_shape)):<18} {lp.rows:>9} "
            f"{human_bytes(lp.shared_wire_bytes):>11} {human_bytes(lp.allreduce_wire_bytes):>11}  {lp.choice}"
        )
    lines += [f"{name:<{width}} allreduce: {why}" for name, why in (left or {}).items()]
    return "\n".join(lines)
