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
  local gradient, computed the cheapest way for the layer's shapes (hvd_lowcomm.methods.dad.lowrank: exactly
  from few rows, by power iteration on the gradient autograd formed for a conv layer's many
  rows, or by structured power iteration); each rank sends its own k rows (Horovod's allgather
  takes a different count from each rank). Bias gradients, which factors do not carry, are
  allreduced. The k each layer keeps is its "effective rank".
- Every rank runs the same collectives whatever its batch did: the plan covers every layer
  used on any rank at the first step, and a rank on which a planned layer did not run (a branch
  taken on some ranks only) shares one zero row for it. A forward whose output never received
  a gradient (non-reentrant activation checkpointing's recomputation, an output the loss did
  not use) adds no rows, as it adds nothing to the gradient.
- Accumulation: an exchange adds the pooled gradient of the passes since the last one to what
  `.grad` held, as autograd does; the local gradient of a weight formed from rows never enters
  `.grad` (it does not require one, or a hook diverts it), so that `.grad` only ever holds
  pooled numbers and micro-batches exchanged one by one add up to the pooled batch's gradient.
- Rows, factors and sums are float32 whatever the parameters' dtype (bfloat16 weights
  included); the gradients are written back in the parameter's dtype.
- edAD shares every layer's activations but only the output layer's deltas; each rank
  recomputes the hidden deltas from the known weights and activation derivatives. It is exact,
  and therefore allowed, only for nn.Sequential MLPs of Linear layers and element-wise
  activations whose derivative is a function of their output (ReLU, LeakyReLU, Tanh, Sigmoid).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
import math
from typing import Any

import torch
import torch.nn as nn

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.half_wire import from_half_rows, to_half_rows
from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import ConfigError, make_options
from hvd_lowcomm.methods.adaptive_rank import smallest_rank_within
from hvd_lowcomm.methods.dad.options import DAD_MODES, PLANNED_ADAPTIVE_RANK, DadOptions, RankDadOptions, planned_rank
from hvd_lowcomm.methods.dad.plan import (
    LayerPlan,
    activation_rows,
    delta_rows,
    fan_in_out,
    format_plan,
    left_to_allreduce,
    plan_layer,
    row_layers,
    supports,
)
from hvd_lowcomm.methods.drop_in import (
    GradientExchange,
    HorovodArguments,
    NamedParameters,
    dense_gradient,
    horovod_arguments,
    wrap_optimizer,
)
from hvd_lowcomm.methods.dad.lowrank import cheapest_way, factors_from_rows, gradient_power_iteration, missed_energy
from hvd_lowcomm.models.layer_kinds import kind_of


# ---------------------------------------------------------------------------------------------
# the optimiser wrapper


@dataclass
class _Capture:
    """One layer's uses since the last exchange, each numbered in forward order: its input
    activations, the delta its output received, and the model forward it was part of."""

    acts: dict[int, torch.Tensor] = field(default_factory=dict)
    deltas: dict[int, torch.Tensor] = field(default_factory=dict)
    forward_of: dict[int, int] = field(default_factory=dict)
    uses: int = 0
    input_requires_grad: bool = False  # the output's gradient flows without the weight's

    def drop_completed(self) -> None:
        """Forget the uses whose delta came (their backward pass ended); keep the pending ones."""
        for use in list(self.deltas):
            del self.acts[use], self.forward_of[use], self.deltas[use]


class _DadExchange(GradientExchange):
    """Mixed into the user's optimiser class by DadOptimizer: captures every supported layer's
    activations and deltas, plans per layer, and runs one exchange per step; what is shared and
    how gradients come back from it is the `sharing` strategy's (ExactRows, FactorRows,
    RecomputedDeltas)."""

    def __init__(
        self,
        params: Any,
        named_parameters: NamedParameters,
        model: nn.Module,
        sharing: "_Sharing",
        plan: str,
        arguments: HorovodArguments,
        seed: int,
    ) -> None:
        super().__init__(params)
        self._model, self.sharing = model, sharing
        self._force_all = plan == "all" or sharing.shares_every_layer
        self._layers = row_layers(model)
        self._captured = {name: _Capture() for name in self._layers}
        # Hooks are closures that check their module: a deep copy of the model (an EMA copy, a
        # reference) keeps them, and its passes must not count as this model's.
        for name, module in self._layers.items():
            module.register_forward_hook(self._capture_hook(name, module))
        # Samples of this rank's batch: every forward pass of the model whose outputs received a
        # gradient counts its batch once (micro-batches add up; a layer used twice in one pass
        # does not count twice; a forward no backward pass followed does not count).
        self._samples: dict[int, int] = {}  # model forward -> its batch size
        self._backed: set[int] = set()  # model forwards a delta came back to
        self._forwards = 0
        model.register_forward_pre_hook(
            lambda module, inputs, kwargs: self._count_samples(inputs, kwargs) if module is model else None,
            with_kwargs=True,
        )
        self._set_up_exchange(arguments, named_parameters, "DadOptimizer")
        self.plan: dict[str, LayerPlan] = {}
        self.planned = False  # the plan is made once, at the first step (it may be empty)
        self.frozen: set[str] = set()  # layers whose weight the user froze (seen at the plan)
        self.effective_ranks: dict[str, list[int]] = {name: [] for name in self._layers}
        self.generator = torch.Generator().manual_seed(seed)  # rank-dAD's random starts
        # Parameters whose .grad holds only what exchanges wrote (from the first exchange on): the
        # layers' row-formed weights and biases; autograd's local gradient of those that still
        # require one is diverted into `_local_gradients` instead of being added to .grad.
        self._pooled_only: set[nn.Parameter] = set()
        self._local_gradients: dict[nn.Parameter, torch.Tensor] = {}

    def _count_samples(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The first tensor argument: model(x), or model(input_ids=x, labels=x) as HF users call it.
        first = next((v for v in (*inputs, *kwargs.values()) if torch.is_tensor(v)), None)
        if torch.is_grad_enabled() and first is not None:
            self._forwards += 1
            self._samples[self._forwards] = first.shape[0]

    def _capture_hook(self, name: str, layer: nn.Module):
        capture = self._captured[name]

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if module is layer and torch.is_grad_enabled() and output.requires_grad:
                use = capture.uses = capture.uses + 1
                capture.acts[use] = inputs[0].detach()
                capture.forward_of[use] = self._forwards
                capture.input_requires_grad = inputs[0].requires_grad
                # Deltas arrive in backward order: reversed within one backward pass (a layer
                # used twice), in order across several (micro-batches); the use pairs them.
                output.register_hook(lambda grad: self._delta_arrived(capture, use, grad))

        return hook

    def _delta_arrived(self, capture: _Capture, use: int, grad: torch.Tensor) -> None:
        if use in capture.acts:  # (else an exchange between its forward and now dropped it)
            capture.deltas[use] = grad.detach()
            self._backed.add(capture.forward_of[use])
        self._backward_running()  # (a weight whose gradient rows form fires no gradient hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the passes whose backward ended, as their gradients are; a forward whose
        backward is still to come (forward, zero_grad, backward) keeps its captures."""
        for capture in self._captured.values():
            capture.drop_completed()
        self._samples = {f: n for f, n in self._samples.items() if f not in self._backed}
        self._backed.clear()
        self._local_gradients.clear()
        super().zero_grad(set_to_none)

    def _clear_captures(self) -> None:
        self._samples.clear()
        self._backed.clear()
        self._local_gradients.clear()
        for capture in self._captured.values():
            capture.acts.clear()
            capture.deltas.clear()
            capture.forward_of.clear()

    def _divert_local_gradient(self, param: nn.Parameter) -> None:
        """From now on autograd's local gradient of `param` goes to `local_weight_gradient`,
        not into .grad (which then holds only the pooled gradients exchanges write)."""

        def divert(grad: torch.Tensor) -> torch.Tensor:
            kept = self._local_gradients.get(param)  # (autograd accumulates the zeros returned, not `grad`)
            self._local_gradients[param] = grad.detach() if kept is None else kept + grad.detach()
            return torch.zeros_like(grad)

        param.register_hook(divert)

    def local_weight_gradient(self, module: nn.Module) -> torch.Tensor:
        """This rank's local gradient of the layer's weight since the last exchange (zeros if
        the layer did not run here)."""
        weight = module.weight
        local = self._local_gradients.get(weight) if weight in self._pooled_only else weight.grad
        return torch.zeros_like(weight) if local is None else local

    def set_pooled_gradient(self, param: nn.Parameter, pooled: torch.Tensor) -> None:
        """Add `pooled` (float32) to what earlier exchanges of this step left in .grad, in the
        parameter's dtype."""
        earlier = param.grad if param in self._pooled_only else None
        pooled = pooled.reshape(param.shape)
        param.grad = (pooled if earlier is None else earlier.float() + pooled).to(param.dtype)

    # -- the exchange --------------------------------------------------------------------------
    def _exchange(self) -> None:
        """Replace every local gradient by the pooled batch's, sharing rows where planned."""
        ran = [n for n, c in self._captured.items() if c.acts]
        if not ran and not self._samples:
            raise RuntimeError("dAD optimizer: no forward pass with gradients was seen before step()")
        if not self._backward_passes and not self._end_queued and not any(c.deltas for c in self._captured.values()):
            raise RuntimeError("dAD optimizer: a forward pass ran but no backward pass; call backward() before step()")
        backed = [n for f, n in self._samples.items() if f in self._backed]
        local_batch = (
            sum(backed) or sum(self._samples.values()) or next(iter(self._captured[ran[0]].acts.values())).shape[0]
        )
        # The pooled gradient Σ_s (N_s/N) g_s is formed as (1/N) Σ_s N_s g_s: every rank scales
        # its deltas and gradients by its own N_s, and N = Σ N_s travels in the exchange itself,
        # so the step needs no collective round of its own to agree on N.
        scale = float(local_batch)
        first_step = not self.planned
        if first_step:  # every layer's rows on all ranks, to plan from their shapes and counts
            names = list(self._layers)
            with meter.in_phase("setup"):  # once per run (and again after a resume): not a step's traffic
                total_batch, *total_rows = meter.allreduce_ints(
                    [local_batch, *(self.local_row_count(n) for n in names)], "dad.plan_rows", self.group
                )
            self._make_plan(dict(zip(names, total_rows)), self.group_size())
        # The same layers on every rank (the plan's), whether or not they ran here this step.
        shared_layers = [n for n, lp in self.plan.items() if lp.choice == "dad"]
        if first_step:
            self._stop_unused_weight_gradients(shared_layers)
        exact = self.sharing.exact_layers(shared_layers)  # (planned, but their exact gradient is allreduced)
        factored = [n for n in shared_layers if n not in exact]
        # Rows only where they are shared: a conv layer's im2col rows cost more than its
        # allreduce saves; rank-dAD's factors of a conv layer come from its gradient instead.
        rows = {n: self.local_rows(n, scale) for n in factored if self.sharing.needs_rows(self, n)}

        shared = self.sharing.payload(self, rows, factored, scale)
        covered = {id(p) for n in shared_layers for p in self._layers[n].parameters(recurse=False)}
        if not self.sharing.carries_bias:  # allreduce autograd's bias gradient (= scaled delta sums)
            covered -= {id(self._layers[n].bias) for n in shared_layers if self._layers[n].bias is not None}
        others = [p for group in self.param_groups for p in group["params"] if id(p) not in covered and p.requires_grad]
        # Summed in float32 (also for bfloat16 parameters), written back in the parameter's dtype.
        reduced = [(f"allreduce.{self._names.get(p, id(p))}", dense_gradient(p).float() * scale) for p in others]
        reduced += [(self.sharing.exact_name(n), self.sharing.exact_gradient(self, n, scale)) for n in exact]
        votes = self.sharing.votes(factored)
        reduced += votes
        reduced.append(("dad.batch_size", torch.tensor([scale])))

        gathered, summed = meter.gather_and_reduce(shared, reduced, self.group, op="sum")
        total_batch = float(summed[-1])
        self.sharing.apply(self, dict(zip([n for n, _ in shared], gathered)), factored, total_batch)
        for param, value in zip(others, summed):
            param.grad = (value / total_batch).to(param.dtype)
        for n, value in zip(exact, summed[len(others) :]):
            self.set_pooled_gradient(self._layers[n].weight, value / total_batch)
        self.sharing.count_votes(factored, summed[len(others) + len(exact) : len(summed) - 1])
        if first_step:
            self._keep_local_gradients_out_of_grad(shared_layers)
        self._clear_captures()

    def _keep_local_gradients_out_of_grad(self, shared_layers: list[str]) -> None:
        """After the first exchange: the gradients of the shared layers' weights and biases
        the sharing writes hold only pooled numbers; autograd's local ones are diverted."""
        for name in shared_layers:
            module = self._layers[name]
            written = [module.weight] + (
                [module.bias]
                if module.bias is not None and (self.sharing.carries_bias or self.sharing.shares_every_layer)
                else []
            )
            for param in written:
                if param.requires_grad and name not in self.frozen:
                    self._divert_local_gradient(param)
                if name not in self.frozen or param is not module.weight:
                    self._pooled_only.add(param)

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
        """This rank's [activations, deltas × scale] rows of layer `name`: one zero row where it
        did not run with a gradient here (every rank must send the same tensors)."""
        module, capture = self._layers[name], self._captured[name]
        # A use whose output got no delta adds nothing: a forward that non-reentrant
        # checkpointing recomputed (the gradient reached the first), or an output the loss
        # did not use. Deltas are keyed by their forward's index: the pairs keep forward order.
        uses = sorted(capture.deltas)
        if not uses:
            d_in, d_out = fan_in_out(module)
            return module.weight.new_zeros(1, d_in, dtype=torch.float32), module.weight.new_zeros(
                1, d_out, dtype=torch.float32
            )
        # fp32 rows whatever autocast or the parameters computed in: gradients and the wire stay fp32.
        acts = torch.cat([activation_rows(module, capture.acts[i].float()) for i in uses])
        deltas = torch.cat([delta_rows(module, capture.deltas[i].float()) for i in uses]) * scale
        return acts, deltas

    def local_row_count(self, name: str) -> int:
        """Rows of layer `name` on this rank this step (without forming them)."""
        d_out = fan_in_out(self._layers[name])[1]
        return sum(delta.numel() for delta in self._captured[name].deltas.values()) // d_out

    def layer(self, name: str) -> nn.Module:
        return self._layers[name]

    def _make_plan(self, total_rows: dict[str, int], world_size: int) -> None:
        """A plan for every layer that ran with a gradient on any rank (`total_rows`: its rows
        over all ranks this step), the same on every rank."""
        for name, rows in total_rows.items():
            if not rows:
                continue
            module = self._layers[name]
            shared_rows, extra = self.sharing.planned_rows(module, rows, world_size)
            self.plan[name] = plan_layer(
                name,
                module,
                shared_rows,
                world_size,
                extra,
                force=self._force_all,
                half_rows=self.sharing.half_rows(world_size),
            )
            if not module.weight.requires_grad:  # frozen by the user: no gradient to form for it
                self.frozen.add(name)
                if not self.sharing.shares_every_layer:  # (edAD still needs its rows for the deltas below)
                    self.plan[name] = replace(self.plan[name], choice="allreduce")
        left = {name: why for name, why in left_to_allreduce(self._model).items() if name not in self.plan}
        left.update({name: "not used with a gradient this step" for name in self._layers if name not in self.plan})
        self.planned = True
        runtime.announce(
            f"{self.sharing.label} plan (wire bytes per rank per step):\n{format_plan(list(self.plan.values()), left)}"
        )

    def group_size(self) -> int:
        return self.group.size if self.group is not None else runtime.size()

    def apply_rows(self, name: str, pooled: torch.Tensor, total_batch: float, with_bias: bool) -> None:
        """∇W = Δᵀ A over the pooled rows [A | Δ] (Δ scaled by each rank's batch: divided by
        the pooled batch here); ∇b = column sums of Δ."""
        module = self._layers[name]
        d_in, _ = fan_in_out(module)
        acts, deltas = pooled[:, :d_in], pooled[:, d_in:] / total_batch
        self.set_pooled_gradient(module.weight, kind_of(module).from_matrix(module, deltas.T @ acts))
        if with_bias and module.bias is not None and module.bias.requires_grad:
            self.set_pooled_gradient(module.bias, deltas.sum(dim=0))


# ---------------------------------------------------------------------------------------------
# what is shared: one strategy per mode

Rows = dict[str, tuple[torch.Tensor, torch.Tensor]]


class _Sharing:
    """How one mode of dAD turns layers' rows into what ranks share, and what they share back
    into gradients. The exchange (captures, plan, scaling, the one collective) is common."""

    label = "dAD"
    shares_every_layer = False  # share every supported layer whatever the plan's cost rule says
    carries_bias = True  # the shared rows give the bias gradient too

    def planned_rows(self, module: nn.Module, rows: int, world_size: int) -> tuple[int, int]:
        """Rows all ranks share per step for this layer (`rows`: its rows over all ranks at the
        first step), and numbers still allreduced beside them."""
        return rows, 0

    def needs_rows(self, exchange: _DadExchange, name: str) -> bool:
        return True

    def half_rows(self, world_size: int) -> bool:
        """Whether the shared rows travel as float16 among `p` ranks."""
        return False

    def keeps_weight_gradient(self, exchange: _DadExchange, name: str) -> bool:
        """Whether autograd's local weight gradient is still needed (not skipped after the plan)."""
        return False

    def payload(
        self, exchange: _DadExchange, rows: Rows, layers: list[str], scale: float
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

    def exact_gradient(self, exchange: _DadExchange, name: str, scale: float) -> torch.Tensor:
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
        self, exchange: _DadExchange, results: dict[str, torch.Tensor], layers: list[str], total_batch: float
    ) -> None:
        raise NotImplementedError


class ExactRows(_Sharing):
    """dAD: every rank shares its [activations | deltas] rows; ∇W = Δᵀ A over the pooled rows."""

    def payload(
        self, exchange: _DadExchange, rows: Rows, layers: list[str], scale: float
    ) -> list[tuple[str, torch.Tensor]]:
        return [(f"dad.{n}", torch.cat(rows[n], dim=1)) for n in layers]

    def apply(
        self, exchange: _DadExchange, results: dict[str, torch.Tensor], layers: list[str], total_batch: float
    ) -> None:
        for n in layers:
            exchange.apply_rows(n, results[f"dad.{n}"], total_batch, with_bias=True)


# A layer goes to the exact allreduce only after this many steps in a row over the target at
# max_rank: one step's spike (a loss jump) does not show a gradient the factors cannot follow.
FALLBACK_STEPS = 10


class FactorRows(_Sharing):
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

    def from_gradient(self, exchange: _DadExchange, name: str) -> bool:
        """Whether the factors come from the local weight gradient autograd formed (iterating on
        it is cheapest: a conv layer's many rows; or error feedback needs G itself) rather than
        from the rows."""
        module = exchange.layer(name)
        d_in, d_out = fan_in_out(module)
        way = cheapest_way(exchange.local_row_count(name), d_in, d_out, self.iterated_rank(name), self.iterations)
        return (way == "gradient" or self.error_feedback) and module.weight.requires_grad

    def needs_rows(self, exchange: _DadExchange, name: str) -> bool:
        return not self.from_gradient(exchange, name)

    def half_rows(self, world_size: int) -> bool:
        return self.options.factor_dtype == "float16" and world_size > 1

    def keeps_weight_gradient(self, exchange: _DadExchange, name: str) -> bool:
        return self.error_feedback or self.from_gradient(exchange, name)

    def factors_of(
        self, exchange: _DadExchange, name: str, rows: Rows, scale: float
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

    def non_finite_row(self, exchange: _DadExchange, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
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

    def exact_gradient(self, exchange: _DadExchange, name: str, scale: float) -> torch.Tensor:
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
        self, exchange: _DadExchange, rows: Rows, layers: list[str], scale: float
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
        self, exchange: _DadExchange, results: dict[str, torch.Tensor], layers: list[str], total_batch: float
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


class RecomputedDeltas(_Sharing):
    """edAD: every layer's activations and the output layer's deltas are shared; each rank
    recomputes the hidden deltas from them and the known weights (exact for the MLPs
    `edad_chain` accepts)."""

    label = "edAD"
    shares_every_layer = True

    def __init__(self, model: nn.Module) -> None:
        self.chain = edad_chain(model)

    def payload(
        self, exchange: _DadExchange, rows: Rows, layers: list[str], scale: float
    ) -> list[tuple[str, torch.Tensor]]:
        names = [n for n, _ in self.chain]
        shared = [(f"edad.acts.{n}", rows[n][0]) for n in names]
        shared.append((f"edad.delta.{names[-1]}", rows[names[-1]][1]))
        return shared

    def apply(
        self, exchange: _DadExchange, results: dict[str, torch.Tensor], layers: list[str], total_batch: float
    ) -> None:
        names = [n for n, _ in self.chain]
        delta = results[f"edad.delta.{names[-1]}"] / total_batch  # the chain below is linear in it
        for index in range(len(names) - 1, -1, -1):
            name, module = names[index], exchange.layer(names[index])
            acts = results[f"edad.acts.{name}"]
            if name not in exchange.frozen:
                exchange.set_pooled_gradient(module.weight, delta.T @ acts)
            if module.bias is not None and module.bias.requires_grad:
                exchange.set_pooled_gradient(module.bias, delta.sum(dim=0))
            if index:
                derivative = self.chain[index - 1][1]
                delta = (delta @ module.weight.detach().float()) * derivative(acts)


def check_dad_model(model: nn.Module, edad: bool) -> None:
    if not any(supports(m) for m in model.modules()):
        raise ConfigError(
            "dAD needs at least one layer it can form from rows (Linear, Hugging Face Conv1D, "
            "Conv2d with groups=1); this model has none: use --method ddp"
        )
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
            raise ConfigError(
                f"edAD is exact only for Linear layers and element-wise ReLU/LeakyReLU/Tanh/"
                f"Sigmoid activations; layer {name} ({type(module).__name__}) breaks that: use --method dad"
            )
    if not chain or chain[-1][1] is not None:
        raise ConfigError("edAD needs a model that ends with a Linear layer; use --method dad")
    return [(name, derivative) for name, derivative in chain]


def DadOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: NamedParameters | nn.Module | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    model: nn.Module | None = None,
    mode: str = "exact",
    plan: str = DadOptions.plan,
    group: Group | None = None,
    seed: int = 0,
    options: "RankDadOptions | None" = None,
    **rank_options: Any,
) -> torch.optim.Optimizer:
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
        raise ConfigError(
            "DadOptimizer needs the model, whose layers' activations and deltas it shares: "
            "DadOptimizer(opt, named_parameters=model.named_parameters(), model=model)"
        )
    if mode == "exact" and (rank_options or options is not None):
        mode = "rank"
    if mode not in DAD_MODES:
        raise ConfigError(f"DadOptimizer mode must be one of {', '.join(DAD_MODES)}, got {mode!r}")
    if mode != "rank" and (rank_options or options is not None):
        raise ConfigError(
            f"DadOptimizer mode {mode!r} is exact and takes no rank options; use mode='rank' for rank-dAD"
        )
    rank_dad = make_options(RankDadOptions, "rank-dad", options, plan=plan, **rank_options)
    arguments = horovod_arguments(
        "DadOptimizer",
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        sparse_as_dense,
        process_set,
        group,
        model=model,
        compressors=("none", "fp16") if mode == "rank" else ("none",),
        why_not_compressed="its rows are exact (float32); use mode='rank', whose factor rows travel in float16, "
        "or DistributedOptimizer with compression=fp16"
        if mode != "rank"
        else "its own factor rows are its compression",
    )
    if arguments.compression == "fp16" and rank_dad.factor_dtype != "float16":
        raise ConfigError(
            "DadOptimizer: compression=fp16 asks for float16 on the wire, but factor_dtype is "
            "float32; drop one of the two"
        )
    check_dad_model(model, mode == "edad")
    sharing = {"exact": ExactRows, "rank": lambda: FactorRows(rank_dad), "edad": lambda: RecomputedDeltas(model)}[
        mode
    ]()
    return wrap_optimizer(
        optimizer,
        _DadExchange,
        named_parameters or model.named_parameters(),
        model,
        sharing,
        rank_dad.plan,
        arguments,
        seed,
    )
