"""A model's profile for the cost model: its weight layers' shapes, its timed or counted compute,
and the kernels each method's cost asks for; what a method registers (`MethodCost`)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hvd_lowcomm import task
from hvd_lowcomm.config import Config, default_config
from hvd_lowcomm.registry import specs
from hvd_lowcomm.models.layer_kinds import kind_of
from hvd_lowcomm.costmodel.method_cost import MethodCost
from hvd_lowcomm.costmodel.device import TIMING_LIMIT, Device, _MetaOps, costing, measured_device, median_seconds


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
