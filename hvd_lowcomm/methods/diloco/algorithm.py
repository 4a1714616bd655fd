"""`diloco`: DiLoCo-style local SGD (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models"; Streaming DiLoCo, 2025), with the semantics of torchft's DiLoCo:
the method a user whose nodes are joined by a slow link picks today.

The world is split into G groups of contiguous ranks (one per node when the job spans nodes,
else `runtime.groups_for`'s). Each group trains on its own: every step the gradients are
averaged inside the group (data parallel over the node's own links) and the user's inner
optimiser steps. Every H = `sync_every` inner steps the groups meet:

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

- compression (hvd_lowcomm.methods.diloco.exchange): none (fp32 allreduce); fp16, int8 or int2
  (the default) by a quantised reduce-scatter and allgather whose bytes per rank stay below
  twice the slice's whatever the number of groups; sparse (SparseLoCo: top-k of each chunk at
  2 bits from an error-feedback accumulator; with keep_unsent, the default, a group keeps on
  its own model what its exchange left unsent, θ_local <- θ_global - e (unsent_share s: s·e,
  the rest staying in e), so its next Δ carries it and the group trains on from it meanwhile) or lowrank
  (PowerSGD factors of each matrix in 4 bits at a rank that spends factor_share of fp32's
  bytes, error feedback);
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

A model sharded with FSDP2 over each group (`shard_model` on `device_mesh(group_size,
replicate=False)`; `--diloco.shard` in the built-in trainer) needs no slicing: a rank's shards
are its slice. FSDP reduce-scatters the gradients inside the group, and each rank's outer step,
outer state and exchange work on its own shards with the ranks holding the same shards in the
other groups (its column); nothing is gathered after the outer step.

Floating-point buffers (BatchNorm statistics) are averaged plainly with fragment 0. Evaluation
and the final model use the model a sync of every fragment would give now (as AB-training's).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hvd_lowcomm import elastic
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.mesh import (
    full_state_dict,
    load_sharded_state,
    local_part,
    local_shards,
    sharded_state,
    with_shards,
)
from hvd_lowcomm.comm.traffic import meter, side_thread_problem
from hvd_lowcomm.elastic.member import RunFinished, deserialize, serialize
from hvd_lowcomm.optimizers import as_one_optimizer
from hvd_lowcomm.config import ConfigError, make_options
from hvd_lowcomm.methods.base import broadcast_model_and_optimizer, broadcast_parameters, exchange_gradients
from hvd_lowcomm.methods.diloco.options import DiLoCoOptions, fragment_bounds, shard_length, sync_due
from hvd_lowcomm.methods.grouped import (
    OptimizerDoor,
    group_traffic,
    outer_optimizer,
    outer_step_result,
    step_inner_optimizer,
    trial_sync,
    user_step_notice,
)
from hvd_lowcomm.methods.diloco.exchange import Exchange, make_exchange
from hvd_lowcomm.schedule import SET_LATER, require_run_length, run_steps


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

    torchft's form works too: DiLoCo hooks the inner optimiser, so the loop may keep
    `opt.step()` in place of `diloco.step()` (one of the two, never both: the second refuses),
    and `with DiLoCo(...) as diloco:` takes the hooks off when the block ends;
    `diloco.current_step()` (torchft's `manager.current_step()`) counts outer steps and
    `diloco.members()` names the groups that took part in the last one (under the elastic
    launcher, whose restart from checkpoints needs `DiLoCo(..., join=False)` and then
    `diloco.join(step, load)`: see `join`; when `diloco.stop_requested` turns true after a
    step, the run is preempted: checkpoint and exit 0). Through `opt.step()`
    the gradients are averaged in the group just before the step, so a clip the loop applies
    first acts on this rank's own gradient (pass `clip_grad_norm=` to clip the average); a
    GradScaler needs `diloco.step()` (`scaler=`).

    `step()` averages the gradients inside this rank's group, clips them (`clip_grad_norm`),
    steps the inner optimiser and, on the steps the schedule says, runs the outer step of the
    fragments due. `total_steps` lets a `sync_every` below 1 mean a fraction of the run; keyword
    options are those of `DiLoCoOptions`. Every rank starts from rank 0's parameters and
    optimiser state. Collective: every rank constructs it and takes every step. With mixed
    precision pass the loop's GradScaler (`scaler=`) and call `scaler.scale(loss).backward()`:
    `step()` unscales, clips, `scaler.step(optimizer)` and `scaler.update()`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        total_steps: int | None = None,
        options: DiLoCoOptions | None = None,
        clip_grad_norm: float = 0.0,
        scaler: Any = None,
        join: bool = True,
        **kwargs: Any,
    ) -> None:
        o = make_options(DiLoCoOptions, "diloco", options, **kwargs)
        require_run_length(o, ("sync_every",), total_steps, "diloco")
        optimizer = as_one_optimizer(optimizer)  # a (Muon, AdamW) pair steps as one
        self.options, self.model, self.optimizer, self.clip_grad_norm = o, model, optimizer, clip_grad_norm
        self.scaler = scaler
        # Under the elastic launcher this job is one group, and the groups meet through it.
        self.elastic = elastic.member(runtime.rank(), runtime.world().comm)
        if self.elastic is not None:
            check_elastic(o)
        groups = 1 if self.elastic is not None else runtime.default_group_count(o.groups, runtime.size())
        runtime.group_layout(runtime.size(), num_groups=groups)  # a clear error when they do not divide
        self.group, self.all_groups = runtime.split_world(num_groups=groups, label="group")
        self.column, _ = runtime.split_by_position(groups, label="column", side=True)
        self.position = self.group.rank_of(runtime.rank())
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.sharded = check_sharding(named, self.group)
        bounds = fragment_bounds([p.numel() for _, p in named], o.fragments)
        parts = [named[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        # what the group averages (nothing where FSDP reduce-scatters the gradients itself)
        self.inner_named = [] if self.sharded else [(f"diloco.inner.{name}", p) for name, p in named]
        self.buffers = [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]
        if self.sharded:  # the same shards start alike in every group (the optimiser is a fresh one)
            broadcast_parameters([(n, local_part(p)) for n, p in named], self.column.ranks[0], self.column)
        else:
            broadcast_model_and_optimizer(model, optimizer)
        # Per fragment: this rank's slice of its global copy (rank 0's now), its outer optimiser, its exchange.
        self.fragments = [
            Fragment.make(f, params, self._local_slice(params), self.column, o) for f, params in enumerate(parts)
        ]
        self.last_members = [g.ranks for g in self.all_groups]  # who took part in the last outer step
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None  # runs delayed exchanges
        self.exchange_wait_seconds = 0.0  # what steps waited for exchanges between groups
        self.inner_steps = 0
        self.outer_steps = 0
        self.synced_now = False  # whether the step just taken ended with an outer step
        self.every: int | None = None
        self.door = OptimizerDoor(optimizer, "diloco.step()", self._before_inner_step, self._after_inner_step)
        for call in ("synchronize", "skip_synchronize"):  # Horovod's calls: nothing to do here
            if not hasattr(optimizer, call):
                setattr(optimizer, call, user_step_notice("DiLoCo", call))
        if total_steps not in (None, SET_LATER):
            self.set_total_steps(total_steps)
        elif o.sync_every >= 1:  # steps: the schedule is known now
            self._set_every(int(o.sync_every))
        self._healed_step = 0
        self.stop_requested = False  # an elastic run's coordinator asked every group to checkpoint and stop
        if self.elastic is not None and join:
            self.join()

    def join(self, resume_step: int | None = None, load: Callable[[], None] | None = None) -> int:
        """Join the run (the constructor does, unless given `join=False`): under the elastic
        launcher every group starts from one group's state, and a group launched mid-run heals
        from a member. A restart from checkpoints passes the step of this group's checkpoint
        and `load` (which restores it): the groups at the run's newest step call `load`, the
        others heal from them instead. Without the launcher it calls `load` when given a step.
        Returns `healed_step`, where the loop goes on (0 when it starts or loads). A group
        relaunched after the run's last round has nothing to train: its process exits 0 here."""
        if self.elastic is None:
            if resume_step is not None and load is not None:
                load()
            return 0
        try:
            commit = self.elastic.join(resume_step)
        except RunFinished as finished:  # relaunched after the run's last round: nothing is left to train
            runtime.announce(f"{finished}; this group exits")
            runtime.exit_process(0)
        if resume_step is not None and load is not None and self.elastic.slot in commit.members:
            load()
        self._heal(commit)
        return self._healed_step

    def set_total_steps(self, total_steps: int) -> None:
        """Fix H for a run of `total_steps` steps (resolves a fractional sync_every)."""
        self._set_every(max(1, run_steps(self.options.sync_every, total_steps, "diloco.sync_every")))
        o = self.options
        delay = (
            f", applied {o.sync_delay} steps later (alpha {o.update_alpha})"
            if o.sync_delay
            else ", behind the whole next period (eager)"
            if o.eager
            else ""
        )
        if o.compression in ("sparse", "lowrank") and o.outer_momentum:
            # Error feedback already carries what momentum would (docs: benchmarks, "DiLoCo's exchange between groups")
            runtime.announce(
                f"diloco: warning: {o.compression} with outer momentum {o.outer_momentum}: its error feedback "
                f"already carries what momentum would (SparseLoCo), and the two together train far worse "
                f"than plain averaging (docs: benchmarks); consider --diloco.outer_momentum 0 --diloco.outer_lr 1"
            )
        runtime.announce(
            f"diloco: {len(self.all_groups)} groups of {self.group.size} rank(s); an outer step every "
            f"{self.every} inner steps ({len(self.fragments)} fragment(s), {o.compression} exchange"
            f"{delay}; outer lr {o.outer_lr}, momentum {o.outer_momentum})"
        )

    def _set_every(self, every: int) -> None:
        self.options.check_schedule(every)
        if (self.options.sync_delay or self.options.eager) and self.worker is None:
            problem = side_thread_problem()
            if problem:
                raise ConfigError(
                    f"diloco.sync_delay and diloco.eager run the exchange on a second thread, which "
                    f"cannot run collectives here: {problem}"
                )
            self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-exchange")
        self.every = every

    # -- one step ------------------------------------------------------------------------------
    def step(self) -> None:
        """After the caller's backward pass: the inner step, then the outer step of every
        fragment due (see the class)."""
        self.door.take("diloco.step()")
        self._average_in_group()
        with self.door.own_step():
            step_inner_optimizer(
                self.optimizer, [p for f in self.fragments for _, p in f.params], self.clip_grad_norm, self.scaler
            )
        self._after_inner_step()

    def _average_in_group(self) -> None:
        if self.every is None:  # steps only: a fraction needs set_total_steps()
            self._set_every(max(1, run_steps(self.options.sync_every, None, "diloco.sync_every")))
        if self.inner_named:
            exchange_gradients(self.inner_named, self.group)

    def _before_inner_step(self) -> None:
        """The loop called the inner optimiser's step() itself (torchft's idiom)."""
        if self.scaler is not None:
            raise ConfigError(
                "diloco was given a GradScaler (scaler=): call diloco.step() in place of scaler.step(opt) "
                "and opt.step(); it unscales, clips and steps in that order"
            )
        self._average_in_group()
        if self.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for f in self.fragments for _, p in f.params], self.clip_grad_norm)

    def _after_inner_step(self) -> None:
        """The inner step is taken: count it, and run the outer step of every fragment due."""
        self.inner_steps += 1
        for f in self.fragments:
            f.since_sync += 1
        starting = [f for f in self.fragments if sync_due(self.inner_steps, f.index, self.every, len(self.fragments))]
        if self.options.eager:
            if starting:
                self._eager_step(starting)
                self.outer_steps += 1
            self.synced_now = bool(starting)
            return
        if self.elastic is not None:
            if starting:
                self._elastic_round(starting)
            self.synced_now = bool(starting)
            return
        for f in starting:
            self._start(f, background=bool(self.options.sync_delay))
        due = [f for f in self.fragments if f.in_flight is not None and f.in_flight.apply_at == self.inner_steps]
        if due:
            self._apply(due)
            self.outer_steps += 1
        self.synced_now = bool(due)

    def request_stop(self) -> bool:
        """Under the elastic launcher: ask the coordinator to stop every group after the next
        round (a preemption signal reached this group: the scheduler's warning, or its end of
        the allocation), and say True; else False (the caller stops this job itself)."""
        if self.elastic is None:
            return False
        self.elastic.request_stop()
        return True

    def current_step(self) -> int:
        """Outer steps taken so far (torchft's manager.current_step())."""
        return self.outer_steps

    def members(self) -> list[tuple[int, ...]]:
        """The ranks of every group that took part in the last outer step (every group; under
        the elastic launcher, the slots of the groups that did)."""
        return self.last_members

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Take DiLoCo's hooks off the inner optimiser (its step() no longer drives DiLoCo) and
        let any exchange still in flight finish (torchft's DiLoCo leaving its `with` block)."""
        self.door.close()
        self._settle()
        if self.elastic is not None:
            self.elastic.leave()

    def agreement_group(self) -> runtime.Group | None:
        """Where the loop's per-step checks run: the whole world right after an outer step (all
        ranks met in it), else this rank's group (the groups run free)."""
        return None if self.synced_now else self.group

    # -- the outer step ------------------------------------------------------------------------
    def _flat(self, params: list[tuple[str, nn.Parameter]]) -> torch.Tensor:
        """A fragment's parameters as one float32 vector (the outer state is float32 whatever the
        parameters' dtype: bfloat16 would round away most of a pseudo-gradient), padded with
        zeros to a whole number of slices."""
        flat = torch.cat([local_part(p).detach().reshape(-1).float() for _, p in params])
        if self.sharded:  # this rank's shards: its slice as they are
            return flat
        length = shard_length(len(flat), self.group.size) * self.group.size
        return torch.cat([flat, flat.new_zeros(length - len(flat))])

    def _local_slice(self, params: list[tuple[str, nn.Parameter]]) -> torch.Tensor:
        """This rank's slice of the fragment's parameters now, a tensor of its own."""
        if self.sharded:
            return self._flat(params)  # a concatenation: already a copy
        length = shard_length(sum(p.numel() for _, p in params), self.group.size)
        return self._flat(params)[self.position * length : (self.position + 1) * length].clone()

    def _start(self, fragment: Fragment, background: bool, delta: torch.Tensor | None = None) -> None:
        """Start averaging the fragment's pseudo-gradient slice (`delta`, or global - local now)
        over the column: at once, or on the worker thread, to be applied `sync_delay` steps
        later (eager: at the fragment's next sync)."""
        if delta is None:
            delta = pseudo_gradient(fragment, self._local_slice(fragment.params))
        shapes = [tuple(local_part(p).shape) for _, p in fragment.params]  # sharded: this rank's rows of each
        offset = 0 if self.sharded else self.position * len(delta)
        collective = fragment.exchange.start(fragment.index, delta, shapes, offset)
        del delta  # the exchange holds what it sends: Δ itself need not outlive it
        keeps = background and bool(self.options.sync_delay) and self.options.update_alpha > 0
        prepared = [local_part(p).detach().clone() for _, p in fragment.params] if keeps else None
        if background:
            result = self.worker.submit(collective)
        else:
            with self._waiting():
                result = collective()
        later = (self.every if self.options.eager else self.options.sync_delay) if background else 0
        fragment.in_flight = InFlight(result, self.inner_steps + later, prepared)

    def _settle(self) -> None:
        """Wait for every exchange in flight (its result is kept for its own step)."""
        for f in self.fragments:
            if f.in_flight is not None:
                self._result(f.in_flight)

    def _result(self, flight: InFlight) -> torch.Tensor:
        """An exchange's mean, waited for if it is still on the worker thread."""
        if isinstance(flight.result, concurrent.futures.Future):
            with self._waiting():
                flight.result = flight.result.result()
        return flight.result

    def _eager_step(self, due: list[Fragment]) -> None:
        """Eager updates (see the module): start each due fragment's exchange behind the next
        period and step its global copy now with this group's own part of the mean and the other
        groups' part of the previous exchange's."""
        own = [pseudo_gradient(f, self._local_slice(f.params)) for f in due]
        for f, mine in zip(due, own):
            outer_gradient = mine / len(self.all_groups)
            if f.in_flight is not None:
                outer_gradient = outer_gradient + self._others_part(f, f.in_flight)
            f.in_flight = InFlight(outer_gradient, self.inner_steps, None)
        self._apply(due)
        for f, mine in zip(due, own):
            self._start(f, background=True, delta=mine.clone())  # the exchange's own: mine is kept
            f.own_previous = mine

    def _others_part(self, fragment: Fragment, flight: InFlight) -> torch.Tensor:
        """Eager: the other groups' part of an exchange's mean (the mean less this group's own)."""
        return self._result(flight) - fragment.own_previous / len(self.all_groups)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Time blocked on the exchange between groups: the meter's, and in training (not in
        an evaluation's trial sync) this trainer's exchange_wait_seconds."""
        start = time.perf_counter()
        with meter.waiting():
            yield
        if meter.phase == "train":
            self.exchange_wait_seconds += time.perf_counter() - start

    def _apply(self, due: list[Fragment], keep_unsent: bool = True, trial: bool = False) -> None:
        """Step the due fragments' global slices with their averaged pseudo-gradients and give
        every rank of the group the new global parameters (plus update_alpha of the progress
        made since the exchange started, when it ran behind inner steps; with keep_unsent, less
        what the exchange left unsent: Δ is global - local, so the group's model keeps that
        progress, and its next Δ carries it as the accumulator would have). A trial gives the
        model what the step would, the global slices and outer state left as they are."""
        self._settle()
        flights = [f.in_flight for f in due]
        models = []
        for f, flight in zip(due, flights):
            f.in_flight = None
            if trial:
                own = outer_step_result(f.outer, f.global_slice, flight.result)
            else:
                f.outer.zero_grad(set_to_none=True)
                f.global_slice.grad = flight.result
                f.outer.step()
                own = f.global_slice.detach()
            unsent = (
                f.exchange.take_unsent(f.index, self.options.sparse.unsent_share or 1 / f.exchange.members)
                if keep_unsent and self.options.keeps_unsent
                else None
            )
            models.append((f"diloco.global.{f.index}", own if unsent is None else own - unsent.to(own.device)))
        gathered = [m for _, m in models] if self.sharded else meter.allgather_many(models, self.group)
        with torch.no_grad():
            for f, flat, flight in zip(due, gathered, flights):
                offset = 0
                for i, (_, p) in enumerate(f.params):
                    p = local_part(p)
                    new = flat[offset : offset + p.numel()].view_as(p)
                    if flight.prepared is not None:  # keep alpha of what was learned meanwhile
                        new = new + self.options.update_alpha * (p - flight.prepared[i])
                    p.copy_(new)
                    offset += p.numel()
                f.since_sync = self.options.sync_delay if flight.prepared is not None else 0
            if self.fragments[0] in due and self.buffers and self.elastic is None:
                averaged_buffers = meter.allreduce_many(
                    [(f"diloco.buffer.{n}", b) for n, b in self.buffers], self.column, op="average"
                )
                for (_, b), value in zip(self.buffers, averaged_buffers):
                    b.copy_(value)

    # -- elastic rounds (hvd_lowcomm.elastic) ----------------------------------------------------
    def _elastic_round(self, due: list[Fragment]) -> None:
        """An outer step among the groups alive now: the exchange (and the buffers' mean) is
        redone, from the same pseudo-gradient and error feedback, until an attempt succeeds for
        every member; then applied, and a joining group healed from the donor."""
        (f,) = due  # check_elastic: one fragment, blocking
        delta = pseudo_gradient(f, self._local_slice(f.params))
        shapes = [tuple(local_part(p).shape) for _, p in f.params]
        buffers = [(f"diloco.buffer.{n}", b) for n, b in self.buffers]

        def attempt(column: runtime.Group, members: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
            f.exchange.column, f.exchange.members = column, members
            mean = f.exchange.start(f.index, delta.clone(), shapes, self.position * len(delta))()  # redone on failure
            return mean, (meter.allreduce_many(buffers, column, op="average") if buffers else [])

        with self._waiting():
            (mean, averaged), commit = self.elastic.exchange(attempt, f.exchange.kept, f.exchange.put_back)
        f.in_flight = InFlight(mean, self.inner_steps, None)
        self._apply(due)
        with torch.no_grad():
            for (_, b), value in zip(self.buffers, averaged):
                b.copy_(value)
        self.last_members = [(slot,) for slot in commit.members]
        self.outer_steps += 1
        self.stop_requested = commit.stop
        self._heal(commit)  # after the count: a joiner takes the step the others are at

    def _heal(self, commit: Any) -> None:
        """After `commit`: the donor sends this rank's part of the run's state to the joiners'
        ranks at the same position; a joiner takes it. A joiner's error feedback starts at zero:
        the donor's holds what the donor's own exchanges left unsent, which is not the joiner's."""
        donor = self.elastic.slot == commit.donor
        if donor and commit.joiners:
            self.elastic.heal(commit, serialize(self._heal_state()))
        elif self.elastic.slot in commit.joiners:
            with meter.in_phase("heal"):
                self._load_heal_state(deserialize(self.elastic.heal(commit, None)))
            self.last_members = [(slot,) for slot in commit.members]

    def _heal_state(self) -> dict[str, Any]:
        """This rank's part of the run's state: with a sharded model its shards alone (rank i of
        a group holds the same shards in every group), never a gathered model."""
        optimizer = local_shards(sharded_state(self.model, self.optimizer)["optimizer"]) if self.sharded else None
        return {
            "global_slices": [f.global_slice.detach() for f in self.fragments],
            "outer": [f.outer.state_dict() for f in self.fragments],
            "optimizer": self.optimizer.state_dict() if optimizer is None else optimizer,
            "buffers": [b.detach() for _, b in self.buffers],
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for f, global_slice, outer in zip(self.fragments, state["global_slices"], state["outer"]):
                f.global_slice.copy_(global_slice)
                f.outer.load_state_dict(outer)
                f.since_sync = 0
            for (_, b), value in zip(self.buffers, state["buffers"]):
                b.copy_(value)
        if self.sharded:  # the donor's shards into this rank's (its optimiser's state made first)
            own = sharded_state(self.model, self.optimizer)
            own["optimizer"] = with_shards(own["optimizer"], state["optimizer"])
            load_sharded_state(self.model, self.optimizer, own)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.inner_steps, self.outer_steps = state["inner_steps"], state["outer_steps"]
        self._healed_step = self.inner_steps
        self._load_global()

    def _load_global(self) -> None:
        """Every parameter from the global copy (the group's ranks gather their slices)."""
        named = [(f"diloco.global.{f.index}", f.global_slice.detach()) for f in self.fragments]
        flats = [flat for _, flat in named] if self.sharded else meter.allgather_many(named, self.group)
        with torch.no_grad():
            for f, flat in zip(self.fragments, flats):
                offset = 0
                for _, p in f.params:
                    p = local_part(p)
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    @property
    def healed_step(self) -> int:
        """The inner steps the run had taken when this group joined it (0 at the start): a loop
        that joins late skips that many of its steps, so every group ends at the same step."""
        return self._healed_step

    # -- evaluation, the final model, checkpoints ---------------------------------------------
    @contextlib.contextmanager
    def synced(self) -> Iterator[nn.Module]:
        """The model a blocking outer step of every fragment with inner steps since its last
        sync would give now (with keep_unsent of every fragment: a group's model differs from
        the global one even right after a sync), with eager the other groups' parts still in
        flight added too (collective; its traffic counts in the current meter phase); the
        groups' own state, and any exchange in flight, are restored afterwards."""
        pending = [
            f
            for f in self.fragments
            if f.since_sync or (self.options.eager and f.in_flight is not None) or self.options.keeps_unsent
        ]
        if not pending:
            yield self.model
            return
        if self.elastic is not None:  # no trial round between groups: the global copy of the last one
            with trial_sync(self.model, self._load_global, lambda: None, lambda _: None) as model:
                yield model
            return
        self._settle()  # the exchange in flight uses the same state: let it finish first
        with trial_sync(self.model, lambda: self._sync_now(pending), self._sync_state, self._load_sync_state) as model:
            yield model

    def _sync_now(self, fragments: list[Fragment]) -> None:
        in_flight = [f.in_flight for f in self.fragments]  # set aside: restored with the rest
        for f in self.fragments:
            f.in_flight = None
        for f in fragments:
            f.exchange.keeping = False  # put back after the trial anyway
            try:
                self._start(f, background=False)
            finally:
                f.exchange.keeping = True
            held = in_flight[f.index]
            if self.options.eager and held is not None:  # and the other groups' parts not yet applied
                f.in_flight.result = f.in_flight.result + self._others_part(f, held)
        self._apply(fragments, keep_unsent=False, trial=True)  # the synced model itself, the same on every rank
        for f, held in zip(self.fragments, in_flight):
            f.in_flight = held

    def _sync_state(self) -> list[tuple[Any, ...]]:
        """What a trial sync changes besides the model (a trial outer step leaves the global
        slices and outer state alone): each exchange's state, by reference, and the counts."""
        return [(f.exchange.kept(), f.since_sync) for f in self.fragments]

    def _load_sync_state(self, state: list[tuple[Any, ...]]) -> None:
        for f, (exchange_state, since) in zip(self.fragments, state):
            f.exchange.put_back(exchange_state)
            f.since_sync = since

    def full_model(self) -> nn.Module:
        """The synced model, the same on every rank (collective; its traffic counts as eval).
        A sharded model's: full_state_dict()."""
        if self.sharded:
            raise ConfigError(
                "diloco: a sharded model is not copied whole onto every rank; take "
                "diloco.full_state_dict() (the synced model's state dict on rank 0)"
            )
        with meter.in_phase("eval"):
            with self.synced() as model:
                final = copy.deepcopy(model)
            self._end_sync()
        check_same_everywhere(final, "diloco.full_model()")
        return final

    def full_state_dict(self) -> dict[str, Any] | None:
        """The synced model as one ordinary state dict on global rank 0, None elsewhere
        (collective; its traffic counts as eval); the model itself may be sharded."""
        with meter.in_phase("eval"):
            with self.synced() as model:
                state = (
                    full_state_dict(model) if self.sharded else (model.state_dict() if runtime.rank() == 0 else None)
                )
                state = None if state is None else {k: v.detach().clone() for k, v in state.items()}
            self._end_sync()
        return state

    def _end_sync(self) -> None:
        self._settle()  # nothing may be left on the wire when the job ends
        # The sync's last collective is the group's own allgather: without this, a group that
        # finishes first may exit, and Horovod's shutdown then fails another group's gather.
        meter.barrier("diloco.full_model")

    between_groups = ("column", "world")  # the column exchange, and the loop's checks at outer steps

    def epoch_metrics(self) -> dict[str, Any]:
        elastic = {} if self.elastic is None else {"round_members": [slot for (slot,) in self.last_members]}
        return {
            "outer_steps": self.outer_steps,
            "sync_every": self.every,
            "exchange_wait_seconds": round(self.exchange_wait_seconds, 4),
            **group_traffic(self.between_groups),
            **elastic,
        }

    def summary_metrics(self) -> dict[str, Any]:
        """The epoch's figures, and under the elastic launcher what this group saw: its rounds,
        those some group missed or that needed another attempt, and its heals."""
        if self.elastic is None:
            return self.epoch_metrics()
        rounds = [e for e in self.elastic.events if e["event"] == "round"]
        most = max((len(e["members"]) for e in rounds), default=0)
        return {
            **self.epoch_metrics(),
            "elastic_rounds": len(rounds),
            "elastic_short_rounds": sum(len(e["members"]) < most for e in rounds),
            "elastic_redone_rounds": sum(e["attempts"] > 1 for e in rounds),
            "elastic_heal_seconds": [round(e["seconds"], 3) for e in self.elastic.events if e["event"] == "heal"],
            "elastic_heal_bytes": [e["bytes"] for e in self.elastic.events if e["event"] == "heal"],
        }

    def state_dict(self) -> dict[str, Any]:
        """What the ranks of one group share: model, inner optimiser (each rank's own shards of
        them where the model is sharded: in sharded_state_dict), position in the cycle."""
        shared = {} if self.sharded else {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {
            **shared,
            "diloco": {
                "inner_steps": self.inner_steps,
                "since_sync": [f.since_sync for f in self.fragments],
                "outer_steps": self.outer_steps,
                "synced_now": self.synced_now,
                "members": self.last_members,  # an elastic run's: the slots in its last round
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.sharded:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        d = state["diloco"]
        self.inner_steps = d["inner_steps"]
        for f, since in zip(self.fragments, d["since_sync"]):
            f.since_sync = since
        self.outer_steps, self.synced_now = d["outer_steps"], d["synced_now"]
        self.last_members = [tuple(m) for m in d.get("members", self.last_members)]

    def sharded_state_dict(self) -> dict[str, Any] | None:
        """A sharded model's and inner optimiser's shards, under the group's name: the groups'
        models differ between syncs, and DCP keeps one copy of state saved under one name."""
        if not self.sharded:
            return None
        return {f"group-of-rank-{self.group.ranks[0]}": sharded_state(self.model, self.optimizer)}

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        (own,) = state.values()
        load_sharded_state(self.model, self.optimizer, own)

    def local_state_dict(self) -> dict[str, Any]:
        """What is this rank's own: its slices of the global copy, their outer momentum, the
        exchange's error feedback (and warm start), and any exchange in flight (waited for, so
        a run resumed from here applies the same result at the same step). The live tensors,
        not copies (a sharded model's may barely fit): save them before the next step."""
        self._settle()
        return {
            "global_slices": [f.global_slice.detach() for f in self.fragments],
            "outer": joined_outer_state([f.outer for f in self.fragments]),
            "exchange": joined_exchange_state([f.exchange for f in self.fragments]),
            "own_previous": {f.index: f.own_previous.clone() for f in self.fragments if f.own_previous is not None},
            "in_flight": {
                f.index: (f.in_flight.result.clone(), f.in_flight.apply_at, f.in_flight.prepared)
                for f in self.fragments
                if f.in_flight is not None
            },
        }

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        in_flight = {int(f): InFlight(*flight) for f, flight in state["in_flight"].items()}
        own_previous = {int(f): own.clone() for f, own in state.get("own_previous", {}).items()}
        with torch.no_grad():
            for f, global_slice in zip(self.fragments, state["global_slices"]):
                f.global_slice.copy_(global_slice)
                f.outer.load_state_dict(outer_state_of(state["outer"], f.index))
                f.exchange.load_state_dict(exchange_state_of(state["exchange"], f.index))
                f.in_flight, f.own_previous = in_flight.get(f.index), own_previous.get(f.index)


@dataclass
class InFlight:
    """A fragment's started exchange: its result (a Future while it runs on the worker thread),
    the inner step it is applied after, and the fragment's parameters when it started (where
    update_alpha keeps the progress made since)."""

    result: Any
    apply_at: int
    prepared: list[torch.Tensor] | None


@dataclass(eq=False)
class Fragment:
    """One part of the model that syncs on its own schedule (Streaming DiLoCo), and all this
    rank holds for it (torchft's _StreamingDiLoCoFragment): with one fragment, the whole model."""

    index: int  # its place among the fragments: its sync offset, its exchange's key
    params: list[tuple[str, nn.Parameter]]  # its parameters, a contiguous run of the model's
    global_slice: nn.Parameter  # this rank's slice of its global copy: what the outer step steps
    outer: torch.optim.Optimizer  # the outer optimiser over global_slice (its momentum)
    exchange: Exchange  # its exchange between groups (error feedback, warm start)
    since_sync: int = 0  # inner steps since its last sync
    in_flight: InFlight | None = None  # its started exchange, until applied
    own_previous: torch.Tensor | None = None  # eager: this group's part of the exchange in flight

    @classmethod
    def make(
        cls,
        index: int,
        params: list[tuple[str, nn.Parameter]],
        local_slice: torch.Tensor,
        column: runtime.Group,
        options: DiLoCoOptions,
    ) -> "Fragment":
        """A fragment whose global copy starts as this rank's `local_slice` of it."""
        global_slice = nn.Parameter(local_slice)
        return cls(
            index, params, global_slice, outer_optimizer([global_slice], options), make_exchange(column, options)
        )


# The checkpoint holds the fragments' outer optimisers as one SGD's state over every global slice,
# and their exchanges' states as one exchange's, keyed by fragment: a checkpoint loads whichever
# way the fragments' state is held.


def pseudo_gradient(fragment: Fragment, local: torch.Tensor) -> torch.Tensor:
    """Δ = global - local of the fragment's slice, written over `local` (a copy of the rank's
    parameters made for it): a slice of a model that barely fits has no room for a third one."""
    return torch.sub(fragment.global_slice.detach(), local, out=local)


def joined_outer_state(outers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """The fragments' outer optimisers' states as one optimiser's over all global slices, in order."""
    states = [o.state_dict() for o in outers]
    return {
        "state": {f: entry for f, s in enumerate(states) for entry in s["state"].values()},
        "param_groups": [{**states[0]["param_groups"][0], "params": list(range(len(states)))}],
    }


def outer_state_of(joined: dict[str, Any], fragment: int) -> dict[str, Any]:
    """One fragment's outer optimiser state from `joined_outer_state`'s form."""
    entry = {int(f): s for f, s in joined["state"].items()}.get(fragment)
    return {
        "state": {} if entry is None else {0: entry},
        "param_groups": [{**joined["param_groups"][0], "params": [0]}],
    }


def joined_exchange_state(exchanges: list[Exchange]) -> dict[str, Any]:
    """The fragments' exchange states (each a dict of per-fragment dicts) as one."""
    states = [e.state_dict() for e in exchanges]
    return {key: {f: v for s in states for f, v in s[key].items()} for key in states[0]}


def exchange_state_of(joined: dict[str, Any], fragment: int) -> dict[str, Any]:
    """One fragment's exchange state from `joined_exchange_state`'s form."""
    return {key: {f: v for f, v in value.items() if int(f) == fragment} for key, value in joined.items()}


def check_elastic(options: DiLoCoOptions) -> None:
    """Refuse what elastic groups cannot run yet: a round is one blocking exchange of the whole
    model, so that it is applied by all survivors or by none."""
    o = options
    refused = [
        (o.groups > 1, f"diloco.groups {o.groups}: under the elastic launcher each job is one group (--groups there)"),
        (o.fragments > 1, "diloco.fragments: a round exchanges the whole model"),
        (bool(o.sync_delay), "diloco.sync_delay: a round's exchange blocks"),
        (o.eager, "diloco.eager: a round's exchange blocks"),
    ]
    problems = [why for bad, why in refused if bad]
    if problems:
        raise ConfigError("diloco under the elastic launcher cannot take " + "; ".join(problems))


def check_sharding(named: list[tuple[str, nn.Parameter]], group: runtime.Group) -> bool:
    """Whether the model is sharded (FSDP2 DTensors); if so, refuse a layout DiLoCo cannot join:
    shards that span more than this rank's group, or a mesh that also replicates across groups."""
    sharded = [p for _, p in named if isinstance(p, DTensor)]
    if not sharded:
        return False
    if len(sharded) < len(named):
        raise ConfigError(
            "diloco: some parameters are sharded (FSDP2) and some are not; fully_shard the root "
            "module too (hvd_lowcomm.shard_model does)"
        )
    mesh = sharded[0].device_mesh
    if mesh.mesh_dim_names != ("shard",) or tuple(sorted(mesh.mesh.flatten().tolist())) != tuple(group.ranks):
        raise ConfigError(
            f"diloco: the model must be sharded over this rank's DiLoCo group (ranks {group.ranks[0]}-"
            f"{group.ranks[-1]}) alone: shard it on hvd_lowcomm.device_mesh(group_size={group.size}, "
            f"replicate=False), DiLoCo joins the groups itself"
        )
    return True


def check_same_everywhere(model: nn.Module, what: str) -> None:
    """Raise where `model` differs between ranks by more than float rounding (a fingerprint of
    its floating-point state, compared over MPI; eager updates sum the groups' parts in another
    order on each): a model the docs promise is the same on every rank must be."""
    total = absolute = 0.0
    with torch.no_grad():  # tensor by tensor, summed in float64: no copy of the whole model
        for t in model.state_dict().values():
            if t.is_floating_point():
                total += float(t.sum(dtype=torch.float64))
                absolute += float(t.abs().sum(dtype=torch.float64))
    mine = (total, absolute)
    prints = runtime.world().comm.allgather(mine)
    scale = max(p[1] for p in prints)
    if any(abs(p[0] - prints[0][0]) > 1e-5 * scale or abs(p[1] - prints[0][1]) > 1e-5 * scale for p in prints):
        raise RuntimeError(
            f"{what}: the model differs between ranks, so a sync did not see every change: its parameters "
            f"were changed outside the inner optimiser DiLoCo was given (by another optimiser, or by "
            f"hand). Step only that optimiser, through diloco.step() or its own step()"
        )
