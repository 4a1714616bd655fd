"""An α-β cost model of one training step: each method's predicted step time for p ranks on a
given network, from the model's layer shapes and its compute measured on this machine.

    step = compute + the method's own computation + communication - what hides behind backward

Communication (Hockney's α-β model with the algorithms MPI libraries and NCCL use for large
messages: Rabenseifner's reduce-scatter + allgather, recursive-doubling allgather; the bytes
are the ring's, which the traffic meter counts too), for a group of g ranks:

    allreduce of M bytes              2⌈log2 g⌉·α + 2(g-1)/g · M / β
    allgather of m bytes per rank     ⌈log2 g⌉·α + (g-1) · m / β
    point to point, M bytes           α + M / β

β is the bandwidth of the slowest link the ring crosses: the network's once the group spans
several nodes (a ring leaves each node once, so the node's ranks do not share its link), the
node's own (`intra_bandwidth`) inside one. α is the latency of one message. On a *shared*
medium (benchmarks.compare --link: one token bucket that every rank's bytes cross) the bytes of
all ranks add up instead.

Compute: forward + backward + optimiser step of one batch (`profile_model` times it, or a
measured step of `--method local` replaces it). A method's own computation is timed too, per
layer, with the methods' own kernels on random data of the layer's shapes: PowerSGD's
compression cycle (error feedback, P = MQ, orthogonalisation, Q = MᵀP, the new error), rank-dAD's
factors of one rank's gradient (the way it takes for the layer's shapes: exact from few rows,
power iteration on the gradient or on the rows), and the product of shared rows that dAD and rank-dAD
form for every layer, timed for one rank's rows and multiplied by p (the pooled rows of all p
ranks: this cost grows with p). DDP's allreduce overlaps the backward pass (Horovod starts it as
gradients appear); the others exchange after it.

AB-training's traffic and SVDs depend on the ranks its rule keeps, which are learned during
training: the model assumes a share of each factorised layer's smaller side
(MethodSettings.ab_rank_share, 2 %) and predicts the mean step over a run of `run_steps` steps
(its schedule is a fraction of the run; its two full SVDs per layer are spread over it).
"""
from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn as nn

from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.ab import ABOptions, Schedule

FLOAT = 4  # bytes per fp32 number
# The methods the model predicts; `auto` chooses among the drop-in ones (same model, same
# training, only the gradient exchange differs). SIL and mp change how the model trains.
DROP_IN = ("ddp", "ddp-fp16", "powersgd", "dad", "rank-dad")
PREDICTED = (*DROP_IN, "ab", "sil", "mp")


def rate_bits(rate: str) -> float:
    """'1gbit' -> 1e9, '100mbit' -> 1e8 bits per second (tc's units, decimal)."""
    units = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    text = rate.strip().lower()
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * factor
            except ValueError:
                break
    raise ConfigError(f"link rate {rate!r}: use a rate such as 1gbit, 100mbit, 25gbit")


@dataclass(frozen=True)
class Link:
    """The network between ranks."""

    bandwidth: float                 # bytes per second, one direction, between nodes
    latency: float = 2e-6            # seconds per message (α)
    ranks_per_node: int = 1
    intra_bandwidth: float = 20e9    # bytes per second between ranks of one node
    shared: bool = False             # one medium for every rank's bytes (an emulated link)

    @classmethod
    def parse(cls, rate: str, latency_us: float = 2.0, **kwargs: Any) -> "Link":
        return cls(rate_bits(rate) / 8, latency_us * 1e-6, **kwargs)

    def describe(self) -> str:
        text = f"{self.bandwidth * 8 / 1e9:.3g} Gbit/s, {self.latency * 1e6:.3g} µs"
        if self.ranks_per_node > 1:
            text += f", {self.ranks_per_node} ranks per node"
        return text + (", shared medium" if self.shared else "")

    def beta(self, group: int) -> float:
        return self.intra_bandwidth if group <= self.ranks_per_node else self.bandwidth

    def _time(self, messages: float, bytes_per_rank: float, group: int, ranks: int) -> float:
        if group <= 1:
            return 0.0
        if self.shared:  # every rank's bytes cross the one medium
            return messages * self.latency + ranks * bytes_per_rank / self.bandwidth
        return messages * self.latency + bytes_per_rank / self.beta(group)

    def allreduce(self, nbytes: float, group: int, ranks: int) -> float:
        return self._time(2 * _log2(group), 2 * (group - 1) / group * nbytes, group, ranks)

    def allgather(self, nbytes_per_rank: float, group: int, ranks: int) -> float:
        return self._time(_log2(group), (group - 1) * nbytes_per_rank, group, ranks)

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
    shares_rows: bool     # dAD can share its activations and deltas (Linear, plain Conv2d)
    # Seconds of the methods' own kernels for this layer on this machine (`_time_kernels`):
    # powersgd, rank_factors (one rank's gradient), dad_product and rank_product (per rank's
    # rows), rows (forming this rank's activation and delta rows, im2col for a conv) and
    # rank_rows (the same where rank-dAD needs them: not where it factors the gradient).
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
    fp16_seconds: float = 0.0          # casting every gradient to fp16 and back (ddp's fp16 compression)
    # (method, K) -> where its default cut into K partitions falls (sil: outside convolutions,
    # two weight layers each; mp: any block boundary); absent when the method cannot cut it.
    partitions: dict[tuple[str, int], "Cut"] = field(default_factory=dict)

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


def profile_model(model: nn.Module, input_shape: tuple[int, ...], batch: int, repeats: int = 5,
                  partitions: tuple[int, ...] = (2,), settings: "MethodSettings | None" = None) -> Profile:
    """Layer shapes from one forward pass, the median of `repeats` timed steps (forward,
    backward, Adam step) of a copy of `model` on random data of `batch` samples, and the
    methods' own kernels per layer with `settings` (the methods' defaults if None)."""
    from hvd_lowcomm.lowrank import cheapest_way
    from hvd_lowcomm.methods.dad import activation_rows, delta_rows, fan_in_out, supports

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
    x = torch.randn(batch, *input_shape)
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    layers, counted = [], set()
    for name, module in model.named_modules():
        if name not in rows:
            continue
        fan_in, fan_out = fan_in_out(module)
        params = [p for p in module.parameters(recurse=False)]
        counted.update(id(p) for p in params)
        index = next((i for i, child in enumerate(children) if any(m is module for m in child.modules())), -1)
        kernels = _time_kernels(fan_in, fan_out, batch * rows[name], settings or MethodSettings())
        if supports(module):  # dAD's rows of this layer: im2col of a conv's input, its output gradient as rows
            inputs, output = seen[name]
            kernels["rows"] = _median_seconds(lambda: (activation_rows(module, inputs), delta_rows(module, output)))
            s = settings or MethodSettings()
            way = cheapest_way(batch * rows[name], fan_in, fan_out, s.rank_dad_rank, s.rank_dad_iterations)
            kernels["rank_rows"] = 0.0 if way == "gradient" else kernels["rows"]
        layers.append(Layer(name, index, fan_in, fan_out, rows[name], sum(p.numel() for p in params), supports(module),
                            kernels))
    other = sum(p.numel() for p in model.parameters() if id(p) not in counted)
    step, forward, backward = _time_steps(model, x, repeats)
    gradients = torch.randn(sum(p.numel() for p in model.parameters()))
    profile = Profile(layers, other, batch, step, forward, backward, _median_seconds(lambda: gradients.half().float()))
    if children:
        _add_partitions(profile, model, input_shape, partitions)
    return profile


def _rows_hook(rows: dict[str, int], seen: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str
               ) -> Callable[..., None]:
    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        rows[name] = output[0, 0].numel() if isinstance(module, nn.modules.conv._ConvNd) else \
            output[0].numel() // output.shape[-1]
        seen[name] = (inputs[0], output)
    return hook


def _time_steps(model: nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float, float]:
    import torch.nn.functional as F

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    out = model(x)
    y = torch.zeros(len(x), dtype=torch.long) if out.dim() == 2 else None
    steps, forwards, backwards = [], [], []
    for _ in range(repeats + 2):  # two warm-up steps
        start = time.perf_counter()
        optimizer.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y) if y is not None else out.float().pow(2).mean()
        middle = time.perf_counter()
        loss.backward()
        after_backward = time.perf_counter()
        optimizer.step()
        steps.append(time.perf_counter() - start)
        forwards.append(middle - start)
        backwards.append(after_backward - middle)
    return tuple(sorted(times[2:])[repeats // 2] for times in (steps, forwards, backwards))  # medians


def _time_kernels(fan_in: int, fan_out: int, rows: int, settings: "MethodSettings") -> dict[str, float]:
    """Seconds of each method's own work for one layer of fan_in × fan_out with `rows` rows on
    this rank, timed with the methods' own functions on random data (median of 3)."""
    from hvd_lowcomm.factorized import leading_svd
    from hvd_lowcomm.lowrank import cheapest_way, factors_from_rows, gradient_power_iteration
    from hvd_lowcomm.methods.powersgd import orthogonalise

    generator = torch.Generator().manual_seed(0)
    acts, deltas = torch.randn(rows, fan_in, generator=generator), torch.randn(rows, fan_out, generator=generator)
    grad, error = torch.randn(fan_out, fan_in, generator=generator), torch.randn(fan_out, fan_in, generator=generator)
    r = min(fan_out, fan_in, settings.powersgd_rank)
    q = torch.randn(fan_in, r, generator=generator)
    k = min(settings.rank_dad_rank, rows, fan_in, fan_out)
    rank_dad = (settings.rank_dad_rank, settings.rank_dad_iterations, 1e-3)
    by_gradient = cheapest_way(rows, fan_in, fan_out, settings.rank_dad_rank, settings.rank_dad_iterations) == "gradient"

    def powersgd() -> None:  # as the method does it: M and the new error in the error buffer
        m = error.add_(grad)
        p = orthogonalise(m @ q)
        m.sub_(p @ (p.T @ m))

    tall = torch.randn(max(fan_in, fan_out), min(fan_in, fan_out), generator=generator)
    width = min(2 * ab_rank(fan_in, fan_out, settings) + 16, tall.shape[1])

    def ab_leading() -> None:  # a re-factorisation's leading triplets and residual
        u, s, vh = leading_svd(tall, width)
        _ = tall - (u * s) @ vh

    kernels = {"powersgd": powersgd, "ab_leading": ab_leading,
               "rank_factors": lambda: gradient_power_iteration(grad.T, *rank_dad, generator) if by_gradient
               else factors_from_rows(acts, deltas, *rank_dad, generator),
               "dad_product": lambda: deltas.T @ acts,
               "rank_product": lambda: deltas[:k].T @ acts[:k]}
    return {name: _median_seconds(fn) for name, fn in kernels.items()} | {"ab_svd": _svd_seconds(*tall.shape)}


def _svd_seconds(rows: int, cols: int, largest: int = 1024) -> float:
    """A full SVD of a rows × cols matrix (rows >= cols), O(rows cols²): timed at most
    `largest` columns wide and scaled, so that profiling a wide model stays quick."""
    scale = min(1.0, largest / cols)
    small = (max(1, round(rows * scale)), max(1, round(cols * scale)))
    matrix = torch.randn(*small, generator=torch.Generator().manual_seed(0))
    seconds = _median_seconds(lambda: torch.linalg.svd(matrix, full_matrices=False))
    return seconds * (rows * cols * cols) / (small[0] * small[1] * small[1])


def _median_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


@dataclass(frozen=True)
class Cut:
    """A model cut into partitions: each one's share of the flops, its parameters, and the
    numbers per sample crossing each cut."""

    flop_shares: list[float]
    params: list[int]
    widths: list[int]


def _add_partitions(profile: Profile, model: nn.Sequential, input_shape: tuple[int, ...],
                    partitions: tuple[int, ...]) -> None:
    """Where SIL's and mp's default cuts fall for each K (cuts a method refuses are left out)."""
    from hvd_lowcomm.partition import activation_shapes, cut_points

    modules = list(model)
    total = sum(layer.flops for layer in profile.layers) or 1.0
    for method, k in itertools.product(("sil", "mp"), partitions):
        try:
            bounds = cut_points(model, k, [], method == "sil", input_shape)
        except ConfigError:
            continue
        pieces = list(zip(bounds[:-1], bounds[1:]))
        profile.partitions[(method, k)] = Cut(
            [sum(layer.flops for layer in profile.layers if a <= layer.module_index < b) / total for a, b in pieces],
            [sum(p.numel() for m in modules[a:b] for p in m.parameters()) for a, b in pieces],
            [math.prod(shape) for shape in activation_shapes(model, bounds, input_shape)[1:]])


@dataclass
class Prediction:
    method: str
    ranks: int
    compute: float            # seconds: forward, backward, optimiser
    method_compute: float     # seconds: the method's own work (power iteration, row products, ...)
    communication: float      # seconds on the network
    hidden: float             # of which overlapped with the backward pass
    bytes_per_rank: float     # sent per step

    @property
    def step(self) -> float:
        return self.compute + self.method_compute + self.communication - self.hidden


@dataclass(frozen=True)
class MethodSettings:
    """The options the prediction depends on (the methods' defaults)."""

    powersgd_rank: int = 2
    powersgd_min_compression_rate: float = 2.0
    rank_dad_rank: int = 8
    rank_dad_iterations: int = 10
    partitions: int = 2
    # AB-training: its schedule (fractions of the run, as ab's options), its groups (0: one per
    # node on several nodes, else 2), the run's length (the schedule's fractions and the two
    # full SVDs of a run are spread over it), and the rank its cuts keep, as a share of each
    # factorised layer's smaller side: learned during training, so an assumption (this
    # project's MLPs kept 7-27 of 1024 and 13-14 of 2048: 1-3 %).
    ab_warmup: float = ABOptions.warmup
    ab_sync_every: float = ABOptions.sync_every
    ab_full_rank_steps: float = ABOptions.full_rank_steps
    ab_groups: int = ABOptions.groups
    ab_rank_share: float = 0.02
    run_steps: int = 10_000

    @classmethod
    def from_config(cls, cfg: Any) -> "MethodSettings":
        """The settings a run's config gives (partitions: its own method's, for sil and mp)."""
        o = cfg.method_options
        ab = o["ab"]
        return cls(o["powersgd"].rank, o["powersgd"].min_compression_rate, o["rank-dad"].rank,
                   o["rank-dad"].iterations, o[cfg.method].partitions if cfg.method in ("sil", "mp") else 2,
                   ab.warmup, ab.sync_every, ab.full_rank_steps, ab.groups)


def predict(profile: Profile, method: str, ranks: int, link: Link, settings: MethodSettings = MethodSettings()
            ) -> Prediction:
    """The step of `method` on `ranks` ranks, each with the profile's batch."""
    if method not in PREDICTED:
        raise ConfigError(f"the cost model predicts {', '.join(PREDICTED)}; not {method!r}")
    p, compute = ranks, profile.step_seconds
    if method in ("ddp", "ddp-fp16"):
        fp16 = method == "ddp-fp16"
        nbytes = profile.params * (2 if fp16 else FLOAT)
        comm = link.allreduce(nbytes, p, p)
        return Prediction(method, p, compute, profile.fp16_seconds if fp16 else 0.0, comm,
                          min(comm, profile.backward_seconds), _wire("allreduce", nbytes, p))
    if method == "powersgd":
        return _powersgd(profile, p, link, settings)
    if method == "dad":
        return _dad(profile, p, link, rank=None)
    if method == "rank-dad":
        return _dad(profile, p, link, settings.rank_dad_rank, settings.rank_dad_iterations)
    if method == "ab":
        return _ab(profile, p, link, settings)
    return _partitioned(profile, method, p, link, settings.partitions)


def _wire(op: str, nbytes: float, group: int) -> float:
    from hvd_lowcomm.traffic import wire_bytes

    return wire_bytes(op, nbytes * group if op == "allgather" else nbytes, group)


def _powersgd(profile: Profile, p: int, link: Link, s: MethodSettings) -> Prediction:
    compressed_p = compressed_q = plain = 0
    own = 0.0
    for layer in profile.layers:
        n, m = layer.fan_out, layer.fan_in
        r = min(n, m, s.powersgd_rank)
        if (n + m) * r * s.powersgd_min_compression_rate < n * m:
            compressed_p, compressed_q = compressed_p + n * r, compressed_q + m * r
            plain += layer.params - n * m
            own += layer.kernels["powersgd"]
        else:
            plain += layer.params
    plain += profile.other_params
    # Two rounds: P with the uncompressed gradients, then Q.
    comm = sum(link.allreduce(FLOAT * numbers, p, p) for numbers in (compressed_p + plain, compressed_q) if numbers)
    sent = sum(_wire("allreduce", FLOAT * numbers, p) for numbers in (compressed_p, compressed_q, plain))
    return Prediction("powersgd", p, profile.step_seconds, own, comm, 0.0, sent)


def _dad(profile: Profile, p: int, link: Link, rank: int | None, iterations: int = 0) -> Prediction:
    """dAD (rank None) or rank-dAD: per layer the same choice as the methods' plan 'auto'
    (share rows, or factors, where that sends fewer numbers than allreducing the gradient).
    Autograd skips the local weight gradient of layers whose gradient is formed from rows: the
    product of one rank's rows (the dad_product kernel), taken off the measured backward pass."""
    from hvd_lowcomm.lowrank import cheapest_way
    from hvd_lowcomm.methods.dad import sharing_is_cheaper

    gathered = reduced = 0
    own = skipped = 0.0
    for layer in profile.layers:
        local_rows = profile.batch * layer.rows
        width = local_rows if rank is None else min(rank, local_rows, layer.fan_in, layer.fan_out)
        planned = local_rows if rank is None else rank  # the plan's rows per rank
        extra = 0 if rank is None else layer.fan_out  # rank-dAD allreduces the bias
        if layer.shares_rows and sharing_is_cheaper(p * planned, layer.fan_in, layer.fan_out, layer.params, extra):
            gathered += width * (layer.fan_in + layer.fan_out)
            reduced += extra
            own += layer.kernels["rows" if rank is None else "rank_rows"]
            own += p * layer.kernels["dad_product" if rank is None else "rank_product"]
            if rank is not None:  # the factors of this rank's gradient
                own += layer.kernels["rank_factors"]
            if rank is None or cheapest_way(local_rows, layer.fan_in, layer.fan_out, rank, iterations) != "gradient":
                skipped += layer.kernels["dad_product"]
        else:
            reduced += layer.params
    reduced += profile.other_params + 1  # + the pooled batch size, for the N_s/N scale
    own -= skipped
    comm = link.allgather(FLOAT * gathered, p, p) + link.allreduce(FLOAT * reduced, p, p)
    sent = _wire("allgather", FLOAT * gathered, p) + _wire("allreduce", FLOAT * reduced, p)
    return Prediction("dad" if rank is None else "rank-dad", p, profile.step_seconds, own, comm, 0.0, sent)


def ab_rank(fan_in: int, fan_out: int, settings: MethodSettings) -> int:
    """The rank the cost model assumes AB's cuts keep for a fan_in × fan_out layer."""
    return max(1, round(settings.ab_rank_share * min(fan_in, fan_out)))


def _ab(profile: Profile, p: int, link: Link, s: MethodSettings) -> Prediction:
    """AB-training's mean step over a run of s.run_steps steps (ab's default layers: every weight
    layer but the first and last is factorised). Warm-up and full-rank steps are ddp steps;
    a group step allreduces the trained factor (the larger of A's and B's, which sets the
    pace at the next sync) and the dense parameters inside its group (on the node's own
    links when a group fits in a node); once per cycle a sync allreduces A, B and the rest over
    all ranks, and a re-factorisation computes each layer's leading triplets and checks the cut
    with two forward passes; twice per run (first factorisation, first cut) full SVDs."""
    factorised = profile.layers[1:-1]
    if not factorised:
        raise ConfigError("ab: the model needs a weight layer besides the first and the last to factorise")
    groups = s.ab_groups or (p // link.ranks_per_node if p > link.ranks_per_node else 2)
    if p % groups or groups < 2:
        raise ConfigError(f"ab: {p} ranks do not split into {groups} groups")
    schedule = Schedule(ABOptions(warmup=s.ab_warmup, sync_every=s.ab_sync_every,
                                  full_rank_steps=s.ab_full_rank_steps), s.run_steps)
    phases = [schedule.phase(t) for t in range(s.run_steps)]
    group_steps = phases.count("group")
    full_steps = s.run_steps - group_steps
    cycles = sum("sync" in schedule.transitions(t) for t in range(s.run_steps))
    dense = profile.params - sum(layer.fan_in * layer.fan_out for layer in factorised)  # biases, dense layers...

    def factors(cut: bool) -> tuple[int, int]:  # numbers in A and in B: at the assumed rank, or all of it
        ranks = [ab_rank(layer.fan_in, layer.fan_out, s) if cut else min(layer.fan_in, layer.fan_out)
                 for layer in factorised]
        return (sum(max(layer.fan_in, layer.fan_out) * r for layer, r in zip(factorised, ranks)),
                sum(min(layer.fan_in, layer.fan_out) * r for layer, r in zip(factorised, ranks)))

    g = p // groups
    # The first group phase trains the full-rank factors of the first factorisation; the
    # others the cut ones. A group averages its trained factor (the larger one sets the pace).
    first = min(schedule.sync_every, group_steps)
    in_group = [FLOAT * (max(factors(cut)) + dense) for cut in (False, True)]
    at_sync = [FLOAT * (sum(factors(cut)) + dense) for cut in (False, True)]
    ddp = predict(profile, "ddp", p, link, s)
    runs = max(s.run_steps, 1)
    # Re-factorisations: the first cut takes full SVDs (as does the first factorisation), the
    # later ones the leading triplets; each checks its cut with two forward passes.
    own = (max(cycles - 1, 0) * sum(layer.kernels["ab_leading"] for layer in factorised)
           + 2 * sum(layer.kernels["ab_svd"] for layer in factorised) + cycles * 2 * profile.forward_seconds) / runs
    comm = (first * link.allreduce(in_group[0], g, p) + (group_steps - first) * link.allreduce(in_group[1], g, p)
            + full_steps * ddp.communication + min(cycles, 1) * link.allreduce(at_sync[0], p, p)
            + max(cycles - 1, 0) * link.allreduce(at_sync[1], p, p)) / runs
    sent = (first * _wire("allreduce", in_group[0], g) + (group_steps - first) * _wire("allreduce", in_group[1], g)
            + full_steps * ddp.bytes_per_rank + min(cycles, 1) * _wire("allreduce", at_sync[0], p)
            + max(cycles - 1, 0) * _wire("allreduce", at_sync[1], p)) / runs
    return Prediction("ab", p, profile.step_seconds, own, comm, full_steps * ddp.hidden / runs, sent)


def _partitioned(profile: Profile, method: str, p: int, link: Link, k: int) -> Prediction:
    """SIL: each rank computes its partition alone; mp: the partitions of a step run one after
    another (no pipelining) and activations and gradients cross every cut."""
    cut = profile.partitions.get((method, k))
    if cut is None:
        raise ConfigError(f"{method}: this model has no default cut into {k} partitions")
    if p % k:
        raise ConfigError(f"{method}: {p} ranks do not split into {k} partitions")
    g = p // k
    share, params = max(cut.flop_shares), max(cut.params)
    # The K groups average their partitions' gradients at the same time: on separate links the
    # largest takes longest; on one shared medium all of their bytes cross it.
    each = [link.allreduce(FLOAT * n, g, g) for n in cut.params]
    reduce = sum(each) if link.shared else max(each)
    sent = _wire("allreduce", FLOAT * params, g)
    if method == "sil":
        return Prediction(method, p, profile.step_seconds * share, 0.0, reduce, 0.0, sent)
    width = max(cut.widths)
    # Partners are g ranks apart: on different nodes once a group fills whole nodes. Forward
    # then backward, each time the g ranks of one group send at once.
    sends = 2 * link.send(FLOAT * profile.batch * width, g, across_nodes=g >= link.ranks_per_node)
    return Prediction(method, p, profile.step_seconds, 0.0, reduce + sends, 0.0,
                      sent + 2 * FLOAT * profile.batch * width)


def break_even(profile: Profile, method: str, ranks: int, latency: float, settings: MethodSettings = MethodSettings(),
               ranks_per_node: int = 1) -> float:
    """The bandwidth (bytes/s) below which `method` steps faster than ddp: inf when it is faster
    at every bandwidth from 100 Mbit/s to 10 Tbit/s, 0 when it is faster at none."""
    def gain(bandwidth: float) -> float:
        link = Link(bandwidth, latency, ranks_per_node)
        return predict(profile, "ddp", ranks, link, settings).step - predict(profile, method, ranks, link, settings).step

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


def choose(profile: Profile, ranks: int, link: Link, settings: MethodSettings = MethodSettings(),
           candidates: tuple[str, ...] = DROP_IN) -> tuple[str, list[Prediction], str]:
    """The candidate with the shortest predicted step (ddp unless another is MIN_GAIN faster),
    every prediction, and why."""
    predictions = sorted((predict(profile, m, ranks, link, settings) for m in candidates), key=lambda q: q.step)
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
    return best.method, predictions, why


def format_predictions(predictions: list[Prediction]) -> str:
    from hvd_lowcomm.metrics import human_bytes

    lines = [f"{'method':<10} {'step ms':>9} {'compute':>9} {'own work':>9} {'network':>9} {'hidden':>8} {'sent/rank':>10}"]
    for q in predictions:
        lines.append(f"{q.method:<10} {q.step * 1e3:>9.1f} {q.compute * 1e3:>9.1f} {q.method_compute * 1e3:>9.1f} "
                     f"{q.communication * 1e3:>9.1f} {q.hidden * 1e3:>8.1f} {human_bytes(q.bytes_per_rank):>10}")
    return "\n".join(lines)
