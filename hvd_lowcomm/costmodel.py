"""An α-β cost model of one training step: each method's predicted step time for p ranks on a
given network, from the model's layer shapes and its compute, timed on this machine or counted
at an accelerator's rates.

    step = compute + the method's own computation + communication - what hides behind backward

This module holds only what every method shares: the network (`Link`, with Hockney's α-β
costs of the collectives), the model's profile (layer shapes, compute and the methods' kernels),
the devices it is costed for (`Device`), the prediction, and the choices made from predictions
(`choose`, `break_even`). What one method sends and computes in a step is described in the
method's own module, as a `MethodCost` registered with it (hvd_lowcomm.methods); this module
asks the registry for it by name and knows no method itself.

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
of one message, by default the network kind's (`LATENCY_US`). On a *shared* medium
(benchmarks.compare --link without --nodes: one token bucket that every rank's bytes cross) the
bytes of all ranks add up instead.

Compute: forward + backward + optimiser step of one batch, and a method's own computation
(PowerSGD's compression cycle, rank-dAD's factors, AB's SVDs...) per layer with the method's own
kernels on data of the layer's shapes, as its cost asks (`MethodCost.layer_kernels`). Either
timed on this machine (`profile_model` without a device; a measured step of `--method local`
may replace it), or counted for a `Device` (an accelerator of `ACCELERATORS`, this CPU's measured
rates, or a given rate): every op runs on the meta device, shapes only, and its FLOPs and bytes
are costed. The step is three times the forward pass's FLOPs at the device's peak × UTILISATION; each
kernel op at the roofline (`Device.seconds`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from hvd_lowcomm import heldout, task
from hvd_lowcomm.comm.traffic import wire_bytes
from hvd_lowcomm.config import Config, ConfigError, apply_presets, default_config, rate_bits
from hvd_lowcomm.metrics import human_bytes
from hvd_lowcomm.registry import specs
from hvd_lowcomm.models.layer_kinds import kind_of

# Message latency (α) in µs by the network's kind: InfiniBand's RDMA takes one or two, TCP over
# Ethernet tens (the operating system's network stack on both ends).
LATENCY_US = {"ib": 2.0, "eth": 30.0}
# A link named by its rate alone is InfiniBand from this rate (bits/s) up, Ethernet below it.
IB_FROM = 100e9


def link_kind(link: str) -> tuple[str, float]:
    """(kind, bits per second) of a link named 'RATE' (25gbit) or 'KIND:RATE' (ib:200gbit,
    eth:100gbit), the kind one of LATENCY_US's; a rate alone is of the kind IB_FROM says."""
    kind, _, rate = link.rpartition(":")
    bits = rate_bits(rate)
    kind = kind.strip().lower() or ("ib" if bits >= IB_FROM else "eth")
    if kind not in LATENCY_US:
        raise ConfigError(
            f"link {link!r}: name its kind {' or '.join(LATENCY_US)} before the rate "
            f"(ib:200gbit, eth:100gbit), or give the rate alone (25gbit)"
        )
    return kind, bits


@dataclass(frozen=True)
class Link:
    """The network between ranks."""

    bandwidth: float  # bytes per second, one direction, between nodes
    latency: float = 2e-6  # seconds per message (α)
    ranks_per_node: int = 1
    intra_bandwidth: float = 20e9  # bytes per second between ranks of one node
    shared: bool = False  # one medium for every rank's bytes (an emulated link)
    # The share of the backward pass that communication can hide behind: 1 when every rank has
    # a core (or a GPU) of its own, so a core is free to drive the network while it computes;
    # 0 when ranks outnumber cores (the emulated clusters on 2 cores: measured, none hides).
    overlap: float = 1.0

    @classmethod
    def parse(cls, link: str, latency_us: float | None = None, **kwargs: Any) -> "Link":
        """The network `link` names (link_kind), with its kind's latency unless `latency_us` is given."""
        kind, bits = link_kind(link)
        return cls(bits / 8, (LATENCY_US[kind] if latency_us is None else latency_us) * 1e-6, **kwargs)

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

    def _time(self, messages: float, bytes_per_rank: float, group: int, ranks: int, spans_nodes: bool | None) -> float:
        if group <= 1:
            return 0.0
        if self.shared:  # every rank's bytes cross the one medium
            return messages * self.latency + ranks * bytes_per_rank / self.bandwidth
        return messages * self.latency + bytes_per_rank / self.beta(group, spans_nodes)

    def allreduce(self, nbytes: float, group: int, ranks: int, spans_nodes: bool | None = None) -> float:
        return self._time(2 * _log2(group), 2 * (group - 1) / group * nbytes, group, ranks, spans_nodes)

    def allgather(self, nbytes_per_rank: float, group: int, ranks: int, spans_nodes: bool | None = None) -> float:
        return self._time(_log2(group), (group - 1) * nbytes_per_rank, group, ranks, spans_nodes)

    def reduce_scatter(self, nbytes: float, group: int, ranks: int, spans_nodes: bool | None = None) -> float:
        """`nbytes`: each rank's whole input, of which it keeps the reduced 1/group."""
        return self._time(_log2(group), (group - 1) / group * nbytes, group, ranks, spans_nodes)

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
    module_index: int  # position among the Sequential's children (-1: not a Sequential)
    fan_in: int
    fan_out: int
    rows: int  # rows per sample: 1 for Linear, output positions (H·W) for Conv2d
    params: int  # weight + bias numbers
    # Seconds of the methods' own kernels for this layer (Profile.device), by the names the
    # methods' costs give them (MethodCost.layer_kernels: e.g. "powersgd", "dad_product").
    kernels: dict[str, float] = field(default_factory=dict, compare=False, hash=False)

    @property
    def flops(self) -> float:
        """Forward multiply-adds of one sample, ×2."""
        return 2.0 * self.rows * self.fan_in * self.fan_out


@dataclass
class Profile:
    """The model as the cost model needs it, and its compute (timed here, or counted for a device)."""

    layers: list[Layer]
    other_params: int  # parameters outside weight layers (BatchNorm, ...)
    batch: int  # samples per rank per step
    step_seconds: float  # forward + backward + optimiser step
    forward_seconds: float
    backward_seconds: float
    fp16_seconds: float = 0.0  # casting every gradient to fp16 and back (fp16 compression)
    # What a method's cost found out about the model (MethodCost.model_facts), by method name:
    # e.g. where SIL's default cut falls, which layers dAD can share rows of.
    facts: dict[str, Any] = field(default_factory=dict)
    flops: float = 0.0  # the forward pass's on the batch (products, convolutions, attention)
    device: str = "timed on this machine"  # where the seconds come from (Device.name when counted)
    tied_params: int = 0  # numbers in two layers' params at once (a tied embedding and output layer)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers) + self.other_params - self.tied_params

    @property
    def flop_rate(self) -> float:
        """Floating-point operations per second the forward and backward passes reached (the
        backward's twice the forward's)."""
        return 3 * self.flops / max(self.forward_seconds + self.backward_seconds, 1e-9)

    def with_compute(self, step: float, forward: float, backward: float) -> "Profile":
        """The same model with measured times (e.g. those of `--method local`, where the ranks
        share the machine) as its compute; the kernels' times scale as its forward and backward
        passes did."""
        scale = (forward + backward) / max(self.forward_seconds + self.backward_seconds, 1e-12)
        layers = [replace(layer, kernels={k: t * scale for k, t in layer.kernels.items()}) for layer in self.layers]
        return replace(
            self,
            layers=layers,
            step_seconds=step,
            forward_seconds=forward,
            backward_seconds=backward,
            fp16_seconds=self.fp16_seconds * scale,
        )


@dataclass(frozen=True)
class RunAssumptions:
    """What a prediction must assume about the run that only training reveals."""

    # The run's length: schedules given as fractions of the run, and one-off work (AB's full
    # SVDs), spread over it.
    run_steps: int = 10_000
    # The share of each factorised layer's smaller side that a learned cut keeps (AB-training): what
    # the rank rule alone kept on this project's MLPs (docs: which-method, "Which method for my cluster?").
    rank_share: float = 0.02


@dataclass(frozen=True)
class LayerSample:
    """One weight layer of the profiled model, with a real batch through it, for the kernels a
    method's cost times on it."""

    name: str
    module: nn.Module
    inputs: torch.Tensor  # the layer's input on the profiled batch
    output: torch.Tensor  # its output
    fan_in: int
    fan_out: int
    rows: int  # rows on this rank: batch × rows per sample


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
    """

    predict: Callable[..., "Prediction"]
    layer_kernels: Callable[..., dict[str, Any]] | None = None
    model_facts: Callable[..., Any] | None = None
    quality: Callable[..., str | None] | None = None
    judged: bool = False


def sent_bytes(op: str, nbytes_per_rank: float, group: int) -> float:
    """Bytes one rank puts on the wire for `op` of `nbytes_per_rank` in a group of `group`
    ranks: the traffic meter's rule (an allgather's is counted on the gathered total)."""
    return wire_bytes(op, nbytes_per_rank * group if op == "allgather" else nbytes_per_rank, group)


def profile_model(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch: int,
    repeats: int = 5,
    cfg: Config | None = None,
    methods: tuple[str, ...] | None = None,
    vocabulary: int | None = None,
    device: Device | None = None,
) -> Profile:
    """The model on `batch` samples of random data (token ids below `vocabulary` for a text
    dataset's model: DatasetInfo.vocabulary): its layer shapes and forward FLOPs from a pass on
    the meta device; for every method with a cost (or those in `methods`), its kernels per layer
    and its facts of the model, with the options of `cfg` (the defaults if None); and the
    compute. For a `device`: counted at its rates (the step: the forward's FLOPs, and twice them
    backward, at device.step_rate; each kernel by Device.seconds). Without: the median of
    `repeats` timed steps (forward, backward, Adam step) of a copy of `model`, and the kernels,
    timed on this machine, unless that would take longer than TIMING_LIMIT: then counted at this
    CPU's measured rates (measured_device). A model on the meta device (built under
    `torch.device("meta")`: no weights to initialise) is profiled alike."""
    cfg = cfg or default_config()
    costs = _costs(methods)
    x = task.example_input(batch, tuple(input_shape), vocabulary)
    shapes = _copy(model, meta=True)
    with _MetaOps() as forward, torch.no_grad():
        layers, samples, other, tied = _weight_layers(shapes, x)
    with _MetaOps(), torch.no_grad():
        facts = {
            name: cost.model_facts(shapes, tuple(input_shape), options(cfg), cfg)
            for name, (cost, options) in costs.items()
            if cost.model_facts is not None
        }
    flops = sum(op_flops for op_flops, _ in forward.ops)
    if device is None:
        here = measured_device("cpu", cfg.train.amp)
        device = here if _timing_seconds(flops, samples, costs, cfg, repeats, here) > TIMING_LIMIT else None
    if device is None:
        timed = _copy(model, meta=False)
        samples = _weight_layers(timed, x)[1]
        step, forward_seconds, backward_seconds = _time_steps(timed, x, repeats)
        kernels = _layer_kernels(samples, costs, cfg)
        gradients = torch.randn(sum(p.numel() for p in timed.parameters()))
        fp16 = median_seconds(lambda: gradients.half().float())
    else:
        forward_seconds = flops / device.step_rate
        backward_seconds = 2 * forward_seconds  # a product for the inputs' gradient and one for the weights'
        step = forward_seconds + backward_seconds
        with costing(device):
            kernels = _layer_kernels(samples, costs, cfg)
            gradients = torch.empty(sum(p.numel() for p in shapes.parameters()))
            fp16 = median_seconds(lambda: gradients.half().float())
    layers = [replace(layer, kernels=seconds) for layer, seconds in zip(layers, kernels)]
    return Profile(
        layers,
        other,
        batch,
        step,
        forward_seconds,
        backward_seconds,
        fp16,
        facts,
        flops,
        Profile.device if device is None else device.name,
        tied,
    )


def _timing_seconds(
    flops: float,
    samples: list[LayerSample],
    costs: dict[str, tuple[MethodCost, Callable[[Config], Any]]],
    cfg: Config,
    repeats: int,
    here: Device,
) -> float:
    """About how long timing a profile would take on this machine (`here`): its steps, and its
    layers' kernels run 4 times each (median_seconds), counted at this CPU's rates."""
    with costing(here):
        kernels = {id(k): k for k in _layer_kernels(samples, costs, cfg)}.values()  # alike layers' once
    return (repeats + 2) * 3 * flops / here.step_rate + 4 * sum(sum(k.values()) for k in kernels)


def _copy(model: nn.Module, meta: bool) -> nn.Module:
    """A copy of `model` to profile, in training mode and without the hooks a method put on it
    (dAD's captures: not ours to run): on the meta device (shapes only: no numbers copied), or
    on this machine (random weights for a model on the meta device: a step's time does not
    depend on their values)."""
    tensors = list(chain(model.parameters(), model.buffers()))
    on_meta = any(t.is_meta for t in tensors)
    if meta or on_meta:
        memo: dict[int, Any] = {id(t): _meta_like(t) for t in tensors}
        model = copy.deepcopy(model, memo)
    else:
        model = copy.deepcopy(model)
    if on_meta and not meta:
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for t in chain(model.parameters(), model.buffers()):
                t.normal_(0.0, 0.02) if t.is_floating_point() else t.zero_()
    for module in model.modules():
        for hooks in (
            module._forward_hooks,
            module._forward_pre_hooks,
            module._backward_hooks,
            getattr(module, "_backward_pre_hooks", {}),
        ):
            hooks.clear()
    return model.train()


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(t, device="meta")
    return nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty


def _weight_layers(model: nn.Module, x: torch.Tensor) -> tuple[list[Layer], list[LayerSample], int, int]:
    """The model's weight layers (no kernels yet) and their samples, from one forward pass of
    `x`; the numbers in parameters outside them, and those in a parameter of two of them."""
    children = list(model.children()) if isinstance(model, nn.Sequential) else []
    rows: dict[str, int] = {}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # each weight layer's input and output
    hooks = [
        m.register_forward_hook(_rows_hook(rows, seen, name))
        for name, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() >= 2
    ]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    layers, samples, counted, tied = [], [], set(), 0
    for name, module in model.named_modules():
        if name not in rows:
            continue
        kind = kind_of(module)
        fan_out, fan_in = kind.shape(module) if kind else (module.weight.shape[0], module.weight[0].numel())
        params = [p for p in module.parameters(recurse=False)]
        tied += sum(p.numel() for p in params if id(p) in counted)
        counted.update(id(p) for p in params)
        index = next((i for i, child in enumerate(children) if any(m is module for m in child.modules())), -1)
        samples.append(LayerSample(name, module, *seen[name], fan_in, fan_out, len(x) * rows[name]))
        layers.append(Layer(name, index, fan_in, fan_out, rows[name], sum(p.numel() for p in params)))
    return layers, samples, sum(p.numel() for p in model.parameters() if id(p) not in counted), tied


def _costs(methods: tuple[str, ...] | None) -> dict[str, tuple[MethodCost, Callable[[Config], Any]]]:
    """The registered costs (of `methods`, or all), each with how to read its options from a config."""
    found = {}
    for name, spec in specs().items():
        if spec.cost is not None and (methods is None or name in methods):
            found[name] = (spec.cost, lambda cfg, section=spec.section: cfg.method_options.get(section))
    return found


def _layer_kernels(
    samples: list[LayerSample], costs: dict[str, tuple[MethodCost, Callable[[Config], Any]]], cfg: Config
) -> list[dict[str, float]]:
    """Seconds of every method's own kernels for each layer (median_seconds: timed, or counted
    while `costing`); layers alike (a transformer's blocks) share one figure."""
    found: dict[tuple[Any, ...], dict[str, float]] = {}
    for sample in samples:
        if _alike(sample) not in found:
            found[_alike(sample)] = _kernels(sample, costs, cfg)
    return [found[_alike(sample)] for sample in samples]


def _alike(sample: LayerSample) -> tuple[Any, ...]:
    """What a layer's kernels depend on: its kind, its settings and its shapes."""
    module = sample.module
    return (
        type(module),
        module.extra_repr(),
        tuple(module.weight.shape),
        tuple(sample.inputs.shape),
        tuple(sample.output.shape),
    )


def _kernels(
    sample: LayerSample, costs: dict[str, tuple[MethodCost, Callable[[Config], Any]]], cfg: Config
) -> dict[str, float]:
    """Seconds of every method's own kernels for one layer (each name once)."""
    seconds: dict[str, float] = {}
    for cost, options in costs.values():
        if cost.layer_kernels is None:
            continue
        for name, kernel in cost.layer_kernels(sample, options(cfg), cfg).items():
            if name not in seconds:
                seconds[name] = kernel if isinstance(kernel, float) else median_seconds(kernel)
    return seconds


def _rows_hook(
    rows: dict[str, int], seen: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str
) -> Callable[..., None]:
    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        rows[name] = (
            output[0, 0].numel()
            if isinstance(module, nn.modules.conv._ConvNd)
            else output[0].numel() // output.shape[-1]
        )
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
    """Seconds `fn` takes: the median of `repeats` timed runs after a warm-up; while `costing`
    for a device, its ops counted at that device's rates instead."""
    if _costing_for is not None:
        return _costing_for.seconds(count_ops(fn))
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


# ---------------------------------------------------------------------------------------------
# devices: compute counted at an accelerator's (or this machine's measured) rates


@dataclass(frozen=True)
class Accelerator:
    """A GPU's published rates (ACCELERATORS)."""

    bf16_tflops: float  # dense peak in bf16 (fp16 on the V100, which has no bf16)
    fp32_tflops: float  # dense peak in fp32 (without TF32, which PyTorch leaves off for products)
    memory_tbps: float  # memory bandwidth, TB/s
    nvlink_gbit: float  # between the GPUs of one node, each direction


# NVIDIA's data sheets for the SXM parts (A100 80GB, H100, H200, V100), without sparsity.
ACCELERATORS = {
    "a100": Accelerator(312, 19.5, 2.0, 2400),
    "h100": Accelerator(989, 67, 3.35, 3600),
    "h200": Accelerator(989, 67, 4.8, 3600),
    "v100": Accelerator(125, 15.7, 0.9, 1200),
}
# Model FLOPs utilisation: the share of the peak a training step reaches (memory-bound and small
# ops, waits: never all of it), for the step and the methods' kernels alike.
UTILISATION = 0.4
# The least an op costs: launching a GPU kernel (or dispatching a CPU op) takes microseconds
# however little it computes.
OP_SECONDS = 5e-6
# Without a device a profile is timed on this machine (small ops' overheads and all), unless that
# would take longer than this many seconds: then its ops are counted at this CPU's measured rates.
TIMING_LIMIT = 20.0


@dataclass(frozen=True)
class Device:
    """What the compute is costed on: the rates its work reaches."""

    name: str  # as a report says it
    step_rate: float  # flop/s of a training step's products, convolutions, attention
    kernel_rate: float  # flop/s of the methods' own kernels (fp32)
    memory_bandwidth: float = math.inf  # bytes/s

    def seconds(self, ops: list[tuple[float, float]]) -> float:
        """Each op (FLOPs, bytes) at the roofline: its FLOPs at kernel_rate or its bytes at the
        memory bandwidth, whichever takes longer, and never less than OP_SECONDS."""
        return sum(max(flops / self.kernel_rate, nbytes / self.memory_bandwidth, OP_SECONDS) for flops, nbytes in ops)


def compute_device(accelerator: str = "", tflops: float = 0.0, amp: str = "none") -> Device | None:
    """The device to cost a profile's compute on: an `accelerator` of ACCELERATORS, or 'cpu'
    (this machine's measured rates), at its peak for the run's precision (`amp` bf16: bf16,
    else fp32; the kernels in fp32) × UTILISATION; `tflops` (achieved TFLOP/s) replaces the
    step's rate, and without an accelerator is the kernels' rate too. None when neither is
    given: the compute is timed on this machine."""
    if not accelerator:
        return Device(f"{tflops:g} TFLOP/s", tflops * 1e12, tflops * 1e12) if tflops else None
    if accelerator == "cpu":
        device = measured_device("cpu", amp)
    elif accelerator in ACCELERATORS:
        a = ACCELERATORS[accelerator]
        peak = a.bf16_tflops if amp == "bf16" else a.fp32_tflops
        device = Device(
            f"{accelerator}: {UTILISATION:.0%} of its {peak:g} TFLOP/s {_precision(amp)} peak",
            UTILISATION * peak * 1e12,
            UTILISATION * a.fp32_tflops * 1e12,
            a.memory_tbps * 1e12,
        )
    else:
        raise ConfigError(
            f"accelerator {accelerator!r}: use one of {', '.join([*ACCELERATORS, 'cpu'])}, or give "
            f"the rate yours reaches (--tflops)"
        )
    return replace(device, name=f"{accelerator} at {tflops:g} TFLOP/s", step_rate=tflops * 1e12) if tflops else device


def _precision(amp: str) -> str:
    return "bf16" if amp == "bf16" else "fp32"


@functools.cache
def measured_device(where: str, amp: str) -> Device:
    """This machine's CPU, or the GPU `where` names, with its own rates timed: a square
    product's (in the run's precision for the step, fp32 for the kernels) and a large copy's."""
    place = torch.device(where)
    cpu = place.type == "cpu"  # (sizes: long enough to time, yet quick on a CPU's few cores)
    sync = (lambda: None) if cpu else torch.cuda.synchronize

    def seconds(fn: Callable[[], Any]) -> float:
        return median_seconds(lambda: (fn(), sync()))

    def product_rate(dtype: torch.dtype) -> float:
        n = 1024 if cpu else 8192
        a = torch.randn(n, n, device=place).to(dtype)
        return 2 * n**3 / seconds(lambda: a @ a)

    block = torch.empty(1 << (24 if cpu else 28), device=place)
    bandwidth = 2 * block.nbytes / seconds(block.clone)  # read and written once
    fp32 = product_rate(torch.float32)
    step = product_rate(torch.bfloat16) if amp == "bf16" else fp32
    return Device(
        f"{where}: {UTILISATION:.0%} of its measured {step / 1e12:.3g} TFLOP/s {_precision(amp)}",
        UTILISATION * step,
        UTILISATION * fp32,
        bandwidth,
    )


# ---------------------------------------------------------------------------------------------
# counting: every op on the meta device, its FLOPs and bytes recorded

_costing_for: Device | None = None  # while `costing`: the device median_seconds counts for


@contextlib.contextmanager
def costing(device: Device) -> Iterator[None]:
    """Inside, every op runs on the meta device (shapes, no data, no time) and median_seconds
    gives what its function's ops take on `device` (Device.seconds) instead of timing them."""
    global _costing_for
    outer, _costing_for = _costing_for, device
    try:
        with _MetaOps(), torch.no_grad():
            yield
    finally:
        _costing_for = outer


def count_ops(fn: Callable[[], Any]) -> list[tuple[float, float]]:
    """(FLOPs, bytes read and written) of every kernel `fn` launches, run on the meta device."""
    with _MetaOps() as counted, torch.no_grad():
        fn()
    return counted.ops


class _MetaOps(TorchDispatchMode):
    """Runs every op on the meta device: shapes, no data, no time (tensors and factories of
    other devices move there; random generators are dropped). Records (FLOPs, bytes) of each op
    that launches a kernel (not a view, not an allocation). A value read back (`.item()`,
    `if tensor:`) is 0: an iteration that stops once converged runs its full count."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[float, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _READ_BACK:
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
        args, kwargs = tree_map(_on_meta, (args, dict(kwargs or {})))
        if "device" in kwargs:
            kwargs["device"] = torch.device("meta")
        if "generator" in kwargs:
            kwargs["generator"] = None
        out = func(*args, **kwargs)
        if not func.is_view and not func.__name__.startswith(("empty", "new_empty")):
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.ops.append((_flops(func, args, kwargs, out), float(sum(t.nbytes for t in tensors))))
        return out


_READ_BACK = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """An op's floating-point operations: torch's formulas (products, convolutions, attention)
    and the factorisations'; elementwise work has none here (its bytes cost it)."""
    packet = func._overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet in _FACTORISATIONS:
        return _FACTORISATIONS[packet](*args, **kwargs)
    return 0.0


def _qr_flops(a: torch.Tensor, mode: str = "reduced") -> float:
    """Householder QR of each m × n matrix (l the longer side, k the shorter): 2lk² - 2k³/3, and
    as much again to form Q."""
    long, short = max(a.shape[-2:]), min(a.shape[-2:])
    return math.prod(a.shape[:-2]) * (2 * long * short**2 - 2 * short**3 / 3) * (1 if mode == "r" else 2)


def _svd_flops(a: torch.Tensor, full_matrices: bool = False, compute_uv: bool = True, **_: Any) -> float:
    """R-SVD of each m × n matrix (l, k as for QR): 2lk² + 2k³ for the singular values, 6lk² + 20k³
    with the thin factors, 4l²k + 22k³ with the full U (Golub and Van Loan, Matrix Computations)."""
    long, short = max(a.shape[-2:]), min(a.shape[-2:])
    each = (
        2 * long * short**2 + 2 * short**3
        if not compute_uv
        else 4 * long**2 * short + 22 * short**3
        if full_matrices
        else 6 * long * short**2 + 20 * short**3
    )
    return math.prod(a.shape[:-2]) * each


_FACTORISATIONS = {torch.ops.aten.linalg_qr: _qr_flops, torch.ops.aten._linalg_svd: _svd_flops}


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


def predict(
    profile: Profile,
    method: str,
    ranks: int,
    link: Link,
    cfg: Config | None = None,
    assumptions: RunAssumptions = RunAssumptions(),
) -> Prediction:
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


def measured_quality(method: str, cfg: Config | None = None) -> heldout.Measured | None:
    """The held-out suite's verdict on `method`, when cfg runs it with the options that were
    measured (its defaults); None when it was not measured so."""
    spec = specs()[method]
    measured = heldout.measured().get(method)
    if measured is None or spec.options is None:
        return measured
    ran = (cfg or default_config()).method_options.get(spec.section)
    return measured if ran is None or ran == _with_presets(spec, None).method_options.get(spec.section) else None


def left_out(method: str, cfg: Config | None = None) -> str | None:
    """Why `--method auto` does not choose `method` (None: it may). An exact exchange always
    may; a compression only with an error target; both it and fp16's rounding only where their
    defaults held on every judged set of the held-out suite, at the options they were measured with."""
    risk = quality_risk(method, cfg)
    if risk is None:
        return "a fixed rank, or no error feedback: no bound on what it loses"
    if not specs()[method].cost.judged:
        return None
    measured = measured_quality(method, cfg)
    if measured is None:
        return "not measured on the held-out suite at these options"
    return None if measured.held else measured.risk()


def quality_keeping_methods(cfg: Config | None = None) -> tuple[str, ...]:
    """The drop-in methods `--method auto` chooses among: exact ones, and roundings and
    compressions to an error target whose defaults held on the held-out suite."""
    return tuple(m for m in drop_in_methods() if left_out(m, cfg) is None)


def break_even(
    profile: Profile,
    method: str,
    ranks: int,
    network: Link,
    cfg: Config | None = None,
    assumptions: RunAssumptions = RunAssumptions(),
) -> float:
    """The network bandwidth (bytes/s) below which `method` steps faster than ddp, the rest of
    `network` (latency, nodes, their own links) as given: inf when it is faster at every bandwidth
    from 100 Mbit/s to 10 Tbit/s, 0 when it is faster at none."""

    def gain(bandwidth: float) -> float:
        link = replace(network, bandwidth=bandwidth)
        return (
            predict(profile, "ddp", ranks, link, cfg, assumptions).step
            - predict(profile, method, ranks, link, cfg, assumptions).step
        )

    low, high = 100e6 / 8, 10e12 / 8
    if gain(low) <= 0:
        return 0.0
    if gain(high) > 0:
        return math.inf
    for _ in range(16):  # bisection in log space: to 1 part in 10^4 (high / low = 10^5 ^ (1 / 2^16))
        middle = math.sqrt(low * high)
        low, high = (middle, high) if gain(middle) > 0 else (low, middle)
    return math.sqrt(low * high)


# A method must beat ddp by this share to be chosen over it: within it, ddp (which changes
# nothing about the gradient) wins the tie.
MIN_GAIN = 0.05


def choose(
    profile: Profile, ranks: int, link: Link, cfg: Config | None = None, candidates: tuple[str, ...] | None = None
) -> tuple[str, list[Prediction], str]:
    """The candidate (default: every drop-in method that keeps quality) with the shortest
    predicted step (ddp unless another is MIN_GAIN faster), every prediction, and why (with what
    quality risk remains)."""
    if candidates is None:
        candidates = quality_keeping_methods(cfg)
    predictions = sorted((predict(profile, m, ranks, link, cfg) for m in candidates), key=lambda q: q.step)
    best, ddp = predictions[0], next((q for q in predictions if q.method == "ddp"), None)
    if ddp is not None and best.step > (1 - MIN_GAIN) * ddp.step:
        best = ddp
    why = (
        f"{best.method}: predicted {best.step * 1e3:.1f} ms per step on {ranks} ranks over {link.describe()} "
        f"(compute {best.compute * 1e3:.1f} ms, its own work {best.method_compute * 1e3:.1f} ms, "
        f"network {(best.communication - best.hidden) * 1e3:.1f} ms not hidden)"
    )
    if ddp is not None and best.method != "ddp":
        why += f"; ddp would take {ddp.step * 1e3:.1f} ms ({ddp.step / best.step:.2f}x)"
    else:
        runner = next((q for q in predictions if q.method != best.method), None)
        if runner is not None:
            why += (
                f"; the next best, {runner.method}, {runner.step * 1e3:.1f} ms (a method is chosen over "
                f"ddp only when {MIN_GAIN:.0%} faster)"
            )
    risk, measured = quality_risk(best.method, cfg), measured_quality(best.method, cfg)
    why += f". Quality: {risk or 'the same gradient as ddp'}" + (f"; {measured.risk()}" if measured and risk else "")
    return best.method, predictions, why


def format_predictions(predictions: list[Prediction]) -> str:
    lines = [
        f"{'method':<10} {'step ms':>9} {'compute':>9} {'own work':>9} {'network':>9} {'hidden':>8} {'sent/rank':>10}"
    ]
    for q in predictions:
        lines.append(
            f"{q.method:<10} {q.step * 1e3:>9.1f} {q.compute * 1e3:>9.1f} {q.method_compute * 1e3:>9.1f} "
            f"{q.communication * 1e3:>9.1f} {q.hidden * 1e3:>8.1f} {human_bytes(q.bytes_per_rank):>10}"
        )
    return "\n".join(lines)
