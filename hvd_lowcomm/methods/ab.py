"""`ab`: AB-training (Coquelin et al., arXiv 2405.01067): low-rank factors trained by groups.

Every Linear/Conv2d weight outside `ab.full_rank` becomes W = A B (hvd_lowcomm.factorized).
The world is split into G groups of contiguous ranks; the first ⌊G/2⌋ are A-groups (train A,
B frozen), the rest B-groups (train B, A frozen). Schedule, with t the global step and a cycle
= `sync_every` group steps + `full_rank_steps` full-rank steps:

    t < warmup         full-rank data parallel over all ranks
    t = warmup         factorise (every singular value kept: first_full_rank), groups start
    group phase        each rank trains its factor; the trained factor, 1-D parameters and
                       full-rank layers are averaged inside the group; nothing crosses groups
    sync               across all ranks, by sync mode; W = A B; BatchNorm statistics averaged
    full phase         full-rank data parallel over all ranks, so W can regain rank
    re-factorise       keep σ_i > τ σ_1 (rank = MAX over ranks), back to the group phase

Sync modes (A' = A₀ + ΔA trained by A-groups, B' = B₀ + ΔB by B-groups):
    with-stale    average A over all ranks (learned and stale copies), same for B:
                  (A₀ + ΔA/2)(B₀ + ΔB/2) with equal numbers of A- and B-groups
    only-learned  average A over A-groups only, B over B-groups only: A' B'
    only-b        every group trains B only; average B: A₀ B̄
    full          every rank forms its W = A B; W is averaged (full matrices on the wire)

At every phase switch the learning rate drops to `rebound_lr` and ramps linearly back to the
schedule's value over `rebound_steps`. Adam/SGD moments are kept across switches and sliced
or zero-padded when a factor's rank changes (or dropped: `reset_optimizer`).

Traffic in group process sets is intra-group; everything on the world set (warm-up, full-rank
phase, syncs) is inter-group: with one group per node, that is the network traffic.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvd_lowcomm import runtime
from hvd_lowcomm.config import ConfigError, option
from hvd_lowcomm.factorized import FactorizedLayer, factorize_model, rank_for
from hvd_lowcomm.methods import register
from hvd_lowcomm.methods.base import Method, broadcast_model_and_optimizer, make_optimizer
from hvd_lowcomm.traffic import meter

SYNC_MODES = ("with-stale", "only-learned", "only-b", "full")


@dataclass
class ABOptions:
    """AB-training: low-rank factors A, B trained by independent groups of ranks."""

    groups: int = option(0, "independent groups of contiguous ranks (0: one per node, by Horovod's local size)")
    warmup: int = option(100, "steps of full-rank data parallel before the first factorisation")
    sync_every: int = option(50, "group-phase steps between global syncs")
    full_rank_steps: int = option(10, "full-rank data-parallel steps after each sync")
    tau: float = option(0.1, "keep singular values > tau * sigma_1 at re-factorisation")
    sync_mode: str = option("with-stale", "how factors are combined at a sync", choices=SYNC_MODES)
    full_rank: list[str] = option(["first", "last"], "layers never factorised (names, or first/last)")
    first_full_rank: bool = option(True, "keep every singular value at the first factorisation")
    rebound_steps: int = option(20, "steps to ramp the LR back after a phase switch (0: no rebound)")
    rebound_lr: float = option(1e-5, "LR right after a phase switch")
    reset_optimizer: bool = option(False, "drop the factors' optimiser moments at re-factorisation")

    def validate(self) -> None:
        if self.groups < 0:
            raise ConfigError(f"ab.groups must be >= 0 (0: one per node), got {self.groups}")
        if self.warmup < 0 or self.full_rank_steps < 0 or self.rebound_steps < 0:
            raise ConfigError("ab.warmup, ab.full_rank_steps and ab.rebound_steps must be >= 0")
        if self.sync_every < 1:
            raise ConfigError(f"ab.sync_every must be >= 1, got {self.sync_every}")
        if not 0.0 < self.tau < 1.0:
            raise ConfigError(f"ab.tau must be in (0, 1), got {self.tau}")
        if self.rebound_lr <= 0:
            raise ConfigError(f"ab.rebound_lr must be > 0, got {self.rebound_lr}")


class Schedule:
    """Which phase global step t is in, and what happens when entering it."""

    def __init__(self, o: ABOptions) -> None:
        self.warmup, self.sync_every, self.full_rank_steps = o.warmup, o.sync_every, o.full_rank_steps

    def phase(self, t: int) -> str:
        if t < self.warmup:
            return "warmup"
        return "group" if self.position(t) < self.sync_every else "full"

    def position(self, t: int) -> int:
        return (t - self.warmup) % (self.sync_every + self.full_rank_steps)

    def transitions(self, t: int) -> list[str]:
        """Actions at the start of step t: factorize-first, sync, refactorize."""
        now = self.phase(t)
        before = self.phase(t - 1) if t > 0 else "warmup"
        if now == "group" and before == "warmup":
            return ["factorize-first"]
        if now == "full" and before == "group":
            return ["sync"]
        if now == "group" and before == "full":
            return ["refactorize"]
        if now == "group" and t > self.warmup and self.position(t) == 0:  # full_rank_steps == 0
            return ["sync", "refactorize"]
        return []


@register("ab")
class ABTraining(Method):
    """AB-training: factors A and B trained by separate groups, synchronised rarely."""

    options = ABOptions

    def num_groups(self, world_size: int) -> int:
        if self.cfg.options.groups:
            return self.cfg.options.groups
        import horovod.torch as hvd

        return world_size // hvd.local_size()

    def check_world(self, world_size: int) -> None:
        groups = self.num_groups(world_size)
        if groups < 2:
            raise ConfigError(f"AB-training needs at least 2 groups (A-groups and B-groups), got {groups} "
                              f"({'one per node' if not self.cfg.options.groups else 'ab.groups'}): "
                              f"pass --ab.groups 2 (or more) with a rank count it divides")
        runtime.group_layout(world_size, num_groups=groups)

    def check_model(self, model: nn.Module) -> None:
        factorize_model(copy.deepcopy(model), self.cfg.options.full_rank)

    # -- set-up --------------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> None:
        o = self.cfg.options
        self.model = model
        self.layers: dict[str, FactorizedLayer] = factorize_model(model, o.full_rank)
        self.full_parameters = sum(p.numel() for n, p in model.named_parameters() if not n.endswith((".A", ".B")))
        groups = self.num_groups(runtime.size())
        self.group, self.all_groups = runtime.split_world(num_groups=groups, label="group")
        self.role = "B" if o.sync_mode == "only-b" or self.group.index >= groups // 2 else "A"
        a_ranks = sum(g.size for g in self.all_groups[: groups // 2])
        self.trainers = {"A": a_ranks, "B": runtime.size() - a_ranks} if o.sync_mode != "only-b" else \
            {"A": 0, "B": runtime.size()}
        self.optimizer = make_optimizer(self.cfg, model.parameters())
        broadcast_model_and_optimizer(model, self.optimizer)
        self.schedule = Schedule(o)
        self.step = 0
        self.phase = "warmup"
        self.last_switch: int | None = None
        self.base_lr = self.cfg.train.lr
        self._set_trainable()

    # -- one step ------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        self.base_lr = lr  # applied in train_step, after this step's phase switch (if any)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self._advance()
        for group in self.optimizer.param_groups:
            group["lr"] = self._rebound_lr()
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        trained = [(f"ab.grad.{n}", p) for n, p in self.model.named_parameters() if p.requires_grad]
        where = self.group if self.phase == "group" else None  # None: all ranks
        for (_, p), g in zip(trained, meter.allreduce_many(
                [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in trained], where, op="average")):
            p.grad = g
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def _advance(self) -> None:
        for action in self.schedule.transitions(self.step):
            if action == "factorize-first":
                self._factorize(truncate=not self.cfg.options.first_full_rank)
            elif action == "sync":
                self._sync()
            else:
                self._factorize(truncate=True)
        phase = self.schedule.phase(self.step)
        if phase != self.phase:
            self.phase, self.last_switch = phase, self.step
            self._set_trainable()
            self._say(f"step {self.step}: {phase} phase" + (
                f" (ranks {self._ranks_text()}, compression {self.compression_ratio():.2f}x)" if phase == "group" else ""))

    def _rebound_lr(self) -> float:
        o = self.cfg.options
        if self.last_switch is None or o.rebound_steps == 0:
            return self.base_lr
        progress = min(1.0, (self.step - self.last_switch) / o.rebound_steps)
        return o.rebound_lr + (self.base_lr - o.rebound_lr) * progress

    def _set_trainable(self) -> None:
        grouped = self.phase == "group"
        for layer in self.layers.values():
            layer.layer.weight.requires_grad_(not grouped)
            layer.A.requires_grad_(grouped and self.role == "A")
            layer.B.requires_grad_(grouped and self.role == "B")

    # -- factorise, sync -------------------------------------------------------------------------
    def _factorize(self, truncate: bool) -> None:
        tau = self.cfg.options.tau
        svds = [layer.svd() for layer in self.layers.values()]
        local = [rank_for(s, tau) if truncate else len(s) for _, s, _ in svds]
        agreed = meter.allreduce_many([("ab.ranks", torch.tensor(local, dtype=torch.int64))], None, op="max")[0]
        for layer, rank, svd in zip(self.layers.values(), agreed.tolist(), svds):
            old = {"A": layer.A.shape, "B": layer.B.shape}
            layer.factorize(tau, truncate, rank=int(rank), svd=svd)
            self._fit_optimizer_state(layer, old)

    def _fit_optimizer_state(self, layer: FactorizedLayer, old: dict[str, torch.Size]) -> None:
        """Slice or zero-pad the factors' moments to their new rank (or drop them)."""
        for name in ("A", "B"):
            param = getattr(layer, name)
            state = self.optimizer.state.get(param)
            if not state:
                continue
            if self.cfg.options.reset_optimizer:
                del self.optimizer.state[param]
                continue
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == old[name]:
                    state[key] = _resize(value, param.shape)

    def _sync(self) -> None:
        """Combine the groups' factors by sync mode, W = A B, average everything else."""
        mode = self.cfg.options.sync_mode
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
                named = [(f"ab.sync.{n}.{f}", getattr(layer, f).detach() * (self.role == f) / self.trainers[f])
                         for n, layer, f in factors]
                results = meter.allreduce_many(named, None, op="sum")
            else:
                named = [(f"ab.sync.{n}.{f}", getattr(layer, f).detach()) for n, layer, f in factors]
                results = meter.allreduce_many(named, None, op="average")
            for (_, layer, f), value in zip(factors, results):
                getattr(layer, f).data = value
            for _, layer in layers:
                layer.densify()
        self._average_the_rest()

    def _average_the_rest(self) -> None:
        """Parameters outside the factors (1-D, full-rank layers) and float buffers (BatchNorm
        running statistics) may differ between groups: average them over all ranks."""
        factor_ids = {id(t) for layer in self.layers.values() for t in (layer.A, layer.B, layer.layer.weight)}
        rest = [(f"ab.sync.{n}", t) for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]
                if id(t) not in factor_ids and t.is_floating_point()]
        for (_, t), value in zip(rest, meter.allreduce_many([(n, t.detach()) for n, t in rest], None, op="average")):
            t.data.copy_(value)

    # -- evaluation and reporting ----------------------------------------------------------------
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, float]:
        """Accuracy of the model a sync would give now. In the group phase this syncs a copy of
        the state (the traffic counts as evaluation) and restores the groups' own factors."""
        if self.phase != "group":
            return super().evaluate(batches)
        saved = copy.deepcopy(self.model.state_dict())
        self._sync()
        try:
            return super().evaluate(batches)
        finally:
            self.model.load_state_dict(saved)
            for layer in self.layers.values():
                layer.factorized = True

    def compression_ratio(self) -> float:
        """Full-rank parameter count over the parameters one rank trains or sends in the group
        phase at the current ranks (its trained factor, 1-D parameters and full-rank layers;
        each counted once). 1.0 before the first factorisation."""
        factor_ids = {id(t) for layer in self.layers.values() for t in (layer.A, layer.B, layer.layer.weight)}
        rest = sum(p.numel() for p in self.model.parameters() if id(p) not in factor_ids)
        trained = sum(getattr(layer, self.role).numel() if layer.A.numel() else layer.layer.weight.numel()
                      for layer in self.layers.values())
        return self.full_parameters / (trained + rest)

    def epoch_metrics(self) -> dict[str, Any]:
        intra = sum(t.wire_bytes for (phase, _, group), t in meter.by_kind.items()
                    if phase == "train" and group.startswith("group"))
        return {"phase": self.phase, "role": self.role, "compression_ratio": self.compression_ratio(),
                "intra_group_wire_bytes": intra, "inter_group_wire_bytes": meter.total("train", group="world"),
                **{f"rank/{name}": layer.rank for name, layer in self.layers.items()}}

    summary_metrics = epoch_metrics

    def _ranks_text(self) -> str:
        return ", ".join(f"{name}:{layer.rank}" for name, layer in self.layers.items())

    def _say(self, text: str) -> None:
        if runtime.rank() == 0:
            from tqdm import tqdm

            tqdm.write(f"ab: {text}")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ab": {"step": self.step, "phase": self.phase, "last_switch": self.last_switch,
                                               "factorized": {n: l.factorized for n, l in self.layers.items()}}}

    def state_owner(self) -> int:
        return self.group.ranks[0]  # groups train different factors; ranks of a group agree

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model_state = state["model"]
        for name, layer in self.layers.items():  # factors must have the saved shapes first
            layer.A.data = torch.empty_like(model_state[f"{name}.A"])
            layer.B.data = torch.empty_like(model_state[f"{name}.B"])
            layer.factorized = state["ab"]["factorized"][name]
        super().load_state_dict(state)
        ab = state["ab"]
        self.step, self.phase, self.last_switch = ab["step"], ab["phase"], ab["last_switch"]
        self._set_trainable()


def _resize(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Slice or zero-pad a 2-D tensor to `shape` (top-left block kept)."""
    out = tensor.new_zeros(shape)
    rows, cols = min(shape[0], tensor.shape[0]), min(shape[1], tensor.shape[1])
    out[:rows, :cols] = tensor[:rows, :cols]
    return out
