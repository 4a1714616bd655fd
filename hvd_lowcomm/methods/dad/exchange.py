"""dAD's exchange, mixed into the user's optimiser by DadOptimizer: it captures every supported
layer's activations and deltas, fixes the per-layer plan at the first step, scales each rank's
rows by its batch, and runs the step's one exchange; what is shared, and how the pooled
numbers become gradients, is the sharing strategy's (hvd_lowcomm.methods.dad.sharing)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.methods.dad.plan import (
    LayerPlan,
    activation_rows,
    delta_rows,
    fan_in_out,
    format_plan,
    left_to_allreduce,
    plan_layer,
    row_layers,
)
from hvd_lowcomm.methods.dad.sharing import Sharing
from hvd_lowcomm.methods.drop_in import (
    GradientExchange,
    HorovodArguments,
    NamedParameters,
    dense_gradient,
)
from hvd_lowcomm.models.layer_kinds import kind_of


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


class DadExchange(GradientExchange):
    """Mixed into the user's optimiser class by DadOptimizer: captures every supported layer's
    activations and deltas, plans per layer, and runs one exchange per step; what is shared and
    how gradients come back from it is the `sharing` strategy's (ExactRows, FactorRows,
    RecomputedDeltas)."""

    def __init__(
        self,
        params: Any,
        named_parameters: NamedParameters,
        model: nn.Module,
        sharing: "Sharing",
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
