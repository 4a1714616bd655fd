"""A sequential model cut into K partitions held by K groups of ranks (SIL and model parallelism).

The world is split into K equal groups of contiguous ranks; group k holds only partition k.
Rank i of group k has a *partner* at the same position in groups k-1 and k+1 (global rank
± group size): partners read the same samples (data is sharded by position in the group, with
one seed), so activations and gradients pass between partners point to point, through the
traffic meter.
"""

from __future__ import annotations

import itertools
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn

from hvd_lowcomm import task
from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, meter
from hvd_lowcomm.config import ConfigError, option
from hvd_lowcomm.costmodel import Link, Memory, MethodCost, Prediction, Profile, sent_bytes
from hvd_lowcomm.data import ShardedBatches
from hvd_lowcomm.methods.base import exchange_gradients
from hvd_lowcomm.task import example_input

FORWARD, BACKWARD, EVALUATE = 11, 12, 13  # message tags


@dataclass
class PartitionOptions:
    """How a sequential model is cut across groups of ranks."""

    partitions: int = option(2, "partitions, each held by its own group of ranks")
    cuts: list[int] = option(
        [],
        "module indices where partitions 2..K start (empty: every partition gets two "
        "weight layers with a non-linearity between them, then balanced by parameters)",
    )

    def validate(self) -> None:
        if self.partitions < 2:
            raise ConfigError(f"partitions must be at least 2, got {self.partitions}")


def _sequential(model: nn.Module) -> nn.Sequential:
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"partitioning needs an nn.Sequential model (the zoo's mlp, sil6 and cnn are); got {type(model).__name__}"
        )
    return model


# Element-wise non-linearities. Pooling and normalisation do not count: what a partition needs
# is an activation between two weight layers.
NONLINEARITIES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.RReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.LogSigmoid,
    nn.Softplus,
    nn.Softsign,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Tanhshrink,
)


def _kinds(module: nn.Module) -> str:
    """The module's leaves in order as a string: W a weight layer (a weight of 2 or more
    dimensions: Linear, ConvNd, Embedding), N a non-linearity; other leaves are left out."""
    kinds = ""
    for leaf in module.modules():
        if list(leaf.children()):
            continue
        weight = getattr(leaf, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
            kinds += "W"
        elif isinstance(leaf, NONLINEARITIES):
            kinds += "N"
    return kinds


def can_learn(modules: Iterable[nn.Module]) -> bool:
    """Whether a partition holds two weight layers with a non-linearity between them. Anything
    less is an affine map (perhaps followed by an activation), which cannot send the inputs of
    every class onto an arbitrary random code: SIL's partitions collapse without this depth."""
    return _deep("".join(_kinds(m) for m in modules))


def _deep(kinds: str) -> bool:
    return re.search("W.*N.*W", kinds) is not None


def cut_points(
    model: nn.Module,
    partitions: int,
    cuts: list[int],
    need_depth: bool = False,
    input_shape: tuple[int, ...] | None = None,
) -> list[int]:
    """Boundaries [0, c_1, ..., c_{K-1}, len(model)]: partition k is model[b_k:b_{k+1}].

    Explicit `cuts` are taken as given (see `shallow_partitions` for the warning they may earn).
    Otherwise every partition gets two weight layers with a non-linearity between them
    (`can_learn`), and among the cuts that allow this the one whose largest partition holds the
    smallest share of the parameters is chosen, cutting at block boundaries (right before a
    weight layer, i.e. after the previous block's activation and pooling) where possible.
    With `need_depth` (SIL) a model too shallow for that is refused; otherwise (mp) the cut
    falls back to one weight layer per partition. With `need_depth` and the `input_shape`, the
    cut also stays out of a conv net's convolutional part: only where the activation is a
    vector per sample (see `_refuse_inside_convolutions` for why)."""
    modules = list(_sequential(model))
    if cuts:
        if len(cuts) != partitions - 1 or sorted(set(cuts)) != list(cuts) or cuts[0] < 1 or cuts[-1] >= len(modules):
            raise ConfigError(
                f"cuts {cuts} must be {partitions - 1} increasing module indices in 1..{len(modules) - 1}"
            )
        return _refuse_shared_parameters(modules, [0, *cuts, len(modules)])
    return _refuse_shared_parameters(modules, _default_cut_points(modules, partitions, need_depth, input_shape))


def _refuse_shared_parameters(modules: list[nn.Module], bounds: list[int]) -> list[int]:
    """`bounds`, unless a parameter belongs to two partitions (tied weights), which holding
    partitions on different ranks would silently untie."""
    owner: dict[int, int] = {}
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        for module in modules[a:b]:
            for p in module.parameters():
                if owner.setdefault(id(p), k) != k:
                    raise ConfigError(
                        f"partitions {owner[id(p)]} and {k} share a parameter (tied weights, e.g. "
                        f"--model.tie_weights true): each partition lives on its own ranks, so the two "
                        f"copies would drift apart; untie them (--model.tie_weights false)"
                    )
    return bounds


def _default_cut_points(
    modules: list[nn.Module], partitions: int, need_depth: bool, input_shape: tuple[int, ...] | None
) -> list[int]:
    kinds = [_kinds(m) for m in modules]
    cumulative = list(itertools.accumulate((sum(p.numel() for p in m.parameters()) for m in modules), initial=0))
    block_starts = [c for c in range(1, len(modules)) if kinds[c].startswith("W")]
    deep = lambda a, b: _deep("".join(kinds[a:b]))  # noqa: E731
    weighted = lambda a, b: "W" in "".join(kinds[a:b])  # noqa: E731
    flat, shapes = [True] * len(modules), []
    if need_depth and input_shape is not None:  # a vector per sample
        shapes = _shapes_after_each(modules, input_shape)
        flat = [len(shape) == 1 for shape in shapes]
    for rule in (deep,) if need_depth else (deep, weighted):
        for positions in (block_starts, list(range(1, len(modules)))):
            bounds = _balanced_cut([c for c in positions if flat[c - 1]], partitions, rule, cumulative)
            if bounds is not None:
                return bounds
    weight_layers = "".join(kinds).count("W")
    if need_depth and not all(flat) and _balanced_cut(list(range(1, len(modules))), partitions, deep, cumulative):
        if any(len(shape) == 2 for shape in shapes):
            return _refuse_between_token_blocks(partitions)
        return _refuse_inside_convolutions(partitions)
    if need_depth:
        return _refuse_shallow(partitions, weight_layers)
    raise ConfigError(
        f"{partitions} partitions but the model has only {weight_layers} layers with weights: "
        f"use at most {weight_layers} partitions"
    )


def _balanced_cut(
    positions: list[int], partitions: int, rule: Callable[[int, int], bool], cumulative: list[int]
) -> list[int] | None:
    """Boundaries with cuts at `positions` whose pieces all satisfy `rule`, minimising the largest
    piece's share of the parameters (then the sum of squared shares), or None. Dynamic
    programming over (pieces so far, where the last one ends): K·n² rule checks, where trying
    every combination of cuts would grow as n^(K-1)."""
    end, total = len(cumulative) - 1, max(cumulative[-1], 1)
    best: dict[int, tuple[tuple[float, float], list[int]]] = {0: ((0.0, 0.0), [0])}
    for piece in range(1, partitions + 1):
        reached = {}
        for b in [end] if piece == partitions else positions:
            options = []
            for a, ((largest, squares), bounds) in best.items():
                if a < b and rule(a, b):
                    share = (cumulative[b] - cumulative[a]) / total
                    options.append(((max(largest, share), squares + share * share), [*bounds, b]))
            if options:
                reached[b] = min(options)
        best = reached
    return best[end][1] if end in best else None


def _refuse_shallow(partitions: int, weight_layers: int) -> list[int]:
    most = weight_layers // 2
    raise ConfigError(
        f"SIL with {partitions} partitions needs two weight layers with a non-linearity between them in every "
        f"partition (one Linear/Conv and its activation is an affine map, which cannot send each class's inputs "
        f"onto its random code, and training collapses), so at least {2 * partitions} weight layers; this model "
        f"has {weight_layers}. Use a deeper model (--model.name sil6, or --model.name mlp with at least "
        f"{2 * partitions - 1} hidden widths, e.g. --model.hidden {','.join(['256'] * (2 * partitions - 1))})"
        + (f" or at most {most} partitions" if most >= 2 else "")
        + ", or give --sil.cuts yourself to accept the accuracy risk"
    )


def _refuse_inside_convolutions(partitions: int) -> list[int]:
    raise ConfigError(
        f"SIL finds no cut into {partitions} partitions outside this model's convolutional part that leaves two weight "
        f"layers with a non-linearity between them on each side. A cut between conv blocks does not keep SIL's "
        f"accuracy: the later partitions learn only to decode the class codes, so the joined network classifies "
        f"no better than the convolutions before the cut do on their own ({CONV_CUT_EVIDENCE}). Use mp for this model, "
        f"a model with two or more fully connected layers after its convolutions (SIL then cuts among them), or "
        f"give --sil.cuts yourself to accept the accuracy loss"
    )


def _refuse_between_token_blocks(partitions: int) -> list[int]:
    raise ConfigError(
        f"SIL finds no cut into {partitions} partitions where a sample is one vector: between this model's blocks "
        f"each image is a sequence of tokens (a vision transformer), and SIL's class codes are one vector per "
        f"label. Matching a code at every token asks each token to know the image's class, and matching the "
        f"tokens' mean is what lost most accuracy at the cuts inside a conv net ({CONV_CUT_EVIDENCE}). Use mp (it cuts "
        f"between blocks and trains end to end), or give --sil.cuts yourself to accept the accuracy risk"
    )


# Where the refusals of cuts inside a conv net point for the measurement behind them.
CONV_CUT_EVIDENCE = 'measured in the docs: methods/sil, "Where it cuts"'


def shallow_partitions(table: list[dict[str, Any]]) -> list[int]:
    """Indices of the partitions (of a `partition_table`) that lack the depth `can_learn` asks for."""
    return [p["partition"] for p in table if not p["can_learn"]]


def partition_table(model: nn.Module, boundaries: list[int]) -> list[dict[str, Any]]:
    """What each partition holds: module span, layers and share of the parameters (for the
    start-up message and summary.json). Called before other partitions' tensors are released."""
    modules = list(model)
    total = max(sum(p.numel() for p in model.parameters()), 1)
    table = []
    for k, (a, b) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        parameters = sum(p.numel() for m in modules[a:b] for p in m.parameters())
        table.append(
            {
                "partition": k,
                "modules": [a, b - 1],
                "layers": ", ".join(_short(m) for m in modules[a:b]),
                "parameters": parameters,
                "parameter_share": parameters / total,
                "can_learn": can_learn(modules[a:b]),
            }
        )
    return table


def _short(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return f"Linear {module.in_features}->{module.out_features}"
    if isinstance(module, nn.modules.conv._ConvNd):
        return f"{type(module).__name__} {module.in_channels}->{module.out_channels}"
    return type(module).__name__


def token_vocabulary(first: nn.Module) -> int | None:
    """The vocabulary of a zoo language model (nn.Sequential whose first module embeds tokens
    and says how many), None for a model that reads features."""
    return getattr(first, "vocab_size", None)


def parameter_dtype(module: nn.Module) -> torch.dtype:
    """The dtype activations take in `module`: its first floating parameter's (bfloat16 weights:
    bfloat16), float32 without one."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def _shapes_after_each(modules: list[nn.Module], input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Per-sample shape of the output of each module, from one dry run on two random samples in
    eval mode (BatchNorm1d refuses one sample in training mode); modes are restored."""
    modes = {m: m.training for root in modules for m in root.modules()}
    device = runtime.device_of(p for root in modules for p in root.parameters())
    shapes, x = [], example_input(2, input_shape, token_vocabulary(modules[0])).to(device)
    if x.is_floating_point():
        x = x.to(parameter_dtype(modules[0]))
    try:
        with torch.no_grad():
            for module in modules:
                x = module.eval()(x)
                shapes.append(tuple(x.shape[1:]))
    finally:
        for module, training in modes.items():
            module.training = training
    return shapes


def activation_shapes(model: nn.Module, boundaries: list[int], input_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Per-sample shape of the activation entering each partition (the input's for the first)."""
    after = _shapes_after_each(list(model), input_shape)
    return [tuple(input_shape), *(after[b - 1] for b in boundaries[1:-1])]


class Layout:
    """This rank's place: its partition index, group, partners and the partition module."""

    def __init__(
        self, model: nn.Module, options: PartitionOptions, input_shape: tuple[int, ...], need_depth: bool = False
    ) -> None:
        self.boundaries = cut_points(model, options.partitions, options.cuts, need_depth, input_shape)
        # Seconds in this partition's forward and backward passes (not waiting for a partner,
        # which the meter counts as exchange): the step split every method's summary shows.
        self.pass_seconds = {"forward": 0.0, "backward": 0.0}
        self.shapes = activation_shapes(model, self.boundaries, input_shape)
        self.table = partition_table(model, self.boundaries)
        self.count = options.partitions
        self.group, _ = runtime.split_world(num_groups=options.partitions, label="partition")
        self.index = self.group.index
        start, end = self.boundaries[self.index], self.boundaries[self.index + 1]
        self.whole_model_parameters = sum(p.numel() for p in model.parameters())
        self.module = nn.Sequential(*list(model)[start:end])
        # Other partitions' tensors are released on this rank (the caller may still hold the
        # whole model object): each rank keeps only its own partition in memory.
        for index, other in enumerate(model):
            if not start <= index < end:
                for tensor in [*other.parameters(), *other.buffers()]:
                    tensor.data = tensor.data.new_empty(0)
        self.previous = runtime.rank() - self.group.size if self.index > 0 else None
        self.next = runtime.rank() + self.group.size if self.index < self.count - 1 else None
        with meter.in_phase("setup"):  # replicas of a partition start equal, whatever seeded the model
            meter.broadcast_tensors(self.module.state_dict(), self.group.ranks[0], self.group)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def batches(self, split: Any, batch_size: int, shuffle: bool, seed: int, device: torch.device) -> ShardedBatches:
        """Sharded over this group by position, so partners see the same samples."""
        return ShardedBatches(
            split,
            batch_size,
            self.group.rank_of(runtime.rank()),
            self.group.size,
            seed=seed,
            shuffle=shuffle,
            device=device,
        )

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the block's wall time to pass_seconds[phase] ('forward' or 'backward')."""
        device = runtime.device_of(self.module.parameters())
        start = runtime.clock(device)
        try:
            yield
        finally:
            self.pass_seconds[phase] += runtime.clock(device) - start

    def receive(self, source: int, rows: int, shape: tuple[int, ...], tag: int, name: str) -> torch.Tensor:
        """Activations (or their gradients) from another partition, on this partition's device."""
        device = runtime.device_of(self.module.parameters())
        return meter.recv(
            torch.empty(rows, *shape, device=device, dtype=parameter_dtype(self.module)), source, name, tag
        )

    def average_gradients(self) -> None:
        exchange_gradients(
            [(f"partition.grad.{n}", p) for n, p in self.module.named_parameters() if p.requires_grad], self.group
        )


def pipeline_train_step(layout: Layout, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One model-parallel step: activations forward to the partner in the next group, gradients
    back; every group averages its own gradients. Returns the loss on the last partition, 0.0
    elsewhere (the loss exists only there)."""
    optimizer.zero_grad()
    rows = len(y)
    inputs = (
        x
        if layout.first
        else layout.receive(
            layout.previous, rows, layout.shapes[layout.index], FORWARD, "mp.activations"
        ).requires_grad_()
    )
    with layout.timed("forward"):
        out = layout.module(inputs)
        loss = task.loss(out, y) if layout.last else None
    loss_value = 0.0
    if loss is not None:
        with layout.timed("backward"):
            loss.backward()
        loss_value = loss.item()
    else:
        meter.send(out.detach(), layout.next, "mp.activations", FORWARD)
        gradient = layout.receive(layout.next, rows, tuple(out.shape[1:]), BACKWARD, "mp.gradients")
        with layout.timed("backward"):
            out.backward(gradient)
    if not layout.first:
        meter.send(inputs.grad, layout.previous, "mp.gradients", BACKWARD)
    layout.average_gradients()
    optimizer.step()
    return loss_value


def pipeline_evaluate(
    layout: Layout,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[int, int, float]:
    """The joined network on this group's test shard: each batch flows through the partitions
    in order. Counts are returned by the last partition only (zeros elsewhere). `observe(out,
    y)` sees every batch's output of a partition that is not the last."""
    layout.module.eval()
    correct, count, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for x, y in batches:
            inputs = (
                x
                if layout.first
                else layout.receive(layout.previous, len(y), layout.shapes[layout.index], EVALUATE, "eval.activations")
            )
            out = layout.module(inputs)
            if layout.last:
                loss_sum += task.loss(out, y, reduction="sum").item()
                correct += task.correct(out, y)
                count += task.positions(y)
            else:
                meter.send(out, layout.next, "eval.activations", EVALUATE)
                if observe is not None:
                    observe(out, y)
    layout.module.train()
    return correct, count, loss_sum


def joined_state_dict(layout: Layout) -> dict[str, torch.Tensor] | None:
    """The whole model's ordinary state dict (keys as in the unpartitioned nn.Sequential) on
    global rank 0, gathered from each group's first rank; None on other ranks."""
    offset = layout.boundaries[layout.index]
    mine = {
        f"{int(key.split('.', 1)[0]) + offset}.{key.split('.', 1)[1]}": value.detach().cpu()
        for key, value in layout.module.state_dict().items()
    }
    leader = layout.group.rank_of(runtime.rank()) == 0
    with meter.in_phase("control"):
        parts = meter.gather_object(mine if leader else None, "partition.state_dict")
    if runtime.rank() != 0:
        return None
    joined: dict[str, torch.Tensor] = {}
    for part in parts:
        joined.update(part or {})
    return joined


def describe(layout: Layout) -> str:
    lines = [f"{layout.count} partitions, {layout.group.size} rank(s) each:"]
    lines += [
        f"  partition {p['partition']}: modules {p['modules'][0]}..{p['modules'][1]} "
        f"({p['parameter_share']:.1%} of the parameters): {p['layers']}"
        for p in layout.table
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the cost model's view (hvd_lowcomm.costmodel)


@dataclass(frozen=True)
class Cut:
    """A model cut into partitions: the module index each one starts at (and the end), each
    one's parameters, and the numbers per sample crossing each cut."""

    bounds: list[int]
    params: list[int]
    widths: list[int]

    def flop_shares(self, profile: Profile) -> list[float]:
        """Each partition's share of the profiled weight layers' flops."""
        total = sum(layer.flops for layer in profile.layers) or 1.0
        return [
            sum(layer.flops for layer in profile.layers if a <= layer.module_index < b) / total
            for a, b in zip(self.bounds[:-1], self.bounds[1:])
        ]


def default_cut(
    model: nn.Module, input_shape: tuple[int, ...], options: PartitionOptions, need_depth: bool
) -> Cut | None:
    """Where the cut into options.partitions falls (None where it is refused), and what each
    piece holds, for the cost model."""
    if not isinstance(model, nn.Sequential):
        return None
    try:
        bounds = cut_points(model, options.partitions, options.cuts, need_depth, input_shape)
    except ConfigError:
        return None
    modules = list(model)
    return Cut(
        bounds,
        [sum(p.numel() for m in modules[a:b] for p in m.parameters()) for a, b in zip(bounds[:-1], bounds[1:])],
        [math.prod(shape) for shape in activation_shapes(model, bounds, input_shape)[1:]],
    )


def partitioned_cost(
    method: str, exchanges_activations: bool, need_depth: bool, refuse: Callable[[nn.Module], None] | None = None
) -> MethodCost:
    """The cost of `method` (mp: activations and gradients cross the cuts at every step; SIL:
    nothing crosses them), from the cut it would make (`need_depth`: SIL's rule); `refuse(model)`
    raises ConfigError for a model the method will not train whatever the cut (no prediction)."""

    def facts(model: nn.Module, input_shape: tuple[int, ...], options: PartitionOptions, cfg: Any) -> Cut | None:
        if refuse is not None:
            try:
                refuse(model)
            except ConfigError:
                return None
        return default_cut(model, input_shape, options, need_depth)

    def predict(
        profile: Profile, world_size: int, link: Link, options: PartitionOptions, cfg: Any, assumptions: Any
    ) -> Prediction:
        return predict_partitioned(profile, world_size, link, options, method, exchanges_activations)

    def memory(profile: Profile, ranks: int, ranks_per_node: int, options: PartitionOptions, cfg: Any) -> Memory:
        cut = profile.facts.get(method)  # the largest partition, where the method can cut the model
        return Memory(max(cut.params) / profile.params) if cut is not None and profile.params else Memory()

    return MethodCost(predict, model_facts=facts, memory=memory)


def predict_partitioned(
    profile: Profile, world_size: int, link: Link, options: PartitionOptions, method: str, exchanges_activations: bool
) -> Prediction:
    """The K groups average their partitions' gradients at the same time. SIL
    (`exchanges_activations` False): each rank computes its partition alone. mp: the partitions
    of a step run one after another (no pipelining) and activations and gradients cross every cut."""
    cut = profile.facts.get(method)
    k = options.partitions
    if cut is None:
        raise ConfigError(
            f"{method}: cannot train this model (no default cut into {k} partitions, or a model "
            f"it refuses, e.g. sil and a language model)"
        )
    if world_size % k:
        raise ConfigError(f"{method}: {world_size} ranks do not split into {k} partitions")
    g = world_size // k
    share, params = max(cut.flop_shares(profile)), max(cut.params)
    # On separate links the largest partition's allreduce takes longest; on one shared medium
    # all of their bytes cross it.
    each = [link.allreduce(FLOAT_BYTES * n, g, g) for n in cut.params]
    reduce = sum(each) if link.shared else max(each)
    sent = sent_bytes("allreduce", FLOAT_BYTES * params, g)
    if not exchanges_activations:
        return Prediction(
            method, world_size, profile.step_seconds * share, 0.0, reduce, 0.0, sent, sent * link.node_share(g)
        )
    width = max(cut.widths)
    # Partners are g ranks apart: on different nodes once a group fills whole nodes. Forward
    # then backward, each time the g ranks of one group send at once.
    sends = 2 * link.send(FLOAT_BYTES * profile.batch * width, g, across_nodes=g >= link.ranks_per_node)
    # A middle partition's ranks send both ways; with two partitions each rank sends one way.
    directions = 2 if k > 2 else 1
    activations = directions * FLOAT_BYTES * profile.batch * width
    across = g >= link.ranks_per_node  # then every rank of a node sends to another node at once
    return Prediction(
        method,
        world_size,
        profile.step_seconds,
        0.0,
        reduce + sends,
        0.0,
        sent + activations,
        sent * link.node_share(g) + (link.ranks_per_node * activations if across else 0.0),
    )
