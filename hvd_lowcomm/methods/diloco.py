"""`diloco`: DiLoCo-style local SGD (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"; Streaming DiLoCo, 2025), with the semantics of torchft's DiLoCo:
the method a user whose nodes are joined by a slow link picks today.

The world is split into G groups of contiguous ranks (one per node when the job spans nodes,
else 2). Each group trains on its own: every step the gradients are averaged inside the group
(data parallel over the node's own links) and the user's inner optimiser steps. Every
H = `sync_every` inner steps the groups meet:

    Δ = θ_global - θ_local          the pseudo-gradient of this group's last H steps
    Δ̄ = mean of Δ over the groups
    θ_global <- outer optimiser step with gradient Δ̄ (SGD, Nesterov momentum, lr outer_lr)
    θ_local <- θ_global              on every rank; the inner optimiser's state is kept

With outer_lr 1 and outer_momentum 0 (the defaults) this is plain periodic model averaging
(local SGD); the paper's outer optimiser is outer_lr 0.7, outer_momentum 0.9.

The exchange between groups is sharded: the ranks of a group hold the same θ_local, so rank i
of every group averages only its 1/|group| slice of Δ with rank i of the other groups (its
"column", one rank per group), steps its slice of θ_global, and the group allgathers the new
slices: a rank sends model/|group| across the network per sync, not the whole model. Options:

- compression (hvd_lowcomm.methods.outer_exchange): none (fp32 allreduce); fp16 or int8 by a
  quantised reduce-scatter and allgather whose bytes per rank stay below twice the slice's
  whatever the number of groups; sparse (SparseLoCo: top-k of each chunk at 2 bits from an
  error-feedback accumulator; with keep_unsent, the default, a group keeps on its own model
  what its exchange left unsent, θ_local <- θ_global - e, so its next Δ carries it and the
  group trains on from it meanwhile) or lowrank (PowerSGD factors of each matrix in 4 bits at a rank that
  spends factor_share of fp32's bytes, error feedback);
- fragments F (Streaming DiLoCo): the parameters in F contiguous parts of about equal size,
  part f synced at inner steps f·H/F + k·H, so the network carries 1/F of the model at a time;
- sync_delay τ (Streaming DiLoCo's overlap, torchft's fragment_sync_delay): a fragment's
  exchange starts at its sync step on a background thread and is applied τ inner steps later,
  so the network time hides behind those steps; update_alpha α keeps α of the progress the
  fragment made meanwhile on top of the new global parameters (θ_local <- θ_global +
  α (θ_local - θ_local at the start); 0 discards it, as torchft does);
- eager (eager updates, Kale, Douillard & Donchev 2025): the exchange runs behind the whole next
  period. At a sync a group starts the exchange of its pseudo-gradient and at once steps its
  global copy with its own part of the mean fresh and the other groups' part one period old:

      Δ̄ ≈ Δ_own(t) / G + (Δ̄(t-1) - Δ_own(t-1) / G)

  Each contribution is applied once, so the groups' copies differ only by their latest own
  parts (plain averaging only: outer momentum would let their outer states drift apart);
  evaluation and the final model add the other groups' outstanding parts.

Floating-point buffers (BatchNorm statistics) are averaged plainly with fragment 0. Evaluation
and the final model use the model a sync of every fragment would give now (as AB-training's).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch
import torch.nn as nn

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, meter
from hvd_lowcomm.config import Config, ConfigError, make_options, option
from hvd_lowcomm.costmodel import Link, MethodCost, Prediction, Profile, RunAssumptions, sent_bytes
from hvd_lowcomm.registry import register
from hvd_lowcomm.methods.outer_exchange import COMPRESSIONS, Transfer, make_exchange
from hvd_lowcomm.methods.base import broadcast_model_and_optimizer, exchange_gradients
from hvd_lowcomm.methods.grouped import (GroupedOptions, GroupTrainerMethod, group_traffic, outer_optimizer,
                                         step_inner_optimizer, trial_sync)
from hvd_lowcomm.schedule import SET_LATER, require_run_length, run_steps

@dataclass
class DiLoCoOptions(GroupedOptions):
    """DiLoCo: groups train alone for sync_every steps; an outer step on the averaged
    pseudo-gradient joins them."""

    section: ClassVar[str] = "diloco"

    # A fraction, like AB-training's schedule, so the default fits a run of any length: a twentieth
    # of a 10,000-step run is the paper's H = 500.
    sync_every: float = option(0.05, "inner steps between outer steps, H (< 1: fraction of the run's steps)")
    # A pseudo-gradient's error-fed top-k carries what matters of it; the held-out suite compares
    # it with fp32 (docs: benchmarks, "Held-out defaults").
    compression: str = option("sparse", "pseudo-gradients between groups: sparse (the default: top-k of each chunk at "
                                        "2 bits with error feedback, a small share of fp32's bytes at fp32's quality "
                                        "on the held-out suite), lowrank (PowerSGD factors of each matrix in 4 bits, "
                                        "error feedback), int8 (per-block scaling, error feedback), fp16 or none (fp32)",
                              choices=COMPRESSIONS)
    # Denser than SparseLoCo's: its densities lost quality over the tens of outer steps of runs here (the
    # papers ran far more), and Elias-Fano positions pay for the difference (docs: benchmarks, "DiLoCo's
    # exchange between groups").
    density: float = option(0.12, "sparse: the share of each chunk's numbers sent (SparseLoCo used 0.01-0.03 on "
                                  "large models with many outer steps)")
    # Three times density: the mean of G groups' sparse parts holds up to G times their numbers, and what
    # the owner's second selection leaves out is what cost most beyond two groups; other splits of the same
    # bytes did no better (docs: benchmarks, "DiLoCo's exchange between groups").
    owner_density: float = option(0.0, "sparse beyond 2 groups: the share of each chunk of the groups' mean that its "
                                        "owner sends back (the mean of G sparse parts is up to G times denser "
                                        "than one); 0: three times density")
    # A pseudo-gradient's signal is not sparse in coordinates, so much of a group's progress waits unsent;
    # kept on its own model, the group trains on from it and only the other groups see it late. Sparse only:
    # low-rank leaves mostly noise unsent (docs: diloco, on keep_unsent).
    keep_unsent: bool = option(True, "sparse: each group keeps on its own model what its exchange has not sent yet "
                                     "(its error feedback) instead of restarting from the global model without it "
                                     "(not with eager)")
    error_decay: float = option(1.0, "sparse: the error-feedback accumulator's decay, e <- decay*e + Δ")
    # 0, a rank per matrix from a byte budget: one fixed rank spends the bytes unevenly between models, and
    # the pseudo-gradient's tail needs rank wherever the bytes allow (docs: benchmarks, "DiLoCo's exchange
    # between groups").
    rank: int = option(0, "lowrank: columns of P and Q per matrix; 0: each matrix's own, what its share of the "
                          "byte budget (factor_share) buys")
    # 4: the same bytes buy nearly twice int8's rank, at equal bytes rank buys more than precision, and
    # the mean's rounding, fed back by its owner, is not lost (docs: benchmarks, "DiLoCo's exchange between groups").
    factor_bits: int = option(4, "lowrank: bits a factor's number takes on the wire (4 or 8; dense numbers go in "
                                 "int8)", choices=(4, 8))
    factor_share: float = option(0.05, "lowrank with rank 0: the share of fp32's bytes the exchange sends (dense "
                                       "numbers and scales included); every matrix is compressed by the same "
                                       "factor")
    fragments: int = option(1, "streaming: sync the model in this many parts at staggered steps (peak traffic "
                               "between groups / fragments)")
    sync_delay: int = option(0, "inner steps between starting a fragment's exchange and applying it (torchft's "
                                "fragment_sync_delay): the exchange runs behind them; 0 blocks; < H / fragments")
    update_alpha: float = option(1.0, "with sync_delay: the share of the local progress made while the exchange "
                                      "ran that the fragment keeps on top of the new global parameters")
    # Off by default: the other groups' part of each step comes a period late, which costs more the more
    # groups there are (docs: diloco, on diloco.eager).
    eager: bool = option(False, "hide each exchange behind the whole next period (eager updates): step at once with "
                                "this group's own pseudo-gradient and the other groups' from one period earlier; "
                                "plain averaging only (outer_momentum 0), not with sync_delay; pays at few groups "
                                "(the other groups' part, a period late, grows with their number)")

    def validate(self) -> None:
        super().validate()
        if self.sync_every <= 0 or (self.sync_every > 1 and self.sync_every != int(self.sync_every)):
            raise ConfigError(f"diloco.sync_every must be a whole number of steps or a fraction in (0, 1), got "
                              f"{self.sync_every}")
        if self.fragments < 1:
            raise ConfigError(f"diloco.fragments must be >= 1, got {self.fragments}")
        if not 0 < self.density <= 1:
            raise ConfigError(f"diloco.density must be in (0, 1], got {self.density}")
        if not 0 <= self.owner_density <= 1:
            raise ConfigError(f"diloco.owner_density must be in [0, 1] (0: three times density), got {self.owner_density}")
        if not 0 <= self.error_decay <= 1:
            raise ConfigError(f"diloco.error_decay must be in [0, 1], got {self.error_decay}")
        if self.keeps_unsent and self.error_decay != 1:
            raise ConfigError(f"diloco.error_decay {self.error_decay} decays the exchange's accumulator, but with "
                              f"diloco.keep_unsent (the default) each group's model holds what is unsent: set "
                              f"--diloco.keep_unsent false to decay it")
        if self.rank < 0:
            raise ConfigError(f"diloco.rank must be >= 0 (0: from diloco.factor_share), got {self.rank}")
        if not 0 < self.factor_share <= 1:
            raise ConfigError(f"diloco.factor_share must be in (0, 1], got {self.factor_share}")
        if self.sync_delay < 0:
            raise ConfigError(f"diloco.sync_delay must be >= 0, got {self.sync_delay}")
        if not 0 <= self.update_alpha <= 1:
            raise ConfigError(f"diloco.update_alpha must be in [0, 1], got {self.update_alpha}")
        if self.eager and self.sync_delay:
            raise ConfigError("diloco.eager already runs each exchange behind a whole period: leave sync_delay at 0")
        if self.eager and self.fragments > 1:
            raise ConfigError(f"diloco.eager takes one fragment (got {self.fragments}): use sync_delay to overlap "
                              f"a streaming run's exchanges")
        if self.eager and self.outer_momentum:
            raise ConfigError(f"diloco.eager needs plain averaging (outer_momentum 0, got {self.outer_momentum}): each "
                              f"group steps its own copy, and momentum would let the groups' outer states drift apart")

    @property
    def keeps_unsent(self) -> bool:
        """Whether groups keep their unsent error feedback on their models (eager keeps its own)."""
        return self.compression == "sparse" and self.keep_unsent and not self.eager

    def check_schedule(self, every: int) -> None:
        """The delay must let each fragment's exchange land before the next one starts."""
        if self.sync_delay and self.sync_delay >= every / self.fragments:
            raise ConfigError(f"diloco.sync_delay {self.sync_delay} must be below H / fragments = {every} / "
                              f"{self.fragments}: a fragment's exchange must land before the next one starts")


# ---------------------------------------------------------------------------------------------
# fragments, shards and the sync schedule (shared with the cost model)

def fragment_bounds(sizes: list[int], fragments: int) -> list[int]:
    """Tensor indices [0, b_1, ..., len(sizes)]: `fragments` contiguous runs of tensors holding
    about equal numbers."""
    if fragments > len(sizes):
        raise ConfigError(f"diloco.fragments {fragments}, but the model has only {len(sizes)} trainable tensors: "
                          f"use at most {len(sizes)} fragments")
    cumulative = [0]
    for n in sizes:
        cumulative.append(cumulative[-1] + n)
    bounds = [0]
    for k in range(1, fragments):
        target = cumulative[-1] * k / fragments
        best = min(range(bounds[-1] + 1, len(sizes) - (fragments - k) + 1),
                   key=lambda i: abs(cumulative[i] - target))
        bounds.append(best)
    return [*bounds, len(sizes)]


def shard_length(numbers: int, group_size: int) -> int:
    """Numbers in each rank's slice of a fragment (the last slices padded with zeros)."""
    return -(-numbers // group_size)


def sync_due(inner_step: int, fragment: int, every: int, fragments: int) -> bool:
    """Whether `fragment` is synced after inner step `inner_step` (1-based): at f·H/F + k·H."""
    offset = fragment * every // fragments
    return inner_step >= max(offset, 1) and (inner_step - offset) % every == 0


# ---------------------------------------------------------------------------------------------
# DiLoCo for any training loop

class DiLoCo:
    """DiLoCo for any training loop: the caller's optimiser is the inner one; `step()` replaces
    its `optimizer.step()`::

        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        diloco = hvd_lowcomm.DiLoCo(model, opt, total_steps=epochs * len(loader))
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            diloco.step()              # gradients averaged in the group, opt.step(); every H: outer step
        final = diloco.full_model()    # the model after a sync of every fragment (collective)

    `step()` averages the gradients inside this rank's group, clips them (`clip_grad_norm`),
    steps the inner optimiser and, on the steps the schedule says, runs the outer step of the
    fragments due. `total_steps` lets a `sync_every` below 1 mean a fraction of the run; keyword
    options are those of `DiLoCoOptions`. Every rank starts from rank 0's parameters and
    optimiser state. Collective: every rank constructs it and takes every step. With mixed
    precision pass the loop's GradScaler (`scaler=`) and call `scaler.scale(loss).backward()`:
    `step()` unscales, clips, `scaler.step(optimizer)` and `scaler.update()`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, total_steps: int | None = None,
                 options: DiLoCoOptions | None = None, clip_grad_norm: float = 0.0, scaler: Any = None,
                 **kwargs: Any) -> None:
        o = make_options(DiLoCoOptions, "diloco", options, **kwargs)
        require_run_length(o, ("sync_every",), total_steps, "diloco")
        self.options, self.model, self.optimizer, self.clip_grad_norm = o, model, optimizer, clip_grad_norm
        self.scaler = scaler
        groups = runtime.default_group_count(o.groups, runtime.size())
        runtime.group_layout(runtime.size(), num_groups=groups)  # a clear error when they do not divide
        self.group, self.all_groups = runtime.split_world(num_groups=groups, label="group")
        self.column, _ = runtime.split_by_position(groups, label="column")
        self.position = self.group.rank_of(runtime.rank())
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        bounds = fragment_bounds([p.numel() for _, p in named], o.fragments)
        self.fragments = [named[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        self.inner_named = [(f"diloco.inner.{name}", p) for name, p in named]  # what the group averages
        self.buffers = [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]
        broadcast_model_and_optimizer(model, optimizer)
        # This rank's slice of each fragment's global copy, as the outer optimiser's parameters.
        self.global_slices = [nn.Parameter(self._local_slice(f)) for f in range(len(self.fragments))]
        self.outer = outer_optimizer(self.global_slices, o)
        self.exchange = make_exchange(self.column, o)
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None  # runs delayed exchanges
        self.in_flight: dict[int, InFlight] = {}  # fragment -> its started exchange
        self.own_previous: dict[int, torch.Tensor] = {}  # eager: this group's part of each exchange in flight
        self.exchange_wait_seconds = 0.0  # what steps waited for exchanges between groups
        self.inner_steps = 0
        self.since_sync = [0] * len(self.fragments)  # inner steps since each fragment's last sync
        self.outer_steps = 0
        self.synced_now = False  # whether the step just taken ended with an outer step
        self.every: int | None = None
        if total_steps not in (None, SET_LATER):
            self.set_total_steps(total_steps)
        elif o.sync_every >= 1:  # steps: the schedule is known now
            self._set_every(int(o.sync_every))

    def set_total_steps(self, total_steps: int) -> None:
        """Fix H for a run of `total_steps` steps (resolves a fractional sync_every)."""
        self._set_every(max(1, run_steps(self.options.sync_every, total_steps, "diloco.sync_every")))
        o = self.options
        delay = f", applied {o.sync_delay} steps later (alpha {o.update_alpha})" if o.sync_delay else \
            ", behind the whole next period (eager)" if o.eager else ""
        if o.compression in ("sparse", "lowrank") and o.outer_momentum:
            # Far worse than plain averaging wherever measured (docs: benchmarks, "DiLoCo's exchange between groups")
            runtime.announce(f"diloco: warning: {o.compression} with outer momentum {o.outer_momentum} trained far "
                             f"worse than with plain averaging in every measurement here: its error feedback already "
                             f"carries what momentum would (SparseLoCo); consider --diloco.outer_momentum 0 "
                             f"--diloco.outer_lr 1")
        runtime.announce(f"diloco: {len(self.all_groups)} groups of {self.group.size} rank(s); an outer step every "
                         f"{self.every} inner steps ({len(self.fragments)} fragment(s), {o.compression} exchange"
                         f"{delay}; outer lr {o.outer_lr}, momentum {o.outer_momentum})")

    def _set_every(self, every: int) -> None:
        self.options.check_schedule(every)
        if (self.options.sync_delay or self.options.eager) and self.worker is None:
            from mpi4py import MPI

            if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
                raise ConfigError("diloco.sync_delay and diloco.eager run the exchange on a second thread, which needs MPI "
                                  "initialised with MPI_THREAD_MULTIPLE (mpi4py's default; check mpi4py.rc)")
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-exchange")
        self.every = every

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> None:
        """After the caller's backward pass: the inner step, then the outer step of every
        fragment due (see the class)."""
        if self.every is None:  # steps only: a fraction needs set_total_steps()
            self._set_every(max(1, run_steps(self.options.sync_every, None, "diloco.sync_every")))
        exchange_gradients(self.inner_named, self.group)
        step_inner_optimizer(self.optimizer, [p for _, p in self.inner_named], self.clip_grad_norm, self.scaler)
        self.inner_steps += 1
        self.since_sync = [n + 1 for n in self.since_sync]
        starting = [f for f in range(len(self.fragments))
                    if sync_due(self.inner_steps, f, self.every, len(self.fragments))]
        if self.options.eager:
            if starting:
                self._eager_step(starting)
                self.outer_steps += 1
            self.synced_now = bool(starting)
            return
        for f in starting:
            self._start(f, background=bool(self.options.sync_delay))
        due = sorted(f for f, flight in self.in_flight.items() if flight.apply_at == self.inner_steps)
        if due:
            self._apply(due)
            self.outer_steps += 1
        self.synced_now = bool(due)

    def agreement_group(self) -> runtime.Group | None:
        """Where the loop's per-step checks run: the whole world right after an outer step (all
        ranks met in it), else this rank's group (the groups run free)."""
        return None if self.synced_now else self.group

    # -- the outer step ------------------------------------------------------------------------
    def _flat(self, fragment: int) -> torch.Tensor:
        """The fragment's parameters as one vector, padded with zeros to a whole number of slices."""
        flat = torch.cat([p.detach().reshape(-1) for _, p in self.fragments[fragment]])
        length = shard_length(len(flat), self.group.size) * self.group.size
        return torch.cat([flat, flat.new_zeros(length - len(flat))])

    def _local_slice(self, fragment: int) -> torch.Tensor:
        length = shard_length(sum(p.numel() for _, p in self.fragments[fragment]), self.group.size)
        return self._flat(fragment)[self.position * length:(self.position + 1) * length].clone()

    def _start(self, fragment: int, background: bool, delta: torch.Tensor | None = None) -> None:
        """Start averaging the fragment's pseudo-gradient slice (`delta`, or global - local now)
        over the column: at once, or on the worker thread, to be applied `sync_delay` steps
        later (eager: at the fragment's next sync)."""
        if delta is None:
            delta = self.global_slices[fragment].detach() - self._local_slice(fragment)
        shapes = [tuple(p.shape) for _, p in self.fragments[fragment]]
        collective = self.exchange.start(fragment, delta, shapes, self.position * len(delta))
        keeps = background and bool(self.options.sync_delay) and self.options.update_alpha > 0
        prepared = [p.detach().clone() for _, p in self.fragments[fragment]] if keeps else None
        if background:
            result = self.worker.submit(collective)
        else:
            with self._waiting():
                result = collective()
        later = (self.every if self.options.eager else self.options.sync_delay) if background else 0
        self.in_flight[fragment] = InFlight(result, self.inner_steps + later, prepared)

    def _settle(self) -> None:
        """Wait for every exchange in flight (its result is kept for its own step)."""
        for flight in self.in_flight.values():
            self._result(flight)

    def _result(self, flight: InFlight) -> torch.Tensor:
        """An exchange's mean, waited for if it is still on the worker thread."""
        if isinstance(flight.result, concurrent.futures.Future):
            with self._waiting():
                flight.result = flight.result.result()
        return flight.result

    def _eager_step(self, due: list[int]) -> None:
        """Eager updates (see the module): start each due fragment's exchange behind the next
        period and step its global copy now with this group's own part of the mean and the other
        groups' part of the previous exchange's."""
        own = {f: self.global_slices[f].detach() - self._local_slice(f) for f in due}
        for f in due:
            outer_gradient = own[f] / len(self.all_groups)
            previous = self.in_flight.pop(f, None)
            if previous is not None:
                outer_gradient = outer_gradient + self._others_part(f, previous)
            self.in_flight[f] = InFlight(outer_gradient, self.inner_steps, None)
        self._apply(due)
        for f in due:
            self._start(f, background=True, delta=own[f])
            self.own_previous[f] = own[f]

    def _others_part(self, fragment: int, flight: InFlight) -> torch.Tensor:
        """Eager: the other groups' part of an exchange's mean (the mean less this group's own)."""
        return self._result(flight) - self.own_previous[fragment] / len(self.all_groups)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Time blocked on the exchange between groups: the meter's, and in training (not in
        an evaluation's trial sync) this trainer's exchange_wait_seconds."""
        start = time.perf_counter()
        with meter.waiting():
            yield
        if meter.phase == "train":
            self.exchange_wait_seconds += time.perf_counter() - start

    def _apply(self, due: list[int], keep_unsent: bool = True) -> None:
        """Step the due fragments' global slices with their averaged pseudo-gradients and give
        every rank of the group the new global parameters (plus update_alpha of the progress
        made since the exchange started, when it ran behind inner steps; with keep_unsent, less
        what the exchange left unsent: Δ is global - local, so the group's model keeps that
        progress, and its next Δ carries it as the accumulator would have)."""
        self._settle()
        flights = [self.in_flight.pop(f) for f in due]
        self.outer.zero_grad(set_to_none=True)
        for f, flight in zip(due, flights):
            self.global_slices[f].grad = flight.result
        self.outer.step()
        models = []
        for f in due:
            unsent = self.exchange.take_unsent(f) if keep_unsent and self.options.keeps_unsent else None
            own = self.global_slices[f].detach()
            models.append((f"diloco.global.{f}", own if unsent is None else own - unsent.to(own.device)))
        gathered = meter.allgather_many(models, self.group)
        with torch.no_grad():
            for f, flat, flight in zip(due, gathered, flights):
                offset = 0
                for i, (_, p) in enumerate(self.fragments[f]):
                    new = flat[offset:offset + p.numel()].view_as(p)
                    if flight.prepared is not None:  # keep alpha of what was learned meanwhile
                        new = new + self.options.update_alpha * (p - flight.prepared[i])
                    p.copy_(new)
                    offset += p.numel()
                self.since_sync[f] = self.options.sync_delay if flight.prepared is not None else 0
            if 0 in due and self.buffers:
                averaged_buffers = meter.allreduce_many([(f"diloco.buffer.{n}", b) for n, b in self.buffers],
                                                        self.column, op="average")
                for (_, b), value in zip(self.buffers, averaged_buffers):
                    b.copy_(value)

    # -- evaluation, the final model, checkpoints ---------------------------------------------
    @contextlib.contextmanager
    def synced(self) -> Iterator[nn.Module]:
        """The model a blocking outer step of every fragment with inner steps since its last
        sync would give now (with keep_unsent of every fragment: a group's model differs from
        the global one even right after a sync), with eager the other groups' parts still in
        flight added too (collective; its traffic counts in the current meter phase); the
        groups' own state, and any exchange in flight, are restored afterwards."""
        pending = [f for f, n in enumerate(self.since_sync)
                   if n or (self.options.eager and f in self.in_flight) or self.options.keeps_unsent]
        if not pending:
            yield self.model
            return
        self._settle()  # the exchange in flight uses the same state: let it finish first
        with trial_sync(self.model, lambda: self._sync_now(pending), self._sync_state, self._load_sync_state) as model:
            yield model

    def _sync_now(self, fragments: list[int]) -> None:
        in_flight, self.in_flight = self.in_flight, {}  # set aside: restored with the rest
        for f in fragments:
            self._start(f, background=False)
            if self.options.eager and f in in_flight:  # and the other groups' parts not yet applied
                self.in_flight[f].result = self.in_flight[f].result + self._others_part(f, in_flight[f])
        self._apply(fragments, keep_unsent=False)  # the synced model itself, the same on every rank
        self.in_flight = in_flight

    def _sync_state(self) -> tuple[Any, ...]:
        return ([s.detach().clone() for s in self.global_slices], copy.deepcopy(self.outer.state_dict()),
                self.exchange.state_dict(), list(self.since_sync))

    def _load_sync_state(self, state: tuple[Any, ...]) -> None:
        slices, outer_state, exchange_state, since = state
        with torch.no_grad():
            for s, value in zip(self.global_slices, slices):
                s.copy_(value)
        self.outer.load_state_dict(outer_state)
        self.exchange.load_state_dict(exchange_state)
        self.since_sync = since

    def full_model(self) -> nn.Module:
        """The synced model, the same on every rank (collective; its traffic counts as eval)."""
        with meter.in_phase("eval"):
            with self.synced() as model:
                final = copy.deepcopy(model)
            self._settle()  # nothing may be left on the wire when the job ends
            # The sync's last collective is the group's own allgather: without this, a group that
            # finishes first may exit, and Horovod's shutdown then fails another group's gather.
            meter.barrier("diloco.full_model")
        return final

    between_groups = ("column", "world")  # the column exchange, and the loop's checks at outer steps

    def epoch_metrics(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps, "sync_every": self.every,
                "exchange_wait_seconds": round(self.exchange_wait_seconds, 4), **group_traffic(self.between_groups)}

    summary_metrics = epoch_metrics

    def state_dict(self) -> dict[str, Any]:
        """What the ranks of one group share: model, inner optimiser, position in the cycle."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "diloco": {"inner_steps": self.inner_steps, "since_sync": list(self.since_sync),
                           "outer_steps": self.outer_steps, "synced_now": self.synced_now}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        d = state["diloco"]
        self.inner_steps, self.since_sync = d["inner_steps"], list(d["since_sync"])
        self.outer_steps, self.synced_now = d["outer_steps"], d["synced_now"]

    def local_state_dict(self) -> dict[str, Any]:
        """What is this rank's own: its slices of the global copy, their outer momentum, the
        exchange's error feedback (and warm start), and any exchange in flight (waited for, so
        a run resumed from here applies the same result at the same step)."""
        self._settle()
        return {"global_slices": [s.detach().clone() for s in self.global_slices], "outer": self.outer.state_dict(),
                "exchange": self.exchange.state_dict(),
                "own_previous": {f: own.clone() for f, own in self.own_previous.items()},
                "in_flight": {f: (flight.result.clone(), flight.apply_at, flight.prepared)
                              for f, flight in self.in_flight.items()}}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for s, value in zip(self.global_slices, state["global_slices"]):
                s.copy_(value)
        self.outer.load_state_dict(state["outer"])
        self.exchange.load_state_dict(state["exchange"])
        self.in_flight = {int(f): InFlight(result, apply_at, prepared)
                          for f, (result, apply_at, prepared) in state["in_flight"].items()}
        self.own_previous = {int(f): own.clone() for f, own in state.get("own_previous", {}).items()}


@dataclass
class InFlight:
    """A fragment's started exchange: its result (a Future while it runs on the worker thread),
    the inner step it is applied after, and the fragment's parameters when it started (where
    update_alpha keeps the progress made since)."""

    result: Any
    apply_at: int
    prepared: list[torch.Tensor] | None


# ---------------------------------------------------------------------------------------------
# the cost model's view (hvd_lowcomm.costmodel)

def diloco_facts(model: nn.Module, input_shape: tuple[int, ...], options: DiLoCoOptions, cfg: Config
                 ) -> dict[str, Any]:
    """The shapes of each fragment's tensors, and the numbers in the floating-point buffers."""
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    bounds = fragment_bounds([math.prod(s) for s in shapes], options.fragments)
    return {"fragments": [shapes[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
            "buffers": sum(b.numel() for b in model.buffers() if b.is_floating_point())}


def predict_diloco(profile: Profile, world_size: int, link: Link, o: DiLoCoOptions, cfg: Config,
                   assumptions: RunAssumptions) -> Prediction:
    """The mean step over a run of assumptions.run_steps steps: every step the gradients are
    allreduced inside the group (on the node's links when a group fits in a node); each
    fragment's syncs average its slice over the column (one rank per group, across the network
    once groups fill nodes) by the exchange's own collectives, then the group allgathers the
    fragment. Bytes are the busiest position's (low-rank slices differ in their matrices)."""
    groups = runtime.groups_for(o.groups, world_size, link.ranks_per_node)
    if world_size % groups:
        raise ConfigError(f"diloco: {world_size} ranks do not split into {groups} groups")
    g, runs = world_size // groups, max(assumptions.run_steps, 1)
    every = max(1, run_steps(o.sync_every, runs, "diloco.sync_every"))
    facts = profile.facts["diloco"]
    inner = FLOAT_BYTES * profile.params
    comm = runs * link.allreduce(inner, g, world_size)
    sent = runs * sent_bytes("allreduce", inner, g)
    between_nodes = sent * link.node_share(g)
    across = g >= link.ranks_per_node  # a column's ranks sit on different nodes once groups fill nodes
    exchange = make_exchange(None, o, members=groups)
    for f, shapes in enumerate(facts["fragments"]):
        starts = [s for s in range(1, runs + 1) if sync_due(s, f, every, len(facts["fragments"]))]
        # a delayed exchange may land after the run; an eager step lands at once
        applied = len(starts) if o.eager else sum(s + o.sync_delay <= runs for s in starts)
        length = shard_length(sum(math.prod(s) for s in shapes), g)
        transfers = max((exchange.transfers(length, shapes, position * length) for position in range(g)),
                        key=lambda ts: sum(t.sent_bytes(groups) for t in ts))
        landing = [Transfer("allreduce", FLOAT_BYTES * facts["buffers"])] if f == 0 and facts["buffers"] else []
        column = [sum(t.sent_bytes(groups) for t in ts) for ts in (transfers, landing)]
        # an alltoall's time is an allgather's of its parts
        cost = [sum(link.allreduce(t.payload, groups, world_size, spans_nodes=across) if t.op == "allreduce" else
                    link.allgather(t.payload / (groups if t.op == "alltoall" else 1), groups, world_size, spans_nodes=across)
                    for t in ts) for ts in (transfers, landing)]
        gather = sent_bytes("allgather", FLOAT_BYTES * length, g)  # the group's, inside it
        cost[1] += link.allgather(FLOAT_BYTES * length, g, world_size)
        between_nodes += (len(starts) * column[0] + applied * column[1]) * link.node_share(groups, across) \
            + applied * gather * link.node_share(g)
        # A delayed exchange waits on the network behind sync_delay inner steps, an eager one
        # behind the whole period (its thread needs no core of its own: it mostly waits); what
        # they do not cover is exposed.
        behind = every if o.eager else o.sync_delay
        exposed = max(0.0, cost[0] - behind * (profile.step_seconds + link.allreduce(inner, g, world_size)))
        comm += len(starts) * exposed + applied * cost[1]
        sent += len(starts) * column[0] + applied * (column[1] + gather)
    return Prediction("diloco", world_size, profile.step_seconds, 0.0, comm / runs, 0.0, sent / runs, between_nodes / runs)


# ---------------------------------------------------------------------------------------------
# the method

@register("diloco", options=DiLoCoOptions, cost=MethodCost(predict_diloco, model_facts=diloco_facts))
class DiLoCoMethod(GroupTrainerMethod):
    """`--method diloco`: DiLoCo driven by the built-in loop."""

    trainer_class = DiLoCo

    def check_model(self, model: nn.Module) -> None:
        fragment_bounds([p.numel() for p in model.parameters() if p.requires_grad], self.options.fragments)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = self.forward_backward(x, y)
        self.trainer.step()
        return loss
