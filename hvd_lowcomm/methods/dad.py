"""`dad`, `rank-dad`, `edad`: ranks share layer activations and deltas instead of gradients.

Baker, Calhoun, Pearlmutter, Plis, "Efficient Distributed Auto-Differentiation" (arXiv 2102.09631).
For a layer y = x Wᵀ + b the local gradient is Δᵀ A (A: input rows, Δ: output deltas). Instead
of allreducing d_out·d_in numbers, every rank allgathers its rows [A | Δ], rows·(d_in + d_out)
numbers, and every rank forms the pooled gradient [Δ_1; ...; Δ_p]ᵀ [A_1; ...; A_p] itself.

- Linear layers use their input rows directly (leading dimensions become rows); Conv2d layers
  (groups = 1, zero padding) use im2col: rows are (sample, output position) pairs, activations
  the unfolded input patches. Both are exact.
- A per-layer plan, fixed at the first step from shapes, rows and world size, shares
  activations only where that puts fewer bytes on the wire than allreducing the gradient
  (plan "auto"), or for every supported layer (plan "all"). Everything else is allreduced.
- Scaling: with the loss a mean over each rank's batch of N_s samples, rank s multiplies its
  deltas (and its allreduced gradients) by N_s, and the pooled sums are divided by N = sum of
  N_s, which is allreduced in the same exchange: the result is exactly the gradient of the mean
  loss over the pooled batch, also for unequal batch sizes. The exchange is one Horovod cycle
  (allgathers and allreduces submitted together).
- rank-dAD replaces each rank's rows by k <= r factor rows: the top singular triplets of the
  local gradient, computed the cheapest way for the layer's shapes (hvd_lowcomm.methods.lowrank: exactly
  from few rows, by power iteration on the gradient autograd formed for a conv layer's many
  rows, or by structured power iteration); each rank sends its own k rows (Horovod's allgather
  takes a different count from each rank). Bias gradients, which factors do not carry, are
  allreduced. The k each layer keeps is its "effective rank".
- edAD shares every layer's activations but only the output layer's deltas; each rank
  recomputes the hidden deltas from the known weights and activation derivatives. It is exact,
  and therefore allowed, only for nn.Sequential MLPs of Linear layers and element-wise
  activations whose derivative is a function of their output (ReLU, LeakyReLU, Tanh, Sigmoid).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
import math
from typing import Any, Callable

import torch
import torch.nn as nn

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.half_wire import from_half_rows, to_half_rows
from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, meter, wire_bytes
from hvd_lowcomm.config import Config, ConfigError, make_options, option
from hvd_lowcomm.costmodel import Link, LayerSample, MethodCost, Prediction, Profile, RunAssumptions, sent_bytes
from hvd_lowcomm.metrics import human_bytes
from hvd_lowcomm.registry import register
from hvd_lowcomm.methods.drop_in import (GradientExchange, HorovodArguments, NamedParameters, dense_gradient,
                                        horovod_arguments, wrap_optimizer)
from hvd_lowcomm.methods.ddp import DataParallel
from hvd_lowcomm.methods.adaptive_rank import smallest_rank_within
from hvd_lowcomm.methods.lowrank import cheapest_way, factors_from_rows, gradient_power_iteration, missed_energy
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
            why[name] = f"{type(module).__name__}: no exact rows (not a Conv2d, or groups > 1, padding given as a string or not zeros)"
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
    rows: int                 # rows shared per step by all ranks together
    shared_wire_bytes: float  # what sharing activations + deltas (or factors) costs one rank
    allreduce_wire_bytes: float
    choice: str               # "dad" or "allreduce"


def plan_layer(name: str, module: nn.Module, rows: int, world_size: int, extra_allreduce: int = 0,
               force: bool = False, half_rows: bool = False) -> LayerPlan:
    """Share rows for this layer when that sends fewer bytes than allreducing its gradient.

    rows·(d_in + d_out) numbers are allgathered ((p-1)/p of them cross the wire per rank)
    against weight + bias numbers allreduced (2 (p-1)/p). The comparison drops the common
    (p-1)/p factor, so it is the same on one rank. `extra_allreduce` counts numbers the
    sharing variant still allreduces (rank-dAD's bias); `half_rows`: the rows travel as float16.
    """
    d_in, d_out = fan_in_out(module)
    params = sum(p.numel() for p in module.parameters(recurse=False))
    p = world_size
    shared_wire = wire_bytes("allgather", rows * shared_row_bytes(d_in, d_out, half_rows), p) + \
        wire_bytes("allreduce", extra_allreduce * FLOAT_BYTES, p)
    allreduce_wire = wire_bytes("allreduce", params * FLOAT_BYTES, p)
    share = force or sharing_is_cheaper(rows, d_in, d_out, params, extra_allreduce, half_rows)
    return LayerPlan(name, tuple(module.weight.shape), rows, shared_wire, allreduce_wire,
                     "dad" if share else "allreduce")


def shared_row_bytes(d_in: int, d_out: int, half: bool = False) -> int:
    """Bytes of one shared row of d_in + d_out numbers (a float16 row of rank-dAD's factors
    carries a float32 scale for each of its two parts)."""
    return (d_in + d_out) * 2 + 2 * FLOAT_BYTES if half else (d_in + d_out) * FLOAT_BYTES


def sharing_is_cheaper(rows: int, d_in: int, d_out: int, params: int, extra_allreduce: int = 0,
                       half_rows: bool = False) -> bool:
    """The plan's rule: `rows` rows of d_in + d_out numbers shared by all ranks together (plus
    `extra_allreduce` numbers still allreduced, which cost twice) against `params` allreduced."""
    return rows * shared_row_bytes(d_in, d_out, half_rows) + 2 * FLOAT_BYTES * extra_allreduce < \
        2 * FLOAT_BYTES * params


def format_plan(plans: list[LayerPlan], left: dict[str, str] | None = None) -> str:
    """The plan as a table, and the layers with a weight matrix left to allreduce (`left`:
    name -> why), so that no layer's treatment goes unsaid."""
    width = max([16, *(len(lp.name) for lp in plans)])
    lines = [f"{'layer':<{width}} {'weight':<18} {'rows/step':>9} {'share':>11} {'allreduce':>11}  choice"]
    for lp in plans:
        lines.append(f"{lp.name:<{width}} {'x'.join(map(str, lp.weight_shape)):<18} {lp.rows:>9} "
                     f"{human_bytes(lp.shared_wire_bytes):>11} {human_bytes(lp.allreduce_wire_bytes):>11}  {lp.choice}")
    lines += [f"{name:<{width}} allreduce: {why}" for name, why in (left or {}).items()]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the optimiser wrapper

@dataclass
class _Capture:
    acts: list[torch.Tensor] = field(default_factory=list)
    deltas: dict[int, torch.Tensor] = field(default_factory=dict)  # by the index of their activation
    input_requires_grad: bool = False  # the output's gradient flows without the weight's


class _DadExchange(GradientExchange):
    """Mixed into the user's optimiser class by DadOptimizer: captures every supported layer's
    activations and deltas, plans per layer, and runs one exchange per step; what is shared and
    how gradients come back from it is the `sharing` strategy's (ExactRows, FactorRows,
    RecomputedDeltas)."""

    def __init__(self, params: Any, named_parameters: NamedParameters, model: nn.Module, sharing: "_Sharing",
                 plan: str, arguments: HorovodArguments, seed: int) -> None:
        super().__init__(params)
        self._model, self.sharing = model, sharing
        self._force_all = plan == "all" or sharing.shares_every_layer
        self._layers = row_layers(model)
        self._captured = {name: _Capture() for name in self._layers}
        # Hooks are closures that check their module: a deep copy of the model (an EMA copy, a
        # reference) keeps them, and its passes must not count as this model's.
        for name, module in self._layers.items():
            module.register_forward_hook(self._capture_hook(name, module))
        # Samples of this rank's batch: every forward pass of the model counts its batch once
        # (micro-batches add up; a layer used twice in one pass does not count twice).
        self._samples: list[int] = []
        model.register_forward_pre_hook(
            lambda module, inputs, kwargs: self._count_samples(inputs, kwargs) if module is model else None,
            with_kwargs=True)
        self._set_up_exchange(arguments, named_parameters, "DadOptimizer")
        self.plan: dict[str, LayerPlan] = {}
        self.planned = False  # the plan is made once, at the first step (it may be empty)
        self.frozen: set[str] = set()  # layers whose weight the user froze (seen at the plan)
        self.effective_ranks: dict[str, list[int]] = {name: [] for name in self._layers}
        self.generator = torch.Generator().manual_seed(seed)  # rank-dAD's random starts

    def _count_samples(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The first tensor argument: model(x), or model(input_ids=x, labels=x) as HF users call it.
        first = next((v for v in (*inputs, *kwargs.values()) if torch.is_tensor(v)), None)
        if torch.is_grad_enabled() and first is not None:
            self._samples.append(first.shape[0])

    def _capture_hook(self, name: str, layer: nn.Module):
        capture = self._captured[name]

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if module is layer and torch.is_grad_enabled() and output.requires_grad:
                index = len(capture.acts)
                capture.acts.append(inputs[0].detach())
                capture.input_requires_grad = inputs[0].requires_grad
                # Deltas arrive in backward order: reversed within one backward pass (a layer
                # used twice), in order across several (micro-batches); the index pairs them.
                output.register_hook(lambda grad: self._delta_arrived(capture, index, grad))
        return hook

    def _delta_arrived(self, capture: _Capture, index: int, grad: torch.Tensor) -> None:
        capture.deltas[index] = grad.detach()
        self._backward_running()  # (a weight whose gradient rows form fires no gradient hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clear_captures()
        super().zero_grad(set_to_none)

    def _clear_captures(self) -> None:
        self._samples.clear()
        for capture in self._captured.values():
            capture.acts.clear()
            capture.deltas.clear()

    # -- the exchange --------------------------------------------------------------------------
    def _exchange(self) -> None:
        """Replace every local gradient by the pooled batch's, sharing rows where planned."""
        used = [n for n, c in self._captured.items() if c.acts]
        if not used and not self._samples:
            raise RuntimeError("dAD optimizer: no forward pass with gradients was seen before step()")
        local_batch = sum(self._samples) or self._captured[used[0]].acts[0].shape[0]
        # The pooled gradient Σ_s (N_s/N) g_s is formed as (1/N) Σ_s N_s g_s: every rank scales
        # its deltas and gradients by its own N_s, and N = Σ N_s travels in the exchange itself,
        # so the step needs no collective round of its own to agree on N.
        scale = float(local_batch)
        first_step = not self.planned
        if first_step:  # every layer's rows, to plan from their shapes and the pooled batch
            p = self.group_size()
            with meter.in_phase("setup"):  # once per run (and again after a resume): not a step's traffic
                (total_batch,) = meter.allreduce_ints([local_batch], "dad.plan_batch_size", self.group)
            self._make_plan({n: self.local_rows(n, scale) for n in used}, local_batch, total_batch, p)
        shared_layers = [n for n in used if self.plan[n].choice == "dad"]
        if first_step:
            self._stop_unused_weight_gradients(shared_layers)
        # Rows only where they are shared: a conv layer's im2col rows cost more than its
        # allreduce saves; rank-dAD's factors of a conv layer come from its gradient instead.
        rows = {n: self.local_rows(n, scale) for n in shared_layers if self.sharing.needs_rows(self, n)}

        shared = self.sharing.payload(self, rows, shared_layers, scale)
        covered = {id(p) for n in shared_layers for p in self._layers[n].parameters(recurse=False)}
        if not self.sharing.carries_bias:  # allreduce autograd's bias gradient (= scaled delta sums)
            covered -= {id(self._layers[n].bias) for n in shared_layers if self._layers[n].bias is not None}
        others = [p for group in self.param_groups for p in group["params"]
                  if id(p) not in covered and p.requires_grad]
        reduced = [(f"allreduce.{self._names.get(p, id(p))}",
                    dense_gradient(p) * scale) for p in others]
        reduced.append(("dad.batch_size", torch.tensor([scale])))

        gathered, summed = meter.gather_and_reduce(shared, reduced, self.group, op="sum")
        total_batch = float(summed[-1])
        self.sharing.apply(self, dict(zip([n for n, _ in shared], gathered)), shared_layers, total_batch)
        for param, value in zip(others, summed):
            param.grad = value / total_batch
        self._clear_captures()

    def _stop_unused_weight_gradients(self, shared_layers: list[str]) -> None:
        """Autograd's local gradient of a weight whose pooled gradient is formed from rows is
        never used, and costs about half of the layer's backward pass: from the next step on,
        the weight does not require a gradient (its .grad is still set at every step, so the
        optimiser sees no difference). Kept where the output's gradient, which the rows need,
        would then not flow (no bias and an input that requires none: a first layer) and where
        the sharing takes the local gradient itself (rank-dAD on a conv layer)."""
        for name in shared_layers:
            module, capture = self._layers[name], self._captured[name]
            flows = capture.input_requires_grad or (module.bias is not None and module.bias.requires_grad)
            if flows and not self.sharing.keeps_weight_gradient(self, name):
                module.weight.requires_grad_(False)

    def local_rows(self, name: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's [activations, deltas × scale] rows of layer `name`."""
        module, capture = self._layers[name], self._captured[name]
        if len(capture.deltas) != len(capture.acts):
            raise RuntimeError(f"dAD: layer {name} ran forward {len(capture.acts)} times but got "
                               f"{len(capture.deltas)} deltas; call backward() before step()")
        # fp32 rows whatever autocast computed in (train.amp): gradients and the wire stay fp32.
        acts = torch.cat([activation_rows(module, a.float()) for a in capture.acts])
        # Hooks fire in backward order; reversing restores forward order for repeated uses.
        deltas = torch.cat([delta_rows(module, capture.deltas[i].float()) for i in range(len(capture.acts))]) * scale
        return acts, deltas

    def local_row_count(self, name: str) -> int:
        """Rows of layer `name` on this rank this step (without forming them)."""
        d_out = fan_in_out(self._layers[name])[1]
        return sum(delta.numel() for delta in self._captured[name].deltas.values()) // d_out

    def layer(self, name: str) -> nn.Module:
        return self._layers[name]

    def _make_plan(self, rows: dict[str, tuple[torch.Tensor, torch.Tensor]], local_batch: int,
                   total_batch: int, world_size: int) -> None:
        for name, (acts, _) in rows.items():
            module = self._layers[name]
            positions = acts.shape[0] // local_batch
            shared_rows, extra = self.sharing.planned_rows(module, positions, total_batch, world_size)
            self.plan[name] = plan_layer(name, module, shared_rows, world_size, extra, force=self._force_all,
                                         half_rows=self.sharing.half_rows(world_size))
            if not module.weight.requires_grad:  # frozen by the user: no gradient to form for it
                self.frozen.add(name)
                if not self.sharing.shares_every_layer:  # (edAD still needs its rows for the deltas below)
                    self.plan[name] = replace(self.plan[name], choice="allreduce")
        left = {name: why for name, why in left_to_allreduce(self._model).items() if name not in self.plan}
        left.update({name: "not used with a gradient this step" for name in self._layers if name not in self.plan})
        self.planned = True
        runtime.announce(f"{self.sharing.label} plan (wire bytes per rank per step):\n"
                         f"{format_plan(list(self.plan.values()), left)}")

    def group_size(self) -> int:
        return self.group.size if self.group is not None else runtime.size()

    def apply_rows(self, name: str, pooled: torch.Tensor, total_batch: float, with_bias: bool) -> None:
        """∇W = Δᵀ A over the pooled rows [A | Δ] (Δ scaled by each rank's batch: divided by
        the pooled batch here); ∇b = column sums of Δ."""
        module = self._layers[name]
        d_in, _ = fan_in_out(module)
        acts, deltas = pooled[:, :d_in], pooled[:, d_in:] / total_batch
        module.weight.grad = kind_of(module).from_matrix(module, deltas.T @ acts)
        if with_bias and module.bias is not None and module.bias.requires_grad:
            module.bias.grad = deltas.sum(dim=0)


# ---------------------------------------------------------------------------------------------
# what is shared: one strategy per mode

Rows = dict[str, tuple[torch.Tensor, torch.Tensor]]


class _Sharing:
    """How one mode of dAD turns layers' rows into what ranks share, and what they share back
    into gradients. The exchange (captures, plan, scaling, the one collective) is common."""

    label = "dAD"
    shares_every_layer = False  # share every supported layer whatever the plan's cost rule says
    carries_bias = True         # the shared rows give the bias gradient too

    def planned_rows(self, module: nn.Module, positions: int, total_batch: int, world_size: int) -> tuple[int, int]:
        """Rows all ranks share per step for this layer, and numbers still allreduced beside them."""
        return positions * total_batch, 0

    def needs_rows(self, exchange: _DadExchange, name: str) -> bool:
        return True

    def half_rows(self, world_size: int) -> bool:
        """Whether the shared rows travel as float16 among `p` ranks."""
        return False

    def keeps_weight_gradient(self, exchange: _DadExchange, name: str) -> bool:
        """Whether autograd's local weight gradient is still needed (not skipped after the plan)."""
        return False

    def payload(self, exchange: _DadExchange, rows: Rows, layers: list[str], scale: float) -> list[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What the sharing carries from step to step (a checkpoint's, per rank)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def apply(self, exchange: _DadExchange, results: dict[str, torch.Tensor], layers: list[str],
              total_batch: float) -> None:
        raise NotImplementedError


class ExactRows(_Sharing):
    """dAD: every rank shares its [activations | deltas] rows; ∇W = Δᵀ A over the pooled rows."""

    def payload(self, exchange: _DadExchange, rows: Rows, layers: list[str], scale: float) -> list[tuple[str, torch.Tensor]]:
        return [(f"dad.{n}", torch.cat(rows[n], dim=1)) for n in layers]

    def apply(self, exchange: _DadExchange, results: dict[str, torch.Tensor], layers: list[str],
              total_batch: float) -> None:
        for n in layers:
            exchange.apply_rows(n, results[f"dad.{n}"], total_batch, with_bias=True)


class FactorRows(_Sharing):
    """rank-dAD: every rank shares k factor rows of its local gradient (its top singular
    triplets, hvd_lowcomm.methods.lowrank); biases are allreduced.

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
        self.label = f"rank-dAD (r={options.rank})" if not self.adaptive else \
            f"rank-dAD (adaptive: at most {options.error_target:g} of each gradient's energy left out, " \
            f"r <= {options.max_rank})"
        self.last_rank: dict[str, int] = {}        # k each layer kept at its last step
        self.errors: dict[str, torch.Tensor] = {}  # error feedback: what the factors left out
        self.errors_before: dict[str, torch.Tensor] = {}  # the errors before this step's exchange

    def planned_rows(self, module: nn.Module, positions: int, total_batch: int, world_size: int) -> tuple[int, int]:
        return world_size * planned_rank(self.options), module.bias.numel() if module.bias is not None else 0

    def iterated_rank(self, name: str) -> int:
        """Components to compute for layer `name` this step."""
        if not self.adaptive:
            return self.options.rank
        return min(self.options.max_rank, max(self.options.min_rank, 2 * self.last_rank.get(name, PLANNED_ADAPTIVE_RANK // 2)))

    def from_gradient(self, exchange: _DadExchange, name: str) -> bool:
        """Whether the factors come from the local weight gradient autograd formed (iterating on
        it is cheapest: a conv layer's many rows; or error feedback needs G itself) rather than
        from the rows."""
        module = exchange.layer(name)
        d_in, d_out = fan_in_out(module)
        way = cheapest_way(exchange.local_row_count(name), d_in, d_out, self.iterated_rank(name), self.iterations)
        return (way == "gradient" or self.error_feedback) and module.weight.grad is not None

    def needs_rows(self, exchange: _DadExchange, name: str) -> bool:
        return not self.from_gradient(exchange, name)

    def half_rows(self, world_size: int) -> bool:
        return self.options.factor_dtype == "float16" and world_size > 1

    def keeps_weight_gradient(self, exchange: _DadExchange, name: str) -> bool:
        return self.error_feedback or self.from_gradient(exchange, name)

    def factors_of(self, exchange: _DadExchange, name: str, rows: Rows, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's k factor rows [σ_i b_i | c_i] of layer `name`'s local gradient as they go on
        the wire: float16 with a float32 (k × 2) of their scales, else float32 and None."""
        local = rows[name] if name in rows else (exchange.layer(name).weight.grad,)
        if not all(bool(torch.isfinite(t).all()) for t in local):  # (a GradScaler's overflow)
            return self.non_finite_row(exchange, name)
        iterate = (self.iterated_rank(name), self.iterations, self.tol, exchange.generator)
        if name in rows:
            b_rows, c_rows = factors_from_rows(*rows[name], *iterate)
            if self.adaptive:
                energy = float(b_rows.pow(2).sum()) + missed_energy(*rows[name], (b_rows, c_rows), exchange.generator)
        else:
            module = exchange.layer(name)  # its weight's gradient is Σ Δᵀ A over this rank's rows: Gᵀ
            gradient = kind_of(module).matrix(module, module.weight.grad).T * scale
            if self.error_feedback and name in self.errors:
                gradient += self.errors[name] * scale
            b_rows, c_rows = gradient_power_iteration(gradient, *iterate)
            energy = float(gradient.pow(2).sum())
        if self.adaptive:
            k = max(self.options.min_rank, smallest_rank_within(b_rows.pow(2).sum(1), energy, self.options.error_target))
            b_rows, c_rows = b_rows[:k], c_rows[:k]
        packed: tuple[torch.Tensor, torch.Tensor | None] = (torch.cat([b_rows, c_rows], dim=1), None)
        if self.half_rows(exchange.group_size()):
            # b (σ b: the gradient's scale) and c (unit length) each with their own power of two;
            # decoded here as every rank will, so that the error below includes the rounding
            (b_half, b_scales), (c_half, c_scales) = to_half_rows(b_rows), to_half_rows(c_rows)
            packed = torch.cat([b_half, c_half], dim=1), torch.cat([b_scales, c_scales], dim=1)
            b_rows, c_rows = from_half_rows(b_half, b_scales), from_half_rows(c_half, c_scales)
        if self.error_feedback and name not in rows and bool(torch.isfinite(gradient).all()):
            self.errors[name] = (gradient - b_rows.T @ c_rows) / scale
        self.last_rank[name] = max(1, b_rows.shape[0])
        return packed

    def non_finite_row(self, exchange: _DadExchange, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One NaN row in place of a non-finite local gradient's factors (which an SVD refuses):
        every rank's pooled gradient is then NaN, so a GradScaler skips the step on all."""
        d_in, d_out = fan_in_out(exchange.layer(name))
        row = exchange.layer(name).weight.new_full((1, d_in + d_out), math.nan)
        return (row.half(), row.new_ones(1, 2)) if self.half_rows(exchange.group_size()) else (row, None)

    def state_dict(self) -> dict[str, Any]:
        return {"last_rank": dict(self.last_rank), "errors": dict(self.errors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_rank, self.errors = dict(state.get("last_rank", {})), dict(state.get("errors", {}))

    def payload(self, exchange: _DadExchange, rows: Rows, layers: list[str], scale: float) -> list[tuple[str, torch.Tensor]]:
        # Each rank sends its own k rows (Horovod's allgather takes a different count from every
        # rank), so the ranks need not agree on k first; a rank with none sends one zero row.
        self.errors_before = dict(self.errors)  # (given back if a GradScaler skips the step)
        shared = []
        for n in layers:
            payload, scales = self.factors_of(exchange, n, rows, scale)
            exchange.effective_ranks[n].append(payload.shape[0])
            if not len(payload):
                payload, scales = payload.new_zeros(1, payload.shape[1]), None if scales is None else scales.new_ones(1, 2)
            shared.append((f"rank-dad.{n}", payload))
            if scales is not None:  # two float32 per row, gathered in the same cycle
                shared.append((f"rank-dad.{n}.scales", scales))
        return shared

    def apply(self, exchange: _DadExchange, results: dict[str, torch.Tensor], layers: list[str],
              total_batch: float) -> None:
        if not all(bool(torch.isfinite(t).all()) for t in results.values()):
            self.errors = self.errors_before  # an inf or NaN on some rank: the step will be skipped
        for n in layers:
            pooled, scales = results[f"rank-dad.{n}"], results.get(f"rank-dad.{n}.scales")
            if scales is not None:  # [σ b | c] rows, each part with its power of two
                d_in = fan_in_out(exchange.layer(n))[0]
                pooled = torch.cat([from_half_rows(pooled[:, :d_in], scales[:, :1]),
                                    from_half_rows(pooled[:, d_in:], scales[:, 1:])], dim=1)
            exchange.apply_rows(n, pooled, total_batch, with_bias=False)


class RecomputedDeltas(_Sharing):
    """edAD: every layer's activations and the output layer's deltas are shared; each rank
    recomputes the hidden deltas from them and the known weights (exact for the MLPs
    `edad_chain` accepts)."""

    label = "edAD"
    shares_every_layer = True

    def __init__(self, model: nn.Module) -> None:
        self.chain = edad_chain(model)

    def payload(self, exchange: _DadExchange, rows: Rows, layers: list[str], scale: float) -> list[tuple[str, torch.Tensor]]:
        names = [n for n, _ in self.chain]
        shared = [(f"edad.acts.{n}", rows[n][0]) for n in names]
        shared.append((f"edad.delta.{names[-1]}", rows[names[-1]][1]))
        return shared

    def apply(self, exchange: _DadExchange, results: dict[str, torch.Tensor], layers: list[str],
              total_batch: float) -> None:
        names = [n for n, _ in self.chain]
        delta = results[f"edad.delta.{names[-1]}"] / total_batch  # the chain below is linear in it
        for index in range(len(names) - 1, -1, -1):
            name, module = names[index], exchange.layer(names[index])
            acts = results[f"edad.acts.{name}"]
            if name not in exchange.frozen:
                module.weight.grad = delta.T @ acts
            if module.bias is not None and module.bias.requires_grad:
                module.bias.grad = delta.sum(dim=0)
            if index:
                derivative = self.chain[index - 1][1]
                delta = (delta @ module.weight.detach()) * derivative(acts)


def check_dad_model(model: nn.Module, edad: bool) -> None:
    if not any(supports(m) for m in model.modules()):
        raise ConfigError("dAD needs at least one layer it can form from rows (Linear, Hugging Face Conv1D, "
                          "Conv2d with groups=1); this model has none: use --method ddp")
    if edad:
        edad_chain(model)


def edad_chain(model: nn.Module) -> list[tuple[str, Any]]:
    """[(linear name, derivative of the activation that follows it as a function of its output)],
    or ConfigError when recomputing hidden deltas would not be exact for this model."""
    derivatives = {
        nn.ReLU: lambda m: lambda out: (out > 0).to(out.dtype),
        nn.LeakyReLU: lambda m: lambda out: torch.where(out > 0, 1.0, m.negative_slope).to(out.dtype),
        nn.Tanh: lambda m: lambda out: 1 - out * out,
        nn.Sigmoid: lambda m: lambda out: out * (1 - out),
    }
    if not isinstance(model, nn.Sequential):
        raise ConfigError("edAD is exact only for nn.Sequential MLPs; use --method dad")
    chain: list[list[Any]] = []
    for name, module in model.named_children():
        if isinstance(module, nn.Flatten) and not chain:
            continue
        if isinstance(module, nn.Linear):
            if chain and chain[-1][1] is None:
                chain[-1][1] = lambda out: torch.ones_like(out)  # Linear followed directly by Linear
            chain.append([name, None])
        elif type(module) in derivatives and chain and chain[-1][1] is None:
            chain[-1][1] = derivatives[type(module)](module)
        elif isinstance(module, nn.Dropout) and module.p == 0:
            continue
        else:
            raise ConfigError(f"edAD is exact only for Linear layers and element-wise ReLU/LeakyReLU/Tanh/"
                              f"Sigmoid activations; layer {name} ({type(module).__name__}) breaks that: use --method dad")
    if not chain or chain[-1][1] is not None:
        raise ConfigError("edAD needs a model that ends with a Linear layer; use --method dad")
    return [(name, derivative) for name, derivative in chain]


@dataclass
class DadOptions:
    """Exact dAD: share activations and deltas instead of gradients."""

    plan: str = option("auto", "share rows where cheaper than allreduce (auto) or for every supported layer (all)",
                       choices=("auto", "all"))


@dataclass
class RankDadOptions(DadOptions):
    """rank-dAD: share the top singular triplets of each layer's local gradient as factor rows."""

    # Adaptive by default: no one rank suits every layer and model; what holds quality is feeding
    # back what the factors miss (docs: dad, "Error feedback"; docs: transformers, "Measured").
    rank: int = option(0, "components per layer; 0: adaptive, each layer keeps the fewest that leave out at "
                          "most error_target of its local gradient's energy, at most max_rank")
    # A tight target, paid for by the float16 rows' halved bytes (docs: dad, "Float16 rows").
    error_target: float = option(0.05, "adaptive rank: the largest share of a layer's local gradient energy its "
                                       "factors may leave out")
    # A floor, as PowerSGD's: the energy rule alone kept one or two components of a transformer's
    # layers, and what they dropped cost loss no later step won back (docs: dad, "How many").
    min_rank: int = option(16, "adaptive rank: the fewest components per layer (where the layer has them)")
    max_rank: int = option(32, "adaptive rank: the most components per layer")
    error_feedback: bool = option(True, "add what a rank's factors left out of its gradient to its next one "
                                        "(factors then come from the gradient autograd forms)")
    # The factor rows are fed back (the rounding joins each rank's error), so 16 bits per number
    # lose nothing error feedback does not add back, and halve the bytes.
    factor_dtype: str = option("float16", "number format of the factor rows on the wire: float16 (half the bytes; "
                                          "each row scaled by its own power of two) or float32",
                               choices=("float16", "float32"))
    iterations: int = option(10, "most power iterations where the triplets are iterated for (few rows give "
                                 "them exactly, without iterating)")
    tol: float = option(1e-3, "stop iterating when the subspace moves less than this; drop components "
                              "with sigma <= tol * sigma_1")

    def validate(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"rank-dad.rank must be >= 0 (0: adaptive), got {self.rank}")
        if not 0 < self.error_target < 1:
            raise ConfigError(f"rank-dad.error_target must be between 0 and 1, got {self.error_target}")
        if not 1 <= self.min_rank <= self.max_rank:
            raise ConfigError(f"rank-dad needs 1 <= min_rank <= max_rank, got {self.min_rank} and {self.max_rank}")
        if self.iterations < 1:
            raise ConfigError(f"rank-dad.iterations must be >= 1, got {self.iterations}")
        if self.tol <= 0:
            raise ConfigError(f"rank-dad.tol must be > 0, got {self.tol}")


DAD_MODES = ("exact", "rank", "edad")
# The k the plan and the cost model assume for an adaptive rank (they cannot know it before
# training): about the median rank-dAD kept on the benchmarks' transformers.
PLANNED_ADAPTIVE_RANK = 8


def planned_rank(options: "RankDadOptions") -> int:
    """The k per rank the plan and the cost model assume: the fixed rank, or
    PLANNED_ADAPTIVE_RANK (at least min_rank, at most max_rank) when adaptive."""
    return options.rank or min(options.max_rank, max(options.min_rank, PLANNED_ADAPTIVE_RANK))


def DadOptimizer(optimizer: torch.optim.Optimizer, named_parameters: NamedParameters | nn.Module | None = None,
                 compression: Any = None, backward_passes_per_step: int = 1, op: Any = None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: Any = None, *, model: nn.Module | None = None,
                 mode: str = "exact", plan: str = DadOptions.plan, group: Group | None = None, seed: int = 0,
                 options: "RankDadOptions | None" = None, **rank_options: Any) -> torch.optim.Optimizer:
    """Wrap `optimizer` so step() uses the pooled batch's gradient, built by (rank-/e)dAD.

    `model` is the module whose layers' activations and deltas are shared (it may also come
    second, in place of named_parameters: `DadOptimizer(opt, model)`). Horovod's arguments are
    taken as by every wrapper (hvd_lowcomm.methods.drop_in); compression: none for exact dAD
    and edAD (their rows are exact, in float32), none or fp16 for rank-dAD (its factor rows
    are float16 by default).

    mode "exact": dAD; "rank": rank-dAD, by default with each layer's rank adaptive; its
    options are RankDadOptions' (`options=`, or keywords: rank=r for a fixed rank, error_target,
    max_rank, error_feedback, iterations, tol; any of them given with the default mode means
    "rank"); "edad": edAD. plan "auto" shares rows only where that is cheaper than allreduce,
    "all" wherever supported. The loss must be a mean over the local batch (dim 0 of each
    layer's input). From the second step on, weights whose gradient comes from shared rows have
    requires_grad False (autograd's local gradient of them would go unused); their .grad is
    still set at every step.
    """
    if isinstance(named_parameters, nn.Module):
        if model is not None and model is not named_parameters:
            raise ConfigError("DadOptimizer: the module given second is not the model= given too")
        model, named_parameters = named_parameters, None
    if model is None:
        raise ConfigError("DadOptimizer needs the model, whose layers' activations and deltas it shares: "
                          "DadOptimizer(opt, named_parameters=model.named_parameters(), model=model)")
    if mode == "exact" and (rank_options or options is not None):
        mode = "rank"
    if mode not in DAD_MODES:
        raise ConfigError(f"DadOptimizer mode must be one of {', '.join(DAD_MODES)}, got {mode!r}")
    if mode != "rank" and (rank_options or options is not None):
        raise ConfigError(f"DadOptimizer mode {mode!r} is exact and takes no rank options; use mode='rank' for "
                          f"rank-dAD")
    rank_dad = make_options(RankDadOptions, "rank-dad", options, plan=plan, **rank_options)
    arguments = horovod_arguments(
        "DadOptimizer", compression, backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
        sparse_as_dense, process_set, group, compressors=("none", "fp16") if mode == "rank" else ("none",),
        why_not_compressed="its rows are exact (float32); use mode='rank', whose factor rows travel in float16, "
                           "or DistributedOptimizer with compression=fp16" if mode != "rank" else
                           "its own factor rows are its compression")
    if arguments.compression == "fp16" and rank_dad.factor_dtype != "float16":
        raise ConfigError("DadOptimizer: compression=fp16 asks for float16 on the wire, but factor_dtype is "
                          "float32; drop one of the two")
    check_dad_model(model, mode == "edad")
    sharing = {"exact": ExactRows, "rank": lambda: FactorRows(rank_dad), "edad": lambda: RecomputedDeltas(model)}[mode]()
    return wrap_optimizer(optimizer, _DadExchange, named_parameters or model.named_parameters(), model, sharing,
                          rank_dad.plan, arguments, seed)


# ---------------------------------------------------------------------------------------------
# the cost model's view (hvd_lowcomm.costmodel)

def shared_layers(model: nn.Module, input_shape: tuple[int, ...], options: Any, cfg: Config) -> set[str]:
    """The layers whose rows dAD can share (model facts for the cost model)."""
    return set(row_layers(model))


def dad_kernels(sample: LayerSample, options: Any, cfg: Config) -> dict[str, Any]:
    """Forming this rank's rows of the layer (im2col for a conv) and the product of one rank's
    rows, ∇W += Δᵀ A (every rank forms it for all p ranks' rows)."""
    if not supports(sample.module):
        return {}
    generator = torch.Generator().manual_seed(0)
    acts = torch.randn(sample.rows, sample.fan_in, generator=generator)
    deltas = torch.randn(sample.rows, sample.fan_out, generator=generator)
    return {"rows": lambda: (activation_rows(sample.module, sample.inputs), delta_rows(sample.module, sample.output)),
            "dad_product": lambda: deltas.T @ acts}


def rank_dad_kernels(sample: LayerSample, options: "RankDadOptions", cfg: Config) -> dict[str, Any]:
    """The top triplets of one rank's gradient, the way rank-dAD takes them for these shapes
    (an adaptive rank iterates twice the rank it keeps: FactorRows.iterated_rank; error feedback
    adds the error to the gradient first and forms the new one from the kept factors after), and
    the product of one rank's k factor rows."""
    if not supports(sample.module):
        return {}
    generator = torch.Generator().manual_seed(0)
    acts = torch.randn(sample.rows, sample.fan_in, generator=generator)
    deltas = torch.randn(sample.rows, sample.fan_out, generator=generator)
    grad = torch.randn(sample.fan_in, sample.fan_out, generator=generator)  # Gᵀ, as the method holds it
    error = torch.randn(sample.fan_in, sample.fan_out, generator=generator)
    rank = planned_rank(options)
    k = min(rank, sample.rows, sample.fan_in, sample.fan_out)
    iterated = rank if options.rank else min(options.max_rank, 2 * rank)
    iterate = (iterated, options.iterations, options.tol)
    if not _factors_from_gradient(sample.rows, sample.fan_in, sample.fan_out, options):
        factors: Callable[[], Any] = lambda: factors_from_rows(acts, deltas, *iterate, generator)  # noqa: E731
    elif options.error_feedback:
        def factors() -> None:
            fed = grad + error
            b_rows, c_rows = gradient_power_iteration(fed, *iterate, generator)
            torch.sub(fed, b_rows[:k].T @ c_rows[:k], out=error)
    else:
        factors = lambda: gradient_power_iteration(grad, *iterate, generator)  # noqa: E731
    return {"rank_factors": factors, "rank_product": lambda: deltas[:k].T @ acts[:k]}


def _factors_from_gradient(rows: int, fan_in: int, fan_out: int, options: "RankDadOptions") -> bool:
    return options.error_feedback or \
        cheapest_way(rows, fan_in, fan_out, planned_rank(options), options.iterations) == "gradient"


def _predict_sharing(profile: Profile, world_size: int, link: Link, rank: "RankDadOptions | None") -> Prediction:
    """dAD (rank None) or rank-dAD: per layer the same choice as the plan 'auto' (share rows, or
    factors, where that sends fewer numbers than allreducing the gradient), then one allgather
    and one allreduce. Autograd skips the local weight gradient of layers whose gradient is
    formed from rows: the product of one rank's rows, taken off the measured backward pass.
    rank-dAD's float16 rows are 2 bytes a number and 8 a row for its two scales."""
    half = rank is not None and FactorRows(rank).half_rows(world_size)
    gathered = reduced = 0
    own = skipped = 0.0
    shareable = profile.facts.get("dad" if rank is None else "rank-dad", set())
    for layer in profile.layers:
        local_rows = profile.batch * layer.rows
        planned = local_rows if rank is None else planned_rank(rank)  # the plan's rows per rank
        width = local_rows if rank is None else min(planned, local_rows, layer.fan_in, layer.fan_out)
        extra = 0 if rank is None else layer.fan_out  # rank-dAD allreduces the bias
        if layer.name in shareable and sharing_is_cheaper(world_size * planned, layer.fan_in, layer.fan_out, layer.params,
                                                          extra, half):
            gathered += width * shared_row_bytes(layer.fan_in, layer.fan_out, half)
            reduced += extra
            from_gradient = rank is not None and _factors_from_gradient(local_rows, layer.fan_in, layer.fan_out, rank)
            if rank is None:
                own += layer.kernels["rows"] + world_size * layer.kernels["dad_product"]
            else:
                own += (0.0 if from_gradient else layer.kernels["rows"]) + world_size * layer.kernels["rank_product"]
                own += layer.kernels["rank_factors"]
            if not from_gradient:
                skipped += layer.kernels["dad_product"]
        else:
            reduced += layer.params
    reduced += profile.other_params - profile.tied_params + 1  # (a tied weight once) + the pooled batch size
    comm = link.allgather(gathered, world_size, world_size) + link.allreduce(FLOAT_BYTES * reduced, world_size, world_size)
    sent = sent_bytes("allgather", gathered, world_size) + sent_bytes("allreduce", FLOAT_BYTES * reduced, world_size)
    return Prediction("", world_size, profile.step_seconds, own - skipped, comm, 0.0, sent, sent * link.node_share(world_size))


def predict_dad(profile: Profile, world_size: int, link: Link, options: "DadOptions", cfg: Config,
                assumptions: RunAssumptions) -> Prediction:
    return _predict_sharing(profile, world_size, link, None)


def predict_rank_dad(profile: Profile, world_size: int, link: Link, options: "RankDadOptions", cfg: Config,
                     assumptions: RunAssumptions) -> Prediction:
    return _predict_sharing(profile, world_size, link, options)


def predict_edad(profile: Profile, world_size: int, link: Link, options: None, cfg: Config,
                 assumptions: RunAssumptions) -> Prediction:
    """edAD: every layer's activation rows and the output layer's delta rows, one allgather (and
    the pooled batch size); each rank forms every layer's product of the pooled rows and
    recomputes the hidden deltas over them (about one more such product per layer), where
    autograd's local weight gradient (one rank's product) is skipped."""
    if set(profile.facts.get("edad", set())) != {layer.name for layer in profile.layers}:
        raise ConfigError("edad: exact only for MLPs of Linear layers")
    gathered = sum(profile.batch * layer.rows * layer.fan_in for layer in profile.layers)
    gathered += profile.batch * profile.layers[-1].rows * profile.layers[-1].fan_out
    own = sum(layer.kernels["rows"] + (2 * world_size - 1) * layer.kernels["dad_product"] for layer in profile.layers)
    comm = link.allgather(FLOAT_BYTES * gathered, world_size, world_size) + link.allreduce(FLOAT_BYTES, world_size, world_size)
    sent = sent_bytes("allgather", FLOAT_BYTES * gathered, world_size) + sent_bytes("allreduce", FLOAT_BYTES, world_size)
    return Prediction("", world_size, profile.step_seconds, own, comm, 0.0, sent, sent * link.node_share(world_size))


def edad_layers(model: nn.Module, input_shape: tuple[int, ...], options: Any, cfg: Config) -> set[str]:
    """The Linear layers of an MLP edAD is exact for (none when it is not)."""
    try:
        return {name for name, _ in edad_chain(model)}
    except ConfigError:
        return set()


def rank_dad_quality(options: RankDadOptions, cfg: Config) -> str | None:
    """Held to its error target when adaptive with error feedback; a fixed rank has no target,
    and without error feedback the target alone keeps too few components (one per layer holds
    half of a transformer's local gradient energy; docs: dad, "Error feedback")."""
    if options.rank or not options.error_feedback:
        return None
    return (f"low-rank local gradients, each layer's rank adapted so that it leaves out at most "
            f"{options.error_target:.0%} of its energy, which error feedback adds back later")


@register("dad", options=DadOptions, cost=MethodCost(predict_dad, dad_kernels, shared_layers, quality=lambda *_: ""),
          drop_in=True)
class DistributedAutoDiff(DataParallel):
    """Exact dAD: allgather [activations | deltas] per planned layer, allreduce the rest."""

    honours_compression = False  # rows and factors travel in fp32
    edad = False

    def check_model(self, model: nn.Module) -> None:
        check_dad_model(model, self.edad)

    def distribute(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return DadOptimizer(optimizer, model, plan=self.options.plan, seed=self.cfg.train.seed,
                            backward_passes_per_step=self.cfg.train.accumulate)

    def summary_metrics(self) -> dict[str, Any]:
        return {f"plan/{name}": lp.choice for name, lp in self.optimizer.plan.items()}

    def local_state_dict(self) -> dict[str, Any]:
        # rank-dAD's random starts, and its error feedback and last ranks (each rank's own)
        return {"power_iteration_generator": self.optimizer.generator.get_state(),
                **self.optimizer.sharing.state_dict()}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.generator.set_state(state["power_iteration_generator"])
        self.optimizer.sharing.load_state_dict(state)

    def epoch_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, lp in self.optimizer.plan.items():
            out[f"plan/{name}"] = lp.choice
        for name, totals in meter.by_name.items():
            if name.split(".", 1)[0] in ("dad", "rank-dad", "edad", "allreduce"):
                out[f"layer_payload_bytes/{name}"] = totals.payload_bytes
        for name, ks in self.optimizer.effective_ranks.items():
            if ks:
                out[f"effective_rank/{name}"] = sum(ks) / len(ks)
                ks.clear()
        return out


@register("rank-dad", options=RankDadOptions,
          cost=MethodCost(predict_rank_dad, lambda *a: {**dad_kernels(*a), **rank_dad_kernels(*a)}, shared_layers,
                          rank_dad_quality, judged=True),
          drop_in=True)
class RankDistributedAutoDiff(DistributedAutoDiff):
    """rank-dAD: each rank shares k <= r power-iteration factors per planned layer."""

    def distribute(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return DadOptimizer(optimizer, model, mode="rank", options=self.options, seed=self.cfg.train.seed,
                            backward_passes_per_step=self.cfg.train.accumulate)


@register("edad", cost=MethodCost(predict_edad, dad_kernels, edad_layers))
class EfficientDistributedAutoDiff(DistributedAutoDiff):
    """edAD: share all activations and only the output delta; recompute hidden deltas (exact MLPs)."""

    edad = True

    def distribute(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return DadOptimizer(optimizer, model, mode="edad", seed=self.cfg.train.seed)

    @classmethod
    def check_world(cls, cfg: Config, world_size: int) -> None:
        # Hidden deltas are recomputed from the output delta and the shared activations of one
        # forward pass: several micro-batches (or bf16 activations) break that recomputation.
        t = cfg.train
        if t.accumulate > 1 or t.amp != "none":
            raise ConfigError("edad does not support train.accumulate or train.amp (it recomputes hidden deltas "
                              "from one fp32 forward pass); use dad, which does, or leave them at 1 and none")
