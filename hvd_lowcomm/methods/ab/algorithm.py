"""`ab`: AB-training (Coquelin et al., arXiv 2405.01067): low-rank factors trained by groups.

Every Linear/ConvNd weight outside `ab.full_rank` becomes W = A B (hvd_lowcomm.methods.ab.factorized).
The world is split into G groups of contiguous ranks; the first ⌊G/2⌋ are A-groups (train A,
B frozen), the rest B-groups (train B, A frozen). Schedule, with t the global step and a cycle
= `sync_every` group steps + `full_rank_steps` full-rank steps:

    t < warmup         full-rank data parallel over all ranks
    t = warmup         factorise (every singular value kept: first_full_rank), groups start
    group phase        each rank trains its factor; the trained factor (unless comm is
                       individual), 1-D parameters and full-rank layers are averaged inside
                       the group; nothing crosses groups, not even the loop's per-step checks
    sync               across all ranks, by sync mode; W = A B; BatchNorm statistics averaged
    full phase         full-rank data parallel over all ranks, so W can regain rank
    re-factorise       keep the singular values the rank rule and its floor choose (rank =
                       MAX over ranks), checked on the step's batch; back to the group phase.
                       Before `first_cut` (half the run) a re-factorisation keeps every one.

Sync modes (A' = A₀ + ΔA trained by A-groups, B' = B₀ + ΔB by B-groups):
    with-stale    average A over all ranks (learned and stale copies), same for B:
                  (A₀ + ΔA/2)(B₀ + ΔB/2) with equal numbers of A- and B-groups
    only-learned  average A over A-groups only, B over B-groups only: A' B'
    only-b        every group trains B only (one group allowed: data parallel on B); A₀ B̄
    full          every rank forms its W = A B; W is averaged (full matrices on the wire)

A re-factorisation that would cost quality is undone: the pooled loss and accuracy of the
step's batch are compared before and after the cut; when the loss rises by more than
`max_loss_rise` (relative) or the accuracy falls by more than `max_accuracy_drop`, the floor is
halved (more rank kept) and the cut tried again, down to the rank rule alone and then no cut.

With `rebound_steps` > 0, at every switch (phase change, sync, re-factorisation) the learning
rate drops to `rebound_lr` and ramps linearly back to the schedule's value over `rebound_steps`
(off by default: it cost accuracy at the cycle lengths measured; docs: ab). Adam/SGD
moments are kept across switches and sliced or zero-padded when a factor's rank changes (or
dropped: `reset_optimizer`).

Traffic in group process sets is intra-group; every world collective (warm-up, full-rank
phase, syncs, re-factorisation checks, the loop's per-step agreement outside group phases) is
inter-group: with one group per node, that is the network traffic.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn

from hvd_lowcomm import task
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.optimizers import as_one_optimizer
from hvd_lowcomm.config import ConfigError, make_options
from hvd_lowcomm.methods.ab.options import ABOptions, Schedule, check_groups
from hvd_lowcomm.methods.base import broadcast_model_and_optimizer, exchange_gradients
from hvd_lowcomm.methods.ab.factorized import (
    FactorizedLayer,
    choose_rank,
    dropped_fraction,
    factorize_model,
    noise_edge,
    unfactorized_copy,
)
from hvd_lowcomm.methods.grouped import (
    OptimizerDoor,
    group_traffic,
    outer_optimizer,
    step_inner_optimizer,
    trial_sync,
    user_step_notice,
)
from hvd_lowcomm.models.layer_kinds import kind_of
from hvd_lowcomm.schedule import SET_LATER, require_run_length

# What `ABTraining.step` measures a cut on: the model's input, or its keyword arguments (an
# encoder-decoder needs the decoder's too: {"input_ids": x, "labels": y} for a Hugging Face T5).
ModelInput = torch.Tensor | Mapping[str, Any]


class ABTraining:
    """AB-training for any training loop: factorises `model` in place, owns the groups and the
    schedule, and takes one optimisation step per `with ab.step(x, y):` block::

        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        ab = hvd_lowcomm.ABTraining(model, opt, total_steps=epochs * len(loader))
        for x, y in loader:
            with ab.step(x, y):        # before: phase switches; after: exchange, opt.step()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
        final = ab.full_model()        # the synced model as an ordinary network (collective)

    Entering `step` applies the schedule's switch for this step (a re-factorisation measures
    its cut on `model(x)`, or `model(**x)` when `x` is a mapping of keyword arguments, as an
    encoder-decoder needs: `ab.step({"input_ids": x, "labels": y})`, and checks it against the
    labels `y`, or against the dense model's own predictions when `y` is None); leaving it
    averages the gradients of what this rank trains (inside its group in the group phase, over
    all ranks otherwise) and calls `optimizer.step()`. The factors A and B join the parameter group of the weight they
    replace, so the user's optimiser, its hyper-parameters and LR scheduler keep working;
    `clip_grad_norm` clips the pooled gradient before that step. Frozen layers stay dense.
    `total_steps` lets options below 1 mean fractions of the run; keyword options are those
    of `ABOptions` (groups, warmup, sync_every, cut, ...). Collective: every rank
    constructs it and takes every step.

    With mixed precision pass the loop's GradScaler (`scaler=`): inside the block call
    `scaler.scale(loss).backward()`; leaving it unscales, clips, `scaler.step(optimizer)` and
    `scaler.update()`. The first step checks that the model's output fits its labels with one
    forward pass of its own (or pass `example=(x, y)` to check at construction).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        total_steps: int | None = None,
        options: ABOptions | None = None,
        clip_grad_norm: float = 0.0,
        scaler: Any = None,
        example: tuple[ModelInput, torch.Tensor | None] | None = None,
        check_outputs: bool = True,
        **kwargs: Any,
    ) -> None:
        o = make_options(ABOptions, "ab", options, **kwargs)
        require_run_length(o, ("warmup", "sync_every", "full_rank_steps", "rebound_steps"), total_steps, "ab")
        optimizer = as_one_optimizer(optimizer)  # a (Muon, AdamW) pair steps as one
        self.options, self.model, self.optimizer, self.clip_grad_norm = o, model, optimizer, clip_grad_norm
        self.scaler = scaler
        self.checked_outputs = example is not None or not check_outputs  # (else at the first step)
        if example is not None:  # before anything changes
            check_outputs_fit_labels(model, *example)
        groups = runtime.default_group_count(o.groups, runtime.size())
        check_groups(o, groups, runtime.size())
        if o.init == "ortho-sigma":
            _ortho_sigma(model)
        # Frozen layers stay dense: their factors would otherwise be trained by the groups.
        frozen = [name for name, m in model.named_modules() if kind_of(m) is not None and not m.weight.requires_grad]
        self.layers, self.kept_dense = factorize_model(model, o.full_rank, frozen)
        _add_factors_to_optimizer(optimizer, self.layers.values())
        self.full_parameters = sum(p.numel() for n, p in model.named_parameters() if not n.endswith((".A", ".B")))
        self.group, self.all_groups = runtime.split_world(num_groups=groups, label="group")
        self.role = "B" if o.sync_mode == "only-b" or self.group.index >= groups // 2 else "A"
        a_ranks = sum(g.size for g in self.all_groups[: groups // 2])
        self.trainers = (
            {"A": a_ranks, "B": runtime.size() - a_ranks} if o.sync_mode != "only-b" else {"A": 0, "B": runtime.size()}
        )
        broadcast_model_and_optimizer(model, optimizer)
        self.schedule: Schedule | None = None  # plan() knows the run's length; else made at the first step
        self.global_step = 0
        self.phase = "warmup"
        self.last_switch: int | None = None
        self.cuts: dict[str, dict[str, float]] = {}  # the latest re-factorisation, per layer
        self.undone_cuts = 0
        # The outer step's weights (where the group phase began) and its optimiser, when on.
        self.outer_weights = [nn.Parameter(t.detach().clone()) for t in self._outer_targets()]
        self.outer = None if o.plain_average else outer_optimizer(self.outer_weights, o)
        self.door = OptimizerDoor(
            optimizer,
            "the `with ab.step(x, y):` block",
            shut="ABTraining steps the optimiser itself when a `with ab.step(x, y):` block ends, after "
            "the exchange and the schedule's switches; a step of its own would skip both: remove "
            "optimizer.step() from the loop (and scaler.step(opt): pass the GradScaler as scaler=)",
        )
        for call in ("synchronize", "skip_synchronize"):  # Horovod's calls: nothing to do here
            if not hasattr(optimizer, call):
                setattr(optimizer, call, user_step_notice("ABTraining", call))
        self._set_trainable()
        kinds = Counter(layer.kind.name for layer in self.layers.values())
        self._say(
            f"factorises {len(self.layers)} layers ({', '.join(f'{n} {k}' for k, n in kinds.items())}); kept "
            f"dense: {'; '.join(f'{name} ({why})' for name, why in self.kept_dense.items()) or 'none'}"
        )
        if total_steps not in (None, SET_LATER):
            self.set_total_steps(total_steps)

    def set_total_steps(self, total_steps: int) -> None:
        """Fix the schedule for a run of `total_steps` steps (resolves fractional options)."""
        self.schedule = Schedule(self.options, total_steps)
        s = self.schedule
        self._say(
            f"schedule over {total_steps} steps: warm-up {s.warmup}, then cycles of {s.sync_every} group "
            f"steps and {s.full_rank_steps} full-rank steps; the first cut at the first re-factorisation from "
            f"step {s.first_cut} on; LR rebound over {s.rebound_steps} steps"
        )

    # -- one step ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, x: ModelInput, y: torch.Tensor | None = None) -> Iterator[None]:
        """One training step around the caller's forward and backward pass (see the class)."""
        if self.schedule is None:
            self.schedule = Schedule(self.options)  # steps only: a fraction needs set_total_steps()
        if not self.checked_outputs:
            check_outputs_fit_labels(self.model, x, y)
            self.checked_outputs = True
        self._advance(x, y)
        scheduled = [group["lr"] for group in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, scheduled):
            group["lr"] = self._rebound_lr(lr)
        try:
            yield
            self._exchange_gradients()
            with self.door.own_step():
                step_inner_optimizer(
                    self.optimizer,
                    [p for p in self.model.parameters() if p.requires_grad],
                    self.clip_grad_norm,
                    self.scaler,
                )
            self.global_step += 1
        finally:  # the caller's (or its scheduler's) learning rate, untouched by the rebound
            for group, lr in zip(self.optimizer.param_groups, scheduled):
                group["lr"] = lr

    def _exchange_gradients(self) -> None:
        trained = [(f"ab.grad.{n}", p) for n, p in self.model.named_parameters() if p.requires_grad]
        if self.phase == "group" and self.options.comm == "individual":
            trained = [(n, p) for n, p in trained if not n.endswith((".A", ".B"))]  # each rank keeps its own
        exchange_gradients(trained, self.group if self.phase == "group" else None)

    def agreement_group(self) -> runtime.Group | None:
        """Groups run free: after a group step, checks (non-finite values) belong inside the
        group, unless the next step starts with a world collective anyway; None: all ranks."""
        if self.phase == "group" and self.schedule is not None and not self.schedule.transitions(self.global_step):
            return self.group
        return None

    def _advance(self, x: ModelInput, y: torch.Tensor | None) -> None:
        actions = self.schedule.transitions(self.global_step)
        for action in actions:
            if action == "factorize-first":
                self._factorize(x, y, truncate=not self.options.first_full_rank)
            elif action == "sync":
                self._sync()
            else:
                self._factorize(x, y, truncate=self.schedule.cuts(self.global_step))
        phase = self.schedule.phase(self.global_step)
        if self.outer is not None and phase == "group" and {"factorize-first", "refactorize"} & set(actions):
            with torch.no_grad():  # where this group phase begins: the outer step's starting point
                for start, value in zip(self.outer_weights, self._outer_targets()):
                    start.copy_(value)
        if actions or phase != self.phase:
            self.last_switch = self.global_step
        if phase != self.phase:
            self.phase = phase
            self._set_trainable()
            self._say(
                f"step {self.global_step}: {phase} phase"
                + (
                    f" (ranks {self._ranks_text()}, compression {self.compression_ratio():.2f}x)"
                    if phase == "group"
                    else ""
                )
            )
        elif "refactorize" in actions:
            self._say(
                f"step {self.global_step}: re-factorised (ranks {self._ranks_text()}, "
                f"compression {self.compression_ratio():.2f}x)"
            )

    def _rebound_lr(self, lr: float) -> float:
        o, length = self.options, self.schedule.rebound_steps
        if self.last_switch is None or length == 0:
            return lr
        progress = min(1.0, (self.global_step - self.last_switch) / length)
        return o.rebound_lr + (lr - o.rebound_lr) * progress

    def _set_trainable(self) -> None:
        grouped = self.phase == "group"
        for layer in self.layers.values():
            layer.layer.weight.requires_grad_(not grouped)
            layer.A.requires_grad_(grouped and self.role == "A")
            layer.B.requires_grad_(grouped and self.role == "B")

    # -- factorise, sync -------------------------------------------------------------------------
    def _factorize(self, x: ModelInput, y: torch.Tensor | None, truncate: bool) -> None:
        """Factorise every layer; with `truncate`, at the ranks the rule and floor choose,
        agreed over all ranks (MAX), and checked against the pooled loss and accuracy of this
        step's batch (the floor halves until the cut costs at most max_loss_rise and
        max_accuracy_drop)."""
        o = self.options.cut
        layers = list(self.layers.values())
        old = [{"A": layer.A, "B": layer.B} for layer in layers]
        # After a cut, only the leading triplets near the last rank (layer.rank is the full one
        # before any cut). W is identical on every rank here, and so is every spectrum and
        # every decision taken on it.
        spectra = [layer.spectrum(leading=layer.rank if truncate else None) for layer in layers]
        for layer, spectrum in zip(layers, spectra):
            if layer.noise_edge is None:  # the bulk is still there: measure its edge once
                layer.noise_edge = noise_edge(spectrum.s, layer.tall_shape)
        if not truncate:
            for layer, spectrum, shapes in zip(layers, spectra, old):
                layer.factorize(rank=len(spectrum.s), svd=spectrum)
                self._fit_optimizer_state(layer, shapes)
            return
        with self._probing() as logits_of:
            dense_logits = logits_of(x, record=True)
            labels = dense_logits.argmax(-1) if y is None else y  # no labels: agreement with the dense model
            energies = [layer.component_energy(spectrum) for layer, spectrum in zip(layers, spectra)]
            floor = o.max_output_error
            while True:
                local = [
                    layer.rank
                    if floor is None
                    # the last resort: no cut
                    else max(
                        min(layer.rank, math.ceil(o.min_rank_share * min(layer.tall_shape))),
                        choose_rank(
                            sp.s,
                            layer.tall_shape,
                            o.rank_rule,
                            o.tau,
                            e,
                            floor,
                            layer.noise_edge,
                            median=None if sp.complete else sp.median_bound(layer.tall_shape),
                        ),
                    )
                    for layer, sp, e in zip(layers, spectra, energies)
                ]
                ranks = meter.allreduce_ints(local, "ab.ranks", op="max")
                short = [i for i, (rank, sp) in enumerate(zip(ranks, spectra)) if rank > sp.trusted]
                for i in short:  # the cut reaches past the computed triplets: compute more
                    spectra[i] = layers[i].spectrum(leading=int(ranks[i]))
                    energies[i] = layers[i].component_energy(spectra[i])
                if short:
                    continue
                for layer, rank, spectrum in zip(layers, ranks, spectra):
                    layer.factorize(rank=int(rank), svd=spectrum)
                cut_logits = logits_of(x)
                check = torch.tensor(
                    [
                        float(task.loss(dense_logits, labels, "sum")),
                        float(task.loss(cut_logits, labels, "sum")),
                        task.correct(dense_logits, labels),
                        task.correct(cut_logits, labels),
                        task.positions(labels),
                    ],
                    dtype=torch.float64,
                )
                loss_before, loss_after, before, after, count = meter.allreduce_many(
                    [("ab.cut_check", check)], op="sum"
                )[0].tolist()
                drop, rise = (before - after) / count, (loss_after - loss_before) / max(loss_before, 1e-30)
                if (drop <= o.max_accuracy_drop and rise <= o.max_loss_rise) or floor is None:
                    break
                self.undone_cuts += 1
                self._say(
                    f"step {self.global_step}: a cut at ranks {ranks} raised the batch loss by "
                    f"{100 * rise:.1f} % and lowered its accuracy by {100 * drop:.1f} points; keeping more rank"
                )
                floor = floor / 2 if floor > o.max_output_error / 8 else (0.0 if floor else None)
        self.cuts = {
            name: {
                "rank": int(rank),
                "compression": layer.full_size / layer.factor_size(int(rank)),
                "weight_error": dropped_fraction(spectrum.weight_energy(), int(rank)),
                "output_error": dropped_fraction(energy, int(rank)),
            }
            for (name, layer), rank, spectrum, energy in zip(self.layers.items(), ranks, spectra, energies)
        }
        for layer, shapes in zip(layers, old):
            self._fit_optimizer_state(layer, shapes)
        self._say(
            "cut per layer: "
            + "; ".join(
                f"{name} rank {c['rank']} ({c['compression']:.1f}x, drops {100 * c['weight_error']:.0f}% of W, "
                f"{100 * c['output_error']:.0f}% of its output)"
                for name, c in self.cuts.items()
            )
            + f"; batch loss {loss_after / count:.4f} ({100 * rise:+.2f} %), accuracy {100 * after / count:.1f}% "
            f"({-100 * drop:+.1f} points)"
        )

    @contextlib.contextmanager
    def _probing(self) -> Iterator[Any]:
        """Forward passes without training side effects (eval mode, no grad), optionally
        recording every factorised layer's inputs for the output-space floor."""
        hooks = []

        def logits_of(x: ModelInput, record: bool = False) -> torch.Tensor:
            if record:
                hooks.extend(
                    layer.register_forward_hook(lambda m, inputs, out: m.record_inputs(inputs[0]))
                    for layer in self.layers.values()
                )
            try:
                return task.logits(self.model(**x) if isinstance(x, Mapping) else self.model(x))
            finally:
                for hook in hooks:
                    hook.remove()
                hooks.clear()

        self.model.eval()
        try:
            with torch.no_grad():
                yield logits_of
        finally:
            self.model.train()
            for layer in self.layers.values():
                layer.inputs = None

    def _fit_optimizer_state(self, layer: FactorizedLayer, old: dict[str, nn.Parameter]) -> None:
        """The optimiser follows a re-factorisation: a factor whose rank changed is a new
        Parameter (FactorizedLayer._set_factor), which takes the old one's place in its
        parameter group, with the old moments sliced or zero-padded to the new rank (or dropped:
        reset_optimizer)."""
        for name in ("A", "B"):
            param, before = getattr(layer, name), old[name]
            if param is not before:
                for group in self.optimizer.param_groups:
                    group["params"] = [param if p is before else p for p in group["params"]]
            state = self.optimizer.state.pop(before, None)
            if not state or self.options.reset_optimizer:
                continue
            self.optimizer.state[param] = {
                key: _resize(value, param.shape) if torch.is_tensor(value) and value.shape == before.shape else value
                for key, value in state.items()
            }

    def _sync(self) -> None:
        """Combine the groups' factors by sync mode, W = A B, average everything else."""
        mode = self.options.sync_mode
        layers = list(self.layers.items())
        if mode == "full":
            named = [(f"ab.sync.W.{n}", layer.weight().detach()) for n, layer in layers]
            for (_, layer), w in zip(layers, meter.allreduce_many(named, None, op="average")):
                layer.layer.weight.data.copy_(w)
                layer.factorized = False
        else:
            factors = [(n, layer, f) for n, layer in layers for f in ("A", "B") if mode != "only-b" or f == "B"]
            if mode == "only-learned":
                # Each factor averaged over the ranks that trained it: zero elsewhere, sum, divide.
                named = [
                    (f"ab.sync.{n}.{f}", getattr(layer, f).detach() * (self.role == f) / self.trainers[f])
                    for n, layer, f in factors
                ]
                results = meter.allreduce_many(named, None, op="sum")
            else:
                named = [(f"ab.sync.{n}.{f}", getattr(layer, f).detach()) for n, layer, f in factors]
                results = meter.allreduce_many(named, None, op="average")
            for (_, layer, f), value in zip(factors, results):
                getattr(layer, f).data = value
            for _, layer in layers:
                layer.densify()
        self._average_the_rest()
        if self.outer is not None:
            self._outer_step()

    def _outer_targets(self) -> list[torch.Tensor]:
        """What the outer step moves: every factorised layer's W (A B in the group phase, its
        dense weight after a sync) and every other parameter."""
        factor_ids = {id(t) for layer in self.layers.values() for t in (layer.A, layer.B, layer.layer.weight)}
        return [
            *(layer.weight() for layer in self.layers.values()),
            *(p for p in self.model.parameters() if id(p) not in factor_ids),
        ]

    def _outer_step(self) -> None:
        """After a sync: pseudo-gradient = (where the phase began) - (the synced value), one
        outer SGD step from where the phase began, its result the synced weights."""
        self.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for start, synced in zip(self.outer_weights, self._outer_targets()):
                start.grad = start - synced
            self.outer.step()
            for start, synced in zip(self.outer_weights, self._outer_targets()):
                synced.copy_(start)

    def _average_the_rest(self) -> None:
        """Parameters outside the factors (1-D, full-rank layers) and float buffers (BatchNorm
        running statistics) may differ between groups: average them over all ranks."""
        factor_ids = {id(t) for layer in self.layers.values() for t in (layer.A, layer.B, layer.layer.weight)}
        rest = [
            (f"ab.sync.{n}", t)
            for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
            if id(t) not in factor_ids and t.is_floating_point()
        ]
        for (_, t), value in zip(rest, meter.allreduce_many([(n, t.detach()) for n, t in rest], None, op="average")):
            t.data.copy_(value)

    @contextlib.contextmanager
    def synced(self) -> Iterator[nn.Module]:
        """The model a sync would give now (collective in the group phase: a sync on a copy of
        the state, whose traffic counts in the current meter phase); the groups' own factors
        are restored afterwards."""
        if self.phase != "group":
            yield self.model
            return
        with trial_sync(self.model, self._sync, self._outer_state, self._load_outer_state) as model:
            yield model
        for layer in self.layers.values():  # the model's state came back; its factors are live again
            layer.factorized = True

    def _outer_state(self) -> dict[str, Any]:
        return {
            "weights": [w.detach().clone() for w in self.outer_weights],
            "optimizer": self.outer.state_dict() if self.outer is not None else None,
        }

    def _load_outer_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for weight, value in zip(self.outer_weights, state["weights"]):
                weight.copy_(value)
        if self.outer is not None:
            self.outer.load_state_dict(state["optimizer"])

    def full_model(self) -> nn.Module:
        """The synchronised model as an ordinary module (factorised layers back to dense ones
        holding W = A B), the same on every rank; collective (its traffic counts as eval)."""
        with meter.in_phase("eval"), self.synced() as model:
            return unfactorized_copy(model)

    # -- reporting --------------------------------------------------------------------------------
    def _parameter_counts(self) -> tuple[int, int, int]:
        """(parameters outside the factorised layers' weights, in A and B at the current ranks,
        in A and B at rank 1)."""
        factor_ids = {id(t) for layer in self.layers.values() for t in (layer.A, layer.B, layer.layer.weight)}
        rest = sum(p.numel() for p in self.model.parameters() if id(p) not in factor_ids)
        factors = sum(layer.factor_size() if layer.A.numel() else layer.full_size for layer in self.layers.values())
        return rest, factors, sum(layer.factor_size(1) for layer in self.layers.values())

    def compression_ratio(self) -> float:
        """Full-rank parameter count over the low-rank model's (A and B of every factorised
        layer at its current rank, plus everything kept dense). 1.0 before the first
        factorisation."""
        rest, factors, _ = self._parameter_counts()
        return self.full_parameters / (rest + factors)

    between_groups = ("world",)  # syncs, and the loop's checks

    def epoch_metrics(self) -> dict[str, Any]:
        rest, factors, at_rank_one = self._parameter_counts()
        return {
            "phase": self.phase,
            "role": self.role,
            "compression_ratio": self.compression_ratio(),
            # the most any rank could give with the dense layers beside the factorised ones
            "compression_bound": self.full_parameters / (rest + at_rank_one),
            "low_rank_parameters": rest + factors,
            "undone_cuts": self.undone_cuts,
            **group_traffic(self.between_groups),
            **{f"rank/{name}": layer.rank for name, layer in self.layers.items()},
            **{
                f"{key}/{name}": value for name, cut in self.cuts.items() for key, value in cut.items() if key != "rank"
            },
        }

    def summary_metrics(self) -> dict[str, Any]:
        return {**self.epoch_metrics(), "cuts": self.cuts}

    def _ranks_text(self) -> str:
        return ", ".join(f"{name}:{layer.rank}" for name, layer in self.layers.items())

    def _say(self, text: str) -> None:
        runtime.announce(f"ab: {text}")

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: model (with its factors), optimiser and schedule state.
        Ranks of one group hold the same state; groups differ in the group phase."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "ab": {
                "step": self.global_step,
                "phase": self.phase,
                "last_switch": self.last_switch,
                "factorized": {n: layer.factorized for n, layer in self.layers.items()},
                "cuts": self.cuts,
                "undone_cuts": self.undone_cuts,
                "noise_edges": {n: layer.noise_edge for n, layer in self.layers.items()},
                "outer": self._outer_state(),
            },
        }

    def local_state_dict(self) -> dict[str, Any]:
        """Nothing differs between the ranks of a group beyond `state_dict()`."""
        return {}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model_state = state["model"]
        for name, layer in self.layers.items():  # factors must have the saved shapes first
            layer.A.data = torch.empty_like(model_state[f"{name}.A"])
            layer.B.data = torch.empty_like(model_state[f"{name}.B"])
            layer.factorized = state["ab"]["factorized"][name]
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(state["optimizer"])
        ab = state["ab"]
        self.global_step, self.phase, self.last_switch = ab["step"], ab["phase"], ab["last_switch"]
        self.cuts, self.undone_cuts = ab.get("cuts", {}), ab.get("undone_cuts", 0)
        for name, edge in ab.get("noise_edges", {}).items():
            self.layers[name].noise_edge = edge
        if "outer" in ab:
            self._load_outer_state(ab["outer"])
        self._set_trainable()


def check_outputs_fit_labels(model: nn.Module, x: ModelInput, y: torch.Tensor | None) -> None:
    """Refuse, before training, a model whose output its cuts could not be judged on: every
    re-factorisation compares the model's logits on the step's batch with its labels."""
    if y is None:
        return
    model.eval()
    try:
        with torch.no_grad():
            logits = task.logits(model(**x) if isinstance(x, Mapping) else model(x))
    finally:
        model.train()
    try:
        task.loss(logits, y)
    except (ValueError, RuntimeError, IndexError) as err:
        raise ConfigError(
            f"ABTraining judges each cut on the model's output for the step's batch, and this model's logits of "
            f"shape {tuple(logits.shape)} do not fit labels of shape {tuple(y.shape)} ({err}). If the model returns "
            f"logits for part of the input unless given targets (nanoGPT's model(idx) gives the last position only), "
            f"pass its inputs as keywords, ab.step({{'idx': x, 'targets': y}}), or call ab.step(x) without labels: "
            f"the cut is then judged against the dense model's own predictions"
        ) from None


def check_factorizable(model: nn.Module, full_rank: list[str], example: torch.Tensor) -> None:
    """Factorise a copy and check it computes what the model does, dense and as A B at full
    rank: a module that reads a child's weight itself would not see A and B."""
    trial = copy.deepcopy(model)
    layers, _ = factorize_model(trial, full_rank)
    model.eval()
    trial.eval()
    try:
        with torch.no_grad():
            expected = task.logits(model(example))
            for layer in layers.values():
                layer.factorize(rank=min(layer.tall_shape))
            got = task.logits(trial(example))
    except Exception as err:  # noqa: BLE001 - any failure here is the model not fitting AB
        raise ConfigError(
            f"AB-training cannot factorise this model: with {', '.join(layers)} as A B, its "
            f"forward fails ({type(err).__name__}: {err}); name the layer that is used in "
            f"an unusual way in --ab.full_rank"
        ) from None
    finally:
        model.train()
    if not torch.allclose(got, expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max()) + 1e-6):
        raise ConfigError(
            f"AB-training cannot factorise this model: its output changes when "
            f"{', '.join(layers)} compute with A B (some module reads their weight "
            f"directly); keep such layers dense with --ab.full_rank"
        )


def _add_factors_to_optimizer(optimizer: torch.optim.Optimizer, layers: Iterable[FactorizedLayer]) -> None:
    """A and B join the parameter group of the weight they replace (its LR, decay...)."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for layer in layers:
        group = group_of.get(id(layer.layer.weight))
        if group is None:
            raise ConfigError(
                f"AB-training: the optimiser does not hold the weight of {layer.layer}, which it "
                f"factorises; make the optimiser over model.parameters(), or keep that layer dense "
                f"with full_rank"
            )
        present = {id(p) for p in group["params"]}
        group["params"].extend(p for p in (layer.A, layer.B) if id(p) not in present)


def _ortho_sigma(model: nn.Module) -> None:
    """Every Linear/ConvNd weight keeps its singular vectors with all singular values set to 1
    (the reference's ortho-sigma init); the same on every rank, as the seed is."""
    with torch.no_grad():
        for module in model.modules():
            if kind_of(module) is not None:
                w = module.weight
                matrix = w.reshape(w.shape[0], -1).float()  # (SVD takes no bfloat16)
                u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
                w.copy_((u @ vh).reshape(w.shape))


def _resize(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Slice or zero-pad a 2-D tensor to `shape` (top-left block kept)."""
    out = tensor.new_zeros(shape)
    rows, cols = min(shape[0], tensor.shape[0]), min(shape[1], tensor.shape[1])
    out[:rows, :cols] = tensor[:rows, :cols]
    return out
