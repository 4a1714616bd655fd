"""An α-β cost model of one training step: each method's predicted step time for p ranks on a
given network, from the model's layer shapes and its compute measured on this machine.

    step = compute + the method's own computation + communication - what hides behind backward

This module holds only what every method shares: the network (`Link`, with Hockney's α-β
costs of the collectives), the model's profile (layer shapes, compute and the methods' kernels
timed on this machine), the prediction, and the choices made from predictions (`choose`,
`break_even`). What one method sends and computes in a step is described in the method's own
module, as a `MethodCost` registered with it (hvd_lowcomm.methods); this module asks the
registry for it by name and knows no method itself.

Communication (the algorithms MPI libraries and NCCL use for large messages: Rabenseifner's
reduce-scatter + allgather, recursive-doubling allgather; the bytes are the ring's, which the
traffic meter counts too), for a group of g ranks:

    allreduce of M bytes              2⌈log2 g⌉·α + 2(g-1)/g · M / β
    allgather of m bytes per rank     ⌈log2 g⌉·α + (g-1) · m / β
    point to point, M bytes           α + M / β

β is the bandwidth of the slowest link the ring crosses: the network's once the group spans
several nodes (a ring leaves each node once, so the node's ranks do not share its link), the
node's own (`intra_bandwidth`) inside one; for rings of one rank per node that every rank of a
node runs at once (DiLoCo's columns), the node's link shared among its ranks. α is the latency
of one message. On a *shared* medium (benchmarks.compare --link without --nodes: one token
bucket that every rank's bytes cross) the bytes of all ranks add up instead.

Compute: forward + backward + optimiser step of one batch (`profile_model` times it, or a
measured step of `--method local` replaces it). A method's own computation (PowerSGD's
compression cycle, rank-dAD's factors, AB's SVDs...) is timed per layer with the method's own
kernels on random data of the layer's shapes, as its cost asks (`MethodCost.layer_kernels`).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvd_lowcomm import task
from hvd_lowcomm.comm.traffic import wire_bytes
from hvd_lowcomm.config import Config, ConfigError, apply_presets, default_config, rate_bits
from hvd_lowcomm.metrics import human_bytes
from hvd_lowcomm.registry import specs
from hvd_lowcomm.models.layer_kinds import kind_of

@dataclass(frozen=True)
class Link:
    """The network between ranks."""

    bandwidth: float                 # bytes per second, one direction, between nodes
    latency: float = 2e-6            # seconds per message (α)
    ranks_per_node: int = 1
    intra_bandwidth: float = 20e9    # bytes per second between ranks of one node
    shared: bool = False             # one medium for every rank's bytes (an emulated link)
    # The share of the backward pass that communication can hide behind: 1 when every rank has
    # a core (or a GPU) of its own, so a core is free to drive the network while it computes;
    # 0 when ranks outnumber cores (the emulated clusters on 2 cores: measured, none hides).
    overlap: float = 1.0

    @classmethod
    def parse(cls, rate: str, latency_us: float = 2.0, **kwargs: Any) -> "Link":
        return cls(rate_bits(rate) / 8, latency_us * 1e-6, **kwargs)

    def describe(self) -> str:
        text = f"{self.bandwidth * 8 / 1e9:.3g} Gbit/s, {self.latency * 1e6:.3g} µs"
        if self.ranks_per_node > 1:
            text += f", {self.ranks_per_node} ranks per node"
        return text + (", shared medium" if self.shared else "")

    def beta(self, group: int, spans_nodes: bool | None = None) -> float:
        """The bandwidth a ring over `group` ranks runs at: the network's once it leaves a node
        (by default: when the group is larger than a node; `spans_nodes` says so for a group of
        ranks picked across nodes, such as one rank per node)."""
        spans = group > self.ranks_per_node if spans_nodes is None else spans_nodes
        if not spans:
            return self.intra_bandwidth
        if spans_nodes is True:
            # One rank per node: every rank of a node runs its own such ring at the same time
            # (DiLoCo's columns), so the node's ranks share its link.
            return self.bandwidth / self.ranks_per_node
        # A ring over several nodes also passes between the ranks inside each node, so the
        # slower of the two links sets its pace.
        return min(self.bandwidth, self.intra_bandwidth)

    def node_share(self, group: int, spans_nodes: bool | None = None) -> float:
        """Bytes a node sends to other nodes per byte one rank sends in a ring over `group` ranks
        (arguments as `beta`'s): none inside a node; one rank's in a ring that leaves each node
        once; every rank's for rings of one rank per node run by all of a node's ranks at once."""
        spans = group > self.ranks_per_node if spans_nodes is None else spans_nodes
        if group <= 1 or not spans:
            return 0.0
        return float(self.ranks_per_node) if spans_nodes is True else 1.0

    def _time(self, messages: float, bytes_per_rank: float, group: int, ranks: int,
              spans_nodes: bool | None) -> float:
        if group <= 1:
            return 0.0
        if self.shared:  # every rank's bytes cross the one medium
            return messages * self.latency + ranks * bytes_per_rank / self.bandwidth
        return messages * self.latency + bytes_per_rank / self.beta(group, spans_nodes)

    def allreduce(self, nbytes: float, group: int, ranks: int, spans_nodes: bool | None = None) -> float:
        return self._time(2 * _log2(group), 2 * (group - 1) / group * nbytes, group, ranks, spans_nodes)

    def allgather(self, nbytes_per_rank: float, group: int, ranks: int, spans_nodes: bool | None = None) -> float:
        return self._time(_log2(group), (group - 1) * nbytes_per_rank, group, ranks, spans_nodes)

    def send(self, nbytes: float, ranks: int, across_nodes: bool = True) -> float:
        if self.shared:
            return self.latency + ranks * nbytes / self.bandwidth
        return self.latency + nbytes / (self.bandwidth if across_nodes else self.intra_bandwidth)


def _log2(group: int) -> int:
    return math.ceil(math.log2(group)) if group > 1 else 0


@dataclass(frozen=True)
class Layer:
    """A weight layer as the exchange methods see it: rows per sample of fan_in × fan_out."""

    name: str
    module_index: int     # position among the Sequential's children (-1: not a Sequential)
    fan_in: int
    fan_out: int
    rows: int             # rows per sample: 1 for Linear, output positions (H·W) for Conv2d
    params: int           # weight + bias numbers
    # Seconds of the methods' own kernels for this layer on this machine, by the names the
    # methods' costs give them (MethodCost.layer_kernels: e.g. "powersgd", "dad_product").
    kernels: dict[str, float] = field(default_factory=dict, compare=False, hash=False)

    @property
    def flops(self) -> float:
        """Forward multiply-adds of one sample, ×2."""
        return 2.0 * self.rows * self.fan_in * self.fan_out


@dataclass
class Profile:
    """The model as the cost model needs it, and its compute on this machine."""

    layers: list[Layer]
    other_params: int                  # parameters outside weight layers (BatchNorm, ...)
    batch: int                         # samples per rank per step
    step_seconds: float                # forward + backward + optimiser step
    forward_seconds: float
    backward_seconds: float
    fp16_seconds: float = 0.0          # casting every gradient to fp16 and back (fp16 compression)
    # What a method's cost found out about the model (MethodCost.model_facts), by method name:
    # e.g. where SIL's default cut falls, which layers dAD can share rows of.
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers) + self.other_params

    @property
    def flop_rate(self) -> float:
        """Floating-point operations per second the weight layers reached in the timed forward and
        backward passes (one product forward, two backward)."""
        return 3 * self.batch * sum(layer.flops for layer in self.layers) / \
            max(self.forward_seconds + self.backward_seconds, 1e-9)

    def with_compute(self, step: float, forward: float, backward: float) -> "Profile":
        """The same model with measured times (e.g. those of `--method local`, where the ranks
        share the machine) as its compute; the kernels' times scale as its forward and backward
        passes did."""
        scale = (forward + backward) / max(self.forward_seconds + self.backward_seconds, 1e-12)
        layers = [replace(layer, kernels={k: t * scale for k, t in layer.kernels.items()}) for layer in self.layers]
        return replace(self, layers=layers, step_seconds=step, forward_seconds=forward, backward_seconds=backward,
                       fp16_seconds=self.fp16_seconds * scale)

    def at_flop_rate(self, rate: float) -> "Profile":
        """The same model on a device that reaches `rate` flop/s (every phase scaled alike)."""
        scale = self.flop_rate / rate
        return self.with_compute(self.step_seconds * scale, self.forward_seconds * scale, self.backward_seconds * scale)


@dataclass(frozen=True)
class RunAssumptions:
    """What a prediction must assume about the run that only training reveals."""

    # The run's length: schedules given as fractions of the run, and one-off work (AB's full
    # SVDs), spread over it.
    run_steps: int = 10_000
    # The share of each factorised layer's smaller side that a learned cut keeps (AB-training;
    # this project's MLPs kept 7-27 of 1024 and 13-14 of 2048: 1-3 %).
    rank_share: float = 0.02


@dataclass(frozen=True)
class LayerSample:
    """One weight layer of the profiled model, with a real batch through it, for the kernels a
    method's cost times on it."""

    name: str
    module: nn.Module
    inputs: torch.Tensor      # the layer's input on the profiled batch
    output: torch.Tensor      # its output
    fan_in: int
    fan_out: int
    rows: int                 # rows on this rank: batch × rows per sample


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
    """

    predict: Callable[..., "Prediction"]
    layer_kernels: Callable[..., dict[str, Any]] | None = None
    model_facts: Callable[..., Any] | None = None
    quality: Callable[..., str | None] | None = None


def wire(op: str, nbytes_per_rank: float, group: int) -> float:
    """Bytes one rank puts on the wire for `op` of `nbytes_per_rank` in a group of `group`
    ranks: the traffic meter's rule (an allgather's is counted on the gathered total)."""
    return wire_bytes(op, nbytes_per_rank * group if op == "allgather" else nbytes_per_rank, group)


def profile_model(model: nn.Module, input_shape: tuple[int, ...], batch: int, repeats: int = 5,
                  cfg: Config | None = None, methods: tuple[str, ...] | None = None,
                  vocabulary: int | None = None) -> Profile:
    """Layer shapes from one forward pass, the median of `repeats` timed steps (forward,
    backward, Adam step) of a copy of `model` on random data of `batch` samples (token ids
    below `vocabulary` for a text dataset's model: DatasetInfo.vocabulary), and, for every
    method with a cost (or those in `methods`), its kernels per layer and its facts of the
    model, with the options of `cfg` (the defaults if None)."""
    cfg = cfg or default_config()
    costs = _costs(methods)
    model = copy.deepcopy(model).train()
    for module in model.modules():  # a method's hooks (dAD's captures) were copied along: not ours to run
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      getattr(module, "_backward_pre_hooks", {})):
            hooks.clear()
    children = list(model.children()) if isinstance(model, nn.Sequential) else []
    rows: dict[str, int] = {}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # each weight layer's input and output
    hooks = [m.register_forward_hook(_rows_hook(rows, seen, name)) for name, m in model.named_modules()
             if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() >= 2]
    x = task.example_input(batch, tuple(input_shape), vocabulary)
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    layers, counted = [], set()
    for name, module in model.named_modules():
        if name not in rows:
            continue
        kind = kind_of(module)
        fan_out, fan_in = kind.shape(module) if kind else (module.weight.shape[0], module.weight[0].numel())
        params = [p for p in module.parameters(recurse=False)]
        counted.update(id(p) for p in params)
        index = next((i for i, child in enumerate(children) if any(m is module for m in child.modules())), -1)
        sample = LayerSample(name, module, *seen[name], fan_in, fan_out, batch * rows[name])
        layers.append(Layer(name, index, fan_in, fan_out, rows[name], sum(p.numel() for p in params),
                            _time_kernels(sample, costs, cfg)))
    other = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    step, forward, backward = _time_steps(model, x, repeats)
    gradients = torch.randn(sum(p.numel() for p in model.parameters()))
    profile = Profile(layers, other, batch, step, forward, backward, median_seconds(lambda: gradients.half().float()))
    for name, (cost, options) in costs.items():
        if cost.model_facts is not None:
            profile.facts[name] = cost.model_facts(model, tuple(input_shape), options(cfg), cfg)
    return profile


def _costs(methods: tuple[str, ...] | None) -> dict[str, tuple[MethodCost, Callable[[Config], Any]]]:
    """The registered costs (of `methods`, or all), each with how to read its options from a config."""
    found = {}
    for name, spec in specs().items():
        if spec.cost is not None and (methods is None or name in methods):
            found[name] = (spec.cost, lambda cfg, section=spec.section: cfg.method_options.get(section))
    return found


def _time_kernels(sample: LayerSample, costs: dict[str, tuple[MethodCost, Callable[[Config], Any]]],
                  cfg: Config) -> dict[str, float]:
    """Seconds of every method's own kernels for one layer (each name timed once)."""
    seconds: dict[str, float] = {}
    for cost, options in costs.values():
        if cost.layer_kernels is None:
            continue
        for name, kernel in cost.layer_kernels(sample, options(cfg), cfg).items():
            if name not in seconds:
                seconds[name] = kernel if isinstance(kernel, float) else median_seconds(kernel)
    return seconds


def _rows_hook(rows: dict[str, int], seen: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str
               ) -> Callable[..., None]:
    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        rows[name] = output[0, 0].numel() if isinstance(module, nn.modules.conv._ConvNd) else \
            output[0].numel() // output.shape[-1]
        seen[name] = (inputs[0], output)
    return hook


def _time_steps(model: nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float, float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    out = task.logits(model(x))
    y = torch.zeros(len(x), dtype=torch.long) if out.dim() == 2 else None
    steps, forwards, backwards = [], [], []
    for _ in range(repeats + 2):  # two warm-up steps
        start = time.perf_counter()
        optimizer.zero_grad()
        out = task.logits(model(x))
        loss = F.cross_entropy(out, y) if y is not None else out.float().pow(2).mean()
        middle = time.perf_counter()
        loss.backward()
        after_backward = time.perf_counter()
        optimizer.step()
        steps.append(time.perf_counter() - start)
        forwards.append(middle - start)
        backwards.append(after_backward - middle)
    return tuple(sorted(times[2:])[repeats // 2] for times in (steps, forwards, backwards))  # medians


def median_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


@dataclass(frozen=True)
class Prediction:
    """One method's predicted step (seconds) and bytes; `method` and `ranks` are filled in by
    `predict`."""

    method: str
    ranks: int
    compute: float            # seconds: forward, backward, optimiser
    method_compute: float     # seconds: the method's own work (power iteration, row products, ...)
    communication: float      # seconds on the network
    hidden: float             # of which overlapped with the backward pass
    bytes_per_rank: float     # sent per step
    # Sent per step from one node to the others (what its network link carries; Link.node_share).
    node_link_bytes: float = 0.0

    @property
    def step(self) -> float:
        return self.compute + self.method_compute + self.communication - self.hidden


def predict(profile: Profile, method: str, ranks: int, link: Link, cfg: Config | None = None,
            assumptions: RunAssumptions = RunAssumptions()) -> Prediction:
    """The step of `method` on `ranks` ranks, each with the profile's batch, with the options of
    `cfg` (the defaults if None) and the presets the method's name implies."""
    spec = specs().get(method)
    if spec is None or spec.cost is None:
        raise ConfigError(f"the cost model predicts {', '.join(predicted_methods())}; not {method!r}")
    cfg = _with_presets(spec, cfg)
    prediction = spec.cost.predict(profile, ranks, link, cfg.method_options.get(spec.section), cfg, assumptions)
    return replace(prediction, method=method, ranks=ranks)


def _with_presets(spec: Any, cfg: Config | None) -> Config:
    """cfg (the defaults if None) with the presets the method's name implies (a copy if any)."""
    if spec.presets:
        cfg = copy.deepcopy(cfg or default_config())
        apply_presets(cfg, spec.presets)
    return cfg or default_config()


def predicted_methods() -> list[str]:
    """Every registered method with a cost, in registration order."""
    return [name for name, spec in specs().items() if spec.cost is not None]


def drop_in_methods() -> tuple[str, ...]:
    """The methods `--method auto` may choose among: same model, same training, only the exchange differs."""
    return tuple(name for name, spec in specs().items() if spec.drop_in and spec.cost is not None)


def quality_risk(method: str, cfg: Config | None = None) -> str | None:
    """What `method` with cfg's options may lose against ddp (MethodCost.quality): "" nothing,
    a sentence for an error-targeted compression, None for one without a target."""
    spec = specs()[method]
    cfg = _with_presets(spec, cfg)
    if spec.cost is None or spec.cost.quality is None:
        return None
    return spec.cost.quality(cfg.method_options.get(spec.section), cfg)


def quality_keeping_methods(cfg: Config | None = None) -> tuple[str, ...]:
    """The drop-in methods whose result is ddp's, or held to an error target: what `--method
    auto` chooses among (a compression without a target would trade quality silently)."""
    return tuple(m for m in drop_in_methods() if quality_risk(m, cfg) is not None)


def break_even(profile: Profile, method: str, ranks: int, network: Link, cfg: Config | None = None,
               assumptions: RunAssumptions = RunAssumptions()) -> float:
    """The network bandwidth (bytes/s) below which `method` steps faster than ddp, the rest of
    `network` (latency, nodes, their own links) as given: inf when it is faster at every bandwidth
    from 100 Mbit/s to 10 Tbit/s, 0 when it is faster at none."""
    def gain(bandwidth: float) -> float:
        link = replace(network, bandwidth=bandwidth)
        return predict(profile, "ddp", ranks, link, cfg, assumptions).step - \
            predict(profile, method, ranks, link, cfg, assumptions).step

    low, high = 100e6 / 8, 10e12 / 8
    if gain(low) <= 0:
        return 0.0
    if gain(high) > 0:
        return math.inf
    for _ in range(60):  # bisection in log space
        middle = math.sqrt(low * high)
        low, high = (middle, high) if gain(middle) > 0 else (low, middle)
    return math.sqrt(low * high)


# A method must beat ddp by this share to be chosen over it: within it, ddp (which changes
# nothing about the gradient) wins the tie.
MIN_GAIN = 0.05


def choose(profile: Profile, ranks: int, link: Link, cfg: Config | None = None,
           candidates: tuple[str, ...] | None = None) -> tuple[str, list[Prediction], str]:
    """The candidate (default: every drop-in method that keeps quality) with the shortest
    predicted step (ddp unless another is MIN_GAIN faster), every prediction, and why (with what
    quality risk remains)."""
    if candidates is None:
        candidates = quality_keeping_methods(cfg)
    predictions = sorted((predict(profile, m, ranks, link, cfg) for m in candidates), key=lambda q: q.step)
    best, ddp = predictions[0], next((q for q in predictions if q.method == "ddp"), None)
    if ddp is not None and best.step > (1 - MIN_GAIN) * ddp.step:
        best = ddp
    why = (f"{best.method}: predicted {best.step * 1e3:.1f} ms per step on {ranks} ranks over {link.describe()} "
           f"(compute {best.compute * 1e3:.1f} ms, its own work {best.method_compute * 1e3:.1f} ms, "
           f"network {(best.communication - best.hidden) * 1e3:.1f} ms not hidden)")
    if ddp is not None and best.method != "ddp":
        why += f"; ddp would take {ddp.step * 1e3:.1f} ms ({ddp.step / best.step:.2f}x)"
    else:
        runner = next((q for q in predictions if q.method != best.method), None)
        if runner is not None:
            why += f"; the next best, {runner.method}, {runner.step * 1e3:.1f} ms (a method is chosen over " \
                   f"ddp only when {MIN_GAIN:.0%} faster)"
    risk = quality_risk(best.method, cfg)
    why += f". Quality: {risk or 'the same gradient as ddp'}"
    return best.method, predictions, why


def format_predictions(predictions: list[Prediction]) -> str:
    lines = [f"{'method':<10} {'step ms':>9} {'compute':>9} {'own work':>9} {'network':>9} {'hidden':>8} {'sent/rank':>10}"]
    for q in predictions:
        lines.append(f"{q.method:<10} {q.step * 1e3:>9.1f} {q.compute * 1e3:>9.1f} {q.method_compute * 1e3:>9.1f} "
                     f"{q.communication * 1e3:>9.1f} {q.hidden * 1e3:>8.1f} {human_bytes(q.bytes_per_rank):>10}")
    return "\n".join(lines)
