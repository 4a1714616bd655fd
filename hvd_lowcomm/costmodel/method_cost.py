"""What a method registers with the cost model (`MethodCost`), what its `predict` returns
(`Prediction`), and what a prediction may assume of the run (`RunAssumptions`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class RunAssumptions:
    """What a prediction must assume about the run that only training reveals."""

    # The run's length: schedules given as fractions of the run, and one-off work (AB's full
    # SVDs), spread over it.
    run_steps: int = 10_000
    # The share of each factorised layer's smaller side that a learned cut keeps (AB-training): the
    # rank rule's own keep, as measured (docs: which-method, "Which method for my cluster?").
    rank_share: float = 0.02


@dataclass(frozen=True)
class MethodCost:
    """How a method's step costs, registered with the method (hvd_lowcomm.registry.register).

    predict(profile, ranks, link, options, cfg, assumptions) -> Prediction
        the step on `ranks` ranks with the method's `options` (its section of `cfg`, presets
        applied); bytes_per_rank are those of the rank that sends most. Raise ConfigError when
        the method cannot train this model or rank count (the planner leaves it out).
    layer_kernels(sample, options, cfg) -> {name: callable or seconds}
        the method's own work on one weight layer, timed (median of 3) into layer.kernels[name].
    model_facts(model, input_shape, options, cfg) -> anything
        what the method needs to know of the model (where it cuts it...), kept in
        profile.facts[method name].
    quality(options, cfg) -> str | None
        what its result may lose against ddp's with these options: "" when nothing (the same
        gradient), a sentence when a compression is held to an error target, None when it is
        not (a fixed rank: `--method auto` does not choose it). Not given: None.
    judged: whether `--method auto` needs the held-out suite's verdict on the method's defaults
        (hvd_lowcomm.heldout) before choosing it: true for a compression whose loss depends on
        the model and data (an error target, or fp16's rounding), false for an exact exchange.
    memory(profile, ranks, ranks_per_node, options, cfg) -> Memory
        what one rank holds for the method with these options (plan's memory table); every
        registered method gives one (`replicated` for a whole model on every rank).
    memory_forms: the method's other forms the memory table shows beside its defaults, as
        (row label, options), an option's value NODE meaning the ranks of a node.
    """

    predict: Callable[..., Prediction]
    layer_kernels: Callable[..., dict[str, Any]] | None = None
    model_facts: Callable[..., Any] | None = None
    quality: Callable[..., str | None] | None = None
    judged: bool = False
    memory: Callable[..., Memory] | None = None
    memory_forms: tuple[tuple[str, dict[str, Any]], ...] = ()


# In a memory form's options: the number of ranks on a node (a group the size of a node).
NODE = "node"


@dataclass(frozen=True)
class Memory:
    """What one rank holds for a method, in float32 numbers: `model_share` of the weights, their
    gradients and the optimiser's slots (below 1 where the model is sharded or partitioned),
    `gathered` numbers a sharded model holds gathered at once, and `state`, the method's own
    buffers by name (outer state, error feedback). Activations are not counted."""

    model_share: float = 1.0
    gathered: float = 0.0
    state: dict[str, float] = field(default_factory=dict)

    def numbers(self, params: int, optimizer_slots: int) -> float:
        return params * (2 + optimizer_slots) * self.model_share + self.gathered + sum(self.state.values())


def replicated(*args: Any) -> Memory:
    """The memory rule of a method that keeps the whole model on every rank and nothing of its own."""
    return Memory()


@dataclass(frozen=True)
class Prediction:
    """One method's predicted step (seconds) and bytes; `method` and `ranks` are filled in by
    `predict`."""

    method: str
    ranks: int
    compute: float  # seconds: forward, backward, optimiser
    method_compute: float  # seconds: the method's own work (power iteration, row products, ...)
    communication: float  # seconds on the network
    hidden: float  # of which overlapped with the backward pass
    bytes_per_rank: float  # sent per step
    # Sent per step from one node to the others (what its network link carries; Link.node_share).
    node_link_bytes: float = 0.0

    @property
    def step(self) -> float:
        return self.compute + self.method_compute + self.communication - self.hidden
