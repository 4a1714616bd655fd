"""What every training method provides, and the pieces most of them share."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from hvd_lowcomm import task
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.optimizers import muon_with_adamw
from hvd_lowcomm.config import Config
from hvd_lowcomm.data import DatasetInfo, ShardedBatches


class Method:
    """One training method as the built-in loop (hvd_lowcomm.loop) drives it.

    Made with the run's config and the dataset's description (`hvd_lowcomm.data.DatasetInfo`,
    whose input shape and classes a method may need; None only where a test drives a method
    without data), after `check_world` passed. The life cycle, in the order the framework calls
    it on every rank:

     1. `check_world(cfg, world_size)`  (class method) before anything is built; raise
        ConfigError if the rank layout does not fit the method;
     2. `check_model(model)`      raise ConfigError if the method cannot train `model`;
     3. `setup(model)`            take the freshly built model, make the optimiser, make every
                                  rank start from the same state;
     4. `batches(split, ...)`     this rank's batches of a split (default: sharded over all ranks);
        `epochs()`                how many epochs the run has;
     5. `set_total_steps(n)`      the run's length, once, before the first step (schedules
                                  given as fractions of the run resolve here);
     6. per epoch: `start_epoch(epoch)`; per step: `set_lr(lr)` then `train_step(x, y)`, which
        returns the local loss; `agreement_group()` says where the loop's per-step checks run;
     7. `evaluate(batches)`       (correct, count, loss sum) over this rank's test shard;
        `epoch_metrics()`         method-specific numbers for the epoch record;
     8. `state_dict()` / `load_state_dict()`  everything needed to resume, held by the rank
        `state_owner()` names; `local_state_dict()` / `load_local_state_dict()` what each rank
        holds for itself (hvd_lowcomm.checkpoint);
     9. `summary_metrics()`       figures for the final summary; `final_state_dict()` the
                                  trained model as one ordinary state dict (collective).

    What the framework knows of a method besides this object (options, presets, cost) is
    registered with it (hvd_lowcomm.registry.register). Every byte a method sends goes through
    `hvd_lowcomm.comm.traffic.meter`.
    """

    name = "?"  # set by @register
    default_model = "mlp"  # the model trained when --model.name is not given
    # Whether every rank takes every step (so the loop may run a collective each step for
    # preemption and non-finite checks); False where some ranks idle while others train.
    lockstep = True
    # Whether this method sends its gradients as comm.compression says (else that option is
    # refused for it rather than silently ignored).
    honours_compression = False

    def __init__(self, cfg: Config, data: DatasetInfo | None = None) -> None:
        self.cfg = cfg
        self.options: Any = cfg.options  # this method's options dataclass (None if it has none)
        self.data = data
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        # Seconds of the run's steps spent in forward and backward passes (forward_backward).
        self.pass_seconds: dict[str, float] = {"forward": 0.0, "backward": 0.0}

    @classmethod
    def engine_needed(cls, cfg: Config) -> str | None:
        """The engine this method needs with these options (what comm.engine auto then picks),
        or None for either."""
        return None

    @classmethod
    def check_world(cls, cfg: Config, world_size: int) -> None:
        """Raise ConfigError when this method cannot run on `world_size` ranks."""

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise ConfigError when this method cannot train `model`."""

    def setup(self, model: torch.nn.Module) -> None:
        raise NotImplementedError

    def set_total_steps(self, total_steps: int) -> None:
        """Called once before the first step with the number of steps the run will take."""

    def epochs(self) -> int:
        return self.cfg.train.epochs

    def batches(self, split: Any, batch_size: int, shuffle: bool, device: torch.device) -> Any:
        """This rank's batches of `split` (an hvd_lowcomm.data.H5Split)."""
        return ShardedBatches(
            split, batch_size, runtime.rank(), runtime.size(), seed=self.cfg.train.seed, shuffle=shuffle, device=device
        )

    def join_run(self, resumed_at: int | None, load: Callable[[], None]) -> int:
        """Join the run after `setup`: `load()` restores the checkpoint of step `resumed_at`
        (None: there is none). Returns the step the run had reached when this rank's group
        joined it by healing from a member (elastic groups); the loop starts there. 0: from the
        start or the checkpoint."""
        if resumed_at is not None:
            load()
        return 0

    def request_stop(self) -> bool:
        """This rank got a preemption signal: True when the method stops it together with others
        (then `stop_requested` says when), False to stop at the loop's next agreement."""
        return False

    def stop_requested(self) -> bool:
        """Whether the run asked this rank to checkpoint and stop at this step, as a preemption
        signal would (an elastic run's coordinator, preempted, says so at a round)."""
        return False

    def start_epoch(self, epoch: int) -> None:
        """Called before each epoch's first step (1-based)."""

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        raise NotImplementedError

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The local batch's loss, and its gradient accumulated into .grad: in train.accumulate
        micro-batches, each loss weighted by its share of the batch (so the sum is the whole
        batch's mean-loss gradient), forward passes under train.amp autocast."""
        assert self.model is not None
        t = self.cfg.train
        total = 0.0
        parts = [(xs, ys) for xs, ys in zip(x.tensor_split(t.accumulate), y.tensor_split(t.accumulate)) if len(ys)]
        for index, (xs, ys) in enumerate(parts):
            self.start_micro_batch(last=index == len(parts) - 1)
            start = runtime.clock(x.device)
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=t.amp == "bf16"):
                loss = task.loss(task.logits(self.model(xs)), ys) * (len(ys) / len(y))
            middle, exchanged = runtime.clock(x.device), getattr(self.optimizer, "exchange_seconds", 0.0)
            loss.backward()  # (a drop-in wrapper's exchange runs as the last one ends: not the pass's time)
            total += loss.item()
            self.pass_seconds["forward"] += middle - start
            self.pass_seconds["backward"] += (
                runtime.clock(x.device) - middle - (getattr(self.optimizer, "exchange_seconds", 0.0) - exchanged)
            )
        return total

    def start_micro_batch(self, last: bool) -> None:
        """Called before each micro-batch's forward pass; `last`: the batch's last one, whose
        backward pass completes the step's gradient."""

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int, float]:
        assert self.model is not None
        self.model.eval()
        correct, count, loss_sum = 0, 0, 0.0
        with torch.no_grad():
            for x, y in batches:
                logits = task.logits(self.model(x))
                loss_sum += task.loss(logits, y, reduction="sum").item()
                correct += task.correct(logits, y)
                count += task.positions(y)
        self.model.train()
        return correct, count, loss_sum

    def agreement_group(self) -> runtime.Group | None:
        """Where the loop's per-step checks (non-finite values) run after the step just taken:
        None for all ranks. A method whose groups run free returns this rank's group; the
        world then meets only where it returns None (preemption and periodic checkpoints
        wait for that)."""
        return None

    def summary_metrics(self) -> dict[str, Any]:
        """Method-specific figures for the final summary (summary.json and the printed table)."""
        return {}

    def set_lr(self, lr: float) -> None:
        """Apply the schedule's learning rate for the coming step (methods with several
        optimisers or their own LR rules override this)."""
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def epoch_metrics(self) -> dict[str, Any]:
        return {}

    def final_state_dict(self) -> dict[str, Any] | None:
        """The trained model as one ordinary state dict, on global rank 0 (None elsewhere);
        collective, called on every rank at the end of training."""
        assert self.model is not None
        return self.model.state_dict() if runtime.rank() == 0 else None

    def state_dict(self) -> dict[str, Any]:
        assert self.model is not None and self.optimizer is not None
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.model is not None and self.optimizer is not None
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def state_owner(self) -> int:
        """The global rank whose `state_dict()` this rank restores from (and writes, when it is
        this rank). Default 0: after every step all ranks hold the same state."""
        return 0

    def local_state_dict(self) -> dict[str, Any]:
        """State that differs per rank and is not in `state_dict()` (e.g. a per-rank generator)."""
        return {}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def sharded_state_dict(self) -> dict[str, Any] | None:
        """State held as DTensors (a sharded model's and its optimiser's), which a checkpoint
        saves with torch.distributed.checkpoint (DCP) beside the ranks' files; None: none."""
        return None

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Take back sharded_state_dict()'s tree, which DCP loaded in place."""

    @classmethod
    def reshards(cls, cfg: Config) -> bool:
        """Whether a checkpoint resumes on another rank count or group size: only where all of
        the state that depends on the layout is in sharded_state_dict()."""
        return False


def make_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """train.optimizer over `model`'s parameters (muon: Muon for its hidden weight matrices,
    AdamW for the rest, as one optimiser: hvd_lowcomm.optimizers)."""
    t = cfg.train
    params = model.parameters()
    if t.optimizer == "muon":
        return muon_with_adamw(model, lr=t.lr, weight_decay=t.weight_decay)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    raise ValueError(f"unknown optimizer {t.optimizer!r}")


def broadcast_model_and_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, root_rank: int = 0, group: runtime.Group | None = None
) -> None:
    """Make every rank of `group` start from `root_rank`'s parameters and optimiser state."""
    broadcast_parameters(model.state_dict(), root_rank, group)
    broadcast_optimizer_state(optimizer, root_rank, group)


def broadcast_parameters(
    params: dict[str, torch.Tensor], root_rank: int = 0, group: runtime.Group | None = None
) -> None:
    """hvd.broadcast_parameters on either engine: `params` (a state_dict, or named tensors) in
    place from `root_rank`, metered as set-up traffic."""
    with meter.in_phase("setup"):
        meter.broadcast_tensors(params, root_rank, group)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int = 0, group: runtime.Group | None = None
) -> None:
    """hvd.broadcast_optimizer_state on either engine: every tensor of the optimiser's state in
    place from `root_rank` (an optimiser that has not stepped has none, the same on all ranks)."""
    state = optimizer.state_dict()["state"]
    with meter.in_phase("setup"):
        meter.broadcast_tensors(
            [
                (f"optimizer.{index}.{key}", value)
                for index, entry in sorted(state.items())
                for key, value in sorted(entry.items())
                if torch.is_tensor(value)
            ],
            root_rank,
            group,
        )


def exchange_gradients(
    named: Iterable[tuple[str, torch.nn.Parameter]], group: runtime.Group | None = None, op: str = "average"
) -> None:
    """Replace every parameter's gradient by its `op` over `group` (None: all ranks), one
    metered, fused allreduce for all of them; a parameter without a gradient takes part with
    zeros (every rank must send the same tensors) and gets the pooled value."""
    named = list(named)
    pooled = meter.allreduce_many(
        [(n, p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in named], group, op=op
    )
    for (_, p), g in zip(named, pooled):
        p.grad = g
