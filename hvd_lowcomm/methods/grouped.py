"""What the methods that train in independent groups of ranks share (AB-training, DiLoCo): their
common options, the outer optimiser, evaluation on a trial sync, the traffic split between
and inside groups, and the adapter the built-in loop drives.

Both split the world into groups (one per node when the job spans nodes, else 2 or the smallest
group count that divides an odd rank count:
`runtime.groups_for`, the same rule for runs and for the cost model), let each group train on
its own, and now and then combine the groups' progress as a pseudo-gradient that an outer SGD
step applies (DiLoCo's outer step; plain averaging at lr 1 without momentum).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch
import torch.nn as nn
from torch.optim.sgd import sgd as functional_sgd

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.config import Config, ConfigError, option
from hvd_lowcomm.methods.base import Method, make_optimizer
from hvd_lowcomm.schedule import SET_LATER


@dataclass
class GroupedOptions:
    """Options every grouped method has (its own dataclass extends this one)."""

    section: ClassVar[str] = "?"  # the options' section, for messages

    groups: int = option(
        0,
        "independent groups of contiguous ranks (0: one per node on several nodes, else 2, "
        "or on an odd rank count its smallest divisor)",
    )
    # Plain averaging by default, not DiLoCo's lr 0.7 with Nesterov momentum 0.9: once syncs agree in
    # direction that step moves the model lr/(1 - momentum) = 7 times the groups' mean progress, which pays
    # for long, smooth pseudo-gradients, not for short ones or error-fed exchanges (docs: benchmarks,
    # "DiLoCo's exchange between groups").
    outer_lr: float = option(
        1.0, "outer learning rate at a sync (1 with outer_momentum 0: the plain average; DiLoCo's paper: 0.7)"
    )
    outer_momentum: float = option(0.0, "outer momentum at a sync, kept across syncs (DiLoCo's paper: 0.9)")
    outer_nesterov: bool = option(True, "Nesterov momentum for the outer step (DiLoCo's paper)")

    def validate(self) -> None:
        s = self.section
        if self.groups < 0:
            raise ConfigError(f"{s}.groups must be >= 0 (0: automatic), got {self.groups}")
        if self.outer_lr <= 0:
            raise ConfigError(f"{s}.outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"{s}.outer_momentum must be in [0, 1), got {self.outer_momentum}")

    @property
    def plain_average(self) -> bool:
        """Whether the outer step is the plain average (no optimiser needed)."""
        return self.outer_lr == 1 and not self.outer_momentum


def outer_optimizer(params: Iterable[torch.Tensor], options: GroupedOptions) -> torch.optim.Optimizer:
    """The outer SGD over `params` (the global copy a pseudo-gradient steps)."""
    return torch.optim.SGD(
        params,
        lr=options.outer_lr,
        momentum=options.outer_momentum,
        nesterov=options.outer_nesterov and options.outer_momentum > 0,
    )


def outer_step_result(outer: torch.optim.Optimizer, param: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """What `outer` (outer_optimizer's SGD) would make of `param` with `gradient`, leaving
    `param` and the optimiser's state as they are (`gradient` is used up): torch's own SGD step
    run on copies, so bitwise the step itself, for a trial sync that must not clone the outer
    state."""
    group = outer.param_groups[0]
    if not (group["momentum"] or group["weight_decay"] or group["maximize"]):
        # SGD's whole step is param + (-lr) gradient (torch's add): written over the gradient
        return torch.add(param.detach(), gradient, alpha=-group["lr"], out=gradient)
    buffer = outer.state.get(param, {}).get("momentum_buffer")
    stepped = param.detach().clone()
    functional_sgd(
        [stepped],
        [gradient],
        [None if buffer is None else buffer.clone()],
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group["maximize"],
        foreach=group["foreach"],
        fused=group["fused"],
    )
    return stepped


def step_inner_optimizer(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], clip_grad_norm: float, scaler: Any
) -> None:
    """The user's optimiser steps on the pooled gradients: a GradScaler's scale taken off
    first, then clipped, the step skipped where the scaler found inf or NaN (the same on every
    rank that pooled them), and the scaler's scale updated."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if clip_grad_norm:
        torch.nn.utils.clip_grad_norm_(list(params), clip_grad_norm)
    if scaler is None:
        optimizer.step()
        return
    scaler.step(optimizer)
    scaler.update()


class OptimizerDoor:
    """The doors through which a loop can step a trainer that owns the user's optimiser
    (DiLoCo, ABTraining): the trainer's own step (`own`, e.g. "diloco.step()") and the
    optimiser's `step()` itself, which a pre- and a post-step hook on the optimiser see (as
    torchft's DiLoCo hooks its inner optimiser). `before` and `after` run around a direct
    `optimizer.step()`; where `before` is None the door is shut and a direct step refuses
    with `shut`. The first step fixes the door a run uses: a loop that takes both (the
    trainer's step, then the optimiser's) would step twice per batch, so the second door
    refuses at once. `close()` takes the hooks off."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        own: str,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
        shut: str = "",
    ) -> None:
        self.own, self.before, self.after, self.shut = own, before, after, shut
        self.used: str | None = None  # the door the first step came through
        self.inside = False  # the trainer is stepping the optimiser itself: the hooks stand aside
        self.aside = False  # the hooks stand aside for the step running now
        self.handles = [
            optimizer.register_step_pre_hook(self._before_optimizer_step),
            optimizer.register_step_post_hook(self._after_optimizer_step),
        ]

    def take(self, door: str) -> None:
        """A step comes through `door`: the run's door from now on, or a refusal if it has another."""
        if self.used is None:
            self.used = door
        elif self.used != door:
            raise ConfigError(
                f"{door} was called, but this run steps through {self.used}: calling both would take two "
                f"steps per batch. Call one of them: {self.own} (it steps the optimiser itself)"
                + ("" if self.before is None else " or the optimiser's own step(), which it hooks")
            )

    @contextlib.contextmanager
    def own_step(self) -> Iterator[None]:
        """Around the trainer's own call of the optimiser's step (its hooks stand aside)."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.aside = self.inside or initialising_state(optimizer)
        if self.aside:
            return
        if self.before is None:
            raise ConfigError(self.shut)
        self.take("optimizer.step()")
        self.before()

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.aside and self.after is not None:
            self.after()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def initialising_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step of `optimizer` only makes its state: a step at learning rate 0 of an
    optimiser without state, as torch.distributed.checkpoint's get_state_dict / set_state_dict
    take one on zero gradients. Not a training step: the trainers' hooks let it pass."""
    return not optimizer.state and all(float(group.get("lr", 1.0)) == 0 for group in optimizer.param_groups)


def user_step_notice(trainer: str, call: str) -> Callable[..., None]:
    """Horovod's `optimizer.synchronize()` / `skip_synchronize()` on an optimiser a grouped
    trainer steps: nothing to do (the trainer exchanges what it must when it steps), said once."""
    said = []

    def notice(*args: Any, **kwargs: Any) -> Any:
        if not said:
            said.append(True)
            runtime.announce(
                f"hvd_lowcomm: {trainer} exchanges gradients itself when it steps; optimizer.{call}() "
                f"does nothing here and can be dropped"
            )
        return contextlib.nullcontext() if call == "skip_synchronize" else None

    return notice


@contextlib.contextmanager
def trial_sync(
    model: nn.Module, sync: Callable[[], None], state: Callable[[], Any], restore: Callable[[Any], None]
) -> Iterator[nn.Module]:
    """The model a sync would give now, without changing the run: `sync()` on the live model,
    yield it, then put back the model and what `state()` returned (the method's own sync state,
    given to `restore`). Collective where the sync is."""
    # clones, not a deepcopy: a sharded model's DTensors hold their process groups
    saved = (
        {k: v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in model.state_dict().items()},
        state(),
    )
    sync()
    try:
        yield model
    finally:
        model.load_state_dict(saved[0])
        restore(saved[1])


def group_traffic(between: tuple[str, ...]) -> dict[str, float]:
    """Training bytes inside the groups and between them (on the process sets whose labels
    start with `between`; the loop's checks on the world count as between)."""
    return {
        "intra_group_wire_bytes": meter.total_on(("group", "shard")),
        "inter_group_wire_bytes": meter.total_on(between, ("train", "control")),
    }


class GroupTrainerMethod(Method):
    """A method whose training lives in a library object that owns the run's groups and
    schedule (ABTraining, DiLoCo), made in `setup` as `self.trainer` from `trainer_class`: the
    loop's calls named in FORWARDED go to it as they are; the methods below hold what the
    grouped methods share (the group checks, the trainer's setup, evaluation on a trial sync,
    the final model, the state's owner). The trainer provides set_total_steps,
    agreement_group, synced() (the model a sync would give now, for evaluation), full_model(),
    state_dict / load_state_dict (the same on the ranks of a group), local_state_dict /
    load_local_state_dict (each rank's own), `group` and `all_groups`, and epoch_metrics /
    summary_metrics (with `group_traffic`)."""

    trainer_class: ClassVar[type]
    # The loop's calls the trainer answers as they are (the Method contract's names and arguments).
    FORWARDED: ClassVar[tuple[str, ...]] = (
        "set_total_steps",
        "agreement_group",
        "epoch_metrics",
        "state_dict",
        "load_state_dict",
        "local_state_dict",
        "load_local_state_dict",
    )
    trainer_arguments: ClassVar[dict[str, Any]] = {}  # keywords of the trainer's own for the built-in loop
    trainer: Any

    @classmethod
    def check_world(cls, cfg: Config, world_size: int) -> None:
        groups = runtime.default_group_count(cfg.options.groups, world_size)
        runtime.group_layout(world_size, num_groups=groups)  # a clear error when they do not divide
        cls.check_groups(cfg, groups, world_size)

    @classmethod
    def check_groups(cls, cfg: Config, groups: int, world_size: int) -> None:
        """Raise ConfigError when the method cannot train in `groups` groups."""

    def setup(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = make_optimizer(self.cfg, model)
        self.trainer = self.trainer_class(
            model,
            self.optimizer,
            SET_LATER,
            options=self.options,
            clip_grad_norm=self.cfg.train.clip_grad_norm,
            **self.trainer_arguments,
        )

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, float]:
        """Accuracy of the model a sync would give now."""
        # The gradients are dead between steps (each step starts by zeroing them): their memory
        # goes to the trial sync, which a sharded model that barely fits needs.
        self.model.zero_grad(set_to_none=True)
        with self.trainer.synced():
            return super().evaluate(batches)

    def final_state_dict(self) -> dict[str, Any] | None:
        model = self.trainer.full_model()  # collective
        return model.state_dict() if runtime.rank() == 0 else None

    def summary_metrics(self) -> dict[str, Any]:
        """How many groups trained (one per node by default), and the trainer's own figures."""
        return {"groups": len(self.trainer.all_groups), **self.trainer.summary_metrics()}

    def state_owner(self) -> int:
        return self.trainer.group.ranks[0]  # groups differ between syncs; the ranks of a group agree

    def sharded_state_dict(self) -> dict[str, Any] | None:
        own = getattr(self.trainer, "sharded_state_dict", None)  # a trainer that can hold a sharded model
        return own() if own is not None else None

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_sharded_state_dict(state)


def _forwarded(name: str) -> Callable[..., Any]:
    """The Method call `name`, answered by the trainer's method of that name."""

    def forward(self: GroupTrainerMethod, *args: Any) -> Any:
        return getattr(self.trainer, name)(*args)

    forward.__name__, forward.__qualname__ = name, f"GroupTrainerMethod.{name}"
    forward.__doc__ = getattr(Method, name).__doc__
    return forward


for _name in GroupTrainerMethod.FORWARDED:
    setattr(GroupTrainerMethod, _name, _forwarded(_name))
