"""`ddp`: plain data parallelism, Horovod's DistributedOptimizer with every gradient allreduced.

The baseline every other method is judged against. `ddp-fp16` (the same as `--method ddp
--comm.compression fp16`) halves the bytes on the wire: gradients are cast to fp16 for the
allreduce and back afterwards. `local` trains without any exchange: the compute floor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from hvd_lowcomm.comm import runtime
from hvd_lowcomm.comm.runtime import Group
from hvd_lowcomm.comm.traffic import FLOAT_BYTES, FP16Compression, NoCompression, meter
from hvd_lowcomm.config import Config
from hvd_lowcomm.costmodel import Link, MethodCost, Prediction, Profile, RunAssumptions, replicated, sent_bytes
from hvd_lowcomm.registry import register, register_variant
from hvd_lowcomm.methods.base import Method, broadcast_model_and_optimizer, make_optimizer
from hvd_lowcomm.methods.drop_in import (
    GradientExchange,
    HorovodArguments,
    NamedParameters,
    dense_gradient,
    horovod_arguments,
    wrap_optimizer,
)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: NamedParameters | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    group: Group | None = None,
    model: torch.nn.Module | None = None,
) -> torch.optim.Optimizer:
    """`hvd.DistributedOptimizer` with DDP's semantics, every allreduce recorded by the meter.

    Takes Horovod's arguments and honours each: `compression` (hvd.Compression.none / .fp16,
    any Horovod compressor, or "none" / "fp16"), `op` (hvd.Average or hvd.Sum),
    `gradient_predivide_factor`, `groups` / `num_groups` (fusion), `process_set` (or
    hvd_lowcomm's `group`), `backward_passes_per_step`. Each gradient's allreduce starts as
    backward produces it, as in Horovod; when the backward pass that completes the step ends,
    `.grad` holds the mean over the ranks (hvd_lowcomm.methods.drop_in). `model`, when given, is
    where DDP's accumulation flags are read too (`model.require_backward_grad_sync`, `with
    model.no_sync():`, as nanoGPT writes them).
    """
    arguments = horovod_arguments(
        "DistributedOptimizer",
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        sparse_as_dense,
        process_set,
        group,
        compressors=("none", "fp16", "any"),
        model=model,
    )
    return wrap_optimizer(optimizer, _AllreduceExchange, named_parameters, arguments)


class _AllreduceExchange(GradientExchange):
    """Mixed into the user's optimizer class by DistributedOptimizer: an allreduce of every
    gradient, started from the gradient hooks of the backward pass that exchanges. Fusion groups
    start in one order on every rank (the reverse of the parameters', as backward produces them;
    DDP's bucket order): torch.distributed pairs collectives by their order, not by name as
    Horovod does, and a parameter one rank did not use must not make the ranks' orders differ."""

    sums_natively = True  # op=Sum goes to the engine itself

    def __init__(self, params: Any, named_parameters: NamedParameters | None, arguments: HorovodArguments) -> None:
        super().__init__(params)
        self._compressor = {"none": NoCompression, "fp16": FP16Compression}.get(
            arguments.compression, arguments.compression
        )
        self._predivide = arguments.gradient_predivide_factor
        self._fusion_of: dict[torch.nn.Parameter, int] = {}  # parameter -> its fusion group (Horovod's groups)
        self._set_up_exchange(arguments, named_parameters, "DistributedOptimizer")
        self._fusions = self._fusion_groups(arguments.groups)
        # The start order: backward's (the parameters' reversed), then any added after the wrap.
        self._order = list(range(len(self._fusions) - 1, -1, -1))
        self._ready: dict[int, list[torch.nn.Parameter]] = {}  # fusion group -> its gradients ready so far
        self._complete: set[int] = set()  # fusion groups whose every gradient is ready, not yet started
        self._started = 0  # fusion groups started this pass, in start order
        self._pending: dict[int, tuple[list[torch.nn.Parameter], Any, list[Any]]] = {}  # started allreduces

    def _fusion_groups(self, groups: Any) -> list[list[torch.nn.Parameter]]:
        """Horovod's `groups`: lists of parameters allreduced together, or num_groups equal
        splits of the parameters; by default each parameter on its own."""
        params = [p for _, p in self.named_parameters()]
        if isinstance(groups, int):
            size = -(-len(params) // groups)
            groups = [params[i : i + size] for i in range(0, len(params), size)]
        elif groups is None and runtime.engine().name == "torch":
            groups = ddp_buckets(params)
        fusions = [list(g) for g in groups] if groups is not None else []
        listed = {p for g in fusions for p in g}
        fusions += [[p] for p in params if p not in listed]
        for index, fusion in enumerate(fusions):
            for p in fusion:
                self._fusion_of[p] = index
        return fusions

    def _gradient_accumulated(self, param: torch.nn.Parameter) -> None:
        super()._gradient_accumulated(param)
        if not self.exchanges_this_pass() or param not in self._fusion_of:
            return
        index = self._fusion_of[param]
        ready = self._ready.setdefault(index, [])
        if index in self._pending or any(p is param for p in ready):  # started already: one allreduce per step
            return
        ready.append(param)
        if len(ready) == len(self._fusions[index]):  # start it (and what waited for it) while backward goes on
            self._complete.add(index)
            while self._started < len(self._order) and self._order[self._started] in self._complete:
                self._start(self._order[self._started])

    def _start(self, index: int) -> None:
        params = self._fusions[index]
        named, contexts = [], []
        for p in params:
            sent, ctx = self._compressor.compress(dense_gradient(p))
            named.append((self._names[p], sent))
            contexts.append(ctx)
        handle = meter.start_allreduce(
            named,
            self.group,
            op="sum" if self.op == "sum" else "average",
            prescale=1.0 / self._predivide,
            postscale=self._predivide,
        )
        self._pending[index] = (params, handle, contexts)
        self._ready.pop(index, None)
        self._complete.discard(index)
        self._started += 1

    def _exchange(self) -> None:
        for _, p in self.named_parameters():  # added by add_param_group after the wrap
            if p not in self._fusion_of:
                self._fusion_of[p] = len(self._fusions)
                self._order.append(len(self._fusions))
                self._fusions.append([p])
        for index in self._order[self._started :]:  # the rest, unused ones (or set by hand) included
            self._start(index)
        for params, handle, contexts in self._pending.values():
            for p, out, ctx in zip(params, meter.finish_allreduce(handle), contexts):
                p.grad = self._compressor.decompress(out, ctx).view_as(p)
        self._pending.clear()
        self._ready.clear()
        self._complete.clear()
        self._started = 0


# DDP's bucket sizes: a small first bucket starts the exchange early in the backward pass, then
# larger ones. Horovod fuses what its cycle finds ready by itself; torch.distributed does not.
FIRST_BUCKET_BYTES, BUCKET_BYTES = 1 << 20, 25 << 20


def ddp_buckets(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """The parameters in DDP's buckets: in backward's order (reversed), each bucket up to its cap."""
    buckets: list[list[torch.nn.Parameter]] = []
    filled = 0
    for p in reversed(params):
        cap = FIRST_BUCKET_BYTES if len(buckets) <= 1 else BUCKET_BYTES
        if not buckets or filled + p.numel() * p.element_size() > cap:
            buckets.append([])
            filled = 0
        buckets[-1].append(p)
        filled += p.numel() * p.element_size()
    return buckets[::-1]  # in parameter order: the start order reverses it back


def predict_ddp(
    profile: Profile, world_size: int, link: Link, options: None, cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    """Every gradient allreduced over all ranks (in fp16 with comm.compression fp16), overlapping
    the backward pass: Horovod starts each allreduce as its gradient appears."""
    fp16 = cfg.comm.compression == "fp16"
    nbytes = profile.params * (2 if fp16 else FLOAT_BYTES)
    comm = link.allreduce(nbytes, world_size, world_size)
    sent = sent_bytes("allreduce", nbytes, world_size)
    return Prediction(
        "ddp",
        world_size,
        profile.step_seconds,
        profile.fp16_seconds if fp16 else 0.0,
        comm,
        min(comm, link.overlap * profile.backward_seconds),
        sent,
        sent * link.node_share(world_size),
    )


def predict_local(
    profile: Profile, world_size: int, link: Link, options: None, cfg: Config, assumptions: RunAssumptions
) -> Prediction:
    """Nothing exchanged: the step is the compute alone."""
    return Prediction("local", world_size, profile.step_seconds, 0.0, 0.0, 0.0, 0.0)


def ddp_quality(options: None, cfg: Config) -> str:
    """Exact; fp16 on the wire rounds the averaged gradient (which Horovod's users accept)."""
    return "ddp's gradient, rounded to fp16 on the wire" if cfg.comm.compression == "fp16" else ""


DDP_COST = MethodCost(predict_ddp, quality=ddp_quality, memory=replicated)


@register("ddp", cost=DDP_COST, drop_in=True)
class DataParallel(Method):
    """Every gradient averaged over all ranks at every step (Horovod allreduce)."""

    honours_compression = True

    def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        optimizer = make_optimizer(self.cfg, model)
        broadcast_model_and_optimizer(model, optimizer)
        self.optimizer = self.distribute(optimizer, model)

    def distribute(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
        """Wrap the local optimiser so that step() uses the gradient of the pooled batch."""
        return DistributedOptimizer(
            optimizer,
            model.named_parameters(),
            compression=self.cfg.comm.compression,
            backward_passes_per_step=self.cfg.train.accumulate,
        )

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.model is not None and self.optimizer is not None
        self.optimizer.zero_grad()
        loss = self.forward_backward(x, y)
        clip = self.cfg.train.clip_grad_norm
        if clip:  # .grad holds the pooled gradient once backward returns (synchronize: in case it did not run)
            self.optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        return loss


# Judged like a compression: fp16 keeps 11 bits of each gradient and flushes the smallest to
# zero, and Adam scales every coordinate to its own history, so what that costs depends on the model.
register_variant("ddp-fp16", "ddp", {"comm.compression": "fp16"}, cost=replace(DDP_COST, judged=True))


@register("local", cost=MethodCost(predict_local, memory=replicated))
class LocalOnly(DataParallel):
    """No communication: every rank trains its own copy on its own shard (the compute floor).

    Not a way to train (the ranks' models drift apart and the reported accuracy pools them):
    benchmarks.compare runs it beside the real methods so that every step time has the floor
    that the same model, batch and optimiser set without any exchange.
    """

    honours_compression = False

    def distribute(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
        return wrap_optimizer(optimizer, _NoExchange, horovod_arguments("local"))


class _NoExchange(GradientExchange):
    """Keeps every rank's own gradient (method local)."""

    def __init__(self, params: Any, arguments: HorovodArguments) -> None:
        super().__init__(params)
        self._set_up_exchange(arguments, None, "local")

    def _exchange(self) -> None:
        pass
